"""``MoELayer.forward_dispatched``: the experts behind a dispatch the caller runs itself (as DeepEP users do), on 4
gloo ranks modelled as 2 nodes of 2.

The test's own dispatch (``torch.distributed.nn``'s differentiable all-to-all, each rank's rows regrouped by local
expert) stands in for DeepEP's ``Buffer.dispatch`` / ``combine``. Against a dense fp64 reference over every rank's
tokens: the outputs, the gradients of the tokens (through the experts and the gates), and each rank's expert weight
gradients, for plain EP and the balancing policies (per-micro-batch and per-step weights); rows really move where
balancing is on. Activation checkpointing around dispatch + experts + combine gives the same gradients bit for
bit (also with tokens that need no grad, as a first layer's, and with frozen experts besides); the layer's own
``forward`` on the same routing gives the same output; a bad argument on one rank raises on every rank; a policy
that moves the dispatch itself (``+place``, the peers' direct policies) is refused by name.
"""

from __future__ import annotations

import pytest
import torch

from feplb.testing import dense_moe_reference, error_bound, error_of, load_global_weights, run_dist

pytestmark = pytest.mark.dist

H, FF, E, K, W = 16, 32, 16, 2, 4
L = E // W
HOT = (0, 1, 8, 9)   # experts of ranks 0 and 2: each node has a busy GPU and an idle one


def _weights():
    gen = torch.Generator().manual_seed(7)
    router = torch.randn(E, H, generator=gen) / H ** 0.5
    router[:, 0] = 0.0
    router[list(HOT), 0] = 1.0
    w1 = torch.randn(E, H, 2 * FF, generator=gen) / H ** 0.5
    w2 = torch.randn(E, FF, H, generator=gen) / FF ** 0.5
    return router, w1, w2


def _tokens(rank: int, step: int = 0):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(24 + 8 * rank, H, generator=gen)
    x[:, 0] = x[:, 0].abs() + 1.0
    gy = torch.randn(x.shape, generator=gen)
    return x, gy


def _route(x, router):
    """Top-k ids and softmax gates (differentiable in x), as ``dense_moe_reference`` computes them."""
    ids = torch.nn.functional.linear(x.detach().float(), router.float()).softmax(-1).topk(K, dim=-1).indices
    gates = (x @ router.t()).softmax(-1).gather(-1, ids)
    return ids, gates


def _layer(policy: str, weights: str = "per-microbatch", table: torch.Tensor | None = None, **kw):
    """The test's layer; with ``table`` [E, H], each expert output row gains its expert's row of the table (a
    per-expert step after the experts, ``post_expert_ids``)."""
    from feplb import FEPLBConfig, MoELayer

    cls = MoELayer
    if table is not None:
        class PerExpert(MoELayer):
            post_expert_ids = True

            def post_expert(self, y_MD, expert_M):
                return y_MD + table[expert_M].to(y_MD.dtype)

        cls = PerExpert
    router, w1, w2 = _weights()
    layer = cls(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=2, dyn=2, min_chunk=2,
                            plan_wait_ms=60_000, min_straggler_rows=0, policy=policy, weights=weights, **kw))
    load_global_weights(layer, router, w1, w2)
    if weights == "per-step":
        layer.refresh_replicas()
    return layer


