"""MoELayer checkpoints through ``torch.distributed.checkpoint`` (DCP), the expert shards and their optimizer state
as DTensors over the EP group (``feplb.sharded``), on gloo ranks:

* saved from 4 ranks as 2 data-parallel replicas of an EP group of 2 (Adam, two steps of ``feplb-split`` with
  expert biases), through ``get_state_dict`` and ``dcp.save``;
* loaded (``dcp.load``, ``set_state_dict``) into layers of other weights at EP 4
  (2 nodes x 2) and EP 1: every expert's weights and Adam moments equal, bit for bit, those the saving run gathered
  itself over its EP group (all-gather, not DCP); the router and the step counts too; the third step then gives
  the weights the saving run reached with its own third step (the same tokens, split over 4 ranks instead of 2:
  equal up to summation order);
* ``get_model_state_dict(..., full_state_dict=True)`` is the gathered layer;
* the live optimizer state stays plain tensors; ``state_dict()`` to ``torch.save`` / ``torch.load(weights_only=True)``
  round-trips (the optimizer's too, into a fresh optimizer, local again at its first step), and
  ``load_state_dict`` takes the whole [E, ...] tensor too (this rank's rows); type ``"local"``
  gives plain shards; a DTensor of another placement, another EP rank's file (the weights' and the optimizer's:
  one rank's ``torch.save`` loaded on every rank), optimizer state nested in a container or flat (LBFGS's) and
  an unknown type are refused, naming what was wrong; an optimizer keeping other values in its state steps as
  before.
"""

from __future__ import annotations

import io
import os

import pytest
import torch

from feplb.testing import error_of, run_dist

pytestmark = pytest.mark.dist

H, FF, E, K = 16, 24, 8, 2
TOKENS = 48          # one step's tokens, split over the EP group's ranks (every data-parallel replica alike)
PARTS = ("w1", "w2", "b1", "b2")


def _layer(ep: int, seed: int):
    import torch.distributed as dist

    from feplb import FEPLBConfig, MoELayer
    from feplb.testing import load_global_weights

    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(i, i + ep))) for i in range(0, world, ep)] if ep < world else None
    group = groups[rank // ep] if groups else None
    layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=min(ep, 2),
                                 policy="feplb-split" if ep > 1 else "none", expert_bias=True, min_chunk=2,
                                 min_straggler_rows=0), group)
    gen = torch.Generator().manual_seed(seed)
    load_global_weights(layer, torch.randn(E, H, generator=gen), torch.randn(E, H, 2 * FF, generator=gen) / H ** 0.5,
                        torch.randn(E, FF, H, generator=gen) / FF ** 0.5, 0.1 * torch.randn(E, 2 * FF, generator=gen),
                        0.1 * torch.randn(E, H, generator=gen))
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    layer.attach_optimizer(opt)
    return layer, opt


def _step(layer, opt, step: int) -> None:
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(TOKENS, H, generator=gen)
    x[:, 0] += 2.0          # skews the routing
    target = torch.randn(TOKENS, H, generator=gen)
    n = TOKENS // layer.world_size
    rows = slice(layer.rank * n, (layer.rank + 1) * n)
    (layer(x[rows]) * target[rows]).sum().backward()
    dist.all_reduce(layer.router.weight.grad, group=layer.group)     # the router's data-parallel sum
    opt.step()
    opt.zero_grad()


def _gathered(layer, opt) -> dict[str, torch.Tensor]:
    """The layer's whole experts and their Adam state, all-gathered over its EP group (not through DCP)."""
    import torch.distributed as dist

    out = {"router": layer.router.weight.detach().clone(),
           "router.exp_avg": opt.state[layer.router.weight]["exp_avg"].clone(),
           "router.step": opt.state[layer.router.weight]["step"].clone()}
    for name in PARTS:
        p = getattr(layer, name)
        for key, t in (("", p.detach()), (".exp_avg", opt.state[p]["exp_avg"]),
                       (".exp_avg_sq", opt.state[p]["exp_avg_sq"])):
            parts = [torch.empty_like(t) for _ in range(layer.world_size)]
            dist.all_gather(parts, t.contiguous(), group=layer.group)
            out[name + key] = torch.cat(parts)
        out[name + ".step"] = opt.state[p]["step"].clone()
    return out


