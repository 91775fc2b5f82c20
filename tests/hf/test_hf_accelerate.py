"""An accelerate training loop, as accelerate's docs teach it (``Accelerator(gradient_accumulation_steps=2)``,
``prepare``, ``accumulate``, ``backward``, clipping under ``sync_gradients``), trains a model ``feplb.hf.apply`` made
expert-parallel (4 gloo ranks as 2 nodes x 2, tiny Qwen3-MoE, rows moving) as the same loop trains the unmodified
model under DDP, with FEPLB's two calls at the step (``average_expert_grads``, ``clip_grad_norm_``) and the
prepared optimizer attached. With accelerate's own ``clip_grad_norm_`` (torch's over this rank's shards) instead,
the ranks clip by different norms and the comparison fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5")
pytest.importorskip("accelerate")

from feplb.testing import load_module, run_dist  # noqa: E402

pytestmark = pytest.mark.dist

W, G, STEPS, ACCUM = 4, 2, 3, 2


def _models():
    return load_module(Path(__file__).with_name("models.py"))


def _loop(rank: int, world: int, mode: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    import accelerate

    import feplb.hf as fh

    M = _models()
    model = M.make_model("qwen3_moe")
    if mode != "plain":
        fh.apply(model, policy="feplb-split", gpus_per_node=G, min_straggler_rows=0, plan_wait_ms=60_000)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, M.VOCAB, (2, 8), generator=g) for _ in range(world * STEPS * ACCUM)]
    mine = batches[rank::world]          # each rank its own micro-batches
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model, opt = acc.prepare(model, opt)
    if mode != "plain":
        fh.attach_optimizer(model, opt)
    norms = []
    for ids in mine:
        with acc.accumulate(model):
            acc.backward(model(input_ids=ids, labels=ids).loss)
            if acc.sync_gradients:
                if mode == "plain":
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
                else:
                    fh.average_expert_grads(acc.unwrap_model(model))
                    clip = acc.clip_grad_norm_(model.parameters(), 0.5) if mode == "accelerate_clip" else \
                        fh.clip_grad_norm_(acc.unwrap_model(model), 0.5)
                    norms.append(float(clip))
            opt.step()
            opt.zero_grad()
    inner = acc.unwrap_model(model)
    full = inner.state_dict() if mode == "plain" else fh.full_state_dict(inner, rank0_only=False)
    out = {"params": {k: v.detach().clone() for k, v in full.items()}, "norms": norms}
    if mode == "feplb":
        # a prepared optimizer's GradScaler (accelerate makes one for fp16 on a GPU, none on a CPU: given here) is
        # attached with it when attach_optimizer is given none
        from accelerate.optimizer import AcceleratedOptimizer

        from feplb.training import _ReducingScaler

        scaled = AcceleratedOptimizer(torch.optim.SGD(inner.parameters(), lr=0.05), device_placement=False,
                                      scaler=torch.amp.GradScaler("cpu"))
        fh.attach_optimizer(inner, scaled)
        out["scaler_attached"] = isinstance(scaled.scaler, _ReducingScaler)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / (float(b.abs().max()) or 1.0)


def _worst(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(_rel(got[k], want[k]) for k in want)


def test_accelerate_loop_trains_as_the_unmodified_model():
    plain = run_dist(_loop, W, "plain", timeout_s=300)
    feplb = run_dist(_loop, W, "feplb", timeout_s=300)
    # clipping acts at every step: a norm counted wrong changes the step
    assert len(plain[0]["norms"]) == STEPS and all(n > 0.5 for n in plain[0]["norms"]), plain[0]["norms"]
    for r in feplb:
        assert r["scaler_attached"]
        assert _worst(r["params"], plain[0]["params"]) <= 1e-5, _worst(r["params"], plain[0]["params"])
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(r["norms"], plain[0]["norms"], strict=True)), \
            (r["norms"], plain[0]["norms"])
    # accelerate's own clipping sees this rank's shards only: other norms on every rank, other parameters
    local = run_dist(_loop, W, "accelerate_clip", timeout_s=300)
    assert len({tuple(r["norms"]) for r in local}) > 1
    assert max(_worst(r["params"], plain[0]["params"]) for r in local) > 1e-5


def _averaging(rank: int, world: int) -> dict:
    """accelerate's prepared optimizer attached (its DDP averages the rest of the model): a step whose expert
    gradients average_expert_grads did not divide since the last backward is refused on every rank, whether the
    call was forgotten or came before the step's last backward; the step then runs once the loop does it right.
    Under policy 'none' (no collective in the step, so no handshake) alike; a torch optimizer attached (its loop may
    sum the losses) is not checked."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    import accelerate

    import feplb.hf as fh
    from feplb.testing import error_of

    M = _models()
    out = {}
    for policy in ("feplb-split", "none"):
        model = M.make_model("qwen3_moe")
        fh.apply(model, policy=policy, gpus_per_node=G, min_straggler_rows=0, plan_wait_ms=60_000)
        acc = accelerate.Accelerator(cpu=True)
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
        inner = acc.unwrap_model(model)
        fh.attach_optimizer(inner, opt)

        def backward(seed: int, acc=acc, model=model) -> None:
            ids = torch.randint(0, M.VOCAB, (2, 8), generator=torch.Generator().manual_seed(100 * seed + rank))
            acc.backward(model(input_ids=ids, labels=ids).loss)

        backward(1)
        backward(2)
        out[policy, "forgotten"] = error_of(opt.step)
        fh.average_expert_grads(inner)
        out[policy, "then averaged"] = error_of(opt.step)
        opt.zero_grad()
        backward(3)
        fh.average_expert_grads(inner)
        backward(4)
        out[policy, "before the last backward"] = error_of(opt.step)
        opt.zero_grad()
        backward(5)
        backward(6)
        fh.average_expert_grads(inner)
        out[policy, "right"] = error_of(opt.step)
        opt.zero_grad()
    plain = torch.optim.SGD(inner.parameters(), lr=0.05)
    fh.attach_optimizer(inner, plain)
    backward(7)
    out["torch optimizer"] = error_of(plain.step)
    plain.zero_grad()
    # a loop that sums: the flag turned off on the optimizer already attached
    fh.attach_optimizer(inner, opt, average_required=False)
    backward(8)
    out["summing loop"] = error_of(opt.step)
    opt.zero_grad()
    # two prepared optimizers, the experts' and the rest's, both attached: the second step is not refused after
    # the first (which ends the averaging call's own step), and the rest's never checks the experts
    model = M.make_model("qwen3_moe")
    fh.apply(model, policy="feplb-split", gpus_per_node=G, min_straggler_rows=0, plan_wait_ms=60_000)
    experts = set(fh.expert_parameters(model))
    acc = accelerate.Accelerator(cpu=True)
    model, o1, o2 = acc.prepare(model, torch.optim.SGD(list(experts), lr=0.05),
                                torch.optim.SGD([p for p in model.parameters() if p not in experts], lr=0.05))
    inner = acc.unwrap_model(model)
    fh.attach_optimizer(inner, o1)
    fh.attach_optimizer(inner, o2)
    # torch.distributed.checkpoint initialises an empty optimizer state with a step on zero gradients: let through
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out["state initialised"] = error_of(lambda: get_optimizer_state_dict(inner, o1.optimizer))
    backward(9, acc, model)
    fh.average_expert_grads(inner)
    out["two optimizers"] = [error_of(o.step) for o in (o2, o1)]
    o1.zero_grad()
    o2.zero_grad()
    # a GradScaler given with accelerate's prepared optimizer, which it steps: checked through it
    scaler = torch.amp.GradScaler("cpu")
    fh.attach_optimizer(inner, o1, scaler)
    ids = torch.randint(0, M.VOCAB, (2, 8), generator=torch.Generator().manual_seed(1000 + rank))
    scaler.scale(model(input_ids=ids, labels=ids).loss).backward()
    out["scaler, forgotten"] = error_of(lambda: scaler.step(o1))
    return out


def test_unaveraged_expert_gradients_are_refused_at_the_step():
    runs = run_dist(_averaging, 2, timeout_s=200)
    for r in runs:
        for policy in ("feplb-split", "none"):
            for case in ("forgotten", "before the last backward"):
                msg = r[policy, case]
                assert msg is not None and msg.startswith("RuntimeError") and "are not averaged" in msg, \
                    (policy, case, msg)
            assert r[policy, "then averaged"] is None and r[policy, "right"] is None, r
        assert r["torch optimizer"] is None and r["summing loop"] is None, r
        assert r["two optimizers"] == [None, None] and r["state initialised"] is None, r
        assert r["scaler, forgotten"] is not None and "are not averaged" in r["scaler, forgotten"], r
    # agreed in the step's handshake: every rank names the ranks
    assert "on EP rank(s) [0, 1]" in runs[0]["feplb-split", "forgotten"], runs[0]["feplb-split", "forgotten"]
