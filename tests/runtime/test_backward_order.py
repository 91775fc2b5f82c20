"""The order of phase 2's backward, on 4 gloo ranks as 2 nodes x 2 GPUs (the copy thread is the CPU stand-in for the
copy stream, so the order the GPU would see is observable here):

* the results-home exchange's backward (the gradients of the moved rows' results, home to helper) runs on the copy
  thread, beside the static experts' backward, which starts before that exchange ends;
* then a helper computes the hosted rows' backward, before the kept rows' (as the forward computes them);
* the phase-2 exchanges' backward (the rows' and weights' gradients back to their homes) run on the copy thread
  too, started after the static experts' backward and the hosted rows' and before the kept rows' ends: a helper
  sends its gradients home beside its kept rows' backward, and a home waits for them only after its own work (the
  anchored join's node, on every rank, before phase 1's backward);
* with the weights copied again for the backward (``recopy_weights``) too; and the gradients equal plain EP's;
* nothing is left on the copy thread when the backward ends;
* only over copy paths that may run beside other collectives (CUDA IPC, shared memory, gloo, inside a node).

Without ``feplb.experts.EarlyBackward`` the static experts' backward comes last (after the phase-2 exchanges'),
without ``feplb.dispatch.BackwardJoin`` the exchanges' backward run on the calling thread, and without the hosted
rows' promotion (``feplb.phase2.dynamic_and_return``) the kept rows' backward comes before the hosted rows'.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from feplb.testing import load_global_weights, load_module, run_dist

pytestmark = pytest.mark.dist

# the routing and weights of test_runtime.py (GPU 0's and GPU 2's experts are hot: both nodes move rows)
_runtime = load_module(Path(__file__).with_name("test_runtime.py"))
H, FF, E, K, W, G = _runtime.H, _runtime.FF, _runtime.E, _runtime.K, _runtime.W, _runtime.G
SLEEP_S = 0.6   # the static experts' backward, made long enough for 4 ranks on 2 cores to run the exchange beside it
KEPT_S = 0.4    # the kept rows' backward, long enough for the phase-2 exchanges' backward to start beside it


class _Slow(torch.autograd.Function):
    """Identity whose backward sleeps and logs its span: a GEMM's backward made observable."""

    @staticmethod
    def forward(ctx, y, log, t0, what="static backward", sleep_s=SLEEP_S):
        ctx.log, ctx.t0, ctx.what, ctx.sleep_s = log, t0, what, sleep_s
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        import threading
        import time

        a = time.perf_counter() - ctx.t0
        time.sleep(ctx.sleep_s)
        ctx.log.append((ctx.what, threading.current_thread().name, a, time.perf_counter() - ctx.t0))
        return g, None, None, None, None


def _order_rank(rank: int, world: int, recopy: bool, hot: float = 1.0) -> dict:
    import sys
    import threading
    import time

    from feplb import FEPLBConfig, MoELayer, dispatch, phase2

    router, w1, w2, xs = _runtime._weights(5)
    router[[0, 1, 9], 0] *= hot   # (less hot: the helpers keep rows of their own dynamic experts too)
    log: list = []
    t0 = time.perf_counter()
    issue = dispatch.Exchange.issue_backward

    def spy(self, grads, ready=None, *, handoff=False):
        a = time.perf_counter() - t0
        try:
            return issue(self, grads, ready, handoff=handoff)
        finally:
            log.append((self.op, threading.current_thread().name, a, time.perf_counter() - t0))

    mlp = phase2.expert_mlp

    def logged_mlp(*a, **kw):   # the hosted rows' GEMMs (one per weight bank) and the kept rows' GEMM
        kept = sys._getframe(1).f_code.co_name == "dynamic_and_return"
        what = "kept backward" if kept else "hosted backward"
        return _Slow.apply(mlp(*a, **kw), log, t0, what, KEPT_S if kept else 0.0)

    out = {}
    dispatch.Exchange.issue_backward, phase2.expert_mlp = spy, logged_mlp
    try:
        for policy in ("feplb-split", "none"):
            layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=G, dyn=2,
                                         policy=policy, weights="per-microbatch", recopy_weights=recopy,
                                         min_straggler_rows=0, min_chunk=2))
            load_global_weights(layer, router, w1, w2)
            static = layer._static_gemm
            layer._static_gemm = lambda *a, static=static: _Slow.apply(static(*a), log, t0)
            x = xs[rank].clone().requires_grad_(True)
            y = layer(x)
            log.clear()
            y.square().sum().backward()
            joins = layer._backward_join or []
            out[policy] = {"pending": any(j._future is not None for j in joins), "log": list(log),
                           "moved": layer.last_stats.rows_moved, "dx": x.grad,
                           "dw1": layer.w1.grad, "dw2": layer.w2.grad, "drouter": layer.router.weight.grad}
            layer.close()
    finally:
        dispatch.Exchange.issue_backward, phase2.expert_mlp = issue, mlp
    return out


