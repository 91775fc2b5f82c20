"""MoELayer under activation checkpointing (``torch.utils.checkpoint``, reentrant and not) on 4 gloo ranks (2 nodes
x 2 GPUs), against the same layer run without checkpointing:

* the recompute executes exactly what its forward did (``feplb.recompute``): outputs and every gradient (input,
  router, experts) are bit for bit those of the layer without checkpointing, over two optimizer steps of three
  micro-batches (one of which falls back to computing at home, its plan late, which its recompute repeats), for
  plain EP, ``feplb-split`` (rows and weights move), ``feplb-split+place@ema`` with per-micro-batch weights (the
  placement and dynamic sets change between a forward and its recompute) and the peers' ``eplb`` (the direct path);
  the layer last in the checkpointed block and followed by an op that saves its output;
* the last of each step's recomputes would find its plan late: it replays the recorded plan and never plans;
* selective activation checkpointing (torch's ``create_selective_checkpoint_contexts``, torchtitan's op-level mode),
  with the matrix products saved, nearly every op's output, or every one (for fastermoe, the peers' direct path and
  per-step copies): bit for bit as above, and the recompute dispatches its forward's ops in the forward's order
  (torch hands a saved output to the call of the same op and invocation count), also for three recomputes in
  autograd's order;
* recomputes come in any order (three micro-batches forward, then one backward of their sum); ``no_grad`` forwards
  in training mode (one of the very first micro-batch's input, its plan late) are never taken by a non-reentrant
  recompute; a reentrant one may take the equal one, and the parameters' gradients add the micro-batches in
  another order: equal up to rounding there;
* a second backward through the same graph (``retain_graph``) replays again; ``refresh_replicas()`` between a
  checkpointed forward and its backward raises on every rank;
* micro-batches with equal counts on every rank but different plans, pending together: each non-reentrant recompute
  replays its own forward (found by its checkpoint frame); epochs of reentrant checkpointing after a no_grad forward
  of the same batch, with optimizer steps between, never trip on the record left behind; reentrant checkpointing
  inside save_on_cpu, checkpointing in eval mode (both kinds), and the last forward's timeline, left alone;
* nested checkpoints (also of the two kinds, and a no_grad call inside a block), the layer twice in one block
  (each call its own record, again on a second backward), refresh_replicas() where no copies are held, and
  save_on_cpu inside the block (two pending equal forwards, each its own, twice, and under selective activation
  checkpointing);
* a non-reentrant checkpoint nested in a reentrant one, two micro-batches of equal counts and different plans
  pending together after a no_grad forward of the same batch: each inner recompute repeats what its first run (in
  the outer recompute) repeated; a checkpointed forward whose backward never ran (dropped, or an exception in the
  block) leaves no claim on later recomputes; saved-tensor hooks on some ranks only are refused at that forward; a
  backward that raised between two recomputes, retried, repeats them in order;
* a recompute that routes differently from its forward raises a clear error on every rank, and the layer works on;
* memory: the weights (and rows) a helper received are held from the forward to the backward without checkpointing,
  and not at all under it (the recompute receives them again); nothing received outlives the backward.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from feplb.testing import run_dist

pytestmark = pytest.mark.dist

H, FF, E, K, W, G = 16, 24, 16, 2, 4, 2
TOKENS = (40, 24, 32, 16)


def _layer(policy: str, weights: str, seed: int, ids: bool = False, **kw):
    """ids: a layer whose post-expert step takes each row's expert (``post_expert_ids``, as feplb.hf's per-expert
    norm): it scales each row by its expert's number."""
    from feplb import FEPLBConfig, MoELayer

    class WithIds(MoELayer):
        post_expert_ids = True

        def post_expert(self, y_MD, expert_M=None):
            return y_MD * (1.0 + 0.01 * expert_M.to(y_MD.dtype))[:, None]

    torch.manual_seed(seed)     # the same router and expert weights for both layers of a pair
    cls = WithIds if ids else MoELayer
    layer = cls(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=G, dyn=2, policy=policy,
                            weights=weights, min_chunk=2, min_straggler_rows=0, refresh_every=2, **kw))
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer.attach_optimizer(opt)
    return layer, opt


def _inputs(rank: int, mb: int):
    gen = torch.Generator().manual_seed(1000 * rank + mb)
    x = torch.randn(TOKENS[rank], H, generator=gen)
    x[:, 0] += 3.0 * (mb + 1)      # skews the router towards a few experts, differently per micro-batch
    return x, torch.randn(TOKENS[rank], H, generator=gen)


def _block(layer, tail: str):
    """The checkpointed block: ops that save tensors before the layer, and after it (``tanh``) or not (the layer's
    combine is the block's last op that saves: non-reentrant checkpointing stops the recompute there)."""
    def f(x):
        y = layer(torch.sin(x) * 2.0)
        return torch.tanh(y) if tail == "tanh" else y + x
    return f


SELECTIVE = ("selective-mm", "selective-most")
SAC_MODES = (*SELECTIVE, "selective-all")
# allocations whose results are written in place afterwards, in-place ops and collectives: selective activation
# checkpointing refuses a saved tensor modified later ("Tensor cached during selective activation checkpoint has been
# mutated"), whatever the layer; every other op's output is saved by the "most" policy
_NEVER_SAVED = ("empty", "new_empty", "new_zeros", "zeros", "zeros_like", "empty_like", "empty_strided", "full",
                "new_full", "ones", "arange", "scalar_tensor", "lift_fresh", "lift_fresh_copy")


