"""torch.compile story of MoELayer, on 2 gloo ranks (1 node x 2 GPUs): routing and combine compile; the dispatch
in between (collectives, CPU planning, data-dependent splits) is ``torch.compiler.disable``d, so the layer compiles
into exactly two graphs with exactly one graph break, at the dispatch boundary; compiled output and gradients equal
eager ones, and so do a compiled block checkpointed selectively (torch's ``create_selective_checkpoint_contexts``)
and the eager layer, bit for bit. Compiled autograd, which cannot keep the layer's backward, is refused on every
rank."""

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
    layer.zero_grad()

    # a compiled block checkpointed selectively (torch.compile around torchtitan's op-level SelectiveAC): the same
    # as the eager layer, bit for bit
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def saved(ctx, op, *args, **kwargs):
        keep = op == torch.ops.aten.mm.default or str(op).startswith("feplb.grouped_mm")
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    def block(z):
        return checkpoint(lambda v: torch.tanh(layer(torch.sin(v))), z, use_reentrant=False,
                          context_fn=partial(create_selective_checkpoint_contexts, saved))

    torch._dynamo.reset()
    sac = []
    for run in (lambda v: torch.tanh(layer(torch.sin(v))), torch.compile(block, backend="aot_eager")):
        xs = x.clone().requires_grad_(True)
        y = run(xs)
        (y * torch.cos(x)).sum().backward()
        sac.append([y.detach(), xs.grad, layer.w1.grad.clone(), layer.router.weight.grad.clone()])
        layer.zero_grad()
    return {"graphs": explain.graph_count, "breaks": explain.graph_break_count,
            "sac": all(torch.equal(a, b) for a, b in zip(*sac, strict=True)),
            "reasons": [str(b.reason) for b in explain.break_reasons], "moved": layer.last_stats.rows_moved,
            "out": torch.allclose(out, eager, rtol=1e-5, atol=1e-6),
            "grads": all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(grads_c, grads_e, strict=True))}


def test_compile_breaks_exactly_at_dispatch():
    for res in run_dist(_compile_worker, 2, timeout_s=400, collective_timeout_s=300):
        assert res["graphs"] == 2 and res["breaks"] == 1, res
        assert "_experts" in res["reasons"][0], res["reasons"]
        assert res["out"] and res["grads"], res
        assert res["sac"], "a compiled selectively checkpointed block differs from the eager layer"
        assert res["moved"] > 0


def _compiled_autograd_worker(rank, world, weights, policy):
    from torch._dynamo.compiled_autograd import _enable

    from feplb import FEPLBConfig, MoELayer

    torch.manual_seed(rank)
    layer = MoELayer(FEPLBConfig(hidden=16, ffn=32, num_experts=8, top_k=2, gpus_per_node=2, dyn=2, policy=policy,
                                 min_chunk=2, plan_wait_ms=60_000, min_straggler_rows=0, weights=weights))
    x = torch.randn(20 + 4 * rank, 16)
    with torch.no_grad():
        layer.router.weight[:, 0] = 0.0
        layer.router.weight[0, 0] = 3.0     # GPU 0 is hot: balancing moves rows (and weights)

    def step(refused):
        xg = x.clone().requires_grad_(True)
        out = layer(xg)
        error = None
        try:
            if refused == "backward":
                with _enable(torch.compile(backend="aot_eager")):
                    out.sum().backward()
            else:
                out.sum().backward()
                layer.reduce_replica_grads()
        except Exception as exc:   # compiled autograd may wrap the layer's RuntimeError (Dynamo's Unsupported)
            error = f"{type(exc).__name__}: {exc}"
        return out.detach(), error, [xg.grad, layer.w1.grad, layer.w2.grad, layer.router.weight.grad]

    want, err, grads_want = step(None)
    assert err is None, err
    grads_want = [g.clone() for g in grads_want]
    moved = layer.last_stats.rows_moved
    layer.zero_grad()

    errors = {}
    try:
        with _enable(torch.compile(backend="aot_eager")):
            layer(x.clone().requires_grad_(True))
    except RuntimeError as exc:
        errors["forward"] = str(exc)
    with torch.no_grad(), _enable(torch.compile(backend="aot_eager")):
        inference = layer(x)            # no autograd recorded: nothing to refuse
    _, errors["backward"], _ = step("backward")
    layer.zero_grad()
    layer.zero_replica_grads()
    # the refusals left nothing behind: an eager step after them is the first one's
    got, err, grads = step(None)
    return {"moved": moved, "errors": errors, "err": err, "inference": torch.equal(inference, want),
            "out": torch.equal(got, want),
            "grads": all(torch.equal(a, b) for a, b in zip(grads, grads_want, strict=True))}


CA_CASES = [("per-step", "feplb-split"), ("per-microbatch", "feplb-split"), ("per-step", "none")]


def _compiled_autograd_cases(rank, world):
    """Every case of ``CA_CASES`` in turn, in one job: Dynamo's set-up of its first compile in a process (several
    seconds on a CPU) is paid once."""
    return {case: _compiled_autograd_worker(rank, world, *case) for case in CA_CASES}


@pytest.fixture(scope="module")
def compiled_autograd_runs():
    return run_dist(_compiled_autograd_cases, 2, timeout_s=400, collective_timeout_s=120)


@pytest.mark.parametrize("weights,policy", CA_CASES)
def test_compiled_autograd_is_refused_on_every_rank(compiled_autograd_runs, weights, policy):
    """Compiled autograd (torchtitan's experimental.enable_compiled_autograd) cannot keep the layer's backward
    (node order, collectives on the copy thread): a forward inside it, and a backward under it, raise a clear error
    on every rank before any collective of theirs (the run would otherwise fail mid-backward on one rank and leave
    its peer waiting); an eager step afterwards equals one before."""
    for ranks in compiled_autograd_runs:
        res = ranks[(weights, policy)]
        assert res["moved"] > 0 or policy == "none", res
        assert set(res["errors"]) == {"forward", "backward"}, res
        for where, msg in res["errors"].items():
            assert msg is not None and "cannot run under compiled autograd" in msg, (where, msg)
        assert res["err"] is None and res["inference"] and res["out"] and res["grads"], res