@pytest.mark.parametrize("recopy,hot", [(False, 1.0), (True, 1.0), (False, 0.6)],
                         ids=["weights_held", "recopy_weights", "helpers_keep_rows"])
def test_the_static_experts_backward_runs_beside_the_gradients_copies_before_the_homes_wait(recopy, hot):
    results = run_dist(_order_rank, W, recopy, hot, timeout_s=300)
    assert all(r["feplb-split"]["moved"] > 0 for r in results[::G]), "both nodes must move rows"
    both = [r for r in results if {"hosted backward", "kept backward"} <= {e[0] for e in r["feplb-split"]["log"]}]
    assert hot == 1.0 or both, "no rank computes hosted and kept rows: the case would check nothing"
    for rank, res in enumerate(results):
        log = res["feplb-split"]["log"]
        (static,) = [e for e in log if e[0] == "static backward"]
        home = [e for e in log if e[0] == "phase-2 results home"]
        back = [e for e in log if e[0].startswith("phase-2 rows") or e[0].startswith("phase-2 weights")]
        assert len(home) == 1 and len(back) == (2 if recopy else 1), (rank, log)
        assert not res["feplb-split"]["pending"], (rank, "nothing may be left on the copy thread after the backward")
        (home,) = home
        assert home[1].startswith("feplb-copy"), (rank, "the results' gradients must go on the copy thread", log)
        assert home[2] < static[3], (rank, "the results' gradients must be copied beside the static backward", log)
        hosted = [e for e in log if e[0] == "hosted backward"]
        kept = [e for e in log if e[0] == "kept backward"]
        assert len(kept) <= 1, (rank, log)
        for h in hosted:
            assert h[1] == static[1] and h[2] >= static[3], (rank, "the hosted rows' backward after the static", log)
            assert all(h[3] <= k[2] for k in kept), (rank, "the hosted rows' backward before the kept rows'", log)
        for b in back:
            assert b[1].startswith("feplb-copy"), (rank, "the rows' gradients must go home on the copy thread", log)
            assert b[2] >= static[3], (rank, "a home must do its own work before it waits for its helpers", log)
            assert all(b[2] >= h[3] for h in hosted), (rank, "sent home before the hosted rows' backward ran", log)
            assert all(b[2] < k[3] for k in kept), (rank, "the rows' gradients must go home beside the kept", log)
        # balancing changes where rows are computed, never what: plain EP's gradients
        ref = res["none"]
        for k in ("dx", "dw1", "dw2", "drouter"):
            got, want = res["feplb-split"][k], ref[k]
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (rank, k)
        assert [e[0] for e in ref["log"]] == ["static backward"], (rank, "plain EP exchanges nothing in phase 2")


def test_the_results_gradients_go_beside_other_collectives_only_over_copy_paths_that_allow_it():
    """NCCL and NVSHMEM copy paths, or an exchange crossing nodes, keep the exchange's backward in place."""
    from types import SimpleNamespace

    from feplb.dispatch import BackwardJoin

    def ex(name, cross):
        return SimpleNamespace(comm=SimpleNamespace(copy=SimpleNamespace(name=name)),
                               layout=SimpleNamespace(cross_node=cross), active=True)

    for name in ("ipc", "shm", "gloo", "nccl", "nvshmem"):
        for cross in (False, True):
            want = name in ("ipc", "shm", "gloo") and not cross
            assert BackwardJoin.may_run_beside(ex(name, cross)) is want, (name, cross)
            join = BackwardJoin(None)
            sends = [torch.ones(2, requires_grad=True)]
            got = join.wrap(ex(name, cross), [t * 1 for t in sends])
            assert join.armed is want and (got[0].grad_fn is not None)
            with torch.no_grad():
                join.wrap(ex(name, cross), [t * 1 for t in sends])
            assert not join.armed
            # the phase-2 exchanges' join, through the anchor: armed alike, and its node made even without sends
            anchor = torch.zeros(0, requires_grad=True)
            a, got = join.wrap_anchored(ex(name, cross), anchor * 1, [])
            assert join.armed is want and got == [] and (a.grad_fn is not None) and \
                (type(a.grad_fn).__name__ == "_JoinFnBackward") is want, (name, cross)
            # an anchor that needs no gradient would leave no node to finish it: in place
            a, _ = join.wrap_anchored(ex(name, cross), torch.zeros(0), [t * 1 for t in sends])
            assert not join.armed and a.grad_fn is None