def _sac_policy(ctx, op, *args, kind: str, **kwargs):
    """selective-mm: the matrix products saved (torch's aten.mm, feplb's grouped GEMM), the rest recomputed;
    selective-most: every op's output saved but for those of _NEVER_SAVED, in-place ops and collectives;
    selective-all: every op's output saved (a policy that refuses any module writing into a tensor it made). A
    recompute that issued other ops than its forward, or in another order, would then be handed the outputs of
    other calls of the same op (matched by op and invocation count)."""
    from torch.utils.checkpoint import CheckpointPolicy

    name = str(op)
    if kind == "selective-mm":
        keep = op == torch.ops.aten.mm.default or name.startswith("feplb.grouped_mm")
    elif kind == "selective-all":
        keep = True
    else:
        base = name.split(".")[1] if name.count(".") >= 2 else name
        keep = not (base.endswith("_") or name.startswith("c10d") or base in _NEVER_SAVED)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpoint(fn, x, mode: str, log: list | None = None):
    """``torch.utils.checkpoint`` of fn(x) in ``mode``: reentrant, non-reentrant, or selective (non-reentrant with
    torch's ``create_selective_checkpoint_contexts``, a policy of :func:`_sac_policy`); ``log`` gathers the ops
    each run of the block dispatches (its forward, then its recompute), one list per run."""
    from functools import partial

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if mode not in SAC_MODES:
        return checkpoint(fn, x, use_reentrant=mode == "reentrant")
    block = fn if log is None else _logged(fn, log)
    return checkpoint(block, x, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, partial(_sac_policy, kind=mode)))


def _logged(fn, log: list):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import SAC_IGNORED_OPS

    class OpLog(TorchDispatchMode):
        def __init__(self, ops):
            super().__init__()
            self.ops = ops

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func not in SAC_IGNORED_OPS:
                self.ops.append((str(func), tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))))
            return func(*args, **(kwargs or {}))

    def block(x):
        ops = []
        log.append(ops)
        with OpLog(ops):
            return fn(x)
    return block


def _same_ops(log: list, what) -> None:
    """The recompute dispatched the forward's ops, in its order (a prefix of them: non-reentrant checkpointing
    stops once it has every saved tensor)."""
    assert len(log) == 2, (what, "one forward and one recompute", len(log))
    fwd, rec = log
    first = next((i for i, (a, b) in enumerate(zip(fwd, rec, strict=False)) if a != b), None)
    assert first is None and 0 < len(rec) <= len(fwd), (what, first, fwd[first or 0:(first or 0) + 3],
                                                        rec[first or 0:(first or 0) + 3], len(fwd), len(rec))


def _grads(layer, x) -> dict:
    return {"x": x.grad.clone(), "router": layer.router.weight.grad.clone(), "w1": layer.w1.grad.clone(),
            "w2": layer.w2.grad.clone()}


def _compare(got: dict, want: dict, what: str, exact: bool = True) -> None:
    """Bit for bit; or (``exact=False``: sums whose order differs) each tensor's largest error within 1e-6 of its
    largest element."""
    for k in want:
        err = (got[k] - want[k]).abs().max().item()
        assert torch.equal(got[k], want[k]) if exact else err <= 1e-6 * want[k].abs().max().item(), (what, k, err)


def _steps(rank: int, policy: str, weights: str, mode: str, tail: str, ids: bool = False) -> dict:
    """Two optimizer steps of three micro-batches, a backward after each forward: the layer without
    checkpointing (ref) and with (ac) side by side on the same data."""
    ref, ref_opt = _layer(policy, weights, seed=3, ids=ids)
    ac, ac_opt = _layer(policy, weights, seed=3, ids=ids)
    late = _make_late(ref, ac)
    replays = _count_replays(ac)
    moved = fell_back = 0
    for step in range(2):
        for mb in range(3):
            x, dy = _inputs(rank, 3 * step + mb)
            xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            # the second micro-batch's plan comes too late on every rank (both layers): it computes at home, and so
            # must its recompute, whose plan would be on time
            late["on"] = mb == 1
            out_r = _block(ref, tail)(xr)
            log = [] if mode in SAC_MODES else None
            out_a = _checkpoint(_block(ac, tail), xa, mode, log)
            late["on"] = False
            fell_back += ref.last_stats.fell_back
            assert torch.equal(out_a, out_r), (policy, mode, tail, step, mb, "output")
            (out_r * dy).sum().backward()
            # the third micro-batch's recompute would find its plan late: it replays the forward's plan instead
            late["on"] = mb == 2
            (out_a * dy).sum().backward()
            late["on"] = False
            if log is not None:
                _same_ops(log, (policy, mode, tail, step, mb))
            assert ac._records.replayed() == len(ac._records) == 3 * step + mb + 1, "one record per forward, replayed"
            assert len(ref._records) == 0, "a plain training forward leaves no record"
            # what the forward did (the replay leaves it: a recompute plans nothing and reports nothing)
            assert dataclasses.replace(ac.last_stats, plan_us=0.0) == dataclasses.replace(ref.last_stats, plan_us=0.0)
            moved += ref.last_stats.rows_moved
            _compare(_grads(ac, xa), _grads(ref, xr), (policy, mode, tail, step, mb))
        ref_opt.step(), ac_opt.step()
        ref_opt.zero_grad(), ac_opt.zero_grad()
    ref.close(), ac.close()
    assert replays[0] == 6, "every forward was recomputed once"
    return {"moved": moved, "fell_back": fell_back}


def _make_late(*layers) -> dict:
    """While the returned flag is on, the layers' copy threads find their plans late (as a GPU's would be after the
    static GEMM plus plan_wait_ms)."""
    from feplb.balance import PlanResult

    late = {"on": False}
    for layer in layers:
        if layer._balancer is None:
            continue
        wait = layer._balancer.wait_plan

        def wait_plan(future, static_end, _wait=wait):
            res = _wait(future, static_end)
            return PlanResult(plan=None, plan_us=0.0, ready=0, error=None) if late["on"] else res

        layer._balancer.wait_plan = wait_plan
    return late


