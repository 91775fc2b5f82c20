"""``feplb.dropin.policy_state_dict`` / ``load_policy_state_dict`` on 4 gloo ranks (2 nodes x 2 GPUs).

* A layer trained three steps (skewed routing, the histories placing experts, choosing @ema sets, EPLB layouts),
  its histories through ``torch.save`` and ``torch.load(weights_only=True)`` into a fresh layer holding the same
  weights: the next step plans, places and computes alike, bit for bit (output, every gradient, the plan, the
  placement, the copies held), where a fresh layer without them plans otherwise.
* The same as 2 EP groups of 2 ranks (EP x DP) training on their own data: each group gets its own history back
  (one rank's alone would give the other group another's: refused by name).
* Refused on every rank, before anything is restored (strict): a history for another policy or EP layout, a
  missing layer, a name of no layer; ``strict=False`` keeps the layers' own. A rank that restored another history
  than its peers is refused on every rank, and every layer keeps its own history (also with ``strict=False``, one
  rank's file lacking a layer); so are a malformed entry, named, and a restore between the micro-batches of a step
  where copies hold gradients. A refresh that fails once a layer adopted the restored placement: every layer gets
  its own history back and adopts it again.
* The layers' names leave out DDP's and ``torch.compile``'s wrapper levels.
* Through ``torch.distributed.checkpoint`` as a ``Stateful`` (``PolicyStates``): the next step bit for bit; a layer
  of another policy keeps its own history, with a warning naming it.
"""

from __future__ import annotations

import io

import pytest
import torch

from feplb.testing import error_of, load_global_weights, run_dist

pytestmark = pytest.mark.dist

H, FF, E, K, W, G = 16, 32, 16, 2, 4, 2
POLICIES = ("feplb-split+place@ema", "eplb", "feplb-split@ema")


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=gen) / H ** 0.5
    router[:3] *= 4.0                                # skewed routing: experts 0-2 are hot
    w1 = torch.randn(E, H, 2 * FF, generator=gen) / H ** 0.5
    w2 = torch.randn(E, FF, H, generator=gen) / FF ** 0.5
    xs = [torch.randn(48, H, generator=gen) + 0.5 for _ in range(W)]
    dys = [torch.randn(48, H, generator=gen) for _ in range(W)]
    return router, w1, w2, xs, dys


def _layer(policy: str, weights=None, group=None):
    from feplb import FEPLBConfig, MoELayer

    layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=G, plan_wait_ms=60_000,
                                 min_straggler_rows=0, min_chunk=2, dyn=2, policy=policy, weights="per-step",
                                 refresh_every=2), group)
    router, w1, w2, _, _ = _inputs(5)
    if weights is None:
        load_global_weights(layer, router, w1, w2)
    else:
        layer.load_state_dict(weights)
    layer.refresh_replicas()
    return layer


def _step(layer, rank: int, step: int) -> dict:
    _, _, _, xs, dys = _inputs(5)
    layer.zero_grad(set_to_none=True)
    for mb in range(2):
        x = (xs[rank] * (1 + 0.1 * mb + 0.05 * step)).requires_grad_(True)
        out = layer(x)
        (out * dys[rank]).sum().backward()
    layer.reduce_replica_grads()
    return {"out": out.detach(), "dx": x.grad, "grads": [p.grad.clone() for p in layer.parameters()],
            "plan": layer.last_plan.fingerprint() if layer.last_plan is not None else None,
            "home": layer.home_E.tolist(), "moved": layer.last_stats.rows_moved}


def _trained(policy: str, rank: int, group=None, data: int | None = None):
    layer = _layer(policy, group=group)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    for step in range(3):
        _step(layer, rank if data is None else data, step)
        opt.step()
        layer.refresh_replicas()
    return layer


