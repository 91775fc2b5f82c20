"""Training loops that go wrong between the EP ranks without any collective noticing, on 4 gloo ranks as 2 nodes x 2
GPUs: each is refused on every rank at the next forward, or trains as plain EP does.

* a ``torch.amp.GradScaler`` not passed to ``attach_optimizer``: an overflow in one rank's expert gradients (which
  that rank alone sees) skips the step there only, and the ranks' loss scales part; every expert's gradient then sums
  tokens scaled apart. Refused (the ranks' optimizer step counts differ). Passed, the skip is agreed and nothing
  changes on any rank;
* a step the attached scaler skipped, then gradients zeroed in place: the next step's ``average_expert_grads`` is no
  second call (it was refused as one), and training (clipped by ``feplb.clip_grad_norm_``) equals plain EP's;
* a backward discarded with ``model.zero_grad()`` while per-step expert copies hold their share of it (eager and
  lazy replicas, a ``+place`` bank; the gradients set to None, or zeroed in place): refused until the copies' share
  is dropped too; then training equals plain EP's;
* expert weights written after the step of an optimizer attached to the layer (fp32 master weights copied back):
  refused, naming the write after the attached step;
* an optimizer attached to balancing layers stepped on some ranks only (a GradScaler not attached with it, an
  overflow one rank alone saw; or the loop's own condition): the ranks in the step and the one in the next forward
  meet in the step's handshake and raise together, instead of stalling until the process group's timeout; a
  GradScaler not attached with it is refused at its first step on every rank;
* expert parameters frozen on some ranks only, under per-step copies (whose share follows their holder's flags)
  across them: refused on every rank at the forward (frozen between a forward and its backward: at the
  reduction); layers without such copies train as plain EP;
* expert parameters frozen or unfrozen alike between a forward and its backward, or between the forwards of two
  micro-batches before their backwards: trains as plain EP (each forward takes the copies with its own flags).
"""

from __future__ import annotations

import pytest
import torch

from feplb.testing import error_bound, error_of, load_global_weights, run_dist

pytestmark = pytest.mark.dist

H, FF, E, K, W, G = 16, 24, 8, 2, 4, 2