def _state_dicts(layer, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(layer, opt)      # as the README shows
    return {"model": model_sd, "optim": optim_sd}


def _save(rank: int, world: int, path: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    layer, opt = _layer(2, seed=0)
    for step in range(2):
        _step(layer, opt, step)
    sd = _state_dicts(layer, opt)
    out = {"model_dtensors": sorted(k for k, v in sd["model"].items() if isinstance(v, DTensor)),
           "optim_dtensors": sorted(k for k, v in sd["optim"]["state"].items()
                                    for s, t in v.items() if isinstance(t, DTensor) and s == "exp_avg"),
           "live_plain": all(not isinstance(t, DTensor) for st in opt.state.values() for t in st.values())}
    dcp.save(sd, checkpoint_id=path)
    out["saved"] = _gathered(layer, opt)
    # per-rank files: each EP rank of data-parallel replica 1 loads replica 0's (another group's mesh, same size)
    before = {n: getattr(layer, n).detach().clone() for n in PARTS}
    torch.save(layer.state_dict(), f"{path}_rank{rank}.pt")
    dist.barrier()
    layer.load_state_dict(torch.load(f"{path}_rank{rank % 2}.pt", weights_only=True))
    out["replica_file"] = all(torch.equal(getattr(layer, n), before[n]) for n in PARTS)
    # the other EP rank's file (one rank's torch.save loaded on every rank): refused, the weights left as they were,
    # the optimizer's state alike
    torch.save(opt.state_dict(), f"{path}_opt_rank{rank}.pt")
    dist.barrier()
    other = (rank + 1) % 2
    out["other_rank_file"] = error_of(lambda: layer.load_state_dict(torch.load(f"{path}_rank{other}.pt",
                                                                               weights_only=True)))
    out["other_rank_kept"] = all(torch.equal(getattr(layer, n), before[n]) for n in PARTS)
    out["other_rank_opt"] = error_of(lambda: opt.load_state_dict(torch.load(f"{path}_opt_rank{other}.pt",
                                                                            weights_only=True)))
    layer.refresh_replicas()
    _step(layer, opt, 2)
    out["continued"] = _gathered(layer, opt)
    layer.close()
    # saved after close() (a `with layer:` block ended): the optimizer's state still sharded like the weights
    w1 = [id(p) for g in opt.param_groups for p in g["params"]].index(id(layer.w1))
    out["closed_sharded"] = (isinstance(opt.state_dict()["state"][w1]["exp_avg"], DTensor)
                             and isinstance(layer.state_dict()["w1"], DTensor))
    return out


def _load(rank: int, world: int, path: str, ep: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_state_dict

    layer, opt = _layer(ep, seed=1)       # other weights
    sd = _state_dicts(layer, opt)
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(layer, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    layer.refresh_replicas()
    out = {"loaded": _gathered(layer, opt)}
    full = get_model_state_dict(layer, options=StateDictOptions(full_state_dict=True))
    out["full"] = {k: v.clone() for k, v in full.items()}
    if ep == world > 1:
        out.update(_round_trips(layer, opt, path))
    _step(layer, opt, 2)
    out["continued"] = _gathered(layer, opt)
    layer.close()
    dist.barrier()
    return out


def _round_trips(layer, opt, path: str) -> dict:
    """Per-rank files, whole tensors, the local type and bad input, on a layer holding the loaded state."""
    from torch.distributed.tensor import DTensor, Replicate

    from feplb.sharded import _mesh
    from feplb.testing import error_of

    out = {}
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    before = {n: getattr(layer, n).detach().clone() for n in PARTS}
    with torch.no_grad():
        for n in PARTS:
            getattr(layer, n).add_(1.0)
    buf.seek(0)
    layer.load_state_dict(torch.load(buf, weights_only=True))
    out["file_round_trip"] = all(torch.equal(getattr(layer, n), before[n]) for n in PARTS)
    whole = _gathered(layer, opt)
    with torch.no_grad():
        layer.w2.zero_()
    layer.load_state_dict({"w2": whole["w2"]}, strict=False)
    out["whole_tensor"] = torch.equal(layer.w2, before["w2"])
    other, _ = _layer(layer.world_size, seed=2)
    other.load_state_dict({"w1": whole["w1"]}, strict=False, assign=True)   # the parameter becomes its rows: a
    out["whole_assigned"] = (torch.equal(other.w1, before["w1"])            # copy, not a view of all E experts
                             and other.w1.untyped_storage().nbytes() == other.w1.numel() * other.w1.element_size())
    other.close()
    osd = opt.state_dict()
    out["optim_step_plain"] = all(not isinstance(st["step"], DTensor) for st in osd["state"].values())
    opt.load_state_dict(osd)
    w1 = [id(p) for g in opt.param_groups for p in g["params"]].index(id(layer.w1))
    out["optim_round_trip"] = torch.equal(opt.state[layer.w1]["exp_avg"], osd["state"][w1]["exp_avg"].to_local())
    # a per-rank file of the sharded optimizer state loaded into a fresh, untracked optimizer: its next step makes
    # the experts' state local (as a resumed run meets it: load, then step)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    fresh = torch.optim.Adam(layer.parameters(), lr=1e-2)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    out["fresh_loaded_dtensors"] = isinstance(fresh.state[layer.w1]["exp_avg"], DTensor)
    fresh.step()             # no gradients: nothing changes but the state's form
    out["fresh_local"] = all(not isinstance(t, DTensor) and torch.equal(t, opt.state[p][k])
                             for p, st in fresh.state.items() for k, t in st.items())
    # ... or, loaded and then attached (tracked), at once, and it steps
    buf.seek(0)
    tracked = torch.optim.Adam(layer.parameters(), lr=1e-2)
    tracked.load_state_dict(torch.load(buf, weights_only=True))
    layer.attach_optimizer(tracked)
    out["tracked_local"] = all(not isinstance(t, DTensor) and torch.equal(t, opt.state[p][k])
                               for p, st in tracked.state.items() for k, t in st.items())
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    out["tracked_steps"] = error_of(tracked.step)
    tracked.zero_grad()
    with torch.no_grad():     # back to the loaded weights (Adam's step moved them a little)
        for n in PARTS:
            getattr(layer, n).copy_(before[n])
        layer.router.weight.copy_(whole["router"])
    layer.refresh_replicas()
    layer.set_state_dict_type("local")
    out["local_plain"] = (not any(isinstance(v, DTensor) for v in layer.state_dict().values())
                          and not any(isinstance(t, DTensor) for st in opt.state_dict()["state"].values()
                                      for t in st.values()))
    out["local_in_dcp"] = _local_through_dcp(layer, opt, path)
    layer.set_state_dict_type("sharded")
    out["bad_type"] = error_of(lambda: layer.set_state_dict_type("full"))
    replicated = DTensor.from_local(layer.w1.detach().clone(), _mesh(layer, "cpu"), [Replicate()], run_check=False)
    out["bad_placement"] = error_of(lambda: layer.load_state_dict({"w1": replicated}, strict=False))
    p = layer.w2
    opt.state[p]["odd"] = {"m": torch.zeros(3)}       # state nested in a container: DCP would replicate it
    out["bad_state"] = error_of(opt.state_dict)
    del opt.state[p]["odd"]
    opt.state[p]["flat"] = torch.zeros(p.numel())     # a flat vector (LBFGS's): its length grows with L
    out["flat_state"] = error_of(opt.state_dict)
    del opt.state[p]["flat"]
    # an optimizer keeping a value that is not a per-parameter dict in its state (torch allows it) steps as before
    counting = _Counting([torch.zeros(3, requires_grad=True)], lr=0.1)
    out["counting"] = [error_of(counting.step), error_of(counting.step), counting.state["global_step"]]
    out.update(_per_rank_state(layer, path))
    return out


class _App:
    """A ``torch.distributed.checkpoint.stateful.Stateful`` holding a layer and its optimizer, as DCP's tutorial
    checkpoints a model."""

    def __init__(self, layer, opt, which: str):
        self.layer, self.opt, self.which = layer, opt, which

    def state_dict(self):
        return {"model": self.layer.state_dict()} if self.which == "model" else {"optim": self.opt.state_dict()}

    def load_state_dict(self, sd):
        raise AssertionError("never reached: its state_dict() is refused first")


def _local_through_dcp(layer, opt, path: str) -> dict:
    """State-dict type "local" asked for by torch.distributed.checkpoint (every rank alike): refused, nothing
    written; the plain state dicts themselves still given."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from feplb.testing import error_of

    where = path + "_local"
    out = {"save_model": error_of(lambda: dcp.save({"app": _App(layer, opt, "model")}, checkpoint_id=where)),
           "save_optim": error_of(lambda: dcp.save({"app": _App(layer, opt, "optim")}, checkpoint_id=where)),
           "load_model": error_of(lambda: dcp.load({"app": _App(layer, opt, "model")}, checkpoint_id=path)),
           "get_model": error_of(lambda: get_model_state_dict(layer)),
           "get_optim": error_of(lambda: get_optimizer_state_dict(layer, opt))}
    out["nothing_written"] = not os.path.exists(where) or not os.listdir(where)
    out["plain_after"] = error_of(lambda: (layer.state_dict(), opt.state_dict()))
    # a checkpoint of this rank alone (no_dist: its own shards, as a torch.save file per rank) is taken
    alone = f"{path}_alone{layer.rank}"
    out["alone"] = error_of(lambda: dcp.save({"app": _App(layer, opt, "model")}, checkpoint_id=alone, no_dist=True))
    out["alone_written"] = os.path.isdir(alone) and bool(os.listdir(alone))
    return out


class _Counting(torch.optim.SGD):
    def step(self, closure=None):
        self.state["global_step"] = self.state.get("global_step", 0) + 1
        return super().step(closure)


def _per_rank_state(layer, path: str) -> dict:
    """Adafactor on 2-D expert biases: its column statistic [1, G] mixes the rank's experts, so it is stacked per
    rank ([W, G]) and comes back through DCP at the same EP size, with the per-expert ones, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def adafactor():
        return torch.optim.Adafactor([layer.b1, layer.b2, layer.w1], lr=1e-2)

    kept = {n: getattr(layer, n).detach().clone() for n in ("b1", "b2", "w1")}
    ada = adafactor()
    gen = torch.Generator().manual_seed(7 + layer.rank)
    for p in (layer.b1, layer.b2, layer.w1):
        p.grad = torch.randn(p.shape, generator=gen)
    ada.step()
    ada.zero_grad()
    sd = get_optimizer_state_dict(layer, ada)
    out = {"col_shape": list(sd["state"]["b1"]["col_var"].shape), "row_shape": list(sd["state"]["b1"]["row_var"].shape)}
    dcp.save({"optim": sd}, checkpoint_id=path + "_adafactor")
    again = adafactor()
    template = {"optim": get_optimizer_state_dict(layer, again)}
    dcp.load(template, checkpoint_id=path + "_adafactor")
    set_optimizer_state_dict(layer, again, template["optim"])
    out["per_rank_equal"] = all(torch.equal(again.state[p][k], t) for p, st in ada.state.items() for k, t in st.items())
    with torch.no_grad():     # the weights the next step starts from: the loaded ones
        for n, t in kept.items():
            getattr(layer, n).copy_(t)
    layer.refresh_replicas()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    saved = run_dist(_save, 4, path, timeout_s=240)
    loads = {ep: run_dist(_load, ep, path, ep, timeout_s=240) for ep in (4, 1)}
    return saved, loads


def test_saved_as_dtensors(runs):
    saved, _ = runs
    for r in saved:
        assert r["model_dtensors"] == sorted(PARTS), r["model_dtensors"]
        assert r["optim_dtensors"] == sorted(PARTS), r["optim_dtensors"]
        assert r["live_plain"] and r["replica_file"] and r["closed_sharded"], r
        for k in ("other_rank_file", "other_rank_opt"):
            assert r[k] is not None and r[k].startswith("ValueError") and "is the shard of EP rank" in r[k], (k, r[k])
        assert r["other_rank_kept"]
    # the data-parallel replicas trained alike (the same tokens): what one saved is what the other would have
    for k, v in saved[0]["saved"].items():
        assert torch.equal(v, saved[2]["saved"][k]), k


@pytest.mark.parametrize("ep", [4, 1])
def test_loaded_at_another_ep_size(runs, ep):
    saved, loads = runs
    want = saved[0]["saved"]
    for r in loads[ep]:
        got = r["loaded"]
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (ep, k)
        for n in PARTS:
            assert torch.equal(r["full"][n], want[n]), (ep, n)
        assert torch.equal(r["full"]["router.weight"], want["router"])


@pytest.mark.parametrize("ep", [4, 1])
def test_training_continues(runs, ep):
    saved, loads = runs
    want = saved[0]["continued"]
    moved = max((want[n] - saved[0]["saved"][n]).abs().max().item() for n in PARTS)
    assert moved > 1e-4            # the third step changed the weights
    for r in loads[ep]:
        for n in PARTS + ("router",):
            err = (r["continued"][n] - want[n]).abs().max().item()
            assert err <= 1e-5 * max(1.0, want[n].abs().max().item()), (ep, n, err)


def test_files_whole_tensors_local_type_and_bad_input(runs):
    _, loads = runs
    for r in loads[4]:
        assert r["file_round_trip"] and r["whole_tensor"] and r["optim_round_trip"] and r["optim_step_plain"]
        assert r["local_plain"] and r["whole_assigned"]
        dcp = r["local_in_dcp"]
        for k in ("save_model", "save_optim", "load_model", "get_model", "get_optim"):
            assert dcp[k] is not None and "'local'" in dcp[k] and "torch.distributed.checkpoint" in dcp[k], (k, dcp)
        assert "state_dict_saver" in dcp["save_model"] and "state_dict_loader" in dcp["load_model"], dcp
        assert "w1" in dcp["save_optim"] or "w2" in dcp["save_optim"], dcp["save_optim"]
        assert dcp["nothing_written"] and dcp["plain_after"] is None, dcp
        assert dcp["alone"] is None and dcp["alone_written"], dcp
        assert r["fresh_loaded_dtensors"] and r["fresh_local"] and r["tracked_local"] and r["tracked_steps"] is None
        W = len(loads[4])
        assert r["col_shape"] == [W, 2 * FF] and r["row_shape"] == [E, 1] and r["per_rank_equal"], r
        assert "ValueError" in r["bad_type"] and "'full'" in r["bad_type"], r["bad_type"]
        assert r["bad_placement"] is not None and "w1" in r["bad_placement"] and "Replicate" in r["bad_placement"], \
            r["bad_placement"]
        assert r["bad_state"] is not None and "'odd'" in r["bad_state"] and "nests tensors" in r["bad_state"], \
            r["bad_state"]
        flat = r["flat_state"]
        assert flat is not None and "'flat'" in flat and "neither per expert" in flat, flat
        assert r["counting"] == [None, None, 2], r["counting"]


def _per_rank_state_elsewhere(rank: int, world: int) -> dict:
    """Adafactor's per-rank stacked statistic of a 2-D expert bias ([W, G]: it mixes the rank's experts) through the
    full-state path (``set_optimizer_state_dict(full_state_dict=True)``): at the EP size it was saved at it loads
    bit for bit; at another, refused on every rank, naming it (ranks got another rank's statistic, or none)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)

    def adafactor(layer, grads=None):
        """An Adafactor over the layer's biases and w1, stepped once on ``grads`` (zeros at lr 0 without: the state
        a full state dict loads into, made as torchtitan's init_optim_state makes it)."""
        params = [layer.b1, layer.b2, layer.w1]
        opt = torch.optim.Adafactor(params, lr=1e-2 if grads else 0.0)
        for p, g in zip(params, grads or [torch.zeros_like(p) for p in params], strict=True):
            p.grad = g
        opt.step()
        opt.zero_grad()
        return opt

    layer, _ = _layer(world, seed=0)
    gen = torch.Generator().manual_seed(7 + rank)
    ada = adafactor(layer, [torch.randn(p.shape, generator=gen) for p in (layer.b1, layer.b2, layer.w1)])
    saved = get_optimizer_state_dict(layer, ada, options=full)
    again = adafactor(layer)
    out = {"same": error_of(lambda: set_optimizer_state_dict(layer, again, saved, options=full))}
    out["same_equal"] = all(torch.equal(again.state[p][k], t) for p, st in ada.state.items() for k, t in st.items())
    small, _ = _layer(world // 2, seed=1)
    out["elsewhere"] = error_of(lambda: set_optimizer_state_dict(small, adafactor(small), saved, options=full))
    layer.close()
    small.close()
    return out


class _Gram(torch.optim.SGD):
    """SGD keeping a [G, G] statistic of every 2-D parameter's gradient (Shampoo's preconditioner statistics are so
    shaped): of a 2-D expert bias b1 [L, G] a per-rank state whose rows are neither 1 nor L."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dim() == 2:
                    self.state[p].setdefault("gram", torch.zeros(p.shape[1], p.shape[1])).add_(p.grad.T @ p.grad)
        return super().step(closure)


def _gram_state(rank: int, world: int) -> dict:
    """A per-rank state of b1 of G rows ([G, G], stacked over the EP ranks to [W * G, G]): back at the EP size it was
    saved at through the optimizer's own load_state_dict and the full-state path, bit for bit; at another, refused
    on every rank, naming it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def gram(layer, grads=None):
        opt = _Gram([layer.b1], lr=0.0 if grads is None else 1e-2)
        layer.b1.grad = grads if grads is not None else torch.zeros_like(layer.b1)
        opt.step()
        opt.zero_grad()
        return opt

    layer, _ = _layer(world, seed=0)
    opt = gram(layer, torch.randn(layer.b1.shape, generator=torch.Generator().manual_seed(3 + rank)))
    want = opt.state[layer.b1]["gram"].clone()
    sd = opt.state_dict()
    out = {"saved": list(sd["state"][0]["gram"].shape)}
    again = gram(layer)
    out["own"] = error_of(lambda: again.load_state_dict(sd))
    out["own_equal"] = torch.equal(again.state[layer.b1]["gram"], want)
    # a fresh optimizer (no state to compare with: the DTensor's mesh, of this EP size, is what is checked), hooked
    # before it loads, or after (its state localized then)
    from feplb.sharded import track_optimizer

    hooked, late = _Gram([layer.b1], lr=0.0), _Gram([layer.b1], lr=0.0)
    track_optimizer(hooked)
    out["fresh"] = error_of(lambda: (hooked.load_state_dict(sd), late.load_state_dict(sd), track_optimizer(late)))
    out["fresh_equal"] = all(torch.equal(o.state[layer.b1]["gram"], want) for o in (hooked, late))
    full = StateDictOptions(full_state_dict=True)
    saved = get_optimizer_state_dict(layer, opt, options=full)
    again = gram(layer)
    out["full"] = error_of(lambda: set_optimizer_state_dict(layer, again, saved, options=full))
    out["full_equal"] = torch.equal(again.state[layer.b1]["gram"], want)
    small, _ = _layer(world // 2, seed=1)
    out["elsewhere"] = error_of(lambda: set_optimizer_state_dict(small, gram(small), saved, options=full))
    layer.close()
    small.close()
    return out


def test_per_rank_state_of_any_rows_loads_at_its_ep_size():
    for r in run_dist(_gram_state, 4, timeout_s=240, collective_timeout_s=60):
        assert r["saved"] == [4 * 2 * FF, 2 * FF], r
        assert r["own"] is None and r["own_equal"], r
        assert r["fresh"] is None and r["fresh_equal"], r
        assert r["full"] is None and r["full_equal"], r
        err = r["elsewhere"]
        assert err is not None and err.startswith("ValueError") and "'gram'" in err and \
            "at the EP size it was saved at only" in err, err


def test_per_rank_state_at_another_ep_size_refused():
    for r in run_dist(_per_rank_state_elsewhere, 4, timeout_s=240, collective_timeout_s=60):
        assert r["same"] is None and r["same_equal"], r
        err = r["elsewhere"]
        assert err is not None and err.startswith("ValueError") and "'col_var'" in err and \
            "holds it as (1, 48), (2, 48) over this layer's 2 EP ranks" in err and \
            "at the EP size it was saved at only" in err, err


def _one_rank_file(rank, world, path):
    """One rank's ``torch.save`` of the layer's and the optimizer's state dicts (accelerate's ``save_state`` writes
    the main process's alone) loaded on every rank (its ``load_state``): EP rank 0 loads its own experts, the others
    refuse theirs; rank 0 then meets the refusal in its next forward, or in its next per-step call, and raises too,
    instead of waiting for ranks that never come."""
    import torch.distributed as dist

    from feplb import FEPLBConfig, MoELayer

    layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=2, policy="feplb-split",
                                 min_chunk=2, min_straggler_rows=0))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    layer.attach_optimizer(opt)
    layer(torch.randn(8, H)).sum().backward()
    opt.step()
    opt.zero_grad()
    if rank == 0:
        torch.save({"model": layer.state_dict(), "optim": opt.state_dict()}, path)
    dist.barrier()
    saved = torch.load(path, weights_only=True)
    out = {"model": error_of(lambda: layer.load_state_dict(saved["model"]))}
    if rank == 0:
        out["forward"] = error_of(lambda: layer(torch.randn(8, H)))
    layer.load_state_dict(layer.state_dict())     # (every rank its own again)
    out["optim"] = error_of(lambda: opt.load_state_dict(saved["optim"]))
    if rank == 0:
        out["step"] = error_of(layer.refresh_replicas)
    # every rank usable again: a forward of every rank together
    opt.zero_grad()
    out["after"] = error_of(lambda: layer(torch.randn(8, H)))
    layer.close()
    return out


def test_one_rank_file_refused_on_every_rank(tmp_path):
    res = run_dist(_one_rank_file, 4, str(tmp_path / "rank0.pt"), timeout_s=180, collective_timeout_s=60)
    for rank, r in enumerate(res):
        assert r["after"] is None, (rank, r["after"])
        if rank == 0:
            for k in ("forward", "step"):
                assert r[k] is not None and r[k].startswith("ValueError") and "EP rank(s) [1, 2, 3] refused" in r[k] \
                    and "accelerate's save_state" in r[k], (k, r[k])
            assert r["model"] is None and r["optim"] is None, r
        else:
            for k in ("model", "optim"):
                assert r[k] is not None and r[k].startswith("ValueError") and "is the shard of EP rank 0" in r[k], \
                    (rank, k, r[k])