class _OnBackward(torch.autograd.Function):
    """Identity whose backward calls ``fn(grad)`` first (a join's start or finish, as the layer's nodes do)."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.fn(g)
        return g, None


def test_an_exchange_left_pending_is_settled_when_the_backward_ends_and_its_error_surfaces():
    """A backward that starts the exchange but never reaches the node that finishes it (it stopped short) leaves
    nothing on the copy thread: an autograd callback settles it at the backward's end, raising what it raised."""
    import concurrent.futures
    from types import SimpleNamespace

    from feplb.dispatch import BackwardJoin

    calls = []

    def issue_backward(grads, ready, handoff):
        calls.append((len(grads), ready, handoff))
        if fail:
            raise TimeoutError("copy path: a peer never came")
        return {}, None

    ex = SimpleNamespace(device=torch.device("cpu"), issue_backward=issue_backward, handed=lambda got, done: got)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as copier:
        join = BackwardJoin(copier)
        for fail in (False, True):
            x = torch.ones(3, requires_grad=True)
            loss = _OnBackward.apply(x, lambda g: join.start(ex, [g], [g.shape])).sum()
            if fail:
                with pytest.raises(TimeoutError, match="a peer never came"):
                    loss.backward()
            else:
                loss.backward()
            assert join._future is None and calls[-1] == (1, None, True)


def _two_joins_backward(copier, first, second) -> tuple:
    """A backward that starts two exchanges' backward on ``copier`` (``first`` then ``second``: the error each
    raises, or None) and finishes the second's join, which settles the first's (``after``). Returns (the error the
    backward raised or None, the gradient the join gave, both joins)."""
    from types import SimpleNamespace

    from feplb.dispatch import BackwardJoin

    def ex_of(error):
        def issue_backward(grads, ready, handoff):
            if error is not None:
                raise error
            return {0: grads[0].clone()}, None

        return SimpleNamespace(device=torch.device("cpu"), issue_backward=issue_backward,
                               handed=lambda got, done: got, send_grads=lambda got, shapes: [got[0].view(shapes[0])])

    home, rows = BackwardJoin(copier), BackwardJoin(copier)
    rows.after = home
    seen = []

    def starts(g):
        home.start(ex_of(first), [g], [g.shape])
        rows.start(ex_of(second), [2 * g], [g.shape])

    # the finishing node made first: its backward runs last
    finished = _OnBackward.apply(torch.ones(3, requires_grad=True), lambda g: seen.extend(rows.finish()))
    try:
        _OnBackward.apply(finished, starts).sum().backward()
        error = None
    except TimeoutError as exc:
        error = exc
    return error, seen, home, rows


def test_a_join_raises_the_earlier_exchanges_error_first():
    """The phase-2 exchanges' join settles the results-home exchange's first (the copy thread ran it before): where
    that one failed, its error is the one raised, not the later exchange's (which would time out behind it)."""
    import concurrent.futures

    fail_home = TimeoutError("results home: a peer never came")
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as copier:
        error, seen, home, rows = _two_joins_backward(copier, None, None)
        assert error is None and torch.equal(seen[0], 2 * torch.ones(3))
        assert home._future is None and rows._future is None
        for second in (None, TimeoutError("rows home: stalled")):
            error, seen, home, rows = _two_joins_backward(copier, fail_home, second)
            assert error is fail_home and not seen, error
            assert home._future is None
            if second is None:
                rows.settle()
            else:
                with pytest.raises(TimeoutError, match="rows home"):
                    rows.settle()   # (what is left ends too, with its own error)
            assert rows._future is None


def _partial_rank(rank: int, world: int) -> dict:
    """``torch.autograd.grad`` for one parameter at a time (the input, w2 only, w1 only, the router only): every
    rank must run the same exchanges' backward whatever it asks for."""
    from feplb import FEPLBConfig, MoELayer

    router, w1, w2, xs = _runtime._weights(5)
    out = {}
    for policy, recopy in (("feplb-split", False), ("feplb-split", True), ("none", False)):
        layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=G, dyn=2,
                                     policy=policy, weights="per-microbatch", recopy_weights=recopy,
                                     min_straggler_rows=0, min_chunk=2))
        load_global_weights(layer, router, w1, w2)
        got = {}
        for name in ("x", "w2", "w1", "router"):
            x = xs[rank].clone().requires_grad_(True)
            what = {"x": x, "w2": layer.w2, "w1": layer.w1, "router": layer.router.weight}[name]
            (got[name],) = torch.autograd.grad(layer(x).square().sum(), [what])
        out[(policy, recopy)] = {"grads": got, "moved": layer.last_stats.rows_moved}
        layer.close()
    return out


