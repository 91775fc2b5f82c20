"""``FEPLBConfig.recopy_weights`` on 4 gloo ranks (2 nodes x 2 GPUs): a helper lets go of the expert weights it
received once its forward has used them, and the owners copy them to it again in the backward.

* the same outputs and gradients, bit for bit, as the layer that holds them (two micro-batches accumulated), in
  phase 2 (``feplb-split``, rows and weights to helpers) and on the peers' direct path (``fastermoe`` shadowing),
  also under ``torch.autocast`` (the GEMMs' bf16 casts of the weights are made again too);
* the same ``last_stats`` (bytes copied: the forward's);
* memory, followed through weak references to storages: without it every received weight buffer is held from the
  forward to the backward; with it none is (the rows sent to helpers still are: the GEMMs' weight gradients need
  them), nor an adapter's derived weights on the owners; each exchange that carried weights runs once more inside
  the backward and receives as many buffers; nothing received (nor derived) outlives the backward, with the output
  and the loss still held;
* the second copy starts when the gradient of the layer's expert outputs arrives, before the reverse all-to-all's
  backward (on a GPU, on the copy stream beside it), in phase 2 and on the direct path;
* a second backward through the same graph (``retain_graph``) copies nothing again and gives the same gradients;
  a forward without autograd computes the same;
* under activation checkpointing (both kinds), in phase 2 and on the direct path: nothing received is held between
  the forward and the backward, the recompute receives it again, and recopy_weights copies nothing more;
* an owner that changes its weights in place between the forward and the backward (an optimizer step too early)
  makes every rank raise the same error, naming that rank, in the backward;
* rows of an expert placed away from its owner (``+place``) that a plan moves back to the owner are computed there
  with the owner's own parameters, no weights copied to it: bit for bit the same with the received weights held or
  copied again, plain or under either kind of checkpointing, and as plain EP's up to rounding;
* the option needs weights='per-microbatch'.

(The exact match with a dense reference and with plain EP: ``tests/runtime/test_layer.py``.)
"""

from __future__ import annotations

import pytest
import torch

from feplb.testing import ReceivedBuffers, run_dist

pytestmark = pytest.mark.dist

H, FF, E, K, W, G = 16, 24, 16, 2, 4, 2
TOKENS = (40, 24, 32, 16)
HOT = 5   # the expert most tokens pick


def _layer(policy: str, recopy: bool, joined: bool = False):
    """The layer; ``joined``: as the adapters that derive their experts' weights every forward (torchtitan's [w1 |
    w3], Megatron's per-expert modules), whose block around the layer saves them as recipes too."""
    import weakref

    from feplb import FEPLBConfig, MoELayer
    from feplb.dropin import joined_for_forward

    class Joined(MoELayer):
        _joined = None
        made: list | None = None   # weak references to the memory of every join made

        def _join(self, w1, w2):
            out = w1 * 1.0, w2 * 1.0   # new tensors each forward (as a join or cast makes)
            self.made = (self.made or []) + [weakref.ref(w.untyped_storage()) for w in out]
            return out

        def expert_weights(self):
            return self._joined if self._joined is not None else self._join(self.w1, self.w2)

        def forward(self, x, routing):
            with joined_for_forward(self, "joined experts"):
                return super().forward(x, routing=routing)

    torch.manual_seed(7)   # the same experts for both layers of a pair
    cfg = FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=G, dyn=2, policy=policy,
                      weights="per-microbatch", recopy_weights=recopy, router="external", min_chunk=2,
                      min_straggler_rows=0, plan_wait_ms=60_000)
    return (Joined if joined else MoELayer)(cfg)


def _inputs(rank: int, mb: int, hot: float = 0.8):
    """Tokens, routing (most tokens, ``hot`` of them, pick expert HOT first: a straggler every policy balances),
    upstream gradient."""
    gen = torch.Generator().manual_seed(100 * rank + mb)
    T = TOKENS[rank]
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    picks = torch.rand(T, generator=gen) < hot
    ids[picks, 0] = HOT
    ids[picks & (ids[:, 1] == HOT), 1] = (HOT + 1) % E
    gates = torch.softmax(torch.randn(T, K, generator=gen), dim=-1)
    return x, (ids, gates), torch.randn(T, H, generator=gen)