def _accumulated(rank: int, policy: str, weights: str, mode: str) -> dict:
    """Three micro-batches forward, then one backward of their sum: the recomputes run in autograd's order, not the
    forwards'. A no_grad forward in training mode comes between them, and one of the first micro-batch's very input
    just before it, whose plan is late (it computes at home): a non-reentrant recompute never takes either (another
    kind of record), a reentrant one may take the equal one (the same function, up to rounding)."""
    ref, _ = _layer(policy, weights, seed=5)
    ac, _ = _layer(policy, weights, seed=5)
    late = _make_late(ref, ac)
    outs_r, outs_a, xs = [], [], []
    for mb in range(3):
        x, dy = _inputs(rank, 10 + mb)
        if mb == 0:
            late["on"] = True
            with torch.no_grad():
                _block(ref, "tanh")(x), _block(ac, "tanh")(x)
            late["on"] = False
        xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        outs_r.append((_block(ref, "tanh")(xr) * dy).sum())
        outs_a.append((_checkpoint(_block(ac, "tanh"), xa, mode) * dy).sum())
        xs.append((xr, xa))
        if mb == 1:
            with torch.no_grad():       # recorded on both layers alike (no_grad in training mode), never recomputed
                ref(x), ac(x)
    sum(outs_r).backward()
    sum(outs_a).backward()
    # reentrant: a recompute may replay the equal no_grad forward, and the parameters' gradients add the
    # micro-batches in another order (a backward per recompute): equal up to rounding
    exact = mode != "reentrant"
    for i, (xr, xa) in enumerate(xs):
        _compare({"x": xa.grad}, {"x": xr.grad}, (policy, mode, "accumulated", i), exact=exact)
    _compare({k: v for k, v in _grads(ac, xs[0][1]).items() if k != "x"},
             {k: v for k, v in _grads(ref, xs[0][0]).items() if k != "x"}, (policy, mode, "accumulated"),
             exact=exact)
    left = len(ac._records) - ac._records.replayed()
    ref.close(), ac.close()
    return {"left": left}


def _ac_rank(rank: int, world: int, policy: str, weights: str) -> dict:
    out = {}
    for mode in ("reentrant", "non-reentrant"):
        for tail in ("tanh", "layer-last"):
            out[(mode, tail)] = _steps(rank, policy, weights, mode, tail)
        out[(mode, "accumulated")] = _accumulated(rank, policy, weights, mode)
    # selective activation checkpointing (torchtitan's op-level mode): the recompute is matched to its forward op
    # by op, and the layer's replay issues the forward's very ops
    for mode in SELECTIVE:
        out[(mode, "tanh")] = _steps(rank, policy, weights, mode, "tanh")
    out[("selective-most", "accumulated")] = _accumulated(rank, policy, weights, "selective-most")
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "weights"), [("none", "per-step"), ("feplb-split", "per-step"),
                                                 ("feplb-split+place@ema", "per-microbatch"), ("eplb", "per-step")],
                         ids=["plain-ep", "feplb-split", "place-ema-per-microbatch", "eplb"])
def test_recompute_equals_no_checkpointing(policy, weights):
    results = run_dist(_ac_rank, W, policy, weights, timeout_s=600)
    for key, res in results[0].items():
        if "moved" in res and policy != "none":
            assert res["moved"] > 0, (key, "balancing moved no row: the test would not exercise it")
        if "fell_back" in res and policy in ("feplb-split", "feplb-split+place@ema"):
            assert res["fell_back"] == 2, (key, "one fallback per optimizer step")
        if "left" in res:
            assert res["left"] == 2, (key, "two records not replayed: as many as no_grad forwards")


def _misuse_rank(rank: int, world: int) -> dict:
    """Per checkpointing mode: a second backward through the same graph (retain_graph) equals the layer without
    checkpointing doing the same; refresh_replicas() between a checkpointed forward and its backward raises on every
    rank (the per-step copies it computed with are gone), and the layer works on."""
    out = {}
    for mode in ("reentrant", "non-reentrant"):
        ref, _ = _layer("feplb-split@ema", "per-step", seed=7)
        ac, _ = _layer("feplb-split@ema", "per-step", seed=7)
        x, dy = _inputs(rank, 20)
        xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        out_r = _block(ref, "tanh")(xr)
        out_a = checkpoint(_block(ac, "tanh"), xa, use_reentrant=mode == "reentrant")
        for _ in range(2):
            (out_r * dy).sum().backward(retain_graph=True)
            (out_a * dy).sum().backward(retain_graph=True)
        twice = all(torch.equal(a, b) for a, b in zip(_grads(ac, xa).values(), _grads(ref, xr).values(), strict=True))

        layer, _ = _layer("feplb-split+place", "per-step", seed=8)
        with torch.no_grad():
            layer(x)            # a history, so that a placement and its bank exist
        layer.refresh_replicas()
        held = layer.replicas.ever_held
        out_l = checkpoint(_block(layer, "tanh"), x.clone().requires_grad_(True), use_reentrant=mode == "reentrant")
        layer.refresh_replicas()
        try:
            (out_l * dy).sum().backward()
            error = None
        except RuntimeError as exc:
            error = str(exc)
        xb = x.clone().requires_grad_(True)
        (layer(xb) * dy).sum().backward()
        out[mode] = {"twice": twice, "held": held, "error": error, "after_ok": bool(torch.isfinite(xb.grad).all())}
        for m in (ref, ac, layer):
            m.close()
    return out


def test_second_backward_and_refresh_before_the_backward():
    for res in run_dist(_misuse_rank, W, timeout_s=300):
        for mode, r in res.items():
            assert r["twice"], (mode, "a second backward (retain_graph) replays the same forward again")
            assert r["held"], (mode, "the layer held per-step copies: the refresh replaced them")
            assert r["error"] and "refresh_replicas() ran between a forward and its recompute" in r["error"], (mode, r)
            assert r["after_ok"], mode


def _routing(rank: int, seed: int = 0):
    """Fixed routing of this rank's tokens, skewed to a few experts (the same counts whatever the input)."""
    gen = torch.Generator().manual_seed(100 + rank + seed)
    probs = torch.ones(E)
    probs[:3] = 12.0
    ids = torch.stack([torch.multinomial(probs, K, generator=gen) for _ in range(TOKENS[rank])])
    return ids, torch.rand(TOKENS[rank], K, generator=gen) + 0.1


def _external_block(layer, ids, gates):
    def f(x):
        return torch.tanh(layer(torch.sin(x) * 2.0, routing=(ids, gates)))
    return f