def test_a_backward_that_asks_for_one_parameter_runs_every_exchange_on_every_rank():
    results = run_dist(_partial_rank, W, timeout_s=200, collective_timeout_s=20)
    assert all(r[("feplb-split", False)]["moved"] > 0 for r in results[::G])
    for rank, res in enumerate(results):
        ref = res[("none", False)]["grads"]
        for key in (("feplb-split", False), ("feplb-split", True)):
            for name, want in ref.items():
                got = res[key]["grads"][name]
                assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (rank, key, name)


def _hot_layer(h: int = 16, e: int = 8, policy: str = "feplb-split", **kw):
    """A feplb-split layer (or of ``policy``, ``kw`` for its config) over 2 ranks (one node) whose GPU 0 experts are
    hot: rows move to GPU 1 and their results come home, the same weights on every call."""
    from feplb import FEPLBConfig, MoELayer

    gen = torch.Generator().manual_seed(1)
    router = torch.randn(e, h, generator=gen) / h ** 0.5
    router[:, 0] = 0.0
    router[[0, 1], 0] = 4.0
    w1, w2 = torch.randn(e, h, 64, generator=gen) / h ** 0.5, torch.randn(e, 32, h, generator=gen) / 32 ** 0.5
    layer = MoELayer(FEPLBConfig(hidden=h, ffn=32, num_experts=e, top_k=2, gpus_per_node=2, dyn=2, min_chunk=2,
                                 policy=policy, min_straggler_rows=0, **{"weights": "per-microbatch", **kw}))
    load_global_weights(layer, router, w1, w2)
    return layer