def _pair_rank(rank: int, world: int, policy: str, autocast: bool, joined: bool) -> dict:
    """Both layers on the same two micro-batches (a backward after each): what each received and held, between
    each forward and its backward and after it."""
    import dataclasses
    import gc

    from feplb.testing import DerivedWeights

    out = {}
    for recopy in (False, True):
        layer = _layer(policy, recopy, joined)
        res = {"between": [], "after": [], "runs": [], "copies": [], "moved": 0, "grads": [], "derived": [],
               "stats": [], "joins_after": []}
        keep_alive = []   # each micro-batch's output and loss, held as a training loop holds them until the next
        with ReceivedBuffers() as spy, DerivedWeights() as watch:
            for mb in range(2):
                x, routing, dy = _inputs(rank, mb)
                x.requires_grad_(True)
                mark, runs, joins = spy.mark(), spy.runs, len(getattr(layer, "made", None) or ())
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    y = layer(x, routing=routing)
                gc.collect()
                res["between"].append(spy.since(mark))
                res["derived"].append((watch.made, watch.alive()))   # the received weights and their casts
                made = getattr(layer, "made", None) or []
                res.setdefault("joins", []).append(sum(r() is not None for r in made[joins:]))
                loss = (y.float() * dy).sum()
                loss.backward()
                keep_alive[:] = [y, loss]
                gc.collect()
                res["after"].append(spy.since(mark))
                res["joins_after"].append(sum(r() is not None for r in (getattr(layer, "made", None) or [])[joins:]))
                res["runs"].append(spy.runs - runs)
                res["moved"] += layer.last_stats.rows_moved
                res["copies"].append(layer.last_stats.weight_copies)
                res["stats"].append(dataclasses.replace(layer.last_stats, plan_us=0.0))
                res["grads"].append(x.grad)
        res["grads"] += [layer.w1.grad, layer.w2.grad]
        out[recopy] = res
        layer.close()
    return out


@pytest.mark.parametrize("policy,autocast,joined", [("feplb-split", False, False), ("fastermoe", False, False),
                                                    ("feplb-split", True, False), ("fastermoe", False, True)],
                         ids=["phase2", "direct_path", "phase2_autocast", "direct_path_joined"])