def _equal_counts(rank: int, policy: str, weights: str, mode: str) -> dict:
    """Three micro-batches with the same routing (equal counts on every rank) and other inputs, forward, then one
    backward of their sum; the first one's plan is late (it computes at home), so the forwards' plans differ: each
    recompute must replay its own forward's."""
    ref, _ = _layer(policy, weights, seed=9, router="external")
    ac, _ = _layer(policy, weights, seed=9, router="external")
    late = _make_late(ref, ac)
    ids, gates = _routing(rank)
    loss_r = loss_a = 0.0
    xs = []
    for mb in range(3):
        x, dy = _inputs(rank, 30 + mb)
        xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        late["on"] = mb == 0
        loss_r = loss_r + (_external_block(ref, ids, gates)(xr) * dy).sum()
        loss_a = loss_a + (checkpoint(_external_block(ac, ids, gates), xa, use_reentrant=mode == "reentrant")
                           * dy).sum()
        late["on"] = False
        xs.append((xr, xa))
    loss_r.backward()
    loss_a.backward()
    exact = mode != "reentrant"   # a reentrant recompute may take an equal forward's record: the same up to rounding
    for i, (xr, xa) in enumerate(xs):
        _compare({"x": xa.grad}, {"x": xr.grad}, (policy, mode, "equal counts", i), exact=exact)
    _compare({k: getattr(ac, k).grad for k in ("w1", "w2")}, {k: getattr(ref, k).grad for k in ("w1", "w2")},
             (policy, mode, "equal counts"), exact=exact)
    ref.close(), ac.close()
    return {"ok": True}


def _edge_rank(rank: int, world: int) -> dict:
    """Equal counts in several pending checkpointed micro-batches (each recompute replays its own forward); epochs of
    a reentrant checkpoint after a no_grad forward of the same batch, with optimizer steps and refreshes between
    (the record of the checkpointed forward left behind is of an older generation: never taken, never an error);
    reentrant checkpointing inside save_on_cpu; checkpointing in eval mode (both kinds); and the timeline of the
    last forward left alone by a recompute."""
    out = {}
    for policy, weights in (("feplb-split", "per-step"), ("feplb-split+place@ema", "per-microbatch")):
        for mode in ("non-reentrant", "reentrant"):
            out[("equal", policy, mode)] = _equal_counts(rank, policy, weights, mode)

    layer, opt = _layer("feplb-split+place", "per-step", seed=10, router="external")
    ids, gates = _routing(rank, 1)
    x, dy = _inputs(rank, 40)
    with torch.no_grad():
        layer(x, routing=(ids, gates))   # a placement and its bank
    layer.refresh_replicas()
    epochs = []
    for epoch in range(3):
        if epoch == 0:
            with torch.no_grad():        # "old log-probabilities" of the same batch
                layer(x, routing=(ids, gates))
        try:
            xa = x.clone().requires_grad_(True)
            (checkpoint(_external_block(layer, ids, gates), xa, use_reentrant=True) * dy).sum().backward()
            opt.step()                   # attach_optimizer: reduce the replicas' gradients, refresh after the step
            opt.zero_grad()
            epochs.append("ok")
        except RuntimeError as exc:
            epochs.append(str(exc))
    out["epochs"] = epochs
    out["held"] = layer.replicas.ever_held

    ref, _ = _layer("feplb-split", "per-step", seed=11)
    ac, _ = _layer("feplb-split", "per-step", seed=11, timeline=True)
    x, dy = _inputs(rank, 41)
    xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (_block(ref, "tanh")(xr) * dy).sum().backward()
    with torch.autograd.graph.save_on_cpu():
        out_a = checkpoint(_block(ac, "tanh"), xa, use_reentrant=True)
        spans = len(ac.last_timeline.spans())
        (out_a * dy).sum().backward()
    out["save_on_cpu"] = torch.equal(xa.grad, xr.grad)
    out["timeline_kept"] = len(ac.last_timeline.spans()) == spans
    ref.eval(), ac.eval()
    xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (_block(ref, "tanh")(xr) * dy).sum().backward()
    (checkpoint(_block(ac, "tanh"), xa, use_reentrant=False) * dy).sum().backward()
    out["eval"] = torch.equal(xa.grad, xr.grad)
    xa = x.clone().requires_grad_(True)       # reentrant in eval mode: the no_grad first run leaves its record
    (checkpoint(_block(ac, "tanh"), xa, use_reentrant=True) * dy).sum().backward()
    out["eval_reentrant"] = torch.equal(xa.grad, xr.grad)
    for m in (ref, ac, layer):
        m.close()
    return out


@pytest.mark.slow
def test_equal_counts_epochs_other_hooks_eval_mode_and_timeline():
    for res in run_dist(_edge_rank, W, timeout_s=600):
        assert res["held"], "the layer held per-step copies: refreshes replaced them"
        assert res["epochs"] == ["ok"] * 3, res["epochs"]
        assert res["save_on_cpu"] and res["eval"] and res["eval_reentrant"] and res["timeline_kept"], res


def _count_replays(layer) -> list[int]:
    """A counter (one-element list) of the layer's replays."""
    count = [0]
    replay = layer._replay

    def counted(*args):
        count[0] += 1
        return replay(*args)

    layer._replay = counted
    return count