class _RaiseInBackward(torch.autograd.Function):
    """Identity whose backward raises (an out-of-memory error in the static experts' backward, on every rank)."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        raise torch.OutOfMemoryError("injected: out of memory in the static experts' backward")


def _failed_backward_rank(rank: int, world: int) -> dict:
    import time

    from feplb import dispatch

    h = 16
    first, second = _hot_layer(h), _hot_layer(h)
    x = torch.randn(40, h, generator=torch.Generator().manual_seed(100 + rank))
    x[:, 0] = x[:, 0].abs() + 1.0
    with torch.no_grad():
        want = [first(x), second(x)]
    issue = dispatch.Exchange.issue_backward

    def slow(self, *a, **kw):   # rank 1 copies the results' gradients late (a large exchange, a busy host)
        if self.op == "phase-2 results home" and rank == 1:
            time.sleep(0.5)
        return issue(self, *a, **kw)

    dispatch.Exchange.issue_backward = slow
    static = second._static_gemm
    second._static_gemm = lambda *a: _RaiseInBackward.apply(static(*a))
    out = {}
    try:
        second(first(x.clone().requires_grad_())).sum().backward()
    except torch.OutOfMemoryError as exc:
        out["backward"] = str(exc)
    del second._static_gemm
    out["moved"] = second.last_stats.rows_moved
    # the loop skips the micro-batch and goes on: the next forward starts at the first layer, then the second
    t0 = time.perf_counter()
    with torch.no_grad():
        out["same"] = [torch.equal(first(x), want[0]), torch.equal(second(x), want[1])]
    out["next_s"] = time.perf_counter() - t0
    first.close()
    second.close()
    return out


def test_a_backward_that_raises_leaves_no_exchange_beside_the_next_forward():
    """A backward that raises (on every rank) after a layer's results-home exchange started on its copy thread never
    runs the callback that settles it: the next forward (of any layer over the same ranks) ends it before its first
    collective, which otherwise met the copy thread's collectives on the same gloo group in a different order on the
    two ranks (both waited out the group's timeout)."""
    results = run_dist(_failed_backward_rank, 2, timeout_s=120, collective_timeout_s=10)
    for rank, res in enumerate(results):
        assert "injected" in res.get("backward", ""), (rank, res)
        assert res["same"] == [True, True] and res["next_s"] < 5.0, (rank, res)
    assert sum(res["moved"] for res in results) > 0


def test_a_join_interrupted_while_it_waits_keeps_its_exchange_pending():
    """A KeyboardInterrupt while the autograd thread waits for a join's exchange (finish, settle) leaves the exchange
    pending, not forgotten while the copy thread still runs it: the next forward settles it first
    (``settle_abandoned``), before a collective of its own could meet the copy thread's."""
    import concurrent.futures
    import signal
    import threading
    from types import SimpleNamespace

    from feplb.dispatch import BackwardJoin, settle_abandoned

    release = threading.Event()
    ran = []

    def issue_backward(grads, ready, handoff):
        release.wait(10)
        ran.append(len(grads))
        return {}, None

    ex = SimpleNamespace(device=torch.device("cpu"), issue_backward=issue_backward, handed=lambda got, done: got)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as copier:
        join = BackwardJoin(copier)
        x = torch.ones(3, requires_grad=True)

        def start_then_wait(g):
            join.start(ex, [g], [g.shape])
            join.settle()   # interrupted while the copy thread still runs the exchange

        old = signal.signal(signal.SIGALRM, signal.default_int_handler)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            with pytest.raises(KeyboardInterrupt):
                _OnBackward.apply(x, start_then_wait).sum().backward()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert join._future is not None and not ran
        threading.Timer(0.2, release.set).start()
        settle_abandoned()   # (what the next forward does first)
        assert ran == [1] and join._future is None


def _failed_backward_then_close_rank(rank: int, world: int) -> dict:
    import gc

    from feplb import dispatch

    h = 16
    layer = _hot_layer(h)
    x = torch.randn(40, h, generator=torch.Generator().manual_seed(100 + rank))
    x[:, 0] = x[:, 0].abs() + 1.0
    static = layer._static_gemm
    layer._static_gemm = lambda *a: _RaiseInBackward.apply(static(*a))
    out = {}
    try:
        layer(x.clone().requires_grad_()).sum().backward()
    except torch.OutOfMemoryError:
        out["raised"] = True
    copier = layer._balancer.copier
    out["pending"] = sum(j.copier is copier for j, _ in dispatch._STARTED.values())
    layer.close()   # the loop gives the model up (rebuilds it after the out-of-memory error, say)
    del layer
    gc.collect()
    out["left"] = sum(j.copier is copier for j, _ in dispatch._STARTED.values())
    return out


def test_a_closed_layer_leaves_no_abandoned_exchange():
    """A layer closed after a backward that raised (nothing of its forwards after it) leaves none of its joins for
    ``settle_abandoned``: they kept its exchanges' buffers alive, and another layer's next forward settled them
    against the closed layer's released copy path (a cancelled one raising CancelledError there)."""
    results = run_dist(_failed_backward_then_close_rank, 2, timeout_s=120, collective_timeout_s=10)
    for rank, res in enumerate(results):
        assert res.get("raised") and res["pending"] >= 1, (rank, res)
        assert res["left"] == 0, (rank, res)


def _raising_backward(layer, x: torch.Tensor, busy_s: float = 0.0) -> bool:
    """A forward of ``layer`` and a backward that raises (out of memory in its static experts' backward, on every
    rank) after the results-home exchange's backward started on the copy thread; busy_s: that thread is busy that
    long first (an earlier job), so the exchange is still queued when the backward raised. Whether it raised."""
    import time

    static = layer._static_gemm
    layer._static_gemm = lambda *a: _RaiseInBackward.apply(static(*a))
    try:
        y = layer(x.clone().requires_grad_())
        if busy_s:
            layer._balancer.copier.submit(time.sleep, busy_s)
        y.sum().backward()
    except torch.OutOfMemoryError:
        return True
    finally:
        del layer._static_gemm
    return False


def _x_grad(layer, x: torch.Tensor) -> torch.Tensor:
    xg = x.clone().requires_grad_()
    layer(xg).square().sum().backward()
    return xg.grad


def _close_then_rebuild_rank(rank: int, world: int, rounds: int) -> dict:
    from feplb import dispatch

    h = 16
    x = torch.randn(40, h, generator=torch.Generator().manual_seed(100 + rank))
    x[:, 0] = x[:, 0].abs() + 1.0
    with _hot_layer(h, policy="none") as ref:
        want = _x_grad(ref, x)
    out = {"raised": 0, "pending": []}
    for i in range(rounds):
        layer = _hot_layer(h)   # (the first collectives of a new layer: right after the last one's close)
        out["raised"] += _raising_backward(layer, x, busy_s=0.2 if rank == i % 2 else 0.0)
        copier = layer._balancer.copier
        out["pending"].append(sum(j.copier is copier for j, _ in dispatch._STARTED.values()))
        layer.close()   # the loop gives the model up after the out-of-memory error and builds it again
    with _hot_layer(h) as layer:
        out["grad"] = (_x_grad(layer, x) - want).abs().max().item() / want.abs().max().item()
        out["moved"] = layer.last_stats.rows_moved
    return out


def test_a_layer_built_after_closing_one_whose_backward_raised_meets_its_peers():
    """A layer closed after a backward that raised, its results-home exchange's backward still queued on the copy
    thread of one rank (busy with an earlier job) and started on the other's: the close cancelled it on the first
    rank, so the other's copy thread waited in it while the first rank went on to the next layer's construction,
    whose collective met it on the same gloo group (both ranks waited out the group's timeout). The close now waits
    for it; over rounds with either rank's copy thread busy, every new layer is built, and balances exactly."""
    rounds = 6
    results = run_dist(_close_then_rebuild_rank, 2, rounds, timeout_s=150, collective_timeout_s=10)
    for rank, res in enumerate(results):
        assert res["raised"] == rounds and min(res["pending"]) >= 1, (rank, res)
        assert res["grad"] <= 1e-5, (rank, res)
    assert sum(res["moved"] for res in results) > 0


def _rebuild_without_close_rank(rank: int, world: int) -> dict:
    h = 16
    x = torch.randn(40, h, generator=torch.Generator().manual_seed(100 + rank))
    x[:, 0] = x[:, 0].abs() + 1.0
    with _hot_layer(h, policy="none") as ref:
        want = _x_grad(ref, x)
    first = _hot_layer(h)
    out = {"raised": _raising_backward(first, x, busy_s=0.2 if rank == 0 else 0.0)}
    # the loop rebuilds the model after the out-of-memory error and keeps the old one (its copy thread still runs
    # the exchange's backward, later on rank 0): the new layer's construction is collective over the same groups
    second = _hot_layer(h)
    out["grads"] = [(_x_grad(layer, x) - want).abs().max().item() / want.abs().max().item()
                    for layer in (second, first)]
    out["moved"] = second.last_stats.rows_moved
    second.close()
    first.close()
    return out


def test_a_layer_built_after_a_backward_that_raised_ends_the_abandoned_exchange_first():
    """A new layer built (the old one left open) right after a backward that raised: its construction's first
    collective met the old layer's copy thread still running the abandoned exchange's backward on the same gloo
    group, in another order on each rank (both waited out the group's timeout). The construction settles it first
    (``settle_abandoned``); both layers then balance exactly."""
    results = run_dist(_rebuild_without_close_rank, 2, timeout_s=120, collective_timeout_s=10)
    for rank, res in enumerate(results):
        assert res["raised"] and max(res["grads"]) <= 1e-5, (rank, res)
    assert sum(res["moved"] for res in results) > 0


def _hot_input(rank: int, h: int, i: int) -> torch.Tensor:
    """Rank ``rank``'s i-th input for ``_hot_layer(h)``: its routing column positive (the hot experts), needing grad."""
    x = torch.randn(40, h, generator=torch.Generator().manual_seed(1000 * i + rank))
    x[:, 0] = x[:, 0].abs() + 1.0
    return x.requires_grad_()


def _end_raises(g):
    """A gradient hook that raises as an out-of-memory error would, after the layer's backward."""
    raise torch.OutOfMemoryError("injected: out of memory after the layer's backward")


def _step_after_raised_rank(rank: int, world: int) -> dict:
    from torch.utils.checkpoint import checkpoint

    h = 16
    x_of = functools.partial(_hot_input, rank, h)

    out = {}
    for key, kw, ckpt in (("none", {"policy": "none"}, False),
                          ("per-step @ema", {"policy": "feplb-split@ema", "weights": "per-step"}, False),
                          ("lazy @ema", {"policy": "feplb@ema", "weights": "per-step", "replicas": "lazy"}, False),
                          ("per-microbatch", {}, False), ("none, recomputed", {"policy": "none"}, True),
                          ("per-microbatch, recomputed", {}, True)):
        layer = _hot_layer(h, **kw)
        opt = torch.optim.SGD(layer.parameters(), lr=0.01)
        layer.attach_optimizer(opt)
        run = functools.partial(checkpoint, layer, use_reentrant=False) if ckpt else layer
        raised, moved = [], 0
        for step in range(2):
            # a backward that raises, inside the layer (its static experts') or after it (the layer's input), and
            # the loop's skipping of the micro-batch: the gradients dropped, the step done with the next ones
            static = layer._static_gemm
            if step == 0:
                layer._static_gemm = lambda *a, static=static: _RaiseInBackward.apply(static(*a))
            x = x_of(10 * step)
            try:
                y = run(x)
                if step == 1:
                    x.register_hook(_end_raises)
                y.square().mean().backward()
            except torch.OutOfMemoryError:
                raised.append(step)
            layer.__dict__.pop("_static_gemm", None)
            opt.zero_grad()
            for mb in (1, 2):
                run(x_of(10 * step + mb)).square().mean().backward()
                moved += layer.last_stats.rows_moved
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            out[key] = {"y": layer(x_of(99)), "w1": layer.w1.detach().clone(), "w2": layer.w2.detach().clone(),
                        "router": layer.router.weight.detach().clone(), "raised": raised, "moved": moved}
        layer.close()
    return out


def test_a_step_after_a_backward_that_raised_equals_plain_eps():
    """A backward that raised on every rank (inside the layer after its copy thread started an exchange's backward,
    or after the layer's whole backward), the loop then dropping the gradients (an attached optimizer's zero_grad)
    and stepping with the next micro-batches: the weights and the next outputs equal plain EP's, with per-step
    replicas (eager and lazy), per-micro-batch copies, and under activation checkpointing (the raised backward's
    recompute, then the next ones)."""
    results = run_dist(_step_after_raised_rank, 2, timeout_s=200, collective_timeout_s=20)
    for rank, res in enumerate(results):
        for key, got in res.items():
            want = res["none, recomputed" if "recomputed" in key else "none"]
            assert got["raised"] == [0, 1], (rank, key, got["raised"])
            for name in ("y", "w1", "w2", "router"):
                err = (got[name] - want[name]).abs().max() / want[name].abs().max()
                assert err <= 1e-5, (rank, key, name, float(err))
    for key in ("per-step @ema", "lazy @ema", "per-microbatch", "per-microbatch, recomputed"):
        assert sum(res[key]["moved"] for res in results) > 0, key


def _raised_on_one_rank(rank: int, world: int) -> dict:
    import time

    h = 16
    x_of = functools.partial(_hot_input, rank, h)

    out = {"raised": []}
    # 1. rank 0's backward raises after the layer's (its exchanges all ran): the next step goes on, exactly
    for key in ("none", "feplb-split"):
        layer = _hot_layer(h, policy=key)
        opt = torch.optim.SGD(layer.parameters(), lr=0.01)
        layer.attach_optimizer(opt)
        x = x_of(0)
        y = layer(x)
        if rank == 0:
            x.register_hook(_end_raises)
        try:
            y.square().mean().backward()
        except torch.OutOfMemoryError:
            out["raised"].append(key)
        opt.zero_grad()
        layer(x_of(1)).square().mean().backward()
        opt.step()
        with torch.no_grad():
            out[key] = (layer(x_of(2)), layer.w1.detach().clone(), layer.w2.detach().clone())
        out[key + " moved"] = layer.last_stats.rows_moved
        layer.close()
    # 2. rank 0's backward raises inside the layer: rank 1 waits in the backward's exchanges, rank 0 in its next
    #    forward's first collective; both raise once the group's timeout has passed
    layer = _hot_layer(h)
    static = layer._static_gemm
    if rank == 0:
        layer._static_gemm = lambda *a: _RaiseInBackward.apply(static(*a))
    y = layer(x_of(3))
    t0 = time.perf_counter()
    try:
        try:
            y.square().mean().backward()
        except torch.OutOfMemoryError:   # (rank 0: the loop skips the micro-batch)
            out["raised"].append("inside")
        layer.__dict__.pop("_static_gemm", None)
        layer(x_of(4)).square().mean().backward()
        out["inside"] = "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["inside"] = f"{type(exc).__name__}: {exc}"
    out["inside_s"] = time.perf_counter() - t0
    return out


def test_a_backward_that_raised_on_one_rank():
    """A backward that raised on one rank only (its peers finished theirs): where it raised after the layer's
    backward, the next step goes on and equals plain EP's; where it raised inside it, the peers wait in the
    exchanges it never joins and it waits in its next forward's first collective: every rank raises after the
    group's timeout (not before, and not never)."""
    timeout = 6
    results = run_dist(_raised_on_one_rank, 2, timeout_s=150, collective_timeout_s=timeout)
    for rank, res in enumerate(results):
        assert res["raised"] == (["none", "feplb-split", "inside"] if rank == 0 else []), (rank, res["raised"])
        for got, want in zip(res["feplb-split"], res["none"], strict=True):
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), rank
        # (the first rank past its timeout leaves the group: a peer still waiting may see the connection close
        # first, which the same guard names as a peer that died or stalled)
        assert res["inside"].startswith("TimeoutError") or (
            res["inside"].startswith("RuntimeError") and "a peer died or stalled" in res["inside"]), \
            (rank, res["inside"])
        # (not before the timeout; a peer that reached its wait later than the rank timing out first may see the
        # connection close a little before its own timeout)
        assert timeout / 2 <= res["inside_s"] <= 6 * timeout, (rank, res["inside_s"])
    assert sum(res["feplb-split moved"] for res in results) > 0


