"""torch.compile story of MoELayer, on 2 gloo ranks (1 node x 2 GPUs): routing and combine compile; the dispatch
in between (collectives, CPU planning, data-dependent splits) is ``torch.compiler.disable``d, so the layer compiles
into exactly two graphs with exactly one graph break, at the dispatch boundary; compiled output and gradients equal
eager ones."""

from __future__ import annotations

import pytest
import torch

from feplb.testing import run_dist

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _compile_worker(rank, world):
    from feplb import FEPLBConfig, MoELayer

    torch.manual_seed(rank)
    layer = MoELayer(FEPLBConfig(hidden=16, ffn=32, num_experts=8, top_k=2, gpus_per_node=2, dyn=2,
                                 policy="feplb-split", min_chunk=2, plan_wait_ms=60_000, min_straggler_rows=0,
                                 weights="per-microbatch"))
    x = torch.randn(20 + 4 * rank, 16)
    x[:, 0] = x[:, 0].abs() + 1
    with torch.no_grad():
        layer.router.weight[:, 0] = 0.0
        layer.router.weight[0, 0] = 3.0     # GPU 0 is hot, so the compiled run really moves rows
    explain = torch._dynamo.explain(layer)(x)
    torch._dynamo.reset()

    xe = x.clone().requires_grad_(True)
    eager = layer(xe)
    eager.sum().backward()
    grads_e = [xe.grad, layer.w1.grad.clone(), layer.router.weight.grad.clone()]
    layer.zero_grad()

    compiled = torch.compile(layer, backend="aot_eager")
    xc = x.clone().requires_grad_(True)
    out = compiled(xc)
    out.sum().backward()
    grads_c = [xc.grad, layer.w1.grad, layer.router.weight.grad]
    return {"graphs": explain.graph_count, "breaks": explain.graph_break_count,
            "reasons": [str(b.reason) for b in explain.break_reasons], "moved": layer.last_stats.rows_moved,
            "out": torch.allclose(out, eager, rtol=1e-5, atol=1e-6),
            "grads": all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(grads_c, grads_e, strict=True))}


def test_compile_breaks_exactly_at_dispatch():
    for res in run_dist(_compile_worker, 2, timeout_s=400, collective_timeout_s=300):
        assert res["graphs"] == 2 and res["breaks"] == 1, res
        assert "_experts" in res["reasons"][0], res["reasons"]
        assert res["out"] and res["grads"], res
        assert res["moved"] > 0