def test_recopied_weights_give_the_same_gradients_and_are_not_held(policy, autocast, joined):
    results = run_dist(_pair_rank, W, policy, autocast, joined, timeout_s=300)
    assert sum(sum(r[True]["copies"]) for r in results) > 0, "no weights were copied: the test would check nothing"
    assert sum(sum(n for n, _ in (c["weights"] for c in r[True]["between"])) for r in results) > 0, \
        "no rank received weights"
    for rank, res in enumerate(results):
        keep, again = res[False], res[True]
        # the same plans, the same numbers, the same report (bytes copied: the forward's)
        assert keep["stats"] == again["stats"], rank
        assert again["stats"][0].weight_bytes_moved > 0 or again["copies"][0] == 0, again["stats"][0]
        assert again["moved"] > 0, (rank, "balancing moved no row")
        for k, (a, b) in enumerate(zip(keep["grads"], again["grads"], strict=True)):
            assert torch.equal(a, b), (rank, k, "gradients differ", (a - b).abs().max().item())
        assert keep["runs"] == [0, 0], (rank, keep["runs"])
        for mb in range(2):
            held, between, after = keep["between"][mb], again["between"][mb], again["after"][mb]
            # without recopy every received weight buffer is held from the forward to the backward (under autocast,
            # their bf16 casts); with it none
            if not autocast:
                assert held["weights"][1] == held["weights"][0], (rank, mb, held)
            assert keep["derived"][mb][0] == (2 * (mb + 1) if joined else 0), (rank, "recipes without recopy", keep)
            assert keep["derived"][mb][1] == 0, (rank, mb, "the join held", keep["derived"])
            if joined:   # the owners send them again from the join made again, not from one held
                assert keep["joins"][mb] == again["joins"][mb] == 0, (rank, mb, keep["joins"], again["joins"])
            made, alive = again["derived"][mb]
            assert alive == 0, (rank, mb, "weights the recipes derive (casts included) held", made, alive)
            assert between["weights"][0] == held["weights"][0], (rank, mb, "the same copies", between, held)
            assert between["weights"][1] == 0, (rank, mb, "received weights held until the backward", between)
            if policy == "feplb-split" and not autocast:   # the rows for helpers travel apart, and stay (the
                # GEMMs' weight gradients need them; under autocast, their bf16 casts)
                assert between["rows"][1] == between["rows"][0], (rank, mb, between)
            # the weights exchange ran again in the backward (here, on every rank of a node that copied any),
            # receiving as many buffers as in the forward
            assert after["again"][0] == between["weights"][0], (rank, mb, after)
            assert again["runs"][mb] == (again["copies"][mb] > 0), (rank, mb, again["runs"], again["copies"])
            # with the output and the loss still held, as a loop holds them until its next micro-batch
            for kind, (_, alive) in (*after.items(), *keep["after"][mb].items()):
                assert alive == 0, (rank, mb, kind, "outlives the backward", after, keep["after"][mb])
            if joined:
                assert keep["joins_after"][mb] == again["joins_after"][mb] == 0, (rank, mb, again["joins_after"])
    assert all(sum(r[True]["runs"]) > 0 for r in results if sum(n for n, _ in
               (c["weights"] for c in r[True]["between"]))), "a rank that received weights never received them again"
    # the hosted GEMMs saved the received weights as recipes (and, under autocast, their casts too)
    made = [r[True]["derived"][-1][0] for r in results]
    assert sum(made) > 0, made


def _stepped_early_rank(rank: int, world: int, policy: str, who: str, joined: bool = False) -> dict:
    """A forward, then an in-place change of the experts' weights before its backward: on the one rank that sends
    weights to helpers (``who="owner"``) or on every rank (``"all"``); the error each rank raises."""
    layer = _layer(policy, True, joined)
    x, routing, dy = _inputs(rank, 0)
    y = layer(x.requires_grad_(True), routing=routing)
    sent = sum(1 for e, src, _ in layer.last_plan.weight_copies if src == rank)
    owner = min(src for _, src, _ in layer.last_plan.weight_copies)
    if who == "all" or rank == owner:
        with torch.no_grad():
            layer.w1.mul_(0.5)
    try:
        (y * dy).sum().backward()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    layer.close()
    return {"error": error, "owner": owner, "sent": sent}


@pytest.mark.parametrize("policy,who,joined", [("feplb-split", "all", False), ("fastermoe", "owner", False),
                                               ("fastermoe", "all", False), ("fastermoe", "owner", True)])
def test_weights_changed_before_the_backward_raise_on_every_rank(policy, who, joined):
    """Phase 2 agrees over the node (its copies stay in it: a node that copied nothing meets autograd's own check);
    the direct path, whose copies cross nodes here, over the group: every rank names the same rank and expert."""
    results = run_dist(_stepped_early_rank, W, policy, who, joined, timeout_s=300)
    owner = results[0]["owner"]
    assert results[owner]["sent"] > 0
    scope = G if policy == "feplb-split" else W
    for rank, res in enumerate(results):
        err = res["error"]
        assert err is not None, (rank, "no error")
        senders = [r for r in range(rank // scope * scope, (rank // scope + 1) * scope)
                   if results[r]["sent"] and (who == "all" or r == owner)]
        if not senders:
            assert "modified by an inplace operation" in err, (rank, err)
            continue
        assert "again for the backward" in err and f"on EP rank {senders[0]} " in err, (rank, err)
        assert "modified in place" in err and "step the optimizer after the backward" in err, (rank, err)
    if policy == "fastermoe":   # one agreement: the same message everywhere
        assert len({res["error"].split(" read them")[0] for res in results}) == 1, [r["error"] for r in results]


def test_recopy_needs_per_microbatch_weights():
    from feplb import FEPLBConfig

    with pytest.raises(ValueError, match="recopy_weights needs weights='per-microbatch'"):
        FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, weights="per-step", recopy_weights=True)
    with pytest.raises(TypeError, match="recopy_weights must be a bool"):
        FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, weights="per-microbatch", recopy_weights="yes")


