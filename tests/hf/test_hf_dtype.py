"""``feplb.hf.apply(model, dtype=...)``: the experts compute in another dtype than their parameters' (2 gloo ranks,
one node of 2, balancing on: rows move).

* Module by module, every architecture of tests/hf/models.py, fp32 parameters, ``dtype=torch.bfloat16``, on this
  rank's random hidden states and skewed routing: against the unmodified module in fp32, the FEPLB module's output
  and gradients (the experts' summed over the ranks' inputs) err at most twice as much (norm-wise) as the unmodified
  module cast to bf16 (its weights and input: what FSDP's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``
  computes it in), and at least a tenth as much (bf16 GEMMs, not fp32 ones). The parameters and their gradients stay
  fp32, the output returns in the input's dtype (fp32 or bf16), and with transformers' gradient checkpointing the
  module's gradients are bit-equal to those without.
* FSDP2 with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` over the rest of a
  one-layer Qwen3-MoE (the experts ignored; without ``dtype=`` their bf16 input is refused, naming ``dtype=``),
  ``feplb-split@ema``, two SGD steps with ``attach_optimizer`` and ``average_expert_grads``: against the same model
  in fp64 trained on every rank's tokens, the first step's gradients and both steps' parameter changes err at most
  twice as much (norm-wise, the experts' and the rest's apart) as the unmodified model under the same FSDP2 policy
  (its experts sharded by FSDP and computed in bf16).
* A dtype FEPLB cannot compute in is refused on every rank, by ``apply`` and by ``supported``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

from feplb.testing import error_of, load_module, run_dist  # noqa: E402

pytestmark = pytest.mark.dist

WORLD = 2
BF = torch.bfloat16


def _models():
    return load_module(Path(__file__).with_name("models.py"))


def _norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _modules(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import feplb.hf as fh

    M = _models()
    out = {}
    for arch in M.ARCHS:
        model = M.make_model(arch)
        name = next(n for n, m in model.named_modules() if hasattr(m, "gate_up_proj"))
        exact = copy.deepcopy(model.get_submodule(name))
        # what FSDP's MixedPrecisionPolicy(param_dtype=bf16) computes the unmodified module in: bf16 weights
        theirs = copy.deepcopy(exact).to(BF)
        fh.apply(model, dtype=BF, policy="feplb-split", weights="per-microbatch", gpus_per_node=world, min_chunk=1,
                 plan_wait_ms=60_000, min_straggler_rows=0)
        mine = model.get_submodule(name)
        E, H = exact.gate_up_proj.shape[0], model.config.hidden_size
        gen = torch.Generator().manual_seed(70 + rank)
        T, K = 24, 2
        x = torch.randn(T, H, generator=gen).to(BF).float()    # bf16-exact: every run sees the same input
        probs = torch.ones(E)
        probs[0] = 8.0                                          # expert 0 is hot: balancing moves rows
        idx = torch.stack([torch.multinomial(probs, K, generator=gen) for _ in range(T)])
        wts = torch.rand(T, K, generator=gen).to(BF).float()
        dy = torch.randn(T, H, generator=gen)

        def run(m, dt, x, idx, wts, dy, checkpointed=False):
            m.zero_grad(set_to_none=True)
            xx, ww = x.to(dt, copy=True).requires_grad_(True), wts.clone().requires_grad_(True)
            if checkpointed:
                y = torch.utils.checkpoint.checkpoint(m, xx, idx, ww, use_reentrant=False)
            else:
                y = m(xx, idx, ww)
            (y.float() * dy).sum().backward()
            res = {"out": y.detach(), "x": xx.grad, "weights": ww.grad}
            return res | {n: p.grad.detach().clone() for n, p in m.named_parameters()}

        args = (x, idx, wts, dy)
        want, bf, got = run(exact, torch.float32, *args), run(theirs, BF, *args), run(mine, torch.float32, *args)
        got_bf = run(mine, BF, *args)
        again = run(mine, torch.float32, *args, checkpointed=True)
        L = E // world
        for n, _ in mine.named_parameters():   # the experts' gradient over every rank's input, this rank's slice
            for t in (want, bf):
                t[n] = t[n].float()
                dist.all_reduce(t[n])
                t[n] = t[n][rank * L:(rank + 1) * L]
        out[arch] = {
            "errors": {k: (_norm_rel(got[k], want[k]), _norm_rel(bf[k], want[k])) for k in want},
            "dtypes": sorted({str(p.dtype) for p in mine.parameters()} | {str(p.grad.dtype) for p in
                                                                           mine.parameters()}),
            "out_dtypes": (str(got["out"].dtype), str(got_bf["out"].dtype), str(got_bf["x"].dtype)),
            "checkpointed_equal": all(torch.equal(again[k], got[k]) for k in got),
            "moved": mine.last_stats.rows_moved,
        }
    return out


def _fsdp(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    import feplb.hf as fh

    M = _models()
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=BF, reduce_dtype=torch.float32)
    # one decoder layer: the routing then depends on the same bf16 computation in both models
    model = M.make_model("qwen3_moe", num_hidden_layers=1)
    ref = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()
    exact.config._experts_implementation = "eager"   # (torch._grouped_mm takes no fp64)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {}

    def sharded(m, ignored):
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=ignored, mp_policy=mp)
        fully_shard(m, mesh=mesh, ignored_params=ignored, mp_policy=mp)
        return m

    # without dtype= the experts get FSDP's bf16 input: refused, naming what to pass
    plain = M.make_model("qwen3_moe", num_hidden_layers=1)
    fh.apply(plain, gpus_per_node=world)
    ids = M.tokens(rank)
    out["refused"] = error_of(lambda: sharded(plain, set(fh.expert_parameters(plain)))(input_ids=ids))

    fh.apply(model, dtype=BF, policy="feplb-split@ema", gpus_per_node=world, min_chunk=1, plan_wait_ms=60_000,
             min_straggler_rows=0)
    experts = set(fh.expert_parameters(model))
    sharded(model, experts)
    sharded(ref, set())
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref, exact)]
    fh.attach_optimizer(model, opts[0])
    L = next(iter(experts)).shape[0]
    expert_names = {n for n, p in model.named_parameters() if p in experts}

    def whole(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().double()

    def local(n, t):   # the reference's full tensor as this rank holds it (its experts' slice)
        return t[rank * L:(rank + 1) * L] if n in expert_names else t

    def errors(get_mine, get_ref, get_exact):
        res = {}
        for part in ("experts", "rest"):
            names = [n for n in start if (n in expert_names) == (part == "experts")]
            want = torch.cat([local(n, get_exact(n)).reshape(-1) for n in names])
            mine = torch.cat([get_mine(n).reshape(-1) for n in names])
            theirs = torch.cat([local(n, get_ref(n)).reshape(-1) for n in names])
            res[part] = (_norm_rel(mine, want), _norm_rel(theirs, want))
        return res

    def grad_errors():
        mg, rg, eg = (dict(m.named_parameters()) for m in (model, ref, exact))
        return errors(lambda n: whole(mg[n].grad), lambda n: whole(rg[n].grad), lambda n: eg[n].grad.double())

    moved = 0
    for step in range(2):
        ids = M.tokens(rank + world * step)
        model(input_ids=ids, labels=ids).loss.backward()
        moved += sum(m.last_stats.rows_moved for m in fh.experts_modules(model))
        fh.average_expert_grads(model)
        ref(input_ids=ids, labels=ids).loss.backward()
        exact(input_ids=ids, labels=ids).loss.backward()
        for p in exact.parameters():   # the mean over the ranks' tokens, as FSDP's and average_expert_grads'
            dist.all_reduce(p.grad)
            p.grad /= world
        if step == 0:
            out["grads"] = grad_errors()
            out["grad_dtypes"] = sorted({str(p.grad.dtype) for p in experts})
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    mp_, rp, ep = dict(model.named_parameters()), dict(ref.named_parameters()), dict(exact.named_parameters())
    out["changes"] = errors(lambda n: whole(mp_[n]) - local(n, start[n].double()),
                            lambda n: whole(rp[n]) - start[n].double(), lambda n: ep[n].detach() - start[n].double())
    out["moved"] = moved
    out["param_dtypes"] = sorted({str(p.dtype) for p in experts})
    return out


def _refusals(rank: int, world: int) -> dict:
    import feplb.hf as fh

    M = _models()
    model = M.make_model("mixtral")
    return {"apply": error_of(lambda: fh.apply(model, dtype=torch.int8, gpus_per_node=world)),
            "untouched": not fh.experts_modules(model),
            "supported": error_of(lambda: fh.supported(model, world, dtype="bf16")),
            "supported_ok": fh.supported(model, world, dtype=BF)}


def _worker(rank: int, world: int) -> dict:
    return {"modules": _modules(rank, world), "fsdp": _fsdp(rank, world), "refusals": _refusals(rank, world)}


@pytest.fixture(scope="module")
def ranks():
    return run_dist(_worker, WORLD, timeout_s=300, collective_timeout_s=120)


def test_experts_compute_in_the_given_dtype_as_accurately_as_the_unmodified_module(ranks):
    for rank, res in enumerate(ranks):
        for arch, case in res["modules"].items():
            where = f"rank {rank} {arch}"
            assert case["moved"] > 0, (where, "no rows moved")
            assert case["dtypes"] == ["torch.float32"], (where, case["dtypes"])
            assert case["out_dtypes"] == ("torch.float32", "torch.bfloat16", "torch.bfloat16"), (where, case)
            assert case["checkpointed_equal"], where
            for name, (mine, theirs) in case["errors"].items():
                assert theirs > 1e-4, (where, name, "the bf16 module made no error")
                assert mine <= 2 * theirs, f"{where} {name}: error {mine:.3g} > 2x the bf16 module's {theirs:.3g}"
                assert mine >= 0.1 * theirs, (where, name, "not computed in bf16?", mine, theirs)


def test_fsdp_mixed_precision_over_the_rest_trains_as_the_unmodified_model(ranks):
    for rank, res in enumerate(ranks):
        fsdp = res["fsdp"]
        assert fsdp["refused"] is not None and fsdp["refused"].startswith("TypeError") and \
            "MixedPrecisionPolicy" in fsdp["refused"] and "dtype=torch.bfloat16" in fsdp["refused"], fsdp["refused"]
        assert fsdp["moved"] > 0, (rank, fsdp["moved"])
        assert fsdp["param_dtypes"] == fsdp["grad_dtypes"] == ["torch.float32"], (rank, fsdp)
        for what in ("grads", "changes"):
            for part, (mine, theirs) in fsdp[what].items():
                assert theirs > 1e-4, (rank, what, part, "the unmodified model made no bf16 error")
                assert mine <= 2 * theirs, (f"rank {rank} {what} of the {part}: error {mine:.3g} > 2x the "
                                            f"unmodified model's {theirs:.3g}")


def test_a_dtype_feplb_cannot_compute_in_is_refused(ranks):
    for rank, res in enumerate(ranks):
        ref = res["refusals"]
        assert ref["apply"] is not None and ref["apply"].startswith("ValueError") and "dtype=torch.int8" in \
            ref["apply"], (rank, ref["apply"])
        assert ref["untouched"], rank
        assert ref["supported"] is not None and ref["supported"].startswith("ValueError") and "dtype='bf16'" in \
            ref["supported"], (rank, ref["supported"])
        assert ref["supported_ok"] and all(v is None for v in ref["supported_ok"].values()), ref["supported_ok"]
