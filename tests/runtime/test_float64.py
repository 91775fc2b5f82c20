"""A float64 layer computes in float64 throughout, its router's scores included (the router computes fp32 scores
for the lower-precision dtypes): on 4 gloo ranks as 2 nodes x 2, rows moving, output and every gradient within
1e-12 (relative to each tensor's largest entry) of the dense fp64 reference on fresh random weights; on one rank,
``torch.autograd.gradcheck`` of the input passes."""

from __future__ import annotations

import random

import pytest
import torch

from feplb.testing import dense_moe_reference, load_global_weights, run_dist

pytestmark = pytest.mark.dist

H, FF, E, K = 8, 12, 8, 2


def _draw(seed: int, world: int):
    gen = torch.Generator().manual_seed(seed)
    d = torch.float64
    router = torch.randn(E, H, generator=gen, dtype=d) / H ** 0.5
    router[:, 0] = 0.0
    router[0, 0] = 3.0                         # GPU 0's expert is hot: rows move
    w1 = torch.randn(E, H, 2 * FF, generator=gen, dtype=d) / H ** 0.5
    w2 = torch.randn(E, FF, H, generator=gen, dtype=d) / FF ** 0.5
    xs = torch.randn(world, 20, H, generator=gen, dtype=d)
    xs[:, :, 0] = xs[:, :, 0].abs() + 1.0
    dys = torch.randn(world, 20, H, generator=gen, dtype=d)
    return router, w1, w2, xs, dys


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative to the reference's largest element; absolute where the reference is all zero (the gradient of a
    GPU's experts that no token of this draw reached: 0 / 0 would read as a failure)."""
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    return err / scale if scale else err


def _worker(rank: int, world: int, seed: int) -> dict:
    from feplb import FEPLBConfig, MoELayer

    router, w1, w2, xs, dys = _draw(seed, world)
    layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, dtype=torch.float64,
                                 gpus_per_node=min(2, world), policy="feplb-split", weights="per-microbatch",
                                 min_straggler_rows=0, min_chunk=1, dyn=2, plan_wait_ms=60_000))
    load_global_weights(layer, router, w1, w2)
    x = xs[rank].clone().requires_grad_(True)
    (layer(x) * dys[rank]).sum().backward()
    moved = layer.last_stats.rows_moved
    out = {"x": x.grad, "router": layer.router.weight.grad, "w1": layer.w1.grad, "w2": layer.w2.grad,
           "moved": moved}
    with torch.no_grad():
        out["out"] = layer(xs[rank])
    if world == 1:
        xi = xs[0][:4].clone().requires_grad_(True)
        out["gradcheck_x"] = torch.autograd.gradcheck(lambda t: layer(t), (xi,), eps=1e-6, atol=1e-8)
    layer.close()
    return out


def test_float64_layer_is_float64_throughout():
    world, seed = 4, random.randrange(2**31)
    res = run_dist(_worker, world, seed, timeout_s=240)
    router, w1, w2, xs, dys = _draw(seed, world)
    leaves = [t.clone().requires_grad_(True) for t in (router, w1, w2)]
    L = E // world
    grads_w = [torch.zeros_like(w1), torch.zeros_like(w2)]
    assert sum(r["moved"] for r in res) > 0, "no row moved: the case tests nothing"
    for rank, r in enumerate(res):
        x = xs[rank].clone().requires_grad_(True)
        for t in leaves:
            t.grad = None
        y = dense_moe_reference(x, *leaves, K)
        (y * dys[rank]).sum().backward()
        assert _rel(r["out"], y.detach()) <= 1e-12, (seed, rank, "out", _rel(r["out"], y.detach()))
        assert _rel(r["x"], x.grad) <= 1e-12, (seed, rank, "x", _rel(r["x"], x.grad))
        assert _rel(r["router"], leaves[0].grad) <= 1e-12, (seed, rank, "router")
        grads_w[0] += leaves[1].grad
        grads_w[1] += leaves[2].grad
    for rank, r in enumerate(res):   # an owner's expert gradients sum every rank's tokens
        for name, full in (("w1", grads_w[0]), ("w2", grads_w[1])):
            want = full[rank * L:(rank + 1) * L]
            assert _rel(r[name], want) <= 1e-12, (seed, rank, name, _rel(r[name], want))


def test_float64_layer_passes_gradcheck():
    res = run_dist(_worker, 1, random.randrange(2**31), timeout_s=240)
    assert res[0]["gradcheck_x"] is True
