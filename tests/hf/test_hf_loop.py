"""A training loop's calls around a model ``feplb.hf.apply`` made expert-parallel (2 gloo ranks, tiny Qwen3-MoE):
an optimizer made before ``apply`` (it holds the replaced experts, which nothing trains) is refused when attached
and at its first step; accelerate's ``AcceleratedOptimizer`` attaches as the torch optimizer it steps, anything
else that is no optimizer is refused; ``average_expert_grads`` called again before the step (after every backward
of an accumulation) is refused, the loops that zero or step between calls run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5")
pytest.importorskip("accelerate")

from feplb.testing import error_of, load_module, run_dist  # noqa: E402

pytestmark = pytest.mark.dist


def _models():
    return load_module(Path(__file__).with_name("models.py"))


def _loop(rank: int, world: int) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    import accelerate

    import feplb.hf as fh
    from feplb.training import _attached

    M = _models()
    ids = M.tokens(rank)

    def backward(model):
        model(input_ids=ids, labels=ids).loss.backward()

    out = {}
    # an optimizer made before apply
    model = M.make_model("qwen3_moe")
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    fh.apply(model, policy="feplb-split@ema", replicas="lazy", gpus_per_node=world, min_straggler_rows=0)
    out["attach_early"] = error_of(lambda: fh.attach_optimizer(model, early))
    backward(model)
    out["step_early"] = error_of(early.step)
    model.zero_grad()
    fh.zero_replica_grads(model)

    # accelerate's wrapper: its inner optimizer is attached, and its step refreshes the copies
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = accelerate.Accelerator(cpu=True).prepare_optimizer(opt)
    fh.attach_optimizer(model, wrapped)
    out["attached_inner"] = len(_attached(opt)) == 2
    out["not_optimizer"] = error_of(lambda: fh.attach_optimizer(model, object()))

    # average_expert_grads: twice in one accumulation refused; zeroing (a skipped step) or a step in between runs
    backward(model)
    fh.average_expert_grads(model)
    backward(model)
    out["twice"] = error_of(lambda: fh.average_expert_grads(model))
    model.zero_grad()
    fh.zero_replica_grads(model)
    backward(model)
    fh.average_expert_grads(model)
    model.zero_grad()                      # a skipped step: set to None, new tensors at the next backward
    out["zeroed"] = error_of(lambda: (backward(model), fh.average_expert_grads(model)))
    wrapped.step()                         # the attached inner optimizer's step: reduce and refresh
    out["after_step"] = error_of(lambda: (backward(model), fh.average_expert_grads(model)))
    # a step of an optimizer not attached ends the step too (then refreshed by hand, zeroed in place)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    plain.step()
    out["ended_by_step"] = all("_averaged" not in lay.__dict__ for lay in fh.experts_modules(model))
    fh.refresh_replicas(model)
    plain.zero_grad(set_to_none=False)
    out["unattached_step"] = error_of(lambda: (backward(model), fh.average_expert_grads(model)))
    # no backward between: the same gradients divided twice
    out["no_backward"] = error_of(lambda: fh.average_expert_grads(model))
    return out


def test_training_loop_calls():
    for rank, r in enumerate(run_dist(_loop, 2, timeout_s=240)):
        for k in ("attach_early", "step_early"):
            assert r[k] is not None and r[k].startswith("ValueError") and \
                "feplb.hf.apply replaced model.layers.0.mlp.experts" in r[k] and "Make the optimizer after apply" \
                in r[k], (rank, k, r[k])
        assert r["attached_inner"], rank
        assert r["not_optimizer"] is not None and r["not_optimizer"].startswith("TypeError") and \
            "AcceleratedOptimizer" in r["not_optimizer"], r["not_optimizer"]
        for k in ("twice", "no_backward"):
            assert r[k] is not None and r[k].startswith("RuntimeError") and "called again before the optimizer step" \
                in r[k], (rank, k, r[k])
        assert r["zeroed"] is None and r["after_step"] is None and r["unattached_step"] is None and \
            r["ended_by_step"], (rank, r)