def _restore_case(policy: str, rank: int, group=None, data: int | None = None) -> dict:
    """Train, save (collective), restore into a fresh layer of the same weights, and step both (and a fresh one)."""
    from feplb.dropin import load_policy_state_dict, policy_state_dict

    layer = _trained(policy, rank, group, data)
    buf = io.BytesIO()
    torch.save(policy_state_dict(layer), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    weights = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    restored = _layer(policy, weights, group)
    kept = load_policy_state_dict(restored, saved)
    fresh = _layer(policy, weights, group)
    d = rank if data is None else data
    runs = {name: _step(m, d, 3) for name, m in (("trained", layer), ("restored", restored), ("fresh", fresh))}
    a, b, c = runs["trained"], runs["restored"], runs["fresh"]
    out = {
        "kept": kept, "entries": sorted(saved), "groups": [e["ep_ranks"] for e in saved[""]],
        "step": [int(e["step"]) for e in saved[""]],
        "equal": all(torch.equal(a[k], b[k]) for k in ("out", "dx")) and
        all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"], strict=True)),
        "same_plan": a["plan"] == b["plan"] and a["home"] == b["home"], "moved": a["moved"],
        "fresh_differs": a["plan"] != c["plan"] or a["home"] != c["home"],
    }
    # one group's entry alone (as one rank's policy state would be): the other group's layers are refused by name
    first = {"": [e for e in saved[""] if e["ep_ranks"] == [0, 1]]}
    out["other_group"] = error_of(lambda: load_policy_state_dict(fresh, first))
    for m in (layer, restored, fresh):
        m.close()
    return out


def _stages(rank: int, groups) -> dict:
    """Pipeline stages as EP groups: {0, 1} hold layer "a", {2, 3} layer "b" (or, a dense stage, none)."""
    from feplb.dropin import load_policy_state_dict, policy_state_dict

    out = {}
    stage, dense = torch.nn.Module(), torch.nn.Module()
    layer = _trained("feplb-split@ema", rank, groups[rank // 2], data=rank)
    setattr(stage, "ab"[rank // 2], layer)
    if rank < 2:
        dense.a = layer
    saved = policy_state_dict(stage)
    out["keys"] = sorted(saved)
    out["named"] = error_of(lambda: out.__setitem__("kept", load_policy_state_dict(stage, saved)))
    out["dense"] = error_of(lambda: load_policy_state_dict(dense, policy_state_dict(dense)))
    # the refresh refused in group {2, 3} alone (after the checks passed): every rank raises, and keeps its own
    own = layer.state
    if rank >= 2:
        def refused():
            raise RuntimeError("a refresh refused here")
        layer.refresh_replicas = refused
    out["refused"] = error_of(lambda: load_policy_state_dict(stage, saved))
    out["refused_kept"] = layer.state is own
    vars(layer).pop("refresh_replicas", None)
    layer.close()
    return out


def _dcp_case(rank: int, root: str) -> dict:
    """The histories as a ``Stateful`` entry of ``torch.distributed.checkpoint`` (``PolicyStates``): saved with
    ``dcp.save``, loaded with ``dcp.load`` into a fresh layer of the same weights (the next step bit for bit the
    trained layer's), and into a layer of another policy (a warning naming it; its own history kept)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from feplb.dropin import PolicyStates

    layer = _trained("feplb-split@ema", rank)
    weights = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    dcp.save({"feplb_policy": PolicyStates(layer)}, checkpoint_id=root)
    restored = _layer("feplb-split@ema", weights)
    dcp.load({"feplb_policy": PolicyStates(restored)}, checkpoint_id=root)
    loaded_step = int(restored.state.step)
    a, b = _step(layer, rank, 3), _step(restored, rank, 3)
    other = _layer("feplb@ema", weights)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.load({"feplb_policy": PolicyStates([other])}, checkpoint_id=root)
    out = {"equal": all(torch.equal(a[k], b[k]) for k in ("out", "dx")) and a["plan"] == b["plan"]
           and all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"], strict=True)),
           "steps": (loaded_step, int(other.state.step)),
           "warned": [str(w.message) for w in caught if "balancing history" in str(w.message)]}
    for m in (layer, restored, other):
        m.close()
    return out


def _worker(rank: int, world: int, root: str) -> dict:
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from feplb.dropin import PolicyStates, _named_layers, load_policy_state_dict, policy_state_dict

    out = {policy: _restore_case(policy, rank) for policy in POLICIES}
    out["dcp"] = _dcp_case(rank, root)
    # EP x DP: EP groups {0, 1} and {2, 3}, one node each, their own data (ranks 0 and 2 the same tokens as each
    # other, but the groups' skews differ)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out["epdp"] = _restore_case("feplb-split@ema", rank, groups[rank // 2], data=rank % 2 + 2 * (rank // 2))
    out["stages"] = _stages(rank, groups)
    # refusals: another policy, a missing layer and an unknown name (strict); strict=False keeps the own history
    layer = _trained("feplb-split@ema", rank)
    saved = policy_state_dict(layer)
    other = _layer("feplb@ema")
    before = other.state.to_dict()["step"]
    out["other_policy"] = error_of(lambda: load_policy_state_dict(other, saved))
    out["missing"] = error_of(lambda: load_policy_state_dict(other, {}))
    out["unknown"] = error_of(lambda: load_policy_state_dict(layer, {**saved, "nowhere": None}))
    out["kept"] = load_policy_state_dict(other, saved, strict=False)
    out["kept_step"] = (before, other.state.step)
    # a rank restoring another history than its peers' (its own file, say): the refresh refuses on every rank, and
    # every rank keeps its own history
    own = layer.state
    wrong = dict(saved[""][0])
    if rank == 1:
        wrong["step"] = wrong["step"] + 1
    out["apart"] = error_of(lambda: load_policy_state_dict(layer, {"": [wrong]}))
    out["apart_kept"] = layer.state is own
    # two layers, the second's history restored apart on one rank: the first adopts nothing either
    pair = torch.nn.ModuleList([_trained("feplb-split+place@ema", rank), _trained("feplb-split+place@ema", rank)])
    two = policy_state_dict(pair)
    if rank == 1:
        two["1"] = [{**two["1"][0], "step": two["1"][0]["step"] + 1}]
    before = [(m.state, m._plan_state, m.home_E.tolist()) for m in pair]
    out["half"] = error_of(lambda: load_policy_state_dict(pair, two))
    out["half_untouched"] = all(m.state is st and m._plan_state is ps and m.home_E.tolist() == home
                                for m, (st, ps, home) in zip(pair, before, strict=True))
    # strict=False, one rank's file lacking layer "0" (a stale copy): refused on every rank, not some restoring
    stale = {k: v for k, v in two.items() if k != "0"} if rank == 1 else two
    out["apart_lenient"] = error_of(lambda: load_policy_state_dict(pair, stale, strict=False))
    # a malformed entry (ep_ranks not a list) on the ranks holding its layer: named, refused on every rank
    out["malformed"] = error_of(lambda: load_policy_state_dict(pair, {**two, "1": [{**two["1"][0], "ep_ranks": 7}]}))
    out["malformed_untouched"] = all(m.state is st and m._plan_state is ps and m.home_E.tolist() == home
                                     for m, (st, ps, home) in zip(pair, before, strict=True))
    # a refresh that fails after the checks, once the first layer adopted the restored placement (histories of
    # layers trained on other data, each rank on the same tokens): every layer gets its own history back and adopts
    # it again
    others = torch.nn.ModuleList([_trained("feplb-split+place@ema", rank, data=1),
                                  _trained("feplb-split+place@ema", rank, data=2)])
    theirs = policy_state_dict(others)
    fail = pair[1].replicas.refresh

    def refresh_fails_once(*args, **kwargs):
        vars(pair[1].replicas).pop("refresh")
        raise RuntimeError("a refresh failed midway")

    pair[1].replicas.refresh = refresh_fails_once
    out["rollback"] = error_of(lambda: load_policy_state_dict(pair, theirs))
    out["rollback_moved"] = [m.home_E.tolist() for m in others] != [home for _, _, home in before]
    out["rollback_own"] = all(m.state is st and m._plan_state is st and m.home_E.tolist() == home
                              for m, (st, _, home) in zip(pair, before, strict=True)) and fail is not None
    out["rollback_steps"] = all(bool(torch.isfinite(_step(m, rank, 3)["out"]).all()) for m in pair)
    for m in (*pair, *others):
        m.close()
    # between the micro-batches of a step (a copy holds a gradient the reduction has not added): refused, own kept
    _, _, _, xs, dys = _inputs(5)
    (layer(xs[rank]) * dys[rank]).sum().backward()
    own = layer.state   # (the forward folded its micro-batch in)
    out["mid_step"] = error_of(lambda: load_policy_state_dict(layer, saved))
    out["mid_step_kept"] = layer.state is own
    # nor saved there (the histories hold the step's first micro-batch: a run resumed at the step's start would
    # fold it in twice and plan otherwise), also through DCP, which then writes nothing
    out["mid_step_save"] = error_of(lambda: policy_state_dict(layer))
    mid_dir = os.path.join(root, "mid_step")
    out["mid_step_dcp"] = error_of(lambda: dcp.save({"policy": PolicyStates(layer)}, checkpoint_id=mid_dir))
    out["mid_step_dcp_files"] = sorted(os.listdir(mid_dir)) if os.path.isdir(mid_dir) else []
    # names without the wrappers' levels: a MoE layer inside a module, bare, in DDP, compiled
    from feplb.layer import ignore_experts_in_ddp

    holder = torch.nn.Sequential(torch.nn.Linear(H, H), layer)
    ignore_experts_in_ddp(holder)
    ddp = torch.nn.parallel.DistributedDataParallel(holder)
    out["names"] = [[n for n, _ in _named_layers(m)] for m in (holder, ddp, torch.compile(holder),
                                                               torch.compile(ddp), [holder])]
    for m in (layer, other):
        m.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_dist(_worker, W, str(tmp_path_factory.mktemp("policy-dcp")), timeout_s=300, collective_timeout_s=60)


@pytest.mark.parametrize("policy", [*POLICIES, "epdp"])
def test_restored_histories_plan_and_compute_as_the_trained_layer(ranks, policy):
    for rank, res in enumerate(ranks):
        case = res[policy]
        groups = [[0, 1], [2, 3]] if policy == "epdp" else [[0, 1, 2, 3]]
        assert case["entries"] == [""] and case["groups"] == groups and case["step"] == [6] * len(groups), \
            (rank, case)
        assert case["kept"] == [] and case["same_plan"] and case["equal"], (rank, case)
        if policy == "epdp" and rank >= 2:
            assert case["other_group"] is not None and "saved for the EP group(s) of global ranks [[0, 1]], not for " \
                "this layer's [2, 3]" in case["other_group"], (rank, case["other_group"])
        elif policy == "epdp":   # (refused on every rank together: ranks 0 and 1 found their own)
            assert case["other_group"] is not None and "[2, 3]" in case["other_group"], (rank, case["other_group"])
    assert any(res[policy]["moved"] > 0 for res in ranks), [res[policy]["moved"] for res in ranks]
    # without the histories a fresh layer plans otherwise: the restore is what made them equal
    assert any(res[policy]["fresh_differs"] for res in ranks), policy


def test_histories_that_do_not_fit_are_refused_on_every_rank(ranks):
    for rank, res in enumerate(ranks):
        assert res["other_policy"] is not None and res["other_policy"].startswith("ValueError") and \
            "policy 'feplb-split@ema' (the layer's: 'feplb@ema')" in res["other_policy"], (rank, res["other_policy"])
        assert res["missing"] is not None and "(the model itself): not in the saved state" in res["missing"], \
            (rank, res["missing"])
        assert res["unknown"] is not None and "names of no FEPLB layer of the model: ['nowhere']" in \
            res["unknown"], (rank, res["unknown"])
        assert res["kept"] == [""] and res["kept_step"] == (0, 0), (rank, res["kept"], res["kept_step"])
        assert res["apart"] is not None and "nothing restored, on any rank: the ranks of an EP group would " \
            "restore different histories" in res["apart"], (rank, res["apart"])
        assert res["apart_lenient"] is not None and "restore different histories" in res["apart_lenient"] and \
            "0 (EP group of global ranks [0, 1, 2, 3]): restores history" in res["apart_lenient"] and \
            "keeps its own on rank(s) [1]" in res["apart_lenient"], (rank, res["apart_lenient"])
        assert res["malformed"] is not None and res["malformed"].startswith("ValueError") and \
            "1: an entry's ep_ranks is 7, expected a list of global ranks" in res["malformed"] and \
            res["malformed_untouched"], (rank, res["malformed"])
        assert res["rollback"] is not None and "a refresh failed midway" in res["rollback"], (rank, res["rollback"])
        assert res["rollback_moved"] and res["rollback_own"] and res["rollback_steps"], \
            (rank, res["rollback_moved"], res["rollback_own"], res["rollback_steps"])
        assert res["half"] is not None and "nothing restored" in res["half"] and res["half_untouched"], \
            (rank, res["half"], res["half_untouched"])
        assert res["apart_kept"] and res["mid_step_kept"], rank
        assert res["mid_step"] is not None and "nothing restored, on any rank" in res["mid_step"] and \
            "reduce_replica_grads" in res["mid_step"], (rank, res["mid_step"])
        for key in ("mid_step_save", "mid_step_dcp"):
            assert res[key] is not None and "policy_state_dict: called between the micro-batches of a step" in \
                res[key] and "(the model itself) on rank " in res[key], (rank, key, res[key])
        assert not any(f.endswith(".distcp") or f == ".metadata" for f in res["mid_step_dcp_files"]), \
            (rank, res["mid_step_dcp_files"])


def test_pipeline_stages_with_other_layers_or_none(ranks):
    """Stages whose EP groups hold layers of other names, or none (a dense stage), restore under strict=True; a
    refresh refused in one group raises on every rank, each keeping its own history."""
    for rank, res in enumerate(ranks):
        st = res["stages"]
        assert st["keys"] == ["a", "b"] and st["named"] is None and st["kept"] == [], (rank, st)
        assert st["dense"] is None, (rank, st["dense"])
        want = "a refresh refused here" if rank >= 2 else "the refresh after the restore was refused on other ranks"
        assert st["refused"] is not None and want in st["refused"] and st["refused_kept"], (rank, st["refused"])


def test_layer_names_leave_out_the_wrappers(ranks):
    for rank, res in enumerate(ranks):
        assert res["names"] == [["1"], ["1"], ["1"], ["1"], ["0.1"]], (rank, res["names"])


def test_histories_through_torch_distributed_checkpoint(ranks):
    for rank, res in enumerate(ranks):
        case = res["dcp"]
        assert case["equal"], rank
        # the restored layer took the trained one's step count (6 micro-batches); the other policy's kept its own
        assert case["steps"] == (6, 0), (rank, case["steps"])
        assert len(case["warned"]) == 1 and "FEPLB layer(s) ['']" in case["warned"][0], (rank, case["warned"])


def _one_rank_bad_worker(rank: int, world: int) -> dict:
    """What cannot be read on one rank (a state that is no mapping; a ``PolicyStates`` blob of another type, or no
    ``torch.save`` file), and ``strict`` given otherwise on one rank: refused on every rank together, before any
    collective the others would wait in; the layer runs on afterwards."""
    from feplb.dropin import PolicyStates, load_policy_state_dict, policy_state_dict

    layer, x = _layer("feplb-split@ema"), _inputs(0)[3][rank]
    layer(x)
    saved = policy_state_dict(layer)
    sd = PolicyStates(layer).state_dict()
    out = {"mapping": error_of(lambda: load_policy_state_dict(layer, saved if rank != 1 else [saved])),
           "blob_type": error_of(lambda: PolicyStates(layer).load_state_dict(sd if rank != 1 else {"histories": "x"})),
           "blob": error_of(lambda: PolicyStates(layer).load_state_dict(sd if rank != 1 else {"histories": b"x"})),
           "strict": error_of(lambda: load_policy_state_dict(layer, dict(saved, extra=[None]), strict=rank != 1))}
    out["after"] = error_of(lambda: layer(x))
    layer.close()
    return out


def test_unreadable_on_one_rank_refused_on_every_rank():
    res = run_dist(_one_rank_bad_worker, W, timeout_s=180, collective_timeout_s=60)
    for rank, r in enumerate(res):
        assert r["after"] is None, (rank, r["after"])
        for case, want in (("mapping", "TypeError: load_policy_state_dict: state must be a mapping"),
                           ("blob_type", "TypeError: PolicyStates.load_state_dict: expected {'histories': bytes}"),
                           ("blob", "TypeError: PolicyStates.load_state_dict: its histories are no torch.save"),
                           ("strict", "ValueError: load_policy_state_dict: strict differs across ranks")):
            assert r[case] is not None and r[case].startswith(want), (rank, case, r[case])
            assert case == "strict" or "(on rank(s) [1])" in r[case], (rank, case, r[case])