def _backward_after_raised(rank: int, h: int, kw: dict, n_layers: int) -> dict:
    """Two micro-batches forward through ``n_layers`` layers (``_hot_layer(h, **kw)``), the first one's backward
    raising in the first layer's static experts' backward (after its results-home exchange's backward started on
    the copy thread), then the second's backward, nothing between (no forward, step call or construction). Returns
    the second backward's largest gradient error against plain EP's (or its error), the collectives its autograd
    thread started, how many exchanges the raised backward left, and the rows moved."""
    import threading

    from feplb import dispatch, recopy

    x_of = functools.partial(_hot_input, rank, h)
    main = threading.get_ident()
    refs = [_hot_layer(h, policy="none") for _ in range(n_layers)]
    x = y = x_of(2)
    for ref in refs:
        y = ref(y)
    y.square().sum().backward()
    want = {"x": x.grad, **{f"{i}.{n}": p.grad for i, ref in enumerate(refs) for n, p in ref.named_parameters()}}
    for ref in refs:
        ref.close()
    layers = [_hot_layer(h, **kw) for _ in range(n_layers)]
    out = {}
    static = layers[0]._static_gemm
    layers[0]._static_gemm = lambda *a: _RaiseInBackward.apply(static(*a))
    xs, ys = [x_of(1), x_of(2)], []
    for xi in xs:   # (as a pipeline schedule does: both forwards first)
        y = xi
        for layer in layers:
            y = layer(y)
        ys.append(y)
        layers[0].__dict__.pop("_static_gemm", None)
    try:
        ys[0].square().sum().backward()
    except torch.OutOfMemoryError:
        out["raised"] = True
    abandoned = [join._future for join, _ in dispatch._STARTED.values()]
    out["abandoned"] = len(abandoned)
    for layer in layers:
        layer.zero_grad(set_to_none=True)   # (the loop drops what the raised backward accumulated)
    # each collective the autograd thread starts in the second backward (the reverse all-to-all's backward, an
    # exchange's backward run in place, the weights' copy again): had the exchanges the raised backward left on the
    # copy threads ended (and been taken) before it? Not: it may meet them on the same group in another order on
    # each rank (both wait out the group's timeout); raised here instead, on every rank alike.
    met = []

    def check(what):
        if threading.get_ident() != main:
            return
        task = torch._C._current_graph_task_id()
        left = sum(t != task for _, t in dispatch._STARTED.values())
        met.append(what)
        if left or not all(f.done() for f in abandoned):
            raise RuntimeError(f"{what}: started while {left} exchange(s) of the raised backward were pending")

    def spied(fn, what=None):
        def spy(*a, **k):
            check(what or a[0].op)
            return fn(*a, **k)
        return spy

    issue_backward, recopy_start = dispatch.Exchange.issue_backward, recopy.Recopy.start
    for layer in layers:   # (each layer's transport: its own)
        layer.transport.all_to_all = spied(layer.transport.all_to_all, "all-to-all")
    dispatch.Exchange.issue_backward = spied(issue_backward)
    recopy.Recopy.start = spied(recopy_start, "recopy")
    try:
        ys[1].square().sum().backward()
        got = {"x": xs[1].grad, **{f"{i}.{n}": p.grad for i, layer in enumerate(layers)
                                   for n, p in layer.named_parameters()}}
        out["err"] = max(float((got[n] - w).abs().max() / w.abs().max()) for n, w in want.items())
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["err"] = f"{type(exc).__name__}: {exc}"
    finally:
        for layer in layers:
            del layer.transport.all_to_all
        dispatch.Exchange.issue_backward, recopy.Recopy.start = issue_backward, recopy_start
    out["met"] = met
    out["moved"] = sum(layer.last_stats.rows_moved for layer in layers)
    for layer in layers:
        layer.close()
    return out