def _blocks_rank(rank: int, world: int) -> dict:
    """Checkpoints nested in a checkpointed block (the inner one runs under a new frame when the outer recomputes);
    the layer called twice in one block with equal counts, the first call's plan late (each call replays its own
    forward, and again, in order, on a second backward); a reentrant checkpoint with refresh_replicas() before its
    backward where no per-step copies are held (nothing replaced: it works); saved-tensor hooks other than
    checkpointing's inside the block (save_on_cpu: each recompute finds its checkpoint frame below them, so two
    pending forwards of equal counts and different plans each repeat their own, also in a second backward)."""
    from torch.autograd.graph import save_on_cpu

    out = {}
    ids, gates = _routing(rank, 2)
    x, dy = _inputs(rank, 50)

    def pair(policy="feplb-split", weights="per-step"):
        return (_layer(policy, weights, seed=12, router="external")[0],
                _layer(policy, weights, seed=12, router="external")[0])

    def inner(layer):
        return lambda h: torch.tanh(layer(h, routing=(ids, gates)))

    ref, ac = pair()
    xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (torch.cos(inner(ref)(torch.sin(xr))) * dy).sum().backward()
    nested = checkpoint(lambda z: torch.cos(checkpoint(inner(ac), torch.sin(z), use_reentrant=False)), xa,
                        use_reentrant=False)
    (nested * dy).sum().backward(retain_graph=True)
    out["nested"] = torch.equal(xa.grad, xr.grad) and torch.equal(ac.w1.grad, ref.w1.grad)
    (nested * dy).sum().backward()   # a second backward through the nested block
    out["nested"] &= torch.equal(xa.grad, 2 * xr.grad)
    # the two kinds nested in each other, and a no_grad call inside a non-reentrant block
    mixed = []
    for outer, inner_mode in ((True, False), (False, True)):
        xa = x.clone().requires_grad_(True)
        y = checkpoint(lambda z, i=inner_mode: torch.cos(checkpoint(inner(ac), torch.sin(z), use_reentrant=i)), xa,
                       use_reentrant=outer)
        (y * dy).sum().backward()
        mixed.append(torch.equal(xa.grad, xr.grad))

    def with_no_grad_call(z):
        with torch.no_grad():
            ac(z, routing=(ids, gates))
        return torch.cos(inner(ac)(torch.sin(z)))

    xa = x.clone().requires_grad_(True)
    (checkpoint(with_no_grad_call, xa, use_reentrant=False) * dy).sum().backward()
    mixed.append(torch.equal(xa.grad, xr.grad))
    out["mixed"] = mixed
    ref.close(), ac.close()

    ref, ac = pair()
    late = _make_late(ref, ac)

    def twice(layer):
        def f(z):
            late["on"] = True
            y = layer(torch.sin(z), routing=(ids, gates))
            late["on"] = False
            return torch.tanh(layer(y, routing=(ids, gates)))
        return f

    xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_r = twice(ref)(xr)
    out_a = checkpoint(twice(ac), xa, use_reentrant=False)
    late["on"] = False
    for _ in range(2):   # a second backward through the same graph replays both calls again
        (out_r * dy).sum().backward(retain_graph=True)
        (out_a * dy).sum().backward(retain_graph=True)
    out["twice"] = ref.last_stats.fell_back is False and torch.equal(xa.grad, xr.grad) and \
        torch.equal(ac.w1.grad, ref.w1.grad)
    ref.close(), ac.close()

    layer, _ = _layer("none", "per-step", seed=13)
    out_l = checkpoint(_block(layer, "tanh"), x.clone().requires_grad_(True), use_reentrant=True)
    layer.refresh_replicas()   # no copies held: nothing is replaced
    (out_l * dy).sum().backward()
    out["refresh_unheld"] = not layer.replicas.ever_held
    layer.close()

    ref, ac = pair()

    def offloaded(layer):
        def f(z):
            with save_on_cpu():   # the layer's tensors go to save_on_cpu; tanh's to the checkpoint, recomputed
                y = layer(torch.sin(z), routing=(ids, gates))
            return torch.tanh(y)
        return f

    replays = _count_replays(ac)
    xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (offloaded(ref)(xr) * dy).sum().backward()
    (checkpoint(offloaded(ac), xa, use_reentrant=False) * dy).sum().backward()
    out["other_hooks"] = torch.equal(xa.grad, xr.grad) and replays[0] == 1
    # two pending forwards of equal counts and different plans (the first one's late), each under save_on_cpu inside
    # its block: each recompute finds its own checkpoint frame below save_on_cpu's hooks and repeats its own
    # forward, also in a second backward through the same graph
    ref.zero_grad(), ac.zero_grad()
    late = _make_late(ref, ac)
    xs = [_inputs(rank, 51 + mb)[0] for mb in range(2)]
    xrs = [v.clone().requires_grad_(True) for v in xs]
    xas = [v.clone().requires_grad_(True) for v in xs]
    outs_r, outs_a = [], []
    for mb in range(2):
        late["on"] = mb == 0
        outs_r.append(offloaded(ref)(xrs[mb]))
        outs_a.append(checkpoint(offloaded(ac), xas[mb], use_reentrant=False))
    late["on"] = False
    pending = []
    for _ in range(2):
        (sum(outs_r) * dy).sum().backward(retain_graph=True)
        (sum(outs_a) * dy).sum().backward(retain_graph=True)
        pending.append(all(torch.equal(a.grad, r.grad) for a, r in zip(xas, xrs, strict=True)) and
                       torch.equal(ac.w1.grad, ref.w1.grad) and torch.equal(ac.w2.grad, ref.w2.grad))
    out["pending_other_hooks"] = pending + [ref.last_stats.fell_back is False, replays[0]]
    # selective activation checkpointing, save_on_cpu inside the block (the layer's saved tensors go there, tanh's
    # to the checkpoint), masked-free external routing: the recompute replays the forward, op for op
    ref.zero_grad(), ac.zero_grad()
    xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    log = []
    (offloaded(ref)(xr) * dy).sum().backward()
    (_checkpoint(offloaded(ac), xa, "selective-most", log) * dy).sum().backward()
    _same_ops(log, "selective under save_on_cpu")
    out["sac"] = torch.equal(xa.grad, xr.grad) and torch.equal(ac.w1.grad, ref.w1.grad) and \
        torch.equal(ac.w2.grad, ref.w2.grad) and replays[0] == 6
    ref.close(), ac.close()
    return out


def test_nested_twice_in_a_block_unheld_refresh_other_hooks_and_selective():
    for res in run_dist(_blocks_rank, W, timeout_s=300):
        assert res["nested"] and res["twice"] and res["refresh_unheld"] and res["other_hooks"], res
        assert res["mixed"] == [True] * 3, res["mixed"]
        assert res["pending_other_hooks"] == [True, True, True, 5], res["pending_other_hooks"]
        assert res["sac"], "selective checkpointing under save_on_cpu"