def _weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global router [E, H], w1 [E, H, 2F] and w2 [E, F, H] every test layer starts from."""
    gen = torch.Generator().manual_seed(3)
    router = torch.randn(E, H, generator=gen) / H ** 0.5
    router[:, 0] = 0.0
    router[[0, 1], 0] = torch.tensor([4.0, 3.0])     # GPU 0's experts are hot: rows move
    w1 = torch.randn(E, H, 2 * FF, generator=gen) / H ** 0.5
    w2 = torch.randn(E, FF, H, generator=gen) / FF ** 0.5
    return router, w1, w2


def _layer(policy: str, **kw):
    from feplb import FEPLBConfig, MoELayer

    router, w1, w2 = _weights()
    kw.setdefault("plan_wait_ms", 60_000.0)
    layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=G, dyn=2, policy=policy,
                                 min_straggler_rows=0, min_chunk=2, **kw))
    load_global_weights(layer, router, w1, w2)
    return layer


def _x(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(48, H, generator=gen)
    x[:, 0] = x[:, 0].abs() + 1.0
    return x


def _scaler_worker(rank, world):
    res = {}
    # 1. not attached: rank 0 sees an overflow in its experts' gradients, skips; the others step. Refused.
    #    Attached: every rank skips, nothing changes; the next forward runs.
    #    A fused optimizer is stepped even then (its kernel skips the update): counted as skipped all the same.
    for attach, fused in ((False, False), (True, False), (False, True)):
        layer = _layer("none")
        opt = torch.optim.SGD(layer.parameters(), lr=0.1, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        if attach:
            layer.attach_optimizer(opt, scaler=scaler)
        scaler.scale(layer(_x(rank, 0)).pow(2).mean()).backward()
        if rank == 0:
            layer.w1.grad.view(-1)[0] = float("inf")
        before = layer.w1.detach().clone()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        res[f"attached={attach}" + ("/fused" if fused else "")] = (torch.equal(layer.w1, before), scaler.get_scale(),
                                     error_of(lambda layer=layer: layer(_x(rank, 1))))
        layer.close()

    # 2. attached scaler, average_expert_grads, gradients zeroed in place by the model, step 0 skipped (an overflow
    #    on rank 1): the next step's average_expert_grads runs, and training equals plain EP's
    import feplb

    finals, moved, errors, norms = {}, 0, {}, {}
    for policy, kw in (("none", {}), ("feplb-split@ema", {"weights": "per-step"}),
                       ("feplb-split", {"weights": "per-microbatch"})):
        layer = _layer(policy, **kw)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        layer.attach_optimizer(opt, scaler=scaler)
        try:
            for step in range(3):
                # (the model's zero_grad: an attached optimizer's would also end the step's averaging)
                torch.nn.ModuleList([layer]).zero_grad(set_to_none=False)
                for mb in range(2):
                    scaler.scale(layer(_x(rank, 10 * step + mb)).pow(2).mean()).backward()
                    moved += layer.last_stats.rows_moved if policy != "none" else 0
                layer.average_expert_grads()
                if step == 0 and rank == 1:
                    layer.w2.grad.view(-1)[0] = float("nan")
                scaler.unscale_(opt)
                # the replicated router averaged over the ranks, as DDP would (before clipping: its norm counts once)
                torch.distributed.all_reduce(layer.router.weight.grad)
                layer.router.weight.grad.div_(world)
                norms.setdefault(policy, []).append(float(feplb.clip_grad_norm_(layer, 0.01)))
                scaler.step(opt)
                scaler.update()
            finals[policy] = (layer.w1.detach().clone(), layer.w2.detach().clone(), scaler.get_scale())
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors[policy] = f"{type(exc).__name__}: {exc}"
        layer.close()
    res["in_place"] = (finals, moved, errors)
    res["norms"] = norms
    return res


def test_grad_scaler_loops():
    res = run_dist(_scaler_worker, W, timeout_s=240, collective_timeout_s=60)
    for r in range(W):
        for case in ("attached=False", "attached=False/fused"):
            same, scale, err = res[r][case]
            assert same == (r == 0), (r, case, same)        # rank 0 skipped, the others stepped
            assert scale == (128.0 if r == 0 else 256.0)
            assert err is not None and "skipped different numbers of optimizer steps" in err and \
                "attach_optimizer" in err, (case, err)
        same, scale, err = res[r]["attached=True"]
        assert same and scale == 128.0 and err is None, (r, same, scale, err)   # skipped everywhere

        finals, moved, errors = res[r]["in_place"]
        assert not errors, errors
        # feplb.clip_grad_norm_ on a bare layer: the whole group's norm, the per-step copies' share counted once
        norms = res[r]["norms"]
        assert {p: n[1:] for p, n in norms.items()} == {p: n[1:] for p, n in res[0]["norms"].items()}, (r, norms)
        ref_norms = norms["none"]
        # NaN on every rank at the skipped step (rank 1's NaN counts in the group's norm), then above max_norm
        assert all(n[0] != n[0] for n in norms.values()) and all(n > 0.01 for n in ref_norms[1:]), norms
        for policy in ("feplb-split@ema", "feplb-split"):
            for a, b in zip(norms[policy][1:], ref_norms[1:], strict=True):
                assert abs(a - b) <= 1e-5 * b, (policy, norms[policy], ref_norms)
        ref = finals["none"]
        assert ref[2] == 128.0, ref[2]      # one skip (agreed), no growth within 3 steps
        for policy in ("feplb-split@ema", "feplb-split"):
            got = finals[policy]
            assert got[2] == ref[2], (policy, got[2], ref[2])
            for a, b in zip(got[:2], ref[:2], strict=True):
                _, bound = error_bound(b)
                assert (a - b).abs().max().item() <= bound, (policy, r, (a - b).abs().max().item())
    assert sum(res[r]["in_place"][1] for r in range(W)) > 0      # rows moved: balancing ran


def _discard_worker(rank, world, policy, replicas, set_to_none=True):
    res = {}
    layers = {"bal": _layer(policy, weights="per-step", replicas=replicas), "ref": _layer("none")}
    opts = {k: torch.optim.SGD(lay.parameters(), lr=0.1) for k, lay in layers.items()}
    bal = layers["bal"]
    with torch.no_grad():
        bal(_x(rank, 99))
    bal.refresh_replicas()
    held = []
    for step in range(3):
        for k, lay in layers.items():
            out = lay(_x(rank, step))
            out.pow(2).mean().backward()
            if step == 1:
                # a loss spike the loop skips: the model's zero_grad, as torch tutorials write it
                if k == "bal":
                    held.append(not lay.replicas.grads_clean())
                # (a model's: it does not reach the layer's zero_grad; in place or not)
                torch.nn.ModuleList([lay]).zero_grad(set_to_none=set_to_none)
                continue
            lay.reduce_replica_grads()
            opts[k].step()
            lay.refresh_replicas()
            opts[k].zero_grad()
        if step == 1:
            res["refused"] = error_of(lambda: bal(_x(rank, 5)))
            res["refused_again"] = error_of(lambda: bal(_x(rank, 5)))   # still there until dropped
            # a reentrant checkpoint's forward (training mode, autograd off) is refused too; an evaluation pass is not
            x5 = _x(rank, 5).requires_grad_(True)
            res["refused_reentrant"] = error_of(
                lambda x5=x5: torch.utils.checkpoint.checkpoint(bal, x5, use_reentrant=True))
            bal.eval()
            with torch.no_grad():
                res["evaluation"] = error_of(lambda: bal(_x(rank, 5)))
            bal.train()
            bal.zero_replica_grads()
    res["held"] = any(held)
    res["moved"] = bal.last_stats.rows_moved
    res["w"] = [(layers["bal"].w1.detach() - layers["ref"].w1.detach()).abs().max().item(),
                error_bound(layers["ref"].w1.detach())[1],
                (layers["bal"].w2.detach() - layers["ref"].w2.detach()).abs().max().item(),
                error_bound(layers["ref"].w2.detach())[1]]
    # fp32 master weights copied back after the step of an optimizer attached to the layer (which refreshed the
    # copies in its step): refused, naming the write after the attached step, not asking to attach it
    bal.attach_optimizer(opts["bal"])
    bal(_x(rank, 7)).pow(2).mean().backward()
    opts["bal"].step()
    with torch.no_grad():
        bal.w1.copy_(bal.w1.double().float())
    res["written_after_attached_step"] = error_of(lambda: bal(_x(rank, 8)))
    for lay in layers.values():
        lay.close()
    return res


@pytest.mark.parametrize("policy,replicas,set_to_none", [("feplb-split@ema", "eager", True),
                                                         ("feplb@ema", "lazy", True),
                                                         ("feplb-split@ema", "eager", False),
                                                         # the bank's owners hold zero gradients until the reduction
                                                         ("feplb-split+place", "eager", True),
                                                         ("feplb-split+place", "eager", False)])
def test_discarded_backward_with_per_step_copies(policy, replicas, set_to_none):
    res = run_dist(_discard_worker, W, policy, replicas, set_to_none, timeout_s=240, collective_timeout_s=60)
    assert any(r["held"] for r in res)          # some rank's copies held gradients of the discarded backward
    for r in res:
        assert r["refused"] is not None and "zero_replica_grads" in r["refused"] and "dropped" in r["refused"], \
            r["refused"]
        assert r["refused_again"] == r["refused"] and r["refused_reentrant"] == r["refused"]
        assert r["evaluation"] is None, r["evaluation"]
        err = r["written_after_attached_step"]
        assert err is not None and "after the last step of the optimizer attached to the layer" in err, err
        d1, b1, d2, b2 = r["w"]
        assert d1 <= b1 and d2 <= b2, r["w"]     # after dropping them, the steps equal plain EP's


def _reproducible_worker(rank, world, deterministic):
    import random
    import time

    torch.use_deterministic_algorithms(deterministic)
    runs = []
    for run in range(2):
        # a planner whose time varies from plan to plan, beyond a 1 ms grace (a GPU's default grace is 0)
        layer = _layer("feplb-split", weights="per-microbatch", plan_wait_ms=1.0)
        plan_fn, rnd = layer._plan, random.Random(100 * run + rank)

        def slow(*args, plan_fn=plan_fn, rnd=rnd, **kwargs):
            time.sleep(rnd.choice((0.0, 0.03)))
            return plan_fn(*args, **kwargs)

        layer._plan = slow
        fell_back = []
        for mb in range(4):
            layer(_x(rank, mb)).pow(2).mean().backward()
            fell_back.append(layer.last_stats.fell_back)
        runs.append((layer.w1.grad.clone(), layer.w2.grad.clone(), fell_back))
        layer.close()
    return runs


@pytest.mark.parametrize("deterministic", [True, False])
def test_reproducible_under_deterministic_algorithms(deterministic):
    """Under torch.use_deterministic_algorithms(True) the plan is always waited for: two runs whose planners take
    different times give bitwise equal gradients, with no fallback. Without it, the clock decides (fallbacks)."""
    res = run_dist(_reproducible_worker, W, deterministic, timeout_s=240, collective_timeout_s=60)
    fallbacks = sum(f for r in res for run in r for f in run[2])
    if deterministic:
        assert fallbacks == 0
        for r in res:
            (a1, a2, _), (b1, b2, _) = r
            assert torch.equal(a1, b1) and torch.equal(a2, b2)
    else:
        assert fallbacks > 0     # the grace is shorter than the planner: the clock decided


def _partial_step_worker(rank, world, policy, weights):
    import feplb

    res = {}
    # two layers of one group, attached in the other order than the forward runs them: the handshake (on the first
    # attached) meets the forward's first counts all-gather (of the other)
    cases = ("scaler_overflow", "scaler_clean", "loop_condition", "attached_scaler_loop", "clip_then_step",
             "reduce_skipped", "attached_scaler")
    for case in cases:
        a, b = _layer(policy, weights=weights), _layer(policy, weights=weights)
        model = torch.nn.ModuleList([a, b])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        attached = case in ("attached_scaler", "attached_scaler_loop")
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=case.startswith(("scaler", "attached")))
        if case != "reduce_skipped":
            b.attach_optimizer(opt, scaler=scaler if attached else None)
            a.attach_optimizer(opt, scaler=scaler if attached else None)
        before = a.w1.detach().clone()
        with torch.no_grad():
            b(a(_x(rank, 99)))
        a.refresh_replicas()
        b.refresh_replicas()
        # an overflow in rank 0's expert gradients only, made by its backward (a change in place after it is
        # refused where per-step copies hold their share: test_in_place_changes_before_the_reduction_are_refused)
        overflow = a.w1.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf"))) \
            if rank == 0 and case in ("scaler_overflow", "attached_scaler") else None
        scaler.scale(b(a(_x(rank, 0))).pow(2).mean()).backward()
        if overflow is not None:
            overflow.remove()

        def step_then_forward(case=case, a=a, b=b, model=model, opt=opt, scaler=scaler):
            if case in ("loop_condition", "attached_scaler_loop", "clip_then_step", "reduce_skipped") and rank == 2:
                if case == "reduce_skipped":     # a loss-spike skip of reduce and step, then the loop's refresh
                    a.refresh_replicas()
                    b.refresh_replicas()
                opt.zero_grad()
                return b(a(_x(rank, 1)))        # a loss-spike skip on one rank only
            if case == "clip_then_step":
                feplb.clip_grad_norm_(model, 1.0)
            if case == "reduce_skipped":
                a.reduce_replica_grads()
                b.reduce_replica_grads()
                opt.step()
                a.refresh_replicas()
                b.refresh_replicas()
            elif case in ("loop_condition", "clip_then_step"):
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            return b(a(_x(rank, 1)))

        res[case] = (error_of(step_then_forward), torch.equal(a.w1, before))
        if case == "scaler_clean":
            # as the refusal says: attach the scaler, zero the gradients, run the step again from its backward; the
            # same as a loop attached from the start (the scaler's record of its refused step gone with it)
            b.attach_optimizer(opt, scaler=scaler)
            a.attach_optimizer(opt, scaler=scaler)
            opt.zero_grad()
            scaler.scale(b(a(_x(rank, 0))).pow(2).mean()).backward()
            res["retry"] = error_of(lambda scaler=scaler, opt=opt: (scaler.step(opt), scaler.update()))
            res["retry_w"] = a.w1.detach().clone()
        a.close()
        b.close()
    # the reference of the retry: attached from the start, one step on the same batch
    a, b = _layer(policy, weights=weights), _layer(policy, weights=weights)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    b.attach_optimizer(opt, scaler=scaler)
    a.attach_optimizer(opt, scaler=scaler)
    with torch.no_grad():
        b(a(_x(rank, 99)))
    a.refresh_replicas()
    b.refresh_replicas()
    scaler.scale(b(a(_x(rank, 0))).pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    res["fresh_w"] = a.w1.detach().clone()
    a.close()
    b.close()
    return res


@pytest.mark.parametrize("policy,weights", [("feplb-split@ema", "per-step"), ("feplb-split", "per-microbatch")])
def test_step_on_some_ranks_only(policy, weights):
    res = run_dist(_partial_step_worker, W, policy, weights, timeout_s=240, collective_timeout_s=60)
    skipped = "a part of the training step was skipped on some ranks only"
    for r, got in enumerate(res):
        # rank 0's step skipped (its own overflow, unseen by the others): every rank raises, rank 0 in its forward
        err, same = got["scaler_overflow"]
        assert err is not None and err.startswith("RuntimeError") and skipped in err, (r, err)
        assert "EP rank(s) [1, 2, 3] in optimizer.step() of an optimizer attached to the layer, while EP rank(s) " \
               "[0] went on" in err and "attach_optimizer(optimizer, scaler=scaler)" in err, (r, err)
        assert same, r          # nothing was stepped anywhere
        # every rank steps, through a scaler not attached with the optimizer: refused before anything is stepped
        err, same = got["scaler_clean"]
        assert err is not None and "GradScaler not attached with the optimizer" in err and "[0, 1, 2, 3]" in err, \
            (r, err)
        assert same, r
        # rank 2 skips: the optimizer's step (no scaler); an attached scaler's step; feplb.clip_grad_norm_ and the
        # step; the reduction and the step, then refreshes as the others do after their step
        for case, where in (("loop_condition", "optimizer.step()"), ("attached_scaler_loop", "GradScaler"),
                            ("clip_then_step", "feplb.clip_grad_norm_()")):
            err, _ = got[case]
            assert err is not None and skipped in err and "while EP rank(s) [2] went on" in err, (r, case, err)
            assert f"EP rank(s) [0, 1, 3] in {where}" in err or f"EP rank(s) [0, 1, 3] in the unscale_() or step() " \
                f"of a {where}" in err, (r, case, err)
        err, _ = got["reduce_skipped"]
        assert err is not None and "different calls after the backward" in err and \
            "EP rank(s) [0, 1, 3] in reduce_replica_grads(); EP rank(s) [2] in refresh_replicas()" in err, (r, err)
        # attached with the optimizer, the overflow skips the step on every rank and the next forward runs
        err, same = got["attached_scaler"]
        assert err is None and same, (r, err)
        # the retry after the refusal steps as a loop attached from the start
        assert got["retry"] is None, (r, got["retry"])
        diff = (got["retry_w"] - got["fresh_w"]).abs().max().item()
        assert diff <= error_bound(got["fresh_w"])[1], (r, diff)


def _loops_review_worker(rank, world):
    """Five loops with per-step copies, each against the same loop on plain EP (fp64): the experts' gradients
    changed in place before the reduction (clip_grad_value_, a scaling); an expert part frozen between two
    micro-batches under +place (whose bank holds the step's whole gradient until the reduction); +place trained in
    eval mode; an attached
    optimizer stepped with a closure; and a per-layer call made a second time on one rank only."""
    res = {}

    def pair(policy, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.5), **kw):
        """The balancing layer (``kw`` its config's) and plain EP's, each with an attached ``optimizer(params)``."""
        layers = {p: _layer(p, dtype=torch.float64, **(kw if p != "none" else {})) for p in (policy, "none")}
        opts = {p: optimizer(m.parameters()) for p, m in layers.items()}
        for p, m in layers.items():
            m.attach_optimizer(opts[p])
            with torch.no_grad():
                m(_x(rank, 99).double())     # a history, so that copies and a +place bank exist
            m.refresh_replicas()
        return layers, opts

    def diff(layers):
        a, b = layers.values()
        return max((getattr(a, n) - getattr(b, n)).abs().max().item() for n in ("w1", "w2"))

    # 1. clip_grad_value_ / a scaling after the backward, before the attached step's reduction: refused on every
    # rank, nothing stepped (before, the copies' share was added unclipped); as the refusal says, zero the gradients
    # and redo the step from its backward, reducing first: trains as plain EP
    def change(m, how):
        if how.startswith("clip_value"):
            torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3)
        elif how.startswith("clip_norm"):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-2)
        else:
            for q in m.parameters():
                q.grad.mul_(0.5)

    # (under +place the owners' parameters hold a zero gradient from the backward to the reduction, the bank the
    # step's whole gradient: changed in place, the zeros are seen as changed)
    for how, policy in (("clip_value", "feplb-split@ema"), ("scale", "feplb-split@ema"),
                        ("clip_value+place", "feplb-split+place"), ("clip_norm+place", "feplb-split+place")):
        layers, opts = pair(policy)
        errors, moved = [], 0
        for step in range(2):
            for p, m in layers.items():
                (m(_x(rank, step).double()) ** 2).mean().backward()
                moved += m.last_stats.rows_moved if p != "none" else 0
                change(m, how)
                errors.append(error_of(opts[p].step))
                if errors[-1] is not None:
                    opts[p].zero_grad()
                    (m(_x(rank, step).double()) ** 2).mean().backward()
                    m.reduce_replica_grads()      # the documented order: reduce, then change the gradients
                    change(m, how)
                    opts[p].step()
                opts[p].zero_grad()
        res[how] = {"errors": errors, "diff": diff(layers), "moved": moved}
        for m in layers.values():
            m.close()

    # 2. w2 frozen between the step's two micro-batches under +place: it keeps (and steps) the first one's gradient;
    # also where the loop zeroes the gradients between the first forward and its backward
    for zero_between in (False, True):
        layers, opts = pair("feplb-split+place")
        w2_before = layers["feplb-split+place"].w2.detach().clone()
        for p, m in layers.items():
            for mb in range(2):
                loss = (m(_x(rank, mb).double()) ** 2).mean()
                if zero_between and mb == 0:
                    opts[p].zero_grad()
                loss.backward()
                m.w2.requires_grad_(False)
            opts[p].step()
        res[f"frozen{int(zero_between)}"] = {
            "diff": diff(layers), "w2_stepped": not torch.equal(layers["feplb-split+place"].w2, w2_before)}
        for m in layers.values():
            m.close()

    # 2b. trained in eval mode (autograd on; a loop keeping dropout off) under +place: the owners hold their zero
    # gradients as in training mode (before, the reduction took them for dropped and refused the step)
    layers, opts = pair("feplb-split+place")
    errors = []
    for step in range(2):
        for p, m in layers.items():
            m.eval()
            for mb in range(2):
                errors.append(error_of(lambda m=m, mb=mb, step=step: (m(_x(rank, 10 * step + mb).double()) ** 2)
                                       .mean().backward()))
            errors.append(error_of(opts[p].step))
            opts[p].zero_grad()
    res["eval_mode"] = {"diff": diff(layers), "errors": [e for e in errors if e is not None]}
    for m in layers.values():
        m.close()

    # 2d. weight decay added to the gradients through .data (no version counter sees it) before the attached step
    # under +place: the owners' zero gradients carry it into the reduction, which adds the bank's share to it, as
    # plain EP's gradients keep it (a reduction that let the zeros go would lose it)
    layers, opts = pair("feplb-split+place")
    for step in range(2):
        for p, m in layers.items():
            for mb in range(2):
                (m(_x(rank, 10 * step + mb).double()) ** 2).mean().backward()
            for q in (m.w1, m.w2):
                q.grad.data.add_(q.data, alpha=0.1)
            opts[p].step()
            opts[p].zero_grad()
    res["data_decay"] = diff(layers)
    for m in layers.values():
        m.close()

    # 2e. an evaluation forward with autograd on (no backward) while w2 trains, w2 frozen for the step's
    # micro-batches and at the step: no backward reached w2, plain EP's w2 holds no gradient and weight decay
    # leaves it alone; so under +place (whose owners' gradients come from the reduction)
    layers, opts = pair("feplb-split+place", lambda ps: torch.optim.SGD(ps, lr=0.2, weight_decay=0.1))
    for p, m in layers.items():
        opt = opts[p]
        for step in range(2):
            m.eval()
            m(_x(rank, 50 + step).double())      # autograd on, the output dropped
            m.train()
            m.w2.requires_grad_(False)
            (m(_x(rank, step).double()) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            m.w2.requires_grad_(True)
    res["eval_then_frozen"] = diff(layers)
    for m in layers.values():
        m.close()

    # 2f. w2 frozen through the first forwards, unfrozen later: a scaling of its gradient after a backward, before
    # the reduction, is refused on every rank as w1's is (its accumulations are watched from its first forward
    # requiring grad on, not only those of the parameters that required grad at the layer's first)
    layers, opts = pair("feplb-split@ema")
    m = layers["feplb-split@ema"]
    errors = []
    for step in range(2):
        m.w2.requires_grad_(step == 1)
        (m(_x(rank, step).double()) ** 2).mean().backward()
        if step == 1:
            m.w2.grad.mul_(0.5)
        errors.append(error_of(opts["feplb-split@ema"].step))
        opts["feplb-split@ema"].zero_grad()
    res["unfrozen_scaled"] = errors
    for m in layers.values():
        m.close()

    # 2c. w2 frozen between a micro-batch's forward and its backward: autograd leaves plain EP's w2 alone in that
    # backward, and the per-step copies' share of it is dropped alike (+place's bank, @ema replicas, lazy ones)
    for policy, kw in (("feplb-split+place", {}), ("feplb-split@ema", {}), ("feplb@ema", {"replicas": "lazy"})):
        layers, opts = pair(policy, **kw)
        for p, m in layers.items():
            for step in range(2):
                for mb in range(2):
                    y = m(_x(rank, 10 * step + mb).double())
                    if step == 1 and mb == 1:
                        m.w2.requires_grad_(False)
                    (y ** 2).mean().backward()
                opts[p].step()
                m.w2.requires_grad_(True)
                opts[p].zero_grad()
        res[f"frozen_fwd_bwd {policy}"] = diff(layers)
        for m in layers.values():
            m.close()

    # 3. optimizer.step(closure) of an attached optimizer: the closure's backward is reduced before the update
    layers, opts = pair("feplb-split@ema")
    for step in range(2):
        for p, m in layers.items():
            def closure(m=m, p=p, step=step):
                opts[p].zero_grad()
                loss = (m(_x(rank, step).double()) ** 2).mean()
                loss.backward()
                return loss
            opts[p].step(closure) if step == 0 else opts[p].step(closure=closure)
    res["closure"] = diff(layers)
    for m in layers.values():
        m.close()

    # ... and LBFGS, whose step moves the weights between its closure's calls (the copies made again each call)
    layers = {p: _layer(p, dtype=torch.float64) for p in ("feplb-split@ema", "none")}
    for m in layers.values():
        opt = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=4)
        m.attach_optimizer(opt)
        with torch.no_grad():
            m(_x(rank, 99).double())
        m.refresh_replicas()
        for step in range(2):
            def closure(m=m, opt=opt, step=step):
                opt.zero_grad()
                loss = (m(_x(rank, step).double()) ** 2).mean()
                loss.backward()
                return loss
            opt.step(closure)
    res["lbfgs"] = diff(layers)
    for m in layers.values():
        m.close()

    # 4. refresh_replicas() called again on rank 0 only: it meets the others' next forward, every rank raises
    layers, opts = pair("feplb-split@ema")
    m = layers["feplb-split@ema"]
    (m(_x(rank, 0).double()) ** 2).mean().backward()
    opts["feplb-split@ema"].step()

    def again():
        if rank == 0:
            m.refresh_replicas()
        m(_x(rank, 1).double())
    res["again"] = error_of(again)
    for m in layers.values():
        m.close()
    return res


def test_loops_from_a_review():
    res = run_dist(_loops_review_worker, W, timeout_s=300, collective_timeout_s=60)
    for r, got in enumerate(res):
        for how in ("clip_value", "scale", "clip_value+place", "clip_norm+place"):
            errors = got[how]["errors"]     # (per step: the balancing layer's, plain EP's)
            for e in errors[0::2]:
                assert e is not None and "changed in place" in e and "Reduce first" in e, (r, how, errors)
            assert errors[1::2] == [None, None], (r, how, errors)
            assert got[how]["diff"] <= 1e-12, (r, how, got[how]["diff"])
        for k in ("frozen0", "frozen1"):
            assert got[k]["diff"] <= 1e-12, (r, k, got[k])
        assert got["data_decay"] <= 1e-12, (r, got["data_decay"])
        assert got["eval_then_frozen"] <= 1e-12, (r, got["eval_then_frozen"])
        first, second = got["unfrozen_scaled"]
        assert first is None and second is not None and "changed in place" in second, (r, got["unfrozen_scaled"])
        for k in [k for k in got if k.startswith("frozen_fwd_bwd")]:
            assert got[k] <= 1e-12, (r, k, got[k])
        assert not got["eval_mode"]["errors"] and got["eval_mode"]["diff"] <= 1e-12, (r, got["eval_mode"])
        assert got["closure"] <= 1e-12, (r, got["closure"])
        assert got["lbfgs"] <= 1e-10, (r, got["lbfgs"])
        again = got["again"]
        assert again is not None and "EP rank(s) [0] in refresh_replicas()" in again and \
            "went on to the next forward" in again, (r, again)
    assert sum(got["clip_value"]["moved"] for got in res) > 0
    assert all(any(got[k]["w2_stepped"] for got in res) for k in ("frozen0", "frozen1"))
    assert len([k for k in res[0] if k.startswith("frozen_fwd_bwd")]) == 3


def _clip_args_worker(rank, world):
    """feplb.clip_grad_norm_ with an argument that differs on one rank: another max_norm would scale every gradient
    there by another factor (the replicated router drifting apart, silently), another norm_type reduce with another
    op and size (the ranks' collectives mismatched). Refused on every rank, nothing clipped; then the same
    arguments clip alike."""
    import torch.distributed as dist

    import feplb

    layer = _layer("feplb-split")
    res = {}
    for case, args in (("max_norm", (0.01 if rank == 2 else 1.0, 2.0)),
                       ("norm_type", (0.01, float("inf") if rank == 2 else 2.0)),
                       ("error_if_nonfinite", (0.01, 2.0, rank == 2))):
        layer(_x(rank, 0)).sum().backward()
        dist.all_reduce(layer.router.weight.grad)     # (DDP's averaging of the replicated router, as a sum)
        before = layer.router.weight.grad.clone()
        res[case] = error_of(lambda a=args: feplb.clip_grad_norm_(layer, *a[:2], error_if_nonfinite=a[2:] == (True,)))
        res[case + "_kept"] = torch.equal(layer.router.weight.grad, before)
        layer.zero_grad()
    layer(_x(rank, 1)).sum().backward()
    dist.all_reduce(layer.router.weight.grad)
    res["norm"] = float(feplb.clip_grad_norm_(layer, 0.01))
    res["router_grad"] = layer.router.weight.grad.clone()
    layer.close()
    # another part of the model on one rank: rank 2 clips one of two layers where the others clip both (its norm
    # then counted only that layer's gradients, and the other layer's stayed unclipped there, silently; under
    # per-step copies the norms' collectives differed in size, and gloo aborted rank 2's process)
    for policy, weights in (("feplb-split", "per-microbatch"), ("feplb-split@ema", "per-step")):
        model = torch.nn.Sequential(_layer(policy, weights=weights), _layer(policy, weights=weights))
        model(_x(rank, 2)).sum().backward()
        for m in model:
            dist.all_reduce(m.router.weight.grad)
        before = [p.grad.clone() for p in model.parameters()]
        res["part", policy] = error_of(lambda m=model: feplb.clip_grad_norm_(m[0] if rank == 2 else m, 0.01))
        res["part", policy, "kept"] = all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before,
                                                                              strict=True))
        for m in model:
            m.close()
    return res


def test_clip_arguments_differing_on_one_rank():
    res = run_dist(_clip_args_worker, W, timeout_s=180, collective_timeout_s=60)
    for rank, r in enumerate(res):
        for case in ("max_norm", "norm_type", "error_if_nonfinite"):
            assert r[case] is not None and r[case].startswith("ValueError") and "clip_grad_norm_'s arguments" in \
                r[case] and "differs across ranks" in r[case], (rank, case, r[case])
            assert r[case + "_kept"], (rank, case)
        assert r["norm"] == res[0]["norm"] and torch.equal(r["router_grad"], res[0]["router_grad"]), rank
        for policy in ("feplb-split", "feplb-split@ema"):
            err = r["part", policy]
            assert err is not None and err.startswith("ValueError") and "the part of the model" in err and \
                "[[0, 1, 3], [2]]" in err, (rank, policy, err)
            assert r["part", policy, "kept"], (rank, policy)


def _average_args_worker(rank, world):
    """average_expert_grads with arguments that differ on one rank: divide=False there would leave that rank's
    experts' gradients at another scale than the others', silently, under plain EP too; a data-parallel group given
    on two ranks alone (of ranks of the EP group itself) would sum other experts' gradients there. Refused on every
    rank, nothing divided; then the same arguments divide alike. (Under EP x DP each EP rank passes a group of other
    ranks: what must agree is its size.)"""
    import torch.distributed as dist

    from feplb.dropin import average_expert_grads, reduce_replica_grads

    pair = dist.new_group([2, 3])   # (collective: every rank makes it)
    res = {}
    for policy in ("none", "feplb-split"):
        layer = _layer(policy)
        for case, kw in (("divide", {"divide": rank != 2}),
                         ("group", {"data_parallel_group": pair if rank >= 2 else None})):
            layer(_x(rank, 0)).sum().backward()
            reduce_replica_grads(layer)
            before = [p.grad.clone() for p in layer.expert_params()]
            res[policy, case] = error_of(lambda kw=kw, m=layer: average_expert_grads(m, **kw))
            res[policy, case, "kept"] = all(torch.equal(p.grad, b) for p, b in zip(layer.expert_params(), before,
                                                                                     strict=True))
            layer.zero_grad()
        layer(_x(rank, 1)).sum().backward()
        reduce_replica_grads(layer)
        before = [p.grad.clone() for p in layer.expert_params()]
        average_expert_grads(layer)
        res[policy, "divided"] = all(torch.equal(p.grad, b / world) for p, b in zip(layer.expert_params(), before,
                                                                                     strict=True))
        layer.close()
    return res


def _epdp_replicas_apart_worker(rank, world):
    """EP x DP (EP groups {0, 1}, {2, 3}; data-parallel groups {0, 2}, {1, 3}): the per-step calls compared over
    the EP group only let the replicas part silently where they differ across it: divide=False in one replica (its
    experts summed, the other's averaged), experts frozen in one replica (its w2 summed with the other's w1, and the
    other replica left waiting), another max_norm in one replica, or clipping before averaging (each replica its own
    norm). Each refused on every rank, nothing summed or clipped; the same calls in order clip alike, in fp64 for an
    fp64 model."""
    import torch.distributed as dist

    import feplb
    from feplb import FEPLBConfig, MoELayer
    from feplb.dropin import average_expert_grads

    eps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep, dp = eps[rank // 2], dps[rank % 2]
    second = rank >= 2       # (the second replica)
    router, w1, w2 = _weights()
    res = {}
    # the first replica builds a layer more first: the layers' ids (agreed within each EP group) differ between the
    # replicas, which compare their calls all the same
    MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=2), group=ep).close() \
        if not second else None
    for policy in ("none", "feplb-split"):
        layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=2, dyn=2, policy=policy,
                                     min_straggler_rows=0, min_chunk=2, plan_wait_ms=60_000.0, dtype=torch.float64),
                         group=ep)
        load_global_weights(layer, router.double(), w1.double(), w2.double())

        def backward(step, freeze=False, m=layer):
            m.w1.requires_grad_(not freeze)
            m.zero_grad()
            m(_x(rank, step).double()).pow(2).mean().backward()
            dist.all_reduce(m.router.weight.grad)            # DDP over all four ranks (a sum)
            m.w1.requires_grad_(True)
            return [None if p.grad is None else p.grad.clone() for p in m.expert_params()]

        def kept(before, m=layer):
            return all((p.grad is None) == (b is None) and (b is None or torch.equal(p.grad, b))
                       for p, b in zip(m.expert_params(), before, strict=True))

        before = backward(0)
        res[policy, "divide"] = error_of(lambda m=layer: average_expert_grads(m, dp, divide=not second))
        before = backward(1, freeze=second)
        res[policy, "frozen"] = error_of(lambda m=layer: average_expert_grads(m, dp))
        res[policy, "frozen_kept"] = kept(before)
        backward(2)
        average_expert_grads(layer, dp)
        router_grad = layer.router.weight.grad.clone()
        res[policy, "clip_args"] = error_of(lambda m=layer: feplb.clip_grad_norm_(m, 0.02 if second else 0.01))
        res[policy, "clip_args_kept"] = torch.equal(layer.router.weight.grad, router_grad)
        backward(3)
        router_grad = layer.router.weight.grad.clone()
        res[policy, "clip_first"] = error_of(lambda m=layer: feplb.clip_grad_norm_(m, 0.01))
        res[policy, "clip_first_kept"] = torch.equal(layer.router.weight.grad, router_grad)
        average_expert_grads(layer, dp)
        # a step of an optimizer not attached, its gradients zeroed in place (the same tensors), and the next backward:
        # not taken for averaged ones
        opt = torch.optim.SGD(layer.parameters(), lr=0.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        layer(_x(rank, 4).double()).pow(2).mean().backward()
        dist.all_reduce(layer.router.weight.grad)
        res[policy, "clip_in_place"] = error_of(lambda m=layer: feplb.clip_grad_norm_(m, 0.01))
        average_expert_grads(layer, dp)
        norm = feplb.clip_grad_norm_(layer, 0.01)
        res[policy, "norm"] = (norm.dtype, float(norm))
        res[policy, "router_grad"] = layer.router.weight.grad.clone()
        if policy == "none":
            # one replica's expert gradients in Megatron DDP's buffers (main_grad, .grad None): refused there, and
            # the other replica raises with it at once (the handshake reaches the EP group only)
            import time

            for call in ("average", "clip"):
                backward(10)
                if call == "clip":
                    average_expert_grads(layer, dp)
                if not second:
                    for p in layer.expert_params():
                        p.main_grad, p.grad = p.grad.clone(), None
                t0 = time.perf_counter()
                res["buffers", call] = error_of(lambda c=call, m=layer: average_expert_grads(m, dp) if c == "average"
                                                else feplb.clip_grad_norm_(m, 0.01))
                res["buffers", call, "s"] = time.perf_counter() - t0
                for p in layer.expert_params():
                    p.__dict__.pop("main_grad", None)
        layer.close()
    return res


def _epdp_one_replica_refuses_worker(rank, world):
    """EP x DP with per-step copies; one replica's reduction of the copies' gradients refuses (its experts' gradients
    scaled in place before it): that replica raises its own error, the other one names it, both before any sum over
    the data-parallel group (the other replica waited in that sum until the timeout)."""
    import torch.distributed as dist

    from feplb import FEPLBConfig, MoELayer
    from feplb.dropin import attach_optimizer, average_expert_grads

    eps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep, dp = eps[rank // 2], dps[rank % 2]
    layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=2, dyn=2,
                                 policy="feplb-split@ema", refresh_every=1, min_straggler_rows=0, min_chunk=2,
                                 plan_wait_ms=60_000.0), group=ep)
    load_global_weights(layer, *_weights())
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    attach_optimizer(layer, opt)
    for step in range(2):
        layer(_x(rank, step)).pow(2).mean().backward()
        average_expert_grads(layer, dp)
        opt.step()
        opt.zero_grad()
    layer(_x(rank, 5)).pow(2).mean().backward()
    held = layer.replicas.all_pairs() != ()
    if rank < 2:
        layer.w1.grad.mul_(0.5)      # the loop's mistake, in the first replica only
    err = error_of(lambda: average_expert_grads(layer, dp))
    layer.close()
    return {"held": held, "err": err}


def test_epdp_one_replica_refusing_stops_every_replica():
    res = run_dist(_epdp_one_replica_refuses_worker, W, timeout_s=180, collective_timeout_s=60)
    for rank, r in enumerate(res):
        err = r["err"]
        assert r["held"], rank
        if rank < 2:
            assert err is not None and "reduce_replica_grads: on some EP rank the experts' gradients were changed " \
                "in place" in err, (rank, err)
        else:
            assert err == (f"RuntimeError: MoELayer.average_expert_grads: the replica of global rank(s) [{rank - 2}] "
                           "refused the call (its error says why; the replica gradients' reduction, say); nothing "
                           "was summed, on any rank"), (rank, err)


def test_epdp_replicas_calls_apart_are_refused():
    res = run_dist(_epdp_replicas_apart_worker, W, timeout_s=180, collective_timeout_s=60)
    for rank, r in enumerate(res):
        for policy in ("none", "feplb-split"):
            err = r[policy, "divide"]
            assert err is not None and err.startswith("ValueError") and "replicas of these experts) differ" in err \
                and "divide=False" in err, (rank, policy, err)
            err = r[policy, "frozen"]
            assert err is not None and err.startswith("ValueError") and "gradients of [w2]" in err and \
                "gradients of [w1, w2]" in err, (rank, policy, err)
            assert r[policy, "frozen_kept"], (rank, policy)
            err = r[policy, "clip_args"]
            assert err is not None and err.startswith("ValueError") and "replicas of the experts passed other " \
                "arguments" in err, (rank, policy, err)
            assert r[policy, "clip_args_kept"], (rank, policy)
            err = r[policy, "clip_first"]
            assert err is not None and err.startswith("RuntimeError") and "not averaged over the data-parallel " \
                "group yet" in err, (rank, policy, err)
            assert r[policy, "clip_first_kept"], (rank, policy)
            err = r[policy, "clip_in_place"]
            assert err is not None and "not averaged over the data-parallel group yet" in err, (rank, policy, err)
            assert r[policy, "norm"][0] == torch.float64 and r[policy, "norm"] == res[0][policy, "norm"], \
                (rank, policy, r[policy, "norm"])
            assert torch.equal(r[policy, "router_grad"], res[0][policy, "router_grad"]), (rank, policy)
        for call, other in (("average", f"the replica of global rank(s) [{rank % 2}] refused the call"),
                            ("clip", "clip_grad_norm_: the data-parallel replicas of the experts passed other "
                                     "arguments")):
            err = r["buffers", call]
            mine = "Megatron DDP's buffers (main_grad" if call == "average" and rank < 2 else other
            assert err is not None and mine in err, (rank, call, err)
            assert r["buffers", call, "s"] < 4.0, (rank, call, r["buffers", call, "s"])     # at once, not a timeout


def _average_some_layers_worker(rank, world, policy, weights):
    """Two layers over one group; rank 1 averages the first layer's expert gradients only, the others both. Each
    per-layer call handshakes once per round, so that went unseen there; the step's gradients then differ in scale on
    rank 1 (4x in the second layer), and the next forward must refuse on every rank (it trained on silently). The
    same loop with every rank averaging both runs."""
    model = torch.nn.Sequential(_layer(policy, weights=weights), _layer(policy, weights=weights))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res = {}
    for case in ("all", "one left out"):
        model(_x(rank, 0)).sum().backward()
        for m in model if case == "all" or rank != 1 else model[:1]:
            m.average_expert_grads()
        opt.step()
        opt.zero_grad()
        for m in model:
            m.refresh_replicas()
        res[case] = error_of(lambda: model(_x(rank, 1)))
    for m in model:
        m.close()
    return res


@pytest.mark.parametrize("policy,weights", [("none", "per-step"), ("feplb-split", "per-microbatch")])
def test_a_layer_left_out_of_average_expert_grads_on_one_rank_is_refused(policy, weights):
    res = run_dist(_average_some_layers_worker, W, policy, weights, timeout_s=180, collective_timeout_s=60)
    for rank, r in enumerate(res):
        assert r["all"] is None, (rank, r["all"])
        err = r["one left out"]
        assert err is not None and err.startswith("RuntimeError") and "made different per-layer calls" in err and \
            "[[0, 2, 3], [1]]" in err, (rank, err)


def test_average_arguments_differing_on_one_rank():
    res = run_dist(_average_args_worker, W, timeout_s=180, collective_timeout_s=60)
    for rank, r in enumerate(res):
        for policy in ("none", "feplb-split"):
            for case in ("divide", "group"):
                err = r[policy, case]
                if case == "divide":
                    assert err is not None and err.startswith("ValueError") and "average_expert_grads()'s " \
                        "arguments" in err and "differs across ranks" in err and "[[0, 1, 3], [2]]" in err, \
                        (rank, policy, case, err)
                else:   # (a group of ranks of the EP group itself: named as such, not as a size that differs)
                    assert err is not None and err.startswith("ValueError") and "given on EP rank(s) [2, 3] " \
                        "cannot be theirs" in err and "differs across ranks" not in err, (rank, policy, case, err)
                assert r[policy, case, "kept"], (rank, policy, case)
            assert r[policy, "divided"], (rank, policy)


def _frozen_then_average_worker(rank, world):
    """An optimizer attached with average_required while the experts are frozen (PEFT's LoRA on other modules):
    attaching works (torch refuses a gradient hook on a parameter that requires none); once the experts are
    unfrozen, a backward after average_expert_grads (its share left summed) is still refused at the step, on every
    rank, and a step in the right order trains as the same loop on plain EP."""
    from feplb.dropin import attach_optimizer, average_expert_grads

    res = {}
    for policy in ("none", "feplb-split@ema"):
        layer = _layer(policy, weights="per-step") if "@" in policy else _layer(policy)
        for p in layer.expert_params():
            p.requires_grad_(False)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        res[policy, "attach"] = error_of(lambda m=layer, o=opt: attach_optimizer(m, o, average_required=True))
        for p in layer.expert_params():
            p.requires_grad_(True)
        layer(_x(rank, 0)).sum().backward()
        average_expert_grads(layer)
        layer(_x(rank, 1)).sum().backward()          # after the average: its share stays summed
        before = [p.detach().clone() for p in layer.expert_params()]
        res[policy, "late"] = error_of(opt.step)
        res[policy, "kept"] = all(torch.equal(p, b) for p, b in zip(layer.expert_params(), before, strict=True))
        opt.zero_grad()
        layer(_x(rank, 2)).sum().backward()
        average_expert_grads(layer)
        opt.step()
        res[policy, "w"] = [p.detach().clone() for p in layer.expert_params()]
        layer.close()
    return res


def test_experts_unfrozen_after_attach_keep_the_average_check():
    res = run_dist(_frozen_then_average_worker, W, timeout_s=180, collective_timeout_s=60)
    for rank, r in enumerate(res):
        for policy in ("none", "feplb-split@ema"):
            assert r[policy, "attach"] is None, (rank, policy, r[policy, "attach"])
            late = r[policy, "late"]
            assert late is not None and late.startswith("RuntimeError") and "are not averaged" in late, \
                (rank, policy, late)
            assert r[policy, "kept"], (rank, policy)
            for a, b in zip(r["feplb-split@ema", "w"], r["none", "w"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _unfrozen_mid_step_worker(rank, world, policy, kw, variant):
    """w2 frozen for the step's first micro-batches and unfrozen before a later one ("zeroed": its gradient zeroed
    in place before (an attached optimizer's zero_grad(set_to_none=False) discarding a backward; the model's after a
    step): trains as plain EP. Before, the note of w2's last accumulation (an earlier backward, whose tensor the
    zero_grad wrote since) was taken for a gradient changed in place while the copies held a share, and the forward
    after the unfreeze was refused on every rank. "frozen_all_along": w2 never had a gradient, see below."""
    layers = {p: _layer(p, dtype=torch.float64, **(kw if p != "none" else {})) for p in (policy, "none")}
    errors = []
    for m in layers.values():
        opt = torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.5)
        m.attach_optimizer(opt)
        with torch.no_grad():
            m(_x(rank, 99).double())
        m.refresh_replicas()

        def frozen_all_along(m=m, opt=opt):
            # no zero_grad at all: w2 frozen from the first backward on, w1 between the next forward and its
            # backward, w2 unfrozen: its gradient is None as plain EP's (before, taken for dropped under any policy
            # with per-step copies, all of the parameters trained then having none)
            y = m(_x(rank, 0).double())
            m.w2.requires_grad_(False)
            (y ** 2).mean().backward()
            opt.step()
            y = m(_x(rank, 1).double())
            m.w1.requires_grad_(False)
            (y ** 2).mean().backward()
            m.w2.requires_grad_(True)
            (m(_x(rank, 2).double()) ** 2).mean().backward()
            opt.step()

        def loop(m=m, opt=opt):
            if variant == "frozen_all_along":
                return frozen_all_along()
            (m(_x(rank, 0).double()) ** 2).mean().backward()
            y = m(_x(rank, 1).double())
            m.w2.requires_grad_(False)                       # frozen between a forward and its backward
            (y ** 2).mean().backward()
            opt.zero_grad(set_to_none=False)                 # a discarded accumulation (attached: the copies too)
            for step in range(2):
                (m(_x(rank, 10 * step + 2).double()) ** 2).mean().backward()    # w2 frozen
                m.w2.requires_grad_(True)                    # unfrozen between the micro-batches
                (m(_x(rank, 10 * step + 3).double()) ** 2).mean().backward()
                opt.step()
                torch.nn.ModuleList([m]).zero_grad(set_to_none=False)       # the model's, after the step
                m.w2.requires_grad_(False)
        errors.append(error_of(loop))
    a, b = layers.values()
    diff = max((getattr(a, n) - getattr(b, n)).abs().max().item() for n in ("w1", "w2"))
    moved = a.last_stats.rows_moved
    for m in layers.values():
        m.close()
    return errors, diff, moved


@pytest.mark.parametrize("variant", ["zeroed", "frozen_all_along"])
@pytest.mark.parametrize("policy,kw", [("feplb-split@ema", {}), ("feplb@ema", {"replicas": "lazy"}),
                                       ("feplb-split+place", {})])
def test_unfrozen_between_micro_batches(policy, kw, variant):
    res = run_dist(_unfrozen_mid_step_worker, W, policy, kw, variant, timeout_s=240, collective_timeout_s=60)
    for r, (errors, diff, _) in enumerate(res):
        assert errors == [None, None], (r, errors)
        assert diff <= 1e-12, (r, diff)


def _refresh_mid_step_worker(rank, world):
    """refresh_replicas() while the per-step copies hold a backward's share: between the micro-batches of a step,
    and after a backward the loop discarded with the model's zero_grad. Refused on every rank, the message naming
    both ways out (before, it asked only for reduce_replica_grads() before optimizer.step(), which fits neither)."""
    res = {}
    for case in ("between", "discarded"):
        layer = _layer("feplb-split@ema")
        with torch.no_grad():
            layer(_x(rank, 99))
        layer.refresh_replicas()
        layer(_x(rank, 0)).pow(2).mean().backward()
        if case == "discarded":
            torch.nn.ModuleList([layer]).zero_grad()
        res[case] = error_of(layer.refresh_replicas)
        layer.close()
    return res


def test_refresh_between_micro_batches_names_the_way_out():
    res = run_dist(_refresh_mid_step_worker, W, timeout_s=120, collective_timeout_s=60)
    for r, got in enumerate(res):
        for case, err in got.items():
            assert err is not None and "not between the micro-batches of a step" in err and \
                "zero_replica_grads()" in err and "run that step again from its backward" in err, (r, case, err)


def _epdp_unscale_first_worker(rank, world):
    """EP x DP (EP groups {0, 1}, {2, 3}; data-parallel groups {0, 2}, {1, 3}) with an attached GradScaler, the loop
    unscaling before ``average_expert_grads`` (a clipping loop: backward, ``scaler.unscale_``, average, clip, step).
    An overflow in rank 0's expert gradients is agreed over its EP group by the unscale, and reaches rank 2 only in
    the average's sum over the data-parallel group, after rank 2's scaler found its gradients finite: EP group
    {2, 3} stepped inf into its experts and kept its scale while {0, 1} skipped, the replicas silently apart."""
    import torch.distributed as dist

    from feplb import FEPLBConfig, MoELayer

    eps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep, dp = eps[rank // 2], dps[rank % 2]
    gen = torch.Generator().manual_seed(3)
    router = torch.randn(E, H, generator=gen) / H ** 0.5
    w1 = torch.randn(E, H, 2 * FF, generator=gen) / H ** 0.5
    w2 = torch.randn(E, FF, H, generator=gen) / FF ** 0.5
    res = {}
    for policy in ("none", "feplb-split@ema"):
        for order in ("unscale_first", "average_first"):
            layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=2, dyn=2,
                                         policy=policy, min_straggler_rows=0, min_chunk=2, plan_wait_ms=60_000.0),
                             group=ep)
            load_global_weights(layer, router, w1, w2)
            opt = torch.optim.SGD(layer.parameters(), lr=0.1)
            scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
            layer.attach_optimizer(opt, scaler=scaler)
            before = [p.detach().clone() for p in layer.parameters()]
            scaler.scale(layer(_x(rank, 0)).pow(2).mean()).backward()
            dist.all_reduce(layer.router.weight.grad)      # DDP over all four ranks
            layer.router.weight.grad.div_(world)
            layer.reduce_replica_grads()
            if rank == 0:
                layer.w1.grad.view(-1)[0] = float("inf")   # an overflow in rank 0's experts alone
            if order == "unscale_first":
                scaler.unscale_(opt)
                layer.average_expert_grads(dp)
            else:
                layer.average_expert_grads(dp)
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            res[policy, order] = (scaler.get_scale(), all(torch.equal(p, b) for p, b in
                                                          zip(layer.parameters(), before, strict=True)))
            layer.close()
    return res


def test_epdp_scaler_unscaled_before_average():
    res = run_dist(_epdp_unscale_first_worker, W, timeout_s=180, collective_timeout_s=60)
    for rank, r in enumerate(res):
        for key, (scale, kept) in r.items():
            assert scale == 128.0 and kept, (rank, key, scale, kept)   # skipped on every rank of both replicas


def _unscale_before_reduce_worker(rank, world):
    """A GradScaler not attached (the optimizer neither), the loop unscaling before ``reduce_replica_grads``: the
    owners' gradients divided by the scale in place, the per-step copies' share still scaled. The scaler's fused
    unscale kernel left the gradients' version counters alone, so the reduction's refusal of gradients changed in
    place missed it and added the copies' share at 256 times its size, silently; a ``grad.mul_`` of the same factor
    was refused. Both are refused now, on every rank."""
    from feplb.testing import error_of

    res = {}
    for how in ("unscale_", "mul_"):
        layer = _layer("feplb-split@ema", weights="per-step")
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        errs = []
        for step in range(2):
            scaler.scale(layer(_x(rank, step)).pow(2).mean()).backward()
            if how == "unscale_":
                scaler.unscale_(opt)
            else:
                for p in layer.parameters():
                    if p.grad is not None:
                        p.grad.mul_(1 / 256.0)
            err = error_of(layer.reduce_replica_grads)
            errs.append(err)
            if err:
                break
            if how == "unscale_":
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            layer.refresh_replicas()
            opt.zero_grad()
            layer.zero_replica_grads()
        res[how] = errs
        layer.close()
    return res


def test_unattached_scaler_unscaling_before_the_reduction_is_refused():
    res = run_dist(_unscale_before_reduce_worker, W, timeout_s=180, collective_timeout_s=60)
    for rank, r in enumerate(res):
        for how in ("unscale_", "mul_"):
            err = r[how][-1]
            assert err is not None and "changed in place" in err, (rank, how, r[how])


def _lazy_first_step_scaled_worker(rank, world):
    """Lazy replicas (``feplb@ema``, ``replicas="lazy"``) on a fresh layer: the first copies are held inside the
    step's first forward, whose start found none held and watched no accumulation, so the backward's gradients were
    never noted and an in-place change before the reduction (a scaling, torch's clipping) went through, the copies'
    share added unchanged, silently. Refused on every rank, as from the second step on."""
    from feplb.testing import error_of

    layer = _layer("feplb@ema", weights="per-step", replicas="lazy")
    layer(_x(rank, 0)).pow(2).mean().backward()
    held = bool(layer.replicas.ever_held)
    for p in layer.expert_params():
        p.grad.mul_(0.5)
    err = error_of(layer.reduce_replica_grads)
    layer.close()
    return held, err


def test_lazy_replicas_first_step_in_place_change_is_refused():
    res = run_dist(_lazy_first_step_scaled_worker, W, timeout_s=180, collective_timeout_s=60)
    assert any(held for held, _ in res), res     # a plan copied lazily: there is a share to refuse
    for rank, (_, err) in enumerate(res):
        assert err is not None and "changed in place" in err, (rank, err)


def _frozen_apart_worker(rank, world):
    """Expert parameters frozen on some ranks only ("one": rank 1's w2, "freeze experts 2 and 3", which live there;
    "node": ranks 2 and 3's, node 1's). A per-step copy of another rank's expert takes its holder's requires_grad
    flags, so rank 1's copies of GPU 0's hot experts made no gradient, and their owner's w2 gradient silently lacked
    rank 1's share. Now a forward of a layer that keeps per-step copies across the frozen boundary (eager and lazy
    @ema replicas inside a node, EPLB's replicas and a +place bank across nodes) is refused on every rank, with
    autograd or without (a reentrant checkpoint's forward runs without it); once the ranks freeze alike the layer
    trains as plain EP. Layers without such copies train as plain EP, frozen apart: in-node @ema copies with whole
    nodes frozen, fastermoe (which keeps none), per-micro-batch weights (whose copies return their gradients
    to the owners as they are)."""
    from torch.utils.checkpoint import checkpoint

    frozen = {"one": rank == 1, "node": rank >= 2, "alike": False}
    res = {}

    def grads(m, x):
        y = m(x)
        (y ** 2).mean().backward()
        m.reduce_replica_grads()
        return [None if p.grad is None else p.grad.clone() for p in (m.w1, m.w2)], m.last_stats.rows_moved

    x = _x(rank, 0).double()
    for case in frozen:
        base = _layer("none", dtype=torch.float64)
        base.w2.requires_grad_(not frozen[case])
        res["none", case] = grads(base, x)[0]
        base.close()
    for policy, kw, case, refused in (
            ("feplb-split@ema", {}, "one", True), ("feplb@ema", {"replicas": "lazy"}, "one", True),
            ("eplb", {}, "one", True), ("feplb-split+place", {}, "one", True), ("eplb", {}, "node", True),
            ("feplb-split@ema", {}, "node", False), ("fastermoe", {}, "one", False),
            ("feplb-split", {"weights": "per-microbatch"}, "one", False)):
        m = _layer(policy, dtype=torch.float64, **kw)
        with torch.no_grad():
            m(_x(rank, 99).double())            # the history
        m.refresh_replicas()
        m.w2.requires_grad_(not frozen[case])
        if refused:
            res[policy, case, "refused"] = error_of(lambda m=m: m(x))
            res[policy, case, "refused without autograd"] = error_of(
                lambda m=m: checkpoint(m, x.clone().requires_grad_(), use_reentrant=True))
            m.w2.requires_grad_(True)           # frozen alike (none): trains as plain EP
            case = "alike"
        res[policy, case] = grads(m, x)
        m.close()
    return res


def test_experts_frozen_on_some_ranks_only():
    res = run_dist(_frozen_apart_worker, W, timeout_s=240, collective_timeout_s=60)
    for rank, r in enumerate(res):
        for policy, case in (("feplb-split@ema", "one"), ("feplb@ema", "one"), ("eplb", "one"),
                             ("feplb-split+place", "one"), ("eplb", "node")):
            # (the in-node policies' copies stay in their node: its ranks are compared, the others' across nodes)
            groups = {("one", True): "EP ranks [0, 1] grouped by their experts' requires_grad flags: [[0], [1]]",
                      ("one", False): "EP ranks [0, 1, 2, 3] grouped by their experts' requires_grad flags: "
                                      "[[0, 2, 3], [1]]",
                      ("node", False): "EP ranks [0, 1, 2, 3] grouped by their experts' requires_grad flags: "
                                       "[[0, 1], [2, 3]]"}[case, "@ema" in policy]
            for how in ("refused", "refused without autograd"):
                err = r[policy, case, how]
                assert err is not None and err.startswith("RuntimeError") and "differ in which of them require " \
                    "grad" in err and groups in err and "weights='per-microbatch'" in err, (rank, policy, case, err)
        trained = [(p, "alike") for p in ("feplb-split@ema", "feplb@ema", "eplb", "feplb-split+place")] + \
            [("feplb-split@ema", "node"), ("fastermoe", "one"), ("feplb-split", "one")]
        for policy, case in trained:
            got, _ = r[policy, case]
            if policy != "fastermoe":
                assert sum(x[policy, case][1] for x in res) > 0, (policy, case, "rows must move")
            for name, a, b in zip(("w1", "w2"), got, r["none", case], strict=True):
                assert (a is None) == (b is None), (rank, policy, case, name)
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"{rank} {policy} {case} {name}")


def _frozen_between_worker(rank, world):
    """Experts frozen between a forward and its backward on some ranks only: the copies' gradient hook masks with its
    holder's flags at the backward, so a rank freezing alone lost its copies' share of that backward. The reduction
    now agrees the flags every rank noted at each backward, over the ranks sharing copies (a node's for the in-node
    policies' @ema copies, the group's for eplb), and refuses on every rank, nothing reduced; after the step's
    gradients are discarded the layer trains as plain EP. Frozen alike (all ranks, or a whole node under in-node
    copies): trains as plain EP frozen the same way."""
    cases = {"one": rank == 1, "node": rank >= 2, "all": True, "none": False}
    x = _x(rank, 0).double()

    def step(m, freeze):
        y = m(x)
        m.w2.requires_grad_(not freeze)           # frozen between the forward and its backward
        (y ** 2).mean().backward()
        err = error_of(m.reduce_replica_grads)
        m.w2.requires_grad_(True)
        return err, [None if p.grad is None else p.grad.clone() for p in (m.w1, m.w2)], m.last_stats.rows_moved

    res = {}
    for case in ("node", "all", "none"):
        base = _layer("none", dtype=torch.float64)
        res["none", case] = step(base, cases[case])[1]
        base.close()
    for policy, case in (("feplb-split@ema", "one"), ("eplb", "one"), ("feplb-split@ema", "node"),
                         ("feplb-split@ema", "all")):
        m = _layer(policy, dtype=torch.float64)
        with torch.no_grad():
            m(_x(rank, 99).double())            # the history
        m.refresh_replicas()
        res[policy, case] = step(m, cases[case])
        if case == "one":                       # discarded, then again frozen alike (not at all)
            m.zero_grad()
            res[policy, case, "again"] = step(m, False)
        m.close()
    # a reduction with nothing to reduce (the input's gradient only), then a rank's own zero_replica_grads(), which is
    # local: the next step is not refused (each reduction starts the comparison afresh on every rank)
    m = _layer("feplb-split@ema", dtype=torch.float64)
    with torch.no_grad():
        m(_x(rank, 99).double())
    m.refresh_replicas()
    xg = x.clone().requires_grad_()
    torch.autograd.grad((m(xg) ** 2).mean(), xg)
    m.reduce_replica_grads()
    if rank == 0:
        m.zero_replica_grads()
    res["feplb-split@ema", "local zero"] = step(m, False)
    m.close()
    return res


def test_experts_frozen_between_forward_and_backward_on_some_ranks_only():
    res = run_dist(_frozen_between_worker, W, timeout_s=240, collective_timeout_s=60)
    for rank, r in enumerate(res):
        for policy, ranks in (("feplb-split@ema", [0, 1]), ("eplb", [0, 1, 2, 3])):
            err = r[policy, "one"][0]
            assert err is not None and err.startswith("RuntimeError") and f"EP ranks {ranks} differed in which" \
                in err and "Nothing was reduced" in err, (rank, policy, err)
        for key, want in ((("feplb-split@ema", "one", "again"), "none"), (("eplb", "one", "again"), "none"),
                          (("feplb-split@ema", "node"), "node"), (("feplb-split@ema", "all"), "all"),
                          (("feplb-split@ema", "local zero"), "none")):
            err, got, _ = r[key]
            assert err is None, (rank, key, err)
            assert sum(x[key][2] for x in res) > 0, (key, "rows must move")
            for name, a, b in zip(("w1", "w2"), got, r["none", want], strict=True):
                assert (a is None) == (b is None), (rank, key, name)
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"{rank} {key} {name}")


_ORDERS = ("unfrozen before the step", "unfrozen before the backward", "frozen for the second forward",
           "unfrozen for the second forward", "frozen for both backwards", "reentrant checkpoint unfrozen")


def _flag_orders_worker(rank, world, policy, kw):
    """w2's requires_grad flag changed between a forward and its backward, or between the forwards of two
    micro-batches before their backwards (a pipelined order), on every rank alike, each order trained for a step
    and followed by a plain one, with SGD with momentum attached, against plain EP run the same way. Plain EP's
    graph takes a parameter with its flag at the forward, and its backward skips one frozen since: the per-step
    copies' share must follow both (before, a copy took the flag of the last forward, and its share of an earlier
    micro-batch was lost: off by up to 0.29), and a parameter no backward trained keeps no gradient (before, it got
    a zero one, which momentum then stepped)."""
    from torch.utils.checkpoint import checkpoint

    def xs(step):
        return _x(rank, step).double(), _x(rank, step + 50).double()

    def run(m, order):
        x1, x2 = xs(0)
        w2 = m.w2
        if order == "unfrozen before the step":
            w2.requires_grad_(False)
            (m(x1) ** 2).mean().backward()
            w2.requires_grad_(True)
        elif order == "unfrozen before the backward":
            w2.requires_grad_(False)
            y = m(x1)
            w2.requires_grad_(True)
            (y ** 2).mean().backward()
        elif order == "frozen for the second forward":
            y1 = m(x1)
            w2.requires_grad_(False)
            y2 = m(x2)
            w2.requires_grad_(True)
            (y1 ** 2).mean().backward()
            (y2 ** 2).mean().backward()
        elif order == "unfrozen for the second forward":
            w2.requires_grad_(False)
            y1 = m(x1)
            w2.requires_grad_(True)
            y2 = m(x2)
            (y1 ** 2 + y2).mean().backward()      # (one backward through both micro-batches)
        elif order == "frozen for both backwards":
            y1 = m(x1)
            w2.requires_grad_(False)
            y2 = m(x2)
            (y1 ** 2).mean().backward()
            (y2 ** 2).mean().backward()
            w2.requires_grad_(True)
        else:
            w2.requires_grad_(False)
            y = checkpoint(m, x1.clone().requires_grad_(), use_reentrant=True)
            w2.requires_grad_(True)
            (y ** 2).mean().backward()
        grads = [None if p.grad is None else p.grad.clone() for p in (m.w1, m.w2)]
        return grads

    res = {}
    for order in _ORDERS:
        out = {}
        for p in (policy, "none"):
            m = _layer(p, dtype=torch.float64, **(kw if p != "none" else {}))
            opt = torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.5)
            m.attach_optimizer(opt)
            with torch.no_grad():
                m(_x(rank, 99).double())        # the history
            m.refresh_replicas()
            run(m, order)
            m.reduce_replica_grads()
            grads = [None if q.grad is None else q.grad.clone() for q in (m.w1, m.w2)]
            moved = m.last_stats.rows_moved
            opt.step()
            opt.zero_grad()
            (m(xs(1)[0]) ** 2).mean().backward()      # a plain step after: momentum carries what the first stepped
            opt.step()
            out[p] = grads, [q.detach().clone() for q in (m.w1, m.w2)], moved
            m.close()
        res[order] = out
    # changed between a non-reentrant checkpoint's forward and its recompute: torch's checkpoint refuses that for any
    # module (the recompute saves other tensors); refused on every rank before the recompute's exchanges, also where
    # only some ranks changed them (before, the ranks that changed them raised, torch's error inside the recompute or
    # ours after its first collective, while the others waited in its exchanges)
    for p in (policy, "none"):
        for frozen_at in ("forward", "backward"):
            for who in _CHANGED_ON:
                changes = rank in _CHANGED_ON[who]
                m = _layer(p, dtype=torch.float64, **(kw if p != "none" else {}))
                with torch.no_grad():
                    m(_x(rank, 99).double())
                m.refresh_replicas()
                m.w2.requires_grad_(frozen_at != "forward")
                y = checkpoint(m, xs(0)[0].requires_grad_(), use_reentrant=False)
                if changes:
                    m.w2.requires_grad_(frozen_at == "forward")
                res[p, "non-reentrant", frozen_at, who] = error_of(lambda y=y: (y ** 2).mean().backward())
                m.close()
    return res


_CHANGED_ON = {"every rank": [0, 1, 2, 3], "rank 1": [1], "node 1": [2, 3]}


@pytest.mark.parametrize("policy,kw", [("feplb-split@ema", {}), ("feplb@ema", {"replicas": "lazy"}), ("eplb", {}),
                                       ("feplb-split+place", {})])
def test_flags_changed_between_forwards_and_backwards_train_as_plain_ep(policy, kw):
    res = run_dist(_flag_orders_worker, W, policy, kw, timeout_s=240, collective_timeout_s=60)
    for order in _ORDERS:
        assert sum(r[order][policy][2] for r in res) > 0, (order, "rows must move")
        for rank, r in enumerate(res):
            (g, w, _), (g0, w0, _) = r[order][policy], r[order]["none"]
            for name, a, b in zip(("w1 grad", "w2 grad", "w1", "w2"), g + w, g0 + w0, strict=True):
                assert (a is None) == (b is None), (rank, order, name, a is None)
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"{rank} {order} {name}")
    for rank, r in enumerate(res):
        for p in (policy, "none"):
            for frozen_at, was, now in (("forward", False, True), ("backward", True, False)):
                for who, ranks in _CHANGED_ON.items():
                    err = r[p, "non-reentrant", frozen_at, who]
                    assert err is not None and err.startswith(
                        "CheckpointError: MoELayer: the experts' requires_grad flags changed between a non-reentrant"
                        f" activation checkpoint's forward and its recompute in this backward, on EP rank(s) {ranks}"
                    ), (rank, p, frozen_at, who, err)
                    here = f"(here: w2 ({was} at the forward, {now} now))"
                    assert (here in err) == (rank in ranks), (rank, p, frozen_at, who, err)


def _old_banks_worker(rank, world):
    """The per-step copies a refresh replaced are freed by it, as the parameters' old values are by an optimizer
    step: the last forward's views of them (``Replicas.view``) are dropped with them (before, they kept the old
    bank until the next forward, two banks held at the refresh's peak)."""
    import gc
    import weakref

    m = _layer("feplb-split@ema", dtype=torch.float64)
    with torch.no_grad():
        m(_x(rank, 99).double())
    m.refresh_replicas()
    (m(_x(rank, 0).double()) ** 2).mean().backward()
    m.reduce_replica_grads()
    banks = [b for b in (m.replicas.replica_bank, m.replicas.slot_bank) if b is not None]
    refs = [weakref.ref(t) for b in banks for t in b]
    del banks
    m.refresh_replicas()
    gc.collect()
    alive = sum(r() is not None for r in refs)
    m.close()
    return len(refs), alive


def test_a_refresh_frees_the_copies_it_replaced():
    res = run_dist(_old_banks_worker, W, timeout_s=120, collective_timeout_s=60)
    assert sum(n for n, _ in res) > 0, res
    assert all(alive == 0 for _, alive in res), res


_GRAD_FREE_CASES = ("nothing trains", "the router trains", "rank 1's tokens need grad")


def _grad_free_worker(rank, world, policy):
    """The expert parameters frozen and the tokens needing no grad, under autograd (frozen experts behind frozen
    layers, an evaluation with grad on), with and without activation checkpointing: where nothing the layer's
    experts read needs grad on any rank, its output needs grad only through the gates (the router), as plain
    torch's would, and no node of the layer's own (its exchanges, anchors, the experts' GEMMs) is in the graph, so
    no backward runs through it (before, the anchors made its output need grad on every rank, and every backward ran
    the layer's exchanges for nothing); where one rank's tokens need grad, every rank keeps the graph (its backward
    exchanges are collective). Outputs and gradients against the dense fp64 reference of this rank's tokens."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from feplb.testing import dense_moe_reference

    def save_all(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE

    router, w1, w2 = (t.double() for t in _weights())
    res = {}
    for case in _GRAD_FREE_CASES:
        for ckpt in ("none", "non-reentrant", "selective"):
            m = _layer(policy, dtype=torch.float64)
            with torch.no_grad():
                m(_x(rank, 99).double())        # the history
            m.refresh_replicas()
            m.w1.requires_grad_(False)
            m.w2.requires_grad_(False)
            m.router.weight.requires_grad_(case != "nothing trains")
            x = _x(rank, 0).double().requires_grad_(case == "rank 1's tokens need grad" and rank == 1)
            dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
            if ckpt == "none":
                y = m(x)
            else:
                y = checkpoint(m, x, use_reentrant=False, context_fn=functools.partial(
                    create_selective_checkpoint_contexts, save_all) if ckpt == "selective" else
                    torch.utils.checkpoint.noop_context_fn)
            nodes, seen, todo = set(), set(), [y.grad_fn]
            while todo:
                fn = todo.pop()
                if fn is not None and fn not in seen:
                    seen.add(fn)
                    nodes.add(type(fn).__name__)
                    todo.extend(f for f, _ in fn.next_functions)
            rx = x.detach().clone().requires_grad_(x.requires_grad)
            rr = router.clone().requires_grad_(m.router.weight.requires_grad)
            ry = dense_moe_reference(rx, rr, w1, w2, K)
            torch.testing.assert_close(y, ry, rtol=1e-9, atol=1e-12, msg=f"{policy} {case} {ckpt} output")
            if y.requires_grad:
                (y * dy).sum().backward()
                (ry * dy).sum().backward()
                for got, want, what in ((m.router.weight.grad, rr.grad, "router"), (x.grad, rx.grad, "x")):
                    assert (got is None) == (want is None), (policy, case, ckpt, what)
                    if want is not None:
                        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12,
                                                   msg=f"{policy} {case} {ckpt} {what} grad")
            res[case, ckpt] = (y.requires_grad, sorted(nodes), m.last_stats.rows_moved,
                               [p.grad is None for p in (m.w1, m.w2)])
            m.close()
    return res


@pytest.mark.parametrize("policy", ["feplb-split", "feplb-split@ema", "eplb", "fastermoe"])
def test_nothing_needing_grad_on_any_rank_makes_no_graph_through_the_layer(policy):
    res = run_dist(_grad_free_worker, W, policy, timeout_s=240, collective_timeout_s=60)
    layer_nodes = ("_Anchor", "_Exchange", "_AllToAllRows", "_JoinFn", "_Gate", "Entered", "_Restricted", "_glu",
                   "grouped_mm")
    for rank, r in enumerate(res):
        for (case, ckpt), (needs, nodes, _, no_expert_grads) in r.items():
            assert needs == (case != "nothing trains"), (rank, case, ckpt, needs)
            ours = [n for n in nodes if any(k.lower() in n.lower() for k in layer_nodes)]
            if case == "rank 1's tokens need grad":
                assert ours, (rank, case, ckpt, "the layer's graph is kept on every rank", nodes)
            else:
                assert not ours, (rank, case, ckpt, "no node of the layer's", ours)
            assert all(no_expert_grads), (rank, case, ckpt)
    for case in _GRAD_FREE_CASES:
        assert sum(r[case, "none"][2] for r in res) > 0, (policy, case, "rows must move")


def _frozen_rank_training_worker(rank, world, policy, weights):
    """ESFT-style fine-tuning: the experts of EP rank 1 (experts 2 and 3) frozen and left out of its optimizer, as
    transformers' Trainer builds it (over the parameters that require grad), for three steps of SGD with momentum;
    then unfrozen and added to it (a parameter group of their own), two steps more. Against the dense fp64
    reference trained alike (every rank's loss a sum over its tokens; each rank's router its own, unreduced). Before,
    the ranks' optimizers had stepped the layer's experts different numbers of times (rank 1's none), and the second
    forward was refused on every rank as a GradScaler's skipped step, even in plain EP (the scalers' skips are
    compared now)."""
    from feplb.testing import dense_moe_reference

    L = E // world
    m = _layer(policy, dtype=torch.float64, weights=weights)
    if rank == 1:
        m.w1.requires_grad_(False)
        m.w2.requires_grad_(False)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.2, momentum=0.5)

    router, w1, w2 = (t.double() for t in _weights())
    routers = [router.clone().requires_grad_() for _ in range(world)]
    w1s = [w1[r * L:(r + 1) * L].clone().requires_grad_(r != 1) for r in range(world)]
    w2s = [w2[r * L:(r + 1) * L].clone().requires_grad_(r != 1) for r in range(world)]
    ref = torch.optim.SGD(routers + [w for w in w1s + w2s if w.requires_grad], lr=0.2, momentum=0.5)
    moved = 0
    for step in range(5):
        if step == 3:
            if rank == 1:
                m.w1.requires_grad_(True)
                m.w2.requires_grad_(True)
                opt.add_param_group({"params": [m.w1, m.w2]})
            w1s[1].requires_grad_(True)
            w2s[1].requires_grad_(True)
            ref.add_param_group({"params": [w1s[1], w2s[1]]})
        (m(_x(rank, step).double()) ** 2).mean().backward()
        m.reduce_replica_grads()
        opt.step()
        opt.zero_grad()
        m.refresh_replicas()
        moved += m.last_stats.rows_moved
        loss = sum((dense_moe_reference(_x(r, step).double(), routers[r], torch.cat(w1s), torch.cat(w2s), K) ** 2)
                   .mean() for r in range(world))
        loss.backward()
        ref.step()
        ref.zero_grad()
    got = [m.router.weight.detach().clone(), m.w1.detach().clone(), m.w2.detach().clone()]
    m.close()
    return got, [routers[rank].detach(), w1s[rank].detach(), w2s[rank].detach()], moved


@pytest.mark.parametrize("policy,weights", [("none", "per-step"), ("feplb-split", "per-microbatch"),
                                            ("feplb-split", "per-step"), ("fastermoe", "per-microbatch")])
def test_experts_frozen_on_one_rank_and_left_out_of_its_optimizer_train(policy, weights):
    res = run_dist(_frozen_rank_training_worker, W, policy, weights, timeout_s=240, collective_timeout_s=60)
    for rank, (got, want, _) in enumerate(res):
        for name, a, b in zip(("router", "w1", "w2"), got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"{policy} {weights} rank {rank} {name}")
    if policy != "none":
        assert sum(r[2] for r in res) > 0, "rows must move"


def _scaled_step(scaler, opts) -> None:
    """One step of every optimizer in ``opts`` through ``scaler``, its update, the gradients zeroed."""
    for opt in opts:
        scaler.step(opt)
    scaler.update()
    for opt in opts:
        opt.zero_grad()


def _frozen_rank_scaler_worker(rank, world, case, fused):
    """A torch.amp.GradScaler not attached, skipping a step on some ranks only while rank 1's experts are frozen:
    left out of its optimizer ("out"), or in it ("in"); the overflow in rank 0's expert gradients, or in rank 1's
    router gradient ("on frozen"), or rank 1's router stepped by an optimizer of its own, its scaler skipping that
    one ("router apart", where rank 1's experts' optimizer steps on). The ranks' loss scales part (rank 1's tokens
    reach the other ranks' experts scaled apart), whatever rank 1 trains: the next forward is refused on every rank,
    as with every rank training. The scalers' skipped steps are compared, not the optimizers' steps of the experts
    (which a rank leaving its frozen experts out of its optimizer, or stepping them with other optimizers, counts
    apart)."""
    m = _layer("none")
    if rank == 1:
        m.w1.requires_grad_(False)
        m.w2.requires_grad_(False)
    aux = torch.ones(1, requires_grad=True)   # (another part of the model, in the loss)
    if case == "router apart":
        opts = [torch.optim.SGD([m.router.weight], lr=0.1, fused=fused),
                torch.optim.SGD([aux] + [p for p in (m.w1, m.w2) if p.requires_grad], lr=0.1, fused=fused)]
    else:
        opts = [torch.optim.SGD([aux] + [p for p in m.parameters() if p.requires_grad or case == "in"], lr=0.1,
                                fused=fused)]
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for step in range(3):
        err = error_of(lambda step=step: scaler.scale((m(_x(rank, step)) ** 2).mean() * aux).backward())
        if err is not None:
            m.close()
            return step, err
        if step == 1 and rank == (1 if case in ("on frozen", "router apart") else 0):
            (m.w1 if case in ("out", "in") else m.router.weight).grad.view(-1)[0] = float("inf")
        _scaled_step(scaler, opts)
    m.close()
    return None, None


@pytest.mark.parametrize("case", ["out", "in", "on frozen", "router apart"])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_scaler_skipping_apart_is_refused_beside_a_frozen_rank(case, fused):
    res = run_dist(_frozen_rank_scaler_worker, W, case, fused, timeout_s=120, collective_timeout_s=60)
    for rank, (step, err) in enumerate(res):
        assert step == 2 and err is not None and "skipped different numbers of optimizer steps" in err, \
            (rank, case, step, err)


def _scaler_scope_worker(rank, world, case):
    """Which GradScalers' skips the layer compares. "probe": rank 0 alone also trains a probe of its own (a linear
    map of the layer's detached output) under a scaler of its own, which skips once: none of the layer's business,
    never refused (before this session's final change, any scaler's skip was counted). "new scale": the layer's
    scaler, not attached, skips on rank 0 only, then every rank sets the scale by hand (update(new_scale=...)): the
    ranks stepped apart all the same, refused at the next forward."""
    m = _layer("none")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    probe = torch.nn.Linear(H, 1)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1)
    probe_scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for step in range(3):
        err = error_of(lambda step=step: m(_x(rank, step)))
        if err is not None:
            m.close()
            return step, err
        y = m(_x(rank, step))
        if case == "probe":
            (y ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            if rank == 0:
                probe_scaler.scale(probe(y.detach()).pow(2).mean()).backward()
                if step == 0:
                    probe.weight.grad.view(-1)[0] = float("inf")
                probe_scaler.step(probe_opt)
                probe_scaler.update()
                probe_opt.zero_grad()
        else:
            scaler.scale((y ** 2).mean()).backward()
            if step == 0 and rank == 0:
                m.w1.grad.view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update(new_scale=256.0)
            opt.zero_grad()
    m.close()
    return None, None


@pytest.mark.parametrize("case", ["probe", "new scale"])
def test_the_scalers_whose_skips_the_layer_compares(case):
    res = run_dist(_scaler_scope_worker, W, case, timeout_s=120, collective_timeout_s=60)
    for rank, (step, err) in enumerate(res):
        if case == "probe":
            assert err is None, (rank, err)
        else:
            assert step == 1 and err is not None and "skipped different numbers of optimizer steps" in err, \
                (rank, step, err)


def _sharded_scaler_worker(rank, world, case):
    """FSDP's ShardedGradScaler (its own update and unscale), not attached, imported after the layer's first forward
    (or, "late", made between the first step's forward and its backward: no forward comes between it and its first
    update); rank 0 alone overflows. "apart": each rank's scaler agrees its checks over a group of that rank alone,
    so rank 0 alone skips: refused at the next forward on every rank. "agreed": over the whole world, every rank
    skips and halves its scale: runs. Returns (the step refused at or None, the error, the scale)."""
    import torch.distributed as dist

    m = _layer("none")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(_x(rank, 9))
    singles = [dist.new_group([r]) for r in range(world)]

    def make():
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler("cpu", init_scale=256.0,
                                 process_group=dist.group.WORLD if case == "agreed" else singles[rank])

    import sys

    # (the late case tests a scaler whose class nothing wrapped before it was made)
    assert case != "apart late" or "torch.distributed.fsdp.sharded_grad_scaler" not in sys.modules, \
        "FSDP's scaler module is imported already: the late case would test nothing"
    scaler = None if case == "apart late" else make()
    for step in range(3):
        def step_loss(step=step):
            nonlocal scaler
            y = m(_x(rank, step))
            scaler = scaler or make()
            scaler.scale((y ** 2).mean()).backward()

        err = error_of(step_loss)
        if err is not None:
            m.close()
            return step, err, scaler.get_scale()
        if step == 0 and rank == 0:
            m.w1.grad.view(-1)[0] = float("inf")
        _scaled_step(scaler, [opt])
    m.close()
    return None, None, scaler.get_scale()


@pytest.mark.parametrize("case", ["apart", "apart late", "agreed"])
def test_a_sharded_grad_scaler_skipping_apart_is_refused(case):
    res = run_dist(_sharded_scaler_worker, W, case, timeout_s=120, collective_timeout_s=60)
    for rank, (step, err, scale) in enumerate(res):
        if case == "agreed":
            assert err is None and scale == 128.0, (rank, err, scale)
        else:
            assert step == 1 and err is not None and "skipped different numbers of optimizer steps" in err, \
                (rank, step, err)


def _scaler_optimizers_worker(rank, world, case):
    """One GradScaler stepping the layer's optimizer and a second one; rank 0 alone overflows. "head": a head after
    the layer in an optimizer of its own, the overflow in the head's gradients (the scale, combined from every
    optimizer's check, parts all the same: refused). "attached + head": the same with the scaler attached with the
    layer's optimizer (its agreement covers that optimizer's check only: refused). "attached + router": the scaler
    attached with the experts' optimizer, the router in a second one, the overflow in both on rank 0 (the experts'
    skip is agreed, both scales halve alike: runs). Returns (the step refused at or None, the error, the scale)."""
    m = _layer("none")
    head = torch.nn.Linear(H, H)
    if case == "attached + router":
        opts = [torch.optim.SGD([m.w1, m.w2], lr=0.1), torch.optim.SGD([m.router.weight], lr=0.1)]
    else:
        opts = [torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(head.parameters(), lr=0.1)]
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    if case.startswith("attached"):
        m.attach_optimizer(opts[0], scaler=scaler)
    for step in range(3):
        err = error_of(lambda step=step: scaler.scale(head(m(_x(rank, step))).pow(2).mean()).backward())
        if err is not None:
            m.close()
            return step, err, scaler.get_scale()
        if step == 0 and rank == 0:
            for t in ((m.w1, m.router.weight) if case == "attached + router" else (head.weight,)):
                t.grad.view(-1)[0] = float("inf")
        _scaled_step(scaler, opts)
    m.close()
    return None, None, scaler.get_scale()


@pytest.mark.parametrize("case", ["head", "attached + head", "attached + router"])
def test_a_scaler_over_several_optimizers_is_compared_by_its_scale(case):
    res = run_dist(_scaler_optimizers_worker, W, case, timeout_s=120, collective_timeout_s=60)
    for rank, (step, err, scale) in enumerate(res):
        if case == "attached + router":
            assert err is None and scale == 128.0, (rank, err, scale)
        else:
            assert step == 1 and err is not None and "skipped different numbers of optimizer steps" in err, \
                (rank, step, err)