def _moe(layer, x, ids, gates):
    """Dispatch (the caller's own), ``forward_dispatched``, combine: [T, H] -> [T, H], differentiable. The dispatch
    and the combine run on the host (gloo); the rows go to the layer's device and back."""
    from torch.distributed.nn.functional import all_to_all_single

    rank, T, H, L, W = layer.rank, x.shape[0], layer.config.hidden, layer.num_local, layer.world_size
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)               # the (token, k) pairs by expert, so by destination
    send = torch.bincount(flat // L, minlength=W)
    recv = torch.empty_like(send)
    torch.distributed.all_to_all_single(recv, send)
    send_l, recv_l = send.tolist(), recv.tolist()
    rx = all_to_all_single(x.new_empty(sum(recv_l), H), x[order // K], recv_l, send_l)
    re_ = torch.empty(sum(recv_l), dtype=flat.dtype)
    torch.distributed.all_to_all_single(re_, flat[order].contiguous(), recv_l, send_l)
    local = re_ - rank * L
    perm = torch.argsort(local, stable=True)              # every source's rows regrouped by local expert
    counts = torch.bincount(local, minlength=L).tolist()
    y = layer.forward_dispatched(rx[perm].to(layer.expert_weights()[0].device), counts).to(x.device)
    y_recv = y[torch.argsort(perm)]
    y_sent = all_to_all_single(y.new_empty(T * K, H), y_recv, send_l, recv_l)
    y_tk = y_sent[torch.argsort(order)].view(T, K, H)
    return (y_tk * gates[..., None]).sum(1)


def _reference(rank: int, router, w1, w2):
    """fp64: this rank's output, and the gradients of every rank's summed loss w.r.t. the experts."""
    w1d, w2d = w1.double().requires_grad_(), w2.double().requires_grad_()
    out_mine = None
    for r in range(W):
        xr, gyr = _tokens(r)
        xr = xr.double().requires_grad_()
        out = dense_moe_reference(xr, router.double(), w1d, w2d, K)
        (out * gyr.double()).sum().backward()
        if r == rank:
            out_mine, gx = out.detach(), xr.grad
    return out_mine, gx, w1d.grad, w2d.grad


def _err(got, want) -> tuple[float, float]:
    """(max abs error, the project's bound for it) of got against the fp64 want."""
    _, bound = error_bound(want)
    return (got.double() - want).abs().max().item(), bound


def _exact_case(rank: int, policy: str, weights: str) -> dict:
    layer = _layer(policy, weights)
    router, w1, w2 = _weights()
    x, gy = _tokens(rank)
    x.requires_grad_()
    ids, gates = _route(x, router)
    out = _moe(layer, x, ids, gates)
    (out * gy).sum().backward()
    stats = layer.last_stats
    want, gx, gw1, gw2 = _reference(rank, router, w1, w2)
    lo = rank * L
    errs = {"out": _err(out, want), "x": _err(x.grad, gx), "w1": _err(layer.w1.grad, gw1[lo:lo + L]),
            "w2": _err(layer.w2.grad, gw2[lo:lo + L])}
    # the layer's own dispatch on the same routing: the same output
    with torch.no_grad():
        own = layer(x.detach(), routing=(ids, gates.detach()))
    errs["own_forward"] = _err(out.detach(), own.detach().double())
    # rows moved over the group: each plan's moves counted once (by the first rank it covers)
    moved = torch.tensor([stats.rows_moved if rank == stats.planned_ranks[0] else 0])
    torch.distributed.all_reduce(moved)
    layer.close()
    return {"errs": errs, "rows_moved": int(moved), "before": stats.token_straggler_before,
            "after": stats.token_straggler_after}


def _checkpoint_case(rank: int) -> dict:
    """Non-reentrant checkpointing around dispatch + experts + combine: the recompute replays the forward's plan.
    Also with tokens that need no grad (a first layer's, behind a frozen embedding): the rows need it through the
    expert parameters, in the recompute as in the forward (before, the recompute saved fewer tensors, and torch's
    checkpoint raised on every rank). And with the expert parameters frozen too ("frozen"): nothing the layer
    reads needs grad on any rank, so its output needs none, on every rank, as torch's own ops' would not (earlier,
    only on the ranks whose plan made an exchange: only those ran the layer's backward, and the checkpoint's
    recompute, waiting for the others until the timeout; then on every rank, a backward running through the layer
    for nothing)."""
    from torch.utils.checkpoint import checkpoint

    router, _, _ = _weights()
    same, moved = {}, {}
    for need in (True, False, "frozen"):
        grads = []
        for ckpt in (False, True):
            layer = _layer("feplb-split")
            if need == "frozen":
                layer.w1.requires_grad_(False)
                layer.w2.requires_grad_(False)
            x, gy = _tokens(rank, step=1)
            x.requires_grad_(need is True)
            ids, gates = _route(x, router)
            out = checkpoint(_moe, layer, x, ids, gates, use_reentrant=False) if ckpt else \
                _moe(layer, x, ids, gates)
            if need == "frozen":
                assert not out.requires_grad, (rank, ckpt, "nothing needs grad: neither does the output")
            else:
                (out * gy).sum().backward()
            stats = layer.last_stats
            grads.append([None if t is None else t.clone() for t in (x.grad, layer.w1.grad, layer.w2.grad)]
                         + [stats.rows_moved if rank == stats.planned_ranks[0] else 0])
            layer.close()
        same[need] = all((a is None) == (b is None) and (a is None or torch.equal(a, b))
                         for a, b in zip(grads[0][:3], grads[1][:3], strict=True)) and \
            (need != "frozen" or all(g is None for g in grads[1][:3]))
        moved[need] = grads[1][3]
    return {"same": same, "moved": moved}


def _frozen_checkpoint_case(rank: int) -> dict:
    """``forward_dispatched`` alone, under a non-reentrant checkpoint and without, per-step weights, its expert
    parameters frozen and its rows needing no grad on any rank, or on rank 1 only. On no rank: nothing it reads
    needs grad, and its output needs none on any rank (as torch's own ops'; before, it needed grad on every rank,
    and a backward ran through the layer's exchanges for nothing; earlier still, only on the ranks whose plan made
    an exchange, and every rank waited until the timeout). On rank 1 only: the output needs grad on every rank
    (the ranks agree in the counts all-gather), every rank runs the backward, recompute included, and rank 1's
    rows' gradient equals the one without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    out = {}
    for needs_on in ((), (1,)):
        got = {}
        for ckpt in (False, True):
            layer = _layer("feplb-split", "per-step")
            layer.w1.requires_grad_(False)
            layer.w2.requires_grad_(False)
            counts = [40, 8, 0, 0] if rank % 2 == 0 else [6, 2, 0, 0]
            rows = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(rank))
            rows.requires_grad_(rank in needs_on)
            y = checkpoint(lambda r, layer=layer, counts=counts: layer.forward_dispatched(r, counts), rows,
                           use_reentrant=False) if ckpt else layer.forward_dispatched(rows, counts)
            needs = y.requires_grad
            err = error_of(lambda y=y: (y ** 2).mean().backward()) if needs else None
            stats = layer.last_stats
            got[ckpt] = {"needs": needs, "error": err, "grads": [layer.w1.grad, layer.w2.grad],
                         "rows": None if rows.grad is None else rows.grad.clone(),
                         "moved": stats.rows_moved if rank == stats.planned_ranks[0] else 0}
            layer.close()
        out[needs_on] = got
    return out


def _hf_case(rank: int, arch: str) -> dict:
    """A transformers experts module replaced by ``feplb.hf`` (its own weight layout: Mixtral's, gpt-oss's transposed,
    interleaved and biased experts): ``forward_dispatched`` behind the test's dispatch against the module's own
    forward on the same routing, outputs and every gradient."""
    import importlib.util
    from pathlib import Path

    import feplb.hf as fh

    spec = importlib.util.spec_from_file_location("_feplb_hf_models", Path(__file__).parents[1] / "hf" / "models.py")
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    if arch in models.ARCHS:
        model = models.make_model(arch)
    else:   # Ergo's: its norm per expert (a scale [E, H], varied from its ones) given each row's expert id
        from feplb.hfcheck import tiny_model

        model = tiny_model(arch)
    fh.apply(model, policy="feplb-split", gpus_per_node=2, min_chunk=1, plan_wait_ms=60_000, min_straggler_rows=0)
    experts = next(m for m in model.modules() if isinstance(m, fh.FEPLBExperts))
    c = experts.config
    gen = torch.Generator().manual_seed(50 + rank)
    T = 20 + 4 * rank
    x, gy = torch.randn(T, c.hidden, generator=gen), torch.randn(T, c.hidden, generator=gen)
    p = torch.ones(c.num_experts)
    p[[0, 2 * experts.num_local]] = 8.0   # the first expert of each node's first GPU: busy
    ids = torch.stack([torch.multinomial(p, c.top_k, generator=gen) for _ in range(T)])
    gates = torch.rand(T, c.top_k, generator=gen).softmax(-1)
    got = []
    for dispatched in (False, True):
        xx, gg = x.clone().requires_grad_(), gates.clone().requires_grad_()
        out = _moe(experts, xx, ids, gg) if dispatched else experts(xx, ids, gg)
        (out * gy).sum().backward()
        stats = experts.last_stats
        # every parameter of the module: the expert shards, and replicated ones (Ergo's per-expert norm), summed
        # over the ranks (the data-parallel all-reduce): behind the caller's dispatch the norm runs at the experts'
        # owners, not at the tokens' ranks
        sharded = {id(w) for w in experts.expert_params()}
        grads = [w.grad.clone() for w in experts.parameters()]
        for w, g in zip(experts.parameters(), grads, strict=True):
            if id(w) not in sharded:
                torch.distributed.all_reduce(g)
        got.append([out.detach(), xx.grad, gg.grad, *grads, stats.rows_moved if rank == stats.planned_ranks[0] else 0])
        experts.zero_grad()
    rel = [float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(got[1][:-1], got[0][:-1],
                                                                                      strict=True)]
    moved = torch.tensor([got[1][-1]])
    torch.distributed.all_reduce(moved)
    experts.close()
    return {"rel": rel, "moved": int(moved), "params": len(got[0]) - 4}


def _errors_case(rank: int) -> dict:
    out = {}
    layer = _layer("feplb-split")
    rows = torch.randn(6, H)
    # a wrong count on rank 1 alone: every rank raises, rank 1 with its own reason
    counts = [1, 2, 3, 1] if rank == 1 else [1, 2, 3, 0]
    out["sum"] = error_of(lambda: layer.forward_dispatched(rows, counts))
    out["dtype"] = error_of(lambda: layer.forward_dispatched(rows.double() if rank == 2 else rows, [6, 0, 0, 0]))
    out["len"] = error_of(lambda: layer.forward_dispatched(rows, [6, 0, 0] if rank == 3 else [6, 0, 0, 0]))
    # counts the host cannot read (a meta tensor) on rank 1: refused there, and the others learn it
    meta = torch.empty(L, dtype=torch.int64, device="meta")
    out["meta"] = error_of(lambda: layer.forward_dispatched(rows, meta if rank == 1 else [1, 2, 3, 0]))
    # ranks that call differently would run different collectives: autograd off on rank 1 alone (its backward would
    # wait for the others'), or the layer's own forward on rank 0
    with torch.set_grad_enabled(rank != 1):
        out["grad_mode"] = error_of(lambda: layer.forward_dispatched(rows, [1, 2, 3, 0]))
    ids = torch.randint(0, E, (5, K))
    out["method"] = error_of(lambda: layer(rows[:5], routing=(ids, torch.rand(5, K))) if rank == 0 else
                             layer.forward_dispatched(rows, [1, 2, 3, 0]))
    # inside torch.autocast, rows in the autocast dtype are accepted (as forward() accepts its input) and the
    # outputs come back in it: the rows cast to the layer's dtype, the same computation
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = layer.forward_dispatched(rows.bfloat16(), [1, 2, 3, 0])
        full = layer.forward_dispatched(rows.bfloat16().float(), [1, 2, 3, 0])
    out["autocast"] = (half.dtype, full.dtype, torch.equal(half, full.bfloat16()))
    # the layer still works after the refusals (every rank left them together)
    y = layer.forward_dispatched(rows, [2, 2, 1, 1])
    out["after"] = (y.shape == rows.shape, bool(torch.isfinite(y).all()))
    # a rank that received no rows still takes part, forward and backward, computing rows its node peer moved to it
    mine = (rows[:0] if rank == 3 else rows).clone().requires_grad_()
    y = layer.forward_dispatched(mine, [0, 0, 0, 0] if rank == 3 else [2, 2, 1, 1])
    (2 * y).sum().backward()
    out["empty"] = y.shape == mine.shape and mine.grad is not None and mine.grad.shape == mine.shape
    out["hosted"] = layer.last_stats.loads_after_W[rank]
    layer.close()
    for policy in ("feplb-split+place", "eplb"):
        placed = _layer(policy)
        out[policy] = error_of(lambda placed=placed: placed.forward_dispatched(rows, [6, 0, 0, 0]))
        # refused while a peer calls the layer's own forward: every rank raises together (rank 2 too, whose forward
        # would otherwise pair its collectives with the others' next forward), and the layer works on
        out[policy + " apart"] = error_of(lambda placed=placed: placed(rows[:5], routing=(ids, torch.rand(5, K)))
                                          if rank == 2 else placed.forward_dispatched(rows, [6, 0, 0, 0]))
        y = placed(rows[:5], routing=(ids, torch.rand(5, K)))
        out[policy + " after"] = y.shape == (5, H) and bool(torch.isfinite(y).all())
        placed.close()
    return out


def _device_worker(rank: int, world: int, device: str, copy_path: str) -> dict:
    """Two ranks as one node on ``device`` (on CUDA: two processes sharing one GPU over gloo, the CUDA IPC copy
    path): ``forward_dispatched`` behind the test's dispatch with balancing on and off, and the layer's own forward
    with balancing on, on the same routing; the outputs and every gradient, each run against plain EP. Then the same
    three with a per-expert step after the experts (``post_expert_ids``: each row's expert id scattered on the device
    in ``forward``, sent from the host in ``forward_dispatched``), against plain EP with it."""
    if device == "cuda":
        torch.cuda.set_device(0)
    router, _, _ = _weights()
    table = torch.randn(E, H, generator=torch.Generator().manual_seed(11)).to(device)
    runs = {}
    for run in ("none", "feplb-split", "own", "none+ids", "feplb-split+ids", "own+ids"):
        policy = run.removesuffix("+ids")
        layer = _layer("feplb-split" if policy == "own" else policy, device=device, copy_path=copy_path,
                       table=table if run.endswith("+ids") else None)
        x, gy = _tokens(rank, step=2)
        x.requires_grad_()
        ids, gates = _route(x, router)
        if policy == "own":
            out = layer(x.to(device), routing=(ids.to(device), gates.to(device))).cpu()
        else:
            out = _moe(layer, x, ids, gates)
        (out * gy).sum().backward()
        stats = layer.last_stats
        runs[run] = {"out": out.detach(), "x": x.grad, "w1": layer.w1.grad.cpu(), "w2": layer.w2.grad.cpu(),
                     "moved": stats.rows_moved if rank == stats.planned_ranks[0] else 0}
        layer.close()
    # the table changes the outputs: the per-expert runs are not the plain ones
    shifted = float((runs["none+ids"]["out"] - runs["none"]["out"]).abs().max())
    return {"moved": runs["feplb-split"]["moved"] and runs["feplb-split+ids"]["moved"], "shifted": shifted,
            "errs": {f"{run}{ids}.{name}": _err(runs[run + ids][name], runs["none" + ids][name].double())
                     for ids in ("", "+ids") for run in ("feplb-split", "own") for name in ("out", "x", "w1", "w2")}}


def _check_device_worker(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        for name, (err, bound) in res["errs"].items():
            assert err <= bound, f"rank {rank}: {name} off by {err:.3g} (bound {bound:.3g})"
        assert res["shifted"] > 0.1, res["shifted"]
    assert results[0]["moved"] > 0, results


def test_device_worker_on_cpu():
    """The GPU test's worker on CPU tensors (shared-memory copy path): its logic is checked where no GPU is."""
    _check_device_worker(run_dist(_device_worker, 2, "cpu", "auto", timeout_s=120, collective_timeout_s=30))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_forward_dispatched_equals_plain_ep_two_processes_one_gpu():
    # 100 s: inside gpu_check.sh's runtime step (spawned ranks, CUDA init and first compiles)
    _check_device_worker(run_dist(_device_worker, 2, "cuda", "ipc", timeout_s=100, collective_timeout_s=60))


def _has_ergo() -> bool:
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return False
    return "ergo" in CONFIG_MAPPING_NAMES   # transformers >= 5.25


HF_ARCHS = ("mixtral", "gpt_oss") + (("ergo",) if _has_ergo() else ())
CASES = (("none", "per-microbatch"), ("feplb-split", "per-microbatch"), ("feplb", "per-microbatch"),
         ("feplb-split@ema", "per-step"), ("lp", "per-step"))


def _worker(rank: int, world: int) -> dict:
    return {"exact": {case: _exact_case(rank, *case) for case in CASES}, "checkpoint": _checkpoint_case(rank),
            "frozen checkpoint": _frozen_checkpoint_case(rank),
            "errors": _errors_case(rank), "hf": {arch: _hf_case(rank, arch) for arch in HF_ARCHS}}


@pytest.fixture(scope="module")
def ranks():
    return run_dist(_worker, W, timeout_s=240, collective_timeout_s=60)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_forward_dispatched_equals_the_dense_reference(ranks, case):
    for rank, res in enumerate(ranks):
        got = res["exact"][case]
        for name, (err, bound) in got["errs"].items():
            assert err <= bound, f"rank {rank}, {case}: {name} off by {err:.3g} (bound {bound:.3g})"
    moved = ranks[0]["exact"][case]["rows_moved"]
    if case[0] == "none":
        assert moved == 0
    else:
        # balancing really moved rows between the GPUs of a node, and lowered the straggler
        assert moved > 0, case
        assert all(r["exact"][case]["after"] < r["exact"][case]["before"] for r in ranks), case


def test_forward_dispatched_under_activation_checkpointing(ranks):
    for rank, res in enumerate(ranks):
        for need, same in res["checkpoint"]["same"].items():
            assert same, f"rank {rank}: checkpointed gradients differ (tokens requiring grad: {need})"
    for need in (True, False, "frozen"):   # the replayed forward had moved rows
        assert sum(res["checkpoint"]["moved"][need] for res in ranks) > 0, need


def test_forward_dispatched_with_nothing_needing_grad_under_activation_checkpointing(ranks):
    for rank, res in enumerate(ranks):
        for needs_on, by_ckpt in res["frozen checkpoint"].items():
            for ckpt, got in by_ckpt.items():
                assert got["needs"] == bool(needs_on), (rank, needs_on, ckpt, "the output needs grad")
                assert got["error"] is None and got["grads"] == [None, None], (rank, needs_on, ckpt, got)
                assert (got["rows"] is not None) == (rank in needs_on), (rank, needs_on, ckpt)
            if by_ckpt[False]["rows"] is not None:
                assert torch.equal(by_ckpt[True]["rows"], by_ckpt[False]["rows"]), (rank, needs_on)
    for needs_on in ((), (1,)):
        for ckpt in (False, True):
            assert sum(res["frozen checkpoint"][needs_on][ckpt]["moved"] for res in ranks) > 0, (needs_on, ckpt)


def test_forward_dispatched_refuses_bad_arguments_on_every_rank(ranks):
    for rank, res in enumerate(ranks):
        e = res["errors"]
        if rank == 1:
            assert e["sum"].startswith("ValueError") and "add up to 7 rows but rows holds 6" in e["sum"], e["sum"]
        else:
            assert e["sum"].startswith("ValueError") and "EP rank(s) [1] refused" in e["sum"], e["sum"]
        # the refusing rank raises its own error; the others say which rank refused, and what it said
        assert "dtype must be torch.float32" in e["dtype"], e["dtype"]
        assert e["dtype"].startswith("TypeError") if rank == 2 else \
            "EP rank(s) [2] refused this forward (on EP rank(s) [2]: TypeError: " in e["dtype"], e["dtype"]
        assert "one count per local expert (4), got 3" in e["len"], e["len"]
        assert ("EP rank(s) [3] refused" in e["len"]) == (rank != 3), e["len"]
        if rank == 1:
            assert e["meta"].startswith("ValueError") and "counts could not be read on the host" in e["meta"], e["meta"]
        else:
            assert "EP rank(s) [1] refused" in e["meta"], e["meta"]
        assert e["grad_mode"].startswith("RuntimeError") and "autograd on some ranks and off on others (autograd " \
            "on on EP rank(s) [0, 2, 3], off (torch.no_grad, inference_mode) on [1])" in e["grad_mode"], e["grad_mode"]
        assert e["method"].startswith("RuntimeError") and "call this layer in different ways (forward_dispatched " \
            "on EP rank(s) [1, 2, 3], forward on [0])" in e["method"], e["method"]
        assert e["autocast"] == (torch.bfloat16, torch.float32, True), e["autocast"]
        assert e["after"] == (True, True)
        assert e["empty"]
        for policy in ("feplb-split+place", "eplb"):
            assert e[policy].startswith("ValueError") and f"policy {policy!r}" in e[policy], e[policy]
            apart = e[policy + " apart"]
            if rank == 2:
                assert apart is not None and "EP rank(s) [0, 1, 3] refused" in apart, apart
                # the three refused alike: said once, for the three
                assert apart.count(f"policy {policy!r}") == 1 and "(on EP rank(s) [0, 1, 3]: ValueError: " in apart, \
                    apart
            else:
                assert apart is not None and apart.startswith("ValueError") and f"policy {policy!r}" in apart, apart
            assert e[policy + " after"], (rank, policy)
    assert ranks[3]["errors"]["hosted"] > 0   # rank 3 computed rows of rank 2's, with none of its own


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_forward_dispatched_of_a_transformers_experts_module(ranks, arch):
    for rank, res in enumerate(ranks):
        got = res["hf"][arch]
        assert got["params"] == (4 if arch == "gpt_oss" else 3 if arch == "ergo" else 2), got   # biases, norm
        assert max(got["rel"]) <= 1e-5, f"rank {rank}: {got['rel']}"
    assert ranks[0]["hf"][arch]["moved"] > 0