def _nesting_rank(rank: int, world: int) -> dict:
    """A non-reentrant checkpoint nested in a reentrant one, whose first run (in the outer recompute, itself a
    replay) must bind its frame to the record it repeats: two micro-batches of equal counts and different plans (the
    first one's late), one backward of their sum, after a no_grad forward of the first one's batch (the record an
    inner recompute would take otherwise). A checkpointed forward whose backward never ran (its output dropped, or
    an exception after the layer in the block) leaves no claim on a later nested recompute of equal counts. A
    forward under saved-tensor hooks on some ranks only is refused at that forward on every rank. A backward that
    raised midway, retried, replays the records in order again."""
    from torch.autograd.graph import save_on_cpu

    out = {}
    ids, gates = _routing(rank, 3)
    ref, _ = _layer("feplb-split", "per-step", seed=14, router="external")
    ac, _ = _layer("feplb-split", "per-step", seed=14, router="external")
    late = _make_late(ref, ac)

    def inner(layer):
        return lambda h: torch.tanh(layer(h, routing=(ids, gates)))

    def nested(z):
        return torch.cos(checkpoint(inner(ac), torch.sin(z), use_reentrant=False))

    x0, _ = _inputs(rank, 70)
    late["on"] = True
    with torch.no_grad():
        inner(ref)(torch.sin(x0)), inner(ac)(torch.sin(x0))
    loss_r = loss_a = 0.0
    pairs = []
    for mb in range(2):
        x, dy = _inputs(rank, 70 + mb)
        xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        late["on"] = mb == 0
        loss_r = loss_r + (torch.cos(inner(ref)(torch.sin(xr))) * dy).sum()
        loss_a = loss_a + (checkpoint(nested, xa, use_reentrant=True) * dy).sum()
        late["on"] = False
        pairs.append((xr, xa))
    loss_r.backward()
    loss_a.backward()
    out["bound"] = all(torch.equal(xa.grad, xr.grad) for xr, xa in pairs) and \
        all((ac_w - ref_w).abs().max() <= 1e-6 * ref_w.abs().max() for ac_w, ref_w in
            ((ac.w1.grad, ref.w1.grad), (ac.w2.grad, ref.w2.grad)))

    def raising(h):
        inner(ac)(h)
        raise ValueError("after the layer")

    skipped, kept = [], []
    for drop in ("output", "exception", "kept exception"):
        ref.zero_grad(), ac.zero_grad()
        x, dy = _inputs(rank, 80)
        if drop == "output":
            checkpoint(inner(ac), x.clone().requires_grad_(True), use_reentrant=False)   # its backward never runs
        else:
            try:
                checkpoint(raising, x.clone().requires_grad_(True), use_reentrant=False)
            except ValueError as exc:
                if drop == "kept exception":   # (its traceback keeps the checkpoint's frame alive)
                    kept.append(exc)
        x, dy = _inputs(rank, 81)
        xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        (torch.cos(inner(ref)(torch.sin(xr))) * dy).sum().backward()
        try:
            (checkpoint(nested, xa, use_reentrant=False) * dy).sum().backward()
            skipped.append(torch.equal(xa.grad, xr.grad) and torch.equal(ac.w1.grad, ref.w1.grad))
        except RuntimeError as exc:
            skipped.append(str(exc))
    out["skipped"] = skipped
    kept.clear()
    # micro-batches of equal counts (the first one's plan late), each backwarded on its own, as a pipeline schedule
    # does, under reentrant checkpointing: each recompute repeats its own forward's record
    ref.zero_grad(), ac.zero_grad()
    own = []
    other = _routing(rank, 4)   # (counts of no earlier forward: only these two records match)

    def routed(layer):
        return lambda h: torch.tanh(layer(h, routing=other))

    for mb in range(2):
        x, dy = _inputs(rank, 85 + mb)
        xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        late["on"] = mb == 0
        yr, ya = routed(ref)(torch.sin(xr)), checkpoint(lambda z: routed(ac)(torch.sin(z)), xa, use_reentrant=True)
        late["on"] = False
        own.append((yr, ya, xr, xa, dy))
    for yr, ya, _, _, dy in own:
        (yr * dy).sum().backward()
        (ya * dy).sum().backward()
    # (each of the two forwards' records replayed once: the weights' gradients alone, which a reentrant backward
    # accumulates in its own order, could not tell)
    out["one_by_one"] = all(torch.equal(xa.grad, xr.grad) for _, _, xr, xa, _ in own) and \
        [ac._records._replayed.get(seq, 0) for seq, _ in list(ac._records._items)[-2:]] == [1, 1] and \
        all((a - b).abs().max() <= 1e-6 * b.abs().max() for a, b in ((ac.w1.grad, ref.w1.grad),
                                                                      (ac.w2.grad, ref.w2.grad)))
    x, dy = _inputs(rank, 90)
    xa = x.clone().requires_grad_(True)
    try:
        with save_on_cpu() if rank < 2 else contextlib.nullcontext():
            y = inner(ac)(xa)
        (y * dy).sum().backward()
        out["hooks_apart"] = None
    except RuntimeError as exc:
        out["hooks_apart"] = str(exc)
    x, dy = _inputs(rank, 91)   # and the layer works on
    xa = x.clone().requires_grad_(True)
    (checkpoint(inner(ac), xa, use_reentrant=False) * dy).sum().backward()
    out["after"] = bool(torch.isfinite(xa.grad).all())
    # a backward that raised between the recomputes of two calls with equal counts (the first's plan late), retried
    # through the same graph: the retry repeats the first call's record first again
    from feplb.recompute import in_backward

    fail = {"on": True}

    def twice(layer):
        def f(z):
            late["on"] = True
            y = layer(torch.sin(z), routing=(ids, gates))
            late["on"] = False
            if in_backward() and fail["on"]:
                fail["on"] = False
                raise MemoryError("between the two calls' recomputes")
            return torch.tanh(layer(y, routing=(ids, gates)))
        return f

    ref.zero_grad(), ac.zero_grad()
    x, dy = _inputs(rank, 92)
    xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    yr, ya = twice(ref)(xr), checkpoint(twice(ac), xa, use_reentrant=False)
    (yr * dy).sum().backward()
    with contextlib.suppress(MemoryError):
        (ya * dy).sum().backward(retain_graph=True)
    xa.grad = None
    ac.zero_grad()
    (ya * dy).sum().backward()
    out["retried"] = not fail["on"] and torch.equal(xa.grad, xr.grad) and torch.equal(ac.w1.grad, ref.w1.grad)
    ref.close(), ac.close()
    return out