def _twice_rank(rank: int, world: int) -> dict:
    """A backward twice through one graph (``retain_graph``), and a forward without autograd: the same as the layer
    that holds the weights, and the second backward copies nothing again."""
    from feplb import recopy

    runs = []
    start = recopy.Recopy.start

    def counted(rc):
        got = start(rc)
        if got is not None:
            runs.append(1)
        return got

    recopy.Recopy.start = counted
    out = {}
    try:
        for again in (False, True):
            layer = _layer("feplb-split", again)
            x, routing, dy = _inputs(rank, 0)
            with torch.no_grad():
                y0 = layer(x, routing=routing)
            x.requires_grad_(True)
            y = layer(x, routing=routing)
            n = len(runs)
            (y * dy).sum().backward(retain_graph=True)
            first = len(runs) - n
            (y * dy).sum().backward()
            out[again] = {"y0": y0, "y": y.detach(), "grads": [x.grad, layer.w1.grad, layer.w2.grad],
                          "runs": (first, len(runs) - n - first), "copies": layer.last_stats.weight_copies}
            layer.close()
    finally:
        recopy.Recopy.start = start
    return out


def test_second_backward_and_no_grad_forward():
    results = run_dist(_twice_rank, W, timeout_s=300)
    assert any(r[True]["copies"] for r in results)
    for rank, res in enumerate(results):
        keep, again = res[False], res[True]
        assert torch.equal(keep["y0"], again["y0"]) and torch.equal(keep["y"], again["y"]), rank
        for a, b in zip(keep["grads"], again["grads"], strict=True):
            assert torch.equal(a, b), (rank, (a - b).abs().max().item())
        assert keep["runs"] == (0, 0), rank
        assert again["runs"] == (int(again["copies"] > 0), 0), (rank, again["runs"], "copied in the first only")


def _order_rank(rank: int, world: int) -> dict:
    """Per policy, what the backward runs, in order: the weights' exchange again ("again"), each all-to-all's
    backward ("all_to_all": the reverse one first, then phase 1's)."""
    from feplb import dispatch, recopy

    log: list[str] = []
    start, a2a = recopy.Recopy.start, dispatch._AllToAllRows.backward

    def logged_start(rc):
        got = start(rc)
        if got is not None:
            log.append("again")
        return got

    def logged_a2a(ctx, *grads):
        log.append("all_to_all")
        return a2a(ctx, *grads)

    recopy.Recopy.start, dispatch._AllToAllRows.backward = logged_start, staticmethod(logged_a2a)
    out = {}
    try:
        for policy in ("feplb-split", "fastermoe"):
            layer = _layer(policy, True)
            x, routing, dy = _inputs(rank, 0)
            y = layer(x.requires_grad_(True), routing=routing)
            log.clear()
            (y * dy).sum().backward()
            out[policy] = list(log)
            layer.close()
    finally:
        recopy.Recopy.start, dispatch._AllToAllRows.backward = start, a2a
    return out