_AFTER_RAISED = {"one layer": ({}, 1), "recopy_weights": ({"recopy_weights": True}, 1),
                 "two layers, the first raises": ({}, 2)}


def _backward_after_raised_rank(rank: int, world: int) -> dict:
    return {key: _backward_after_raised(rank, 16, kw, n) for key, (kw, n) in _AFTER_RAISED.items()}


def test_a_backward_after_one_that_raised_ends_the_abandoned_exchange_first():
    """Two micro-batches forward (as pipeline schedules do), the first one's backward raising on every rank after a
    results-home exchange's backward started on the copy thread, then the second one's backward at once (no
    forward, step call or construction between): its first collective (the reverse all-to-all's backward, or the
    weights' copy again) met the abandoned exchange on the same gloo group in another order on each rank (both
    waited out the group's timeout, in most runs). The layer's backward now ends it first (``settle_abandoned``,
    before each collective of its nodes and hooks): checked at every collective the autograd thread starts in the
    second backward, which raises there where it was not (every rank alike, no timeout to wait out); the gradients
    then equal plain EP's: one layer, with recopy_weights, and two layers where the abandoned exchange is the other
    layer's."""
    results = run_dist(_backward_after_raised_rank, 2, timeout_s=200, collective_timeout_s=20)
    for rank, res in enumerate(results):
        for key, got in res.items():
            assert got.get("raised") and got["abandoned"] >= 1 and got["met"], (rank, key, got)
            assert isinstance(got["err"], float) and got["err"] <= 1e-5, (rank, key, got["err"])
    for key in _AFTER_RAISED:
        assert sum(res[key]["moved"] for res in results) > 0, key
