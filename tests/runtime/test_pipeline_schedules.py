"""The layer under ``torch.distributed.pipelining`` on 4 gloo ranks (2 nodes x 2), rows moving: a schedule with
whole backwards (``Schedule1F1B``, 4 micro-batches in flight, each EP rank a pipeline stage of its own) trains exactly
as plain EP on the whole batch; a zero-bubble schedule's weight pass (``stage_backward_weight``, after
``stage_backward_input``), which restarts autograd inside the layer, is refused on every rank together, naming it,
and the layer works on, also where the caller dispatched the rows itself (``forward_dispatched``)."""

from __future__ import annotations

import pytest
import torch

from feplb.testing import error_of, load_global_weights, run_dist

pytestmark = pytest.mark.dist

H, FF, E, K, MICROBATCHES = 16, 24, 8, 2, 4


def _global(seed: int):
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=gen) / H ** 0.5
    router[:, 0] = 0.0
    router[[0, 4], 0] = 4.0          # one hot expert per node: rows move inside each node
    w1 = torch.randn(E, H, 2 * FF, generator=gen) / H ** 0.5
    w2 = torch.randn(E, FF, H, generator=gen) / FF ** 0.5
    return router, w1, w2


def _layer(policy: str, **kw):
    from feplb import FEPLBConfig, MoELayer

    layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=2, dyn=2, min_chunk=2,
                                 policy=policy, weights="per-microbatch", min_straggler_rows=0,
                                 plan_wait_ms=60_000, **kw))
    load_global_weights(layer, *_global(3))
    return layer


class _Stage(torch.nn.Module):
    """A residual MoE block: what a pipeline stage of an MoE model holds."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, h):
        return h + self.layer(h)


def _data(rank: int):
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(MICROBATCHES * (8 + 4 * rank), H, generator=gen)
    x[:, 0] = x[:, 0].abs() + 1.0
    return x, torch.randn(x.shape, generator=gen)


def _split_backward(y, xs, target, layer) -> None:
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    _, groups = stage_backward_input([y], [target[:xs.shape[0]]], [xs], iter(layer.parameters()))
    stage_backward_weight(iter(layer.parameters()), groups)


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed import pipelining

    out: dict = {}
    singles = [dist.new_group([r]) for r in range(world)]   # (each EP rank its own one-stage pipeline)
    x, target = _data(rank)
    for policy, kw in (("feplb-split", {}), ("feplb-split", {"recopy_weights": True}), ("none", {})):
        key = policy + ("+recopy" if kw else "")
        layer, ref = _layer(policy, **kw), _layer("none")
        stage = pipelining.PipelineStage(_Stage(layer), 0, 1, torch.device("cpu"), group=singles[rank])
        schedule = pipelining.Schedule1F1B(stage, MICROBATCHES, loss_fn=lambda y, t: (y * t).sum(),
                                           scale_grads=False)
        losses: list = []
        schedule.step(x, target=target, losses=losses)
        out[key + " moved"] = layer.last_stats.rows_moved
        ((x + ref(x)) * target).sum().backward()       # the whole batch at once, plain EP
        want = torch.cat([ref.w1.grad.flatten(), ref.w2.grad.flatten(), ref.router.weight.grad.flatten()])
        got = torch.cat([layer.w1.grad.flatten(), layer.w2.grad.flatten(), layer.router.weight.grad.flatten()])
        out[key + " 1f1b"] = ((got - want).abs().max() / want.abs().max()).item()
        # a zero-bubble schedule's two passes, as ScheduleInterleavedZeroBubble runs them on a stage
        layer.zero_grad()
        xs = x[:8 + 4 * rank].clone().requires_grad_()
        y = xs + layer(xs)

        out[key + " zero-bubble"] = error_of(lambda y=y, xs=xs, layer=layer: _split_backward(y, xs, target, layer))
        layer.zero_grad()
        xs = x[:8 + 4 * rank].clone().requires_grad_()     # the layer works on: a whole backward, as plain EP's
        (xs + layer(xs)).mul(target[:xs.shape[0]]).sum().backward()
        xr = xs.detach().clone().requires_grad_()
        (xr + ref(xr)).mul(target[:xs.shape[0]]).sum().backward()
        out[key + " after"] = torch.allclose(xs.grad, xr.grad, rtol=1e-5, atol=1e-6)
        layer.close()
        ref.close()
    # rows a caller dispatched itself (forward_dispatched, DeepEP's way): node 0 moves rows, node 1 (balanced) makes
    # no exchange at all, and still refuses the weight pass with the others
    layer = _layer("feplb-split")
    gen = torch.Generator().manual_seed(rank)
    counts = ([40, 40], [2, 2], [8, 8], [8, 8])[rank]
    rows = torch.randn(sum(counts), H, generator=gen).requires_grad_()
    y = layer.forward_dispatched(rows, counts)
    out["dispatched moved"] = layer.last_stats.rows_moved
    out["dispatched zero-bubble"] = error_of(lambda: _split_backward(y, rows, torch.randn(y.shape), layer))
    layer.close()
    return out


def test_pipeline_schedules():
    results = run_dist(_worker, 4, timeout_s=300, collective_timeout_s=30)
    for key in ("feplb-split", "feplb-split+recopy", "dispatched"):
        assert sum(res[key + " moved"] for res in results) > 0, key
    for rank, res in enumerate(results):
        for key in ("feplb-split", "feplb-split+recopy", "none", "dispatched"):
            err = res[key + " zero-bubble"]
            assert err is not None and "started inside the layer" in err and "stage_backward_weight" in err, \
                (rank, key, err)
            if key == "dispatched":
                continue
            assert res[key + " 1f1b"] < 1e-5, (rank, key, res[key + " 1f1b"])
            assert res[key + " after"], (rank, key)