def test_the_weights_go_again_before_the_reverse_all_to_alls_backward():
    """The second copy starts when the gradient of the layer's expert outputs arrives, before the backward of the
    reverse all-to-all (on a GPU its copies run on the copy stream beside it), in phase 2 and on the direct path."""
    results = run_dist(_order_rank, W, timeout_s=300)
    for policy in ("feplb-split", "fastermoe"):
        logs = [r[policy] for r in results]
        assert any("again" in log for log in logs), (policy, "no weights copied again: the test would check nothing")
        for rank, log in enumerate(logs):
            assert log.count("all_to_all") == 2, (policy, rank, log)
            assert log in (["again", "all_to_all", "all_to_all"], ["all_to_all", "all_to_all"]), (policy, rank, log)


def _checkpointed_rank(rank: int, world: int, policy: str) -> dict:
    """The layer (holding the weights, or copying them again) inside ``torch.utils.checkpoint``, both kinds: what
    each received, and held between the forward and the backward."""
    import gc

    from torch.utils.checkpoint import checkpoint

    def settle(layer) -> None:
        # The copy thread's last job let go: its worker drops a job's arguments (received buffers among them) only
        # after waking whoever waited for its result, so a count taken right away could still see them
        layer._balancer.copier.submit(lambda: None).result()
        gc.collect()

    out = {}
    with ReceivedBuffers() as spy:
        for again in (False, True):
            layer = _layer(policy, again)
            x, routing, dy = _inputs(rank, 0)
            for mode in ("plain", "reentrant", "non-reentrant"):
                xx = x.clone().requires_grad_(True)
                mark, runs = spy.mark(), spy.runs

                def f(t, layer=layer, routing=routing):
                    return torch.tanh(layer(t, routing=routing))

                y = f(xx) if mode == "plain" else checkpoint(f, xx, use_reentrant=mode == "reentrant")
                settle(layer)
                between = spy.since(mark)
                (y * dy).sum().backward()
                settle(layer)
                out[(again, mode)] = {"between": between, "after": spy.since(mark), "runs": spy.runs - runs,
                                      "grad": xx.grad, "copies": layer.last_stats.weight_copies}
            layer.close()
    return out


@pytest.mark.parametrize("policy", ["feplb-split", "fastermoe"])
def test_under_activation_checkpointing(policy):
    """Checkpointing frees the received weights itself (its recompute receives them again), in phase 2 and on the
    direct path; with recopy_weights no copy is made again in the backward beyond the recompute's, and the
    gradients are the same in every mode."""
    results = run_dist(_checkpointed_rank, W, policy, timeout_s=300)
    assert sum(r[(False, "plain")]["between"]["weights"][0] for r in results) > 0, "no weights received"
    for rank, res in enumerate(results):
        want = res[(False, "plain")]
        n = want["between"]["weights"][0]
        assert want["between"]["weights"][1] == n, (rank, "held without checkpointing", want)
        for (again, mode), got in res.items():
            assert torch.equal(got["grad"], want["grad"]), (rank, again, mode)
            assert got["between"]["weights"][0] == n, (rank, again, mode, "the same copies", got)
            assert got["after"]["again"][0] == (n if again and mode == "plain" else 0), (rank, again, mode, got)
            if again or mode != "plain":
                assert got["between"]["weights"][1] == 0, (rank, again, mode, "held until the backward", got)
            if mode != "plain":   # the recompute receives them again (as the forward did)
                assert got["after"]["weights"][0] == 2 * n, (rank, again, mode, got)
                assert got["runs"] == 0, (rank, again, mode, "copied again beside the recompute")
            for kind, (_, alive) in got["after"].items():
                assert alive == 0, (rank, again, mode, kind, "outlives the backward", got)


def test_the_second_copy_overlaps_the_next_collective_only_over_cuda_ipc_inside_a_node():
    """Over NVSHMEM (on-stream barriers on the transport's team), an NCCL copy path or a part crossing nodes, two
    collectives must not be in flight together: the compute stream waits for the second copy at once there."""
    from types import SimpleNamespace as NS

    from feplb.recopy import Recopy

    for name, cross, want in (("ipc", False, True), ("ipc", True, False), ("nvshmem", False, False),
                              ("nccl", False, False), ("shm", False, False), ("gloo", False, False)):
        rc = Recopy.__new__(Recopy)
        rc.ex = NS(comm=NS(copy=NS(name=name)), layout=NS(cross_node=cross))
        assert rc.overlaps() is want, (name, cross)