def test_nested_first_runs_bind_their_frame_dropped_forwards_hooks_apart_and_a_retried_backward():
    for r, res in enumerate(run_dist(_nesting_rank, W, timeout_s=300)):
        assert res["bound"] and res["retried"] and res["one_by_one"], r
        assert res["skipped"] == [True, True, True], (r, res["skipped"])
        assert res["hooks_apart"] and "under saved-tensor hooks on some ranks only" in res["hooks_apart"] and \
            "[0, 1]" in res["hooks_apart"] and res["after"], (r, res["hooks_apart"])


def _mismatch_rank(rank: int, world: int, mode: str) -> dict:
    """Routing drawn inside the checkpointed block without its RNG state preserved: the recompute routes otherwise."""
    from feplb import FEPLBConfig, MoELayer

    torch.manual_seed(11)
    layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=G, dyn=2,
                                 router="external", policy="feplb-split", min_chunk=2, min_straggler_rows=0))
    x, dy = _inputs(rank, 0)
    gates = torch.full((x.shape[0], K), 0.5)

    def route(x):
        return torch.stack([torch.randperm(E)[:K] for _ in range(x.shape[0])])

    def f(x):
        return layer(x, routing=(route(x), gates))

    torch.manual_seed(100 + rank)
    out = checkpoint(f, x.clone().requires_grad_(True), use_reentrant=mode == "reentrant", preserve_rng_state=False)
    try:
        (out * dy).sum().backward()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    # the layer works on: a plain forward and backward
    xb = x.clone().requires_grad_(True)
    (layer(xb, routing=(route(x), gates)) * dy).sum().backward()
    ok = bool(torch.isfinite(xb.grad).all())
    layer.close()
    return {"error": error, "ok": ok}


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_recompute_that_routes_otherwise_raises_on_every_rank(mode):
    results = run_dist(_mismatch_rank, W, mode, timeout_s=300)
    for r in results:
        assert r["error"] is not None and "matches none of the" in r["error"], r
        assert "preserve_rng_state" in r["error"]
        assert r["ok"]


def _held_rank(rank: int, world: int, policy: str) -> dict:
    """Which received weight buffers outlive the forward (``feplb.testing.ReceivedBuffers``: weak references to the
    storage of every buffer phase 2's exchange of rows and weights returns), counted before and after the backward,
    without checkpointing and with either kind."""
    import gc

    from feplb.testing import ReceivedBuffers

    layer, _ = _layer(policy, "per-microbatch", seed=5)
    out = {}
    with ReceivedBuffers() as seen:
        for mode in ("plain", "reentrant", "non-reentrant"):
            mark = seen.mark()
            x, dy = _inputs(rank, 0)
            x.requires_grad_(True)
            f = _block(layer, "tanh")
            y = f(x) if mode == "plain" else checkpoint(f, x, use_reentrant=mode == "reentrant")
            gc.collect()
            received, alive = seen.since(mark)["weights"]
            (y * dy).sum().backward()
            gc.collect()
            total, alive_after = seen.since(mark)["weights"]
            out[mode] = {"received": received, "alive_between": alive, "received_in_backward": total - received,
                         "alive_after": alive_after, "moved": layer.last_stats.rows_moved}
    layer.close()
    return out


def test_checkpointing_frees_received_weights_until_the_recompute():
    """Weights travelling per micro-batch: a helper holds what it received from its forward to its backward (the
    GEMMs' backward needs them); under activation checkpointing (either kind) nothing is held between the two, and
    the recompute receives them again. Nothing received outlives the backward."""
    results = run_dist(_held_rank, W, "feplb-split", timeout_s=300)
    assert any(r["plain"]["received"] for r in results), "no helper received weights: the test would check nothing"
    for rank, res in enumerate(results):
        plain = res["plain"]
        assert plain["moved"] > 0, (rank, "balancing moved no row")
        assert plain["alive_between"] == plain["received"], (rank, plain)
        assert plain["received_in_backward"] == 0, (rank, plain)
        for mode in ("reentrant", "non-reentrant"):
            got = res[mode]
            assert got["received"] == plain["received"], (rank, mode, got)   # the same plan: the same copies
            assert got["alive_between"] == 0, (rank, mode, "held from the forward to the backward", got)
            assert got["received_in_backward"] == got["received"], (rank, mode, "the recompute copies again", got)
        for mode, got in res.items():
            assert got["alive_after"] == 0, (rank, mode, "outlives the backward", got)


def _not_recomputing_rank(rank: int, world: int, case: str) -> dict:
    """A rank that will not recompute a checkpointed forward the others recompute (the recompute moves rows between
    the ranks, so it needs every rank): under reentrant checkpointing with the block's input needing no grad on EP
    rank 1 only (its output needs none: it never recomputes), refused at the forward; a backward skipped on EP rank
    1 only, which goes on to the next forward, refused there and in the others' recompute. Every rank raises, none
    waits; the layer works on."""
    layer, _ = _layer("feplb-split", "per-microbatch", seed=12)
    x, dy = _inputs(rank, 30)
    reentrant = case == "reentrant-inputs"
    xa = x.clone().requires_grad_(not (reentrant and rank == 1))
    out, error = None, None
    try:
        out = checkpoint(_block(layer, "tanh"), xa, use_reentrant=reentrant)
        if rank != 1 or reentrant:
            (out * dy).sum().backward()
        else:
            layer(x)        # the backward skipped here: on to the next forward
    except RuntimeError as exc:
        error = str(exc)
    xb = x.clone().requires_grad_(True)
    (layer(xb) * dy).sum().backward()
    ok = bool(torch.isfinite(xb.grad).all())
    moved = layer.last_stats.rows_moved
    layer.close()
    return {"error": error, "ok": ok, "moved": moved}


