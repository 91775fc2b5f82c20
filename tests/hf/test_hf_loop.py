"""A training loop's calls around a model ``feplb.hf.apply`` made expert-parallel (2 gloo ranks, tiny Qwen3-MoE):
an optimizer made before ``apply`` (it holds the replaced experts, which nothing trains) is refused when attached
and at its first step; accelerate's ``AcceleratedOptimizer`` attaches as the torch optimizer it steps, anything
else that is no optimizer is refused; ``average_expert_grads`` called again before the step (after every backward
of an accumulation) is refused, the loops that zero or step between calls run. FSDP2 over the expert shards
(``ignored_params`` forgotten) is refused at the first forward, its ``MixedPrecisionPolicy`` feeding the experts
another dtype is named, and ``apply`` after ``fully_shard`` or on a DDP-wrapped model is refused."""

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

    # wrappers: FSDP over the experts (ignored_params forgotten) refused at the first forward; FSDP's
    # MixedPrecisionPolicy feeding the experts bf16 named; apply after fully_shard, or on a DDP-wrapped model, refused
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))

    def sharded(ignore: bool, **kw):
        m = M.make_model("qwen3_moe")
        fh.apply(m, gpus_per_node=world)
        ignored = set(fh.expert_parameters(m)) if ignore else set()
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=ignored, **kw)
        fully_shard(m, mesh=mesh, ignored_params=ignored, **kw)
        return m

    out["fsdp_forgotten"] = error_of(lambda: sharded(False)(input_ids=ids))
    out["fsdp_ignored"] = error_of(lambda: sharded(True)(input_ids=ids))
    out["fsdp_bf16"] = error_of(lambda: sharded(True, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))(
        input_ids=ids))
    late = M.make_model("qwen3_moe")
    for layer in late.model.layers:
        fully_shard(layer, mesh=mesh)
    out["after_fsdp"] = error_of(lambda: fh.apply(late, gpus_per_node=world))
    out["ddp_wrapped"] = error_of(lambda: fh.apply(torch.nn.parallel.DistributedDataParallel(M.make_model("mixtral")),
                                                   gpus_per_node=world))
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
        assert r["fsdp_forgotten"] is not None and "no longer the tensors it holds its experts in" in \
            r["fsdp_forgotten"] and "ignored_params" in r["fsdp_forgotten"], r["fsdp_forgotten"]
        assert r["fsdp_ignored"] is None, r["fsdp_ignored"]
        assert r["fsdp_bf16"] is not None and "MixedPrecisionPolicy" in r["fsdp_bf16"] and "torch.autocast" in \
            r["fsdp_bf16"], r["fsdp_bf16"]
        assert r["after_fsdp"] is not None and "already sharded" in r["after_fsdp"], r["after_fsdp"]
        assert r["ddp_wrapped"] is not None and "wrapped in DistributedDataParallel" in r["ddp_wrapped"], \
            r["ddp_wrapped"]
        assert r["zeroed"] is None and r["after_step"] is None and r["unattached_step"] is None and \
            r["ended_by_step"], (rank, r)