def _owner_rank(rank: int, world: int) -> dict:
    """``feplb-split+place@ema`` (expert HOT placed away from its owner, on the owner's node: 60% of the tokens pick
    it; the plans move rows of it back to the owner), per micro-batch weights: the layer holding the received
    weights and the one copying them again, each plain and under both kinds of checkpointing, over two accumulated
    micro-batches; and plain EP on the same data."""
    from torch.utils.checkpoint import checkpoint

    out = {}
    for policy, again, mode in [("none", False, "plain")] + [("feplb-split+place@ema", a, m) for a in (False, True)
                                                             for m in ("plain", "reentrant", "non-reentrant")]:
        layer = _layer(policy, again)
        with torch.no_grad():
            for mb in range(3):       # a history: the placement adopted at the refresh
                x, routing, _ = _inputs(rank, mb, hot=0.6)
                layer(x, routing=routing)
        layer.refresh_replicas()
        res = {"placed": layer.placement.placed_pairs, "outs": [], "dx": [], "owner_rows": 0, "copies": [],
               "runs": 0}
        for mb in range(3, 5):
            x, routing, dy = _inputs(rank, mb, hot=0.6)
            x.requires_grad_(True)

            def f(t, layer=layer, routing=routing):
                return torch.tanh(layer(t, routing=routing))

            y = f(x) if mode == "plain" else checkpoint(f, x, use_reentrant=mode == "reentrant")
            (y * dy).sum().backward()
            res["outs"].append(y.detach())
            res["dx"].append(x.grad)
            plan = layer.last_plan
            if plan is not None and plan.home_E is not None:
                L = E // W
                res["owner_rows"] += sum(m.row_end - m.row_start for m in plan.moves
                                         if m.dst == m.expert // L != plan.home_E[m.expert])
                res["copies"].append(tuple(plan.weight_copies))
        res["dw"] = [layer.w1.grad, layer.w2.grad]
        out[(policy, again, mode)] = res
        layer.close()
    return out


def test_owners_compute_their_placed_experts_with_recopy_and_checkpointing():
    """Rows of an expert placed away from its owner that a plan moves back to the owner are computed there with the
    owner's own parameters (no weight copy to it): the same outputs and gradients, bit for bit, with the received
    weights held or copied again in the backward, plain or under either kind of checkpointing; as plain EP's up to
    rounding."""
    results = run_dist(_owner_rank, W, timeout_s=400)
    L = E // W
    keys = [k for k in results[0] if k[0] != "none"]
    want_key = ("feplb-split+place@ema", False, "plain")
    assert any(e == HOT and h != HOT // L for e, h in results[0][want_key]["placed"]), results[0][want_key]["placed"]
    for key in keys:
        assert sum(r[key]["owner_rows"] for r in results) > 0, (key, "no rows moved back to an owner: the test "
                                                                     "would not exercise it")
    for rank, res in enumerate(results):
        want, none = res[want_key], res[("none", False, "plain")]
        for key in keys:
            got = res[key]
            for cps in got["copies"]:
                assert not [c for c in cps if c[2] == c[0] // L], (rank, key, "weights copied to their owner", cps)
            assert got["copies"] == want["copies"], (rank, key, "other plans")
            for what in ("outs", "dx", "dw"):
                for i, (a, b) in enumerate(zip(got[what], want[what], strict=True)):
                    assert torch.equal(a, b), (rank, key, what, i, (a - b).abs().max().item())
        for what in ("outs", "dx", "dw"):
            for i, (a, b) in enumerate(zip(want[what], none[what], strict=True)):
                err = (a - b).abs().max().item()
                assert err <= 1e-5 * max(b.abs().max().item(), 1e-6), (rank, what, i, "differs from plain EP", err)