@pytest.mark.parametrize("case", ["reentrant-inputs", "skipped-backward"])
def test_a_rank_that_will_not_recompute_is_refused_on_every_rank(case):
    results = run_dist(_not_recomputing_rank, W, case, timeout_s=300, collective_timeout_s=60)
    for r in results:
        assert r["error"] is not None, r
        if case == "reentrant-inputs":
            assert "would recompute this forward on some ranks only" in r["error"], r["error"]
            assert "none needing grad on [1]" in r["error"], r["error"]
        else:
            assert "recompute a checkpointed forward of this layer" in r["error"], r["error"]
            assert "EP rank(s) [1] went on to the next forward" in r["error"], r["error"]
        assert r["ok"], r
    assert any(r["moved"] for r in results)


def _selective_more_rank(rank: int, world: int, case: str, mode: str) -> dict:
    """Selective activation checkpointing of what runs only in a forward or only in a recompute elsewhere: masked
    routes (the recompute's counts mask the ids), lazy @ema replicas (a forward holds the weights its plan copied,
    its recompute finds them resident), ``forward_dispatched`` (its forward's entry node and counts) and a receive
    buffer of its own (``recv_capacity``: the forward allocates and grows it, its recompute finds it): the op lists
    and bit-equal gradients, against the layer without checkpointing."""
    kw = {"masked": dict(router="external", masked_routes=True), "lazy": dict(replicas="lazy"),
          "dispatched": {}, "capacity": dict(recv_capacity=8, on_overflow="grow")}[case]
    policy = "feplb-split@ema" if case == "lazy" else "feplb-split"
    ref, ref_opt = _layer(policy, "per-step", seed=3, **kw)
    ac, ac_opt = _layer(policy, "per-step", seed=3, **kw)
    moved = held = 0
    for step in range(2):
        for mb in range(2):
            x, dy = _inputs(rank, 3 * step + mb)
            if case == "masked":
                ids, gates = _routing(rank, seed=3 * step + mb)
                ids[::3, 1] = -1

                def block(layer, ids=ids, gates=gates):
                    return _external_block(layer, ids, gates)
            elif case == "dispatched":
                gen = torch.Generator().manual_seed(1000 * rank + 3 * step + mb)
                counts = [int(c) + (30 if rank == 0 and i == 0 else 0)
                          for i, c in enumerate(torch.randint(0, 12, (ac.num_local,), generator=gen))]
                x = torch.randn(sum(counts), H, generator=gen)
                dy = torch.randn(sum(counts), H, generator=gen)

                def block(layer, counts=counts):
                    return lambda z: torch.tanh(layer.forward_dispatched(torch.sin(z) * 2.0, counts))
            else:
                def block(layer):
                    return _block(layer, "tanh")
            xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            out_r = block(ref)(xr)
            log = []
            out_a = _checkpoint(block(ac), xa, mode, log)
            assert torch.equal(out_a, out_r), (case, mode, step, mb, "output")
            (out_r * dy).sum().backward()
            (out_a * dy).sum().backward()
            _same_ops(log, (case, mode, step, mb))
            moved += ref.last_stats.rows_moved
            if case == "lazy":   # (before the step: an attached optimizer's step refreshes, dropping them)
                held = max(held, len(ac.replicas.lazy_pairs))
            want = {"x": xr.grad, **{n: p.grad for n, p in ref.named_parameters() if p.grad is not None}}
            got = {"x": xa.grad, **{n: p.grad for n, p in ac.named_parameters() if p.grad is not None}}
            assert want.keys() == got.keys(), (case, mode)
            _compare(got, want, (case, mode, step, mb))
        ref_opt.step(), ac_opt.step()
        ref_opt.zero_grad(), ac_opt.zero_grad()
    ref.close(), ac.close()
    return {"moved": moved, "lazy": held}


def _save_all_rank(rank: int, world: int, policy: str) -> dict:
    ids = policy.endswith(" ids")
    return _steps(rank, policy.removesuffix(" ids"), "per-step", "selective-all", "tanh", ids=ids)


@pytest.mark.parametrize("policy", ["fastermoe", "feplb-split@ema", "eplb", "feplb-split ids"])
def test_a_selective_policy_saving_every_op(policy):
    """Selective activation checkpointing whose policy saves every op's output, allocations and views included:
    bit for bit as without checkpointing, the recompute dispatching its forward's ops. The layer writes into
    nothing SAC saw it make: fastermoe's shadowing (the direct path's node exchange on the copy path) made a view
    of the copy engine's inbox in the forward, which the engine's next write then mutated (torch: "Tensor cached
    during selective activation checkpoint has been mutated" on the ranks that sent, the others waiting in the
    recompute's exchanges); the copy path now runs outside the dispatch modes, as a transport. "ids": a layer whose
    post-expert step takes each row's expert (feplb.hf's per-expert norm), whose ids were scattered in place into a
    new tensor (the same error on every rank)."""
    results = run_dist(_save_all_rank, W, policy, timeout_s=300, collective_timeout_s=60)
    assert sum(r["moved"] for r in results) > 0, (policy, "balancing moved no row")


@pytest.mark.parametrize("case", ["masked", "lazy", "dispatched", "capacity"])
@pytest.mark.parametrize("mode", SELECTIVE)
def test_selective_masked_routes_lazy_replicas_and_forward_dispatched(case, mode):
    results = run_dist(_selective_more_rank, W, case, mode, timeout_s=300)
    assert sum(r["moved"] for r in results) > 0, (case, mode, "balancing moved no row")
    if case == "lazy":
        assert all(r["lazy"] > 0 for r in results), (mode, "no lazy replica was ever held")
