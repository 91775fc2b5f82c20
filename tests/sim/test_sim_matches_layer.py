"""The simulator predicts the layer: from the same counts and the same history, the plans ``feplb.simulate`` makes are
the plans ``MoELayer`` executes (4 gloo ranks as 2 nodes x 2, training with an attached optimizer, one step per
``refresh_every`` micro-batches). The layer's in-node plans are the simulator's whole plan restricted to each node.
Compared from the second step on: through its first step the layer balances from an empty history where the
simulator adopts the history's first refresh at once (docs/simulation.md, "What the layer does differently")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feplb.sched import CostModel
from feplb.testing import run_dist

pytestmark = pytest.mark.dist

W, G, E, K, T, H = 4, 2, 16, 2, 48, 16
R, STEPS = 3, 3                      # micro-batches per step (= refresh_every), steps
POLICIES = ("feplb", "feplb-split", "feplb-split@ema", "eplb", "feplb-split+place")
COST = CostModel(hidden=H, ffn=H, dtype_bytes=4)


def _routing(seed: int = 0) -> np.ndarray:
    """int64 [N, W, T, K]: each token's K distinct experts, skewed towards a few experts that drift over time."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in range(R * STEPS):
        pop = torch.arange(1, E + 1, dtype=torch.float64).pow(-1.2).roll(n // 2)
        out.append(torch.stack([torch.multinomial(pop.expand(T, E), K, generator=gen) for _ in range(W)]))
    return torch.stack(out).numpy()


def _layer_plans(rank: int, world: int, policy: str, ids_NWTK: np.ndarray) -> list:
    from feplb import FEPLBConfig, MoELayer

    torch.manual_seed(0)
    per_step = "@ema" in policy or "+place" in policy or policy == "eplb"
    layer = MoELayer(FEPLBConfig(hidden=H, ffn=H, num_experts=E, top_k=K, router="external", gpus_per_node=G, dyn=2,
                                 policy=policy, weights="per-step" if per_step else "per-microbatch",
                                 refresh_every=R, min_straggler_rows=0, min_chunk=2, cost=COST,
                                 plan_wait_ms=60_000))
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    layer.attach_optimizer(opt)
    gen = torch.Generator().manual_seed(100 + rank)
    got = []
    for i in range(ids_NWTK.shape[0]):
        ids = torch.from_numpy(np.ascontiguousarray(ids_NWTK[i, rank]))
        x = torch.randn(T, H, generator=gen, requires_grad=True)
        layer(x, routing=(ids, torch.full((T, K), 1.0 / K))).pow(2).mean().backward()
        p, s = layer.last_plan, layer.last_stats
        got.append({"planned": list(s.planned_ranks), "balanced": s.balanced,
                    "plan": None if p is None else _restricted(p, s.planned_ranks)})
        if (i + 1) % R == 0:
            opt.step()
            opt.zero_grad()
    layer.close()
    return got


def _restricted(plan, ranks) -> dict:
    """What a plan decides for the GPUs ``ranks``: their moves and weight copies, their loads, the sets."""
    ranks = set(ranks)
    return {"moves": [tuple(int(v) for v in m) for m in plan.moves if m.src in ranks],
            "weight_copies": sorted(tuple(c) for c in plan.weight_copies if c[2] in ranks),
            "loads_after": [int(v) for d, v in enumerate(plan.loads_after_W) if d in ranks],
            "dynamic": plan.dynamic_WD.tolist(), "home": None if plan.home_E is None else plan.home_E.tolist()}


class _Replay:
    """A workload of one layer replaying given per-rank counts, micro-batch after micro-batch."""

    num_layers, layer_names, name, expert_shape = 1, ("layer",), "replay", None

    def __init__(self, counts_NWE: np.ndarray):
        self.counts, self.num_experts, self.top_k = counts_NWE, counts_NWE.shape[2], K

    def microbatches(self, rng, num_ranks, tokens_per_rank):
        for c in self.counts:
            yield c[None]


def _sim_plans(policy: str, counts_NWE: np.ndarray, monkeypatch) -> list:
    import feplb.simulate as sim

    plans, make = [], sim.make_plan

    def recorded(*args, **kwargs):
        plans.append(make(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(sim, "make_plan", recorded)
    cfg = sim.SimConfig(num_ranks=W, gpus_per_node=G, tokens_per_rank=T, dyn=2, policies=(policy,),
                        microbatches=counts_NWE.shape[0], warmup=0, refresh_every=R, min_chunk=2, cost=COST,
                        plan_us=50)
    sim.simulate(_Replay(counts_NWE), cfg)
    monkeypatch.undo()
    return plans


@pytest.mark.parametrize("policy", POLICIES)
def test_layer_executes_the_simulators_plans(policy, monkeypatch):
    ids = _routing()
    counts = np.stack([[np.bincount(ids[n, w].ravel(), minlength=E) for w in range(W)]
                       for n in range(ids.shape[0])]).astype(np.int64)
    sim_plans = _sim_plans(policy, counts, monkeypatch)
    layer = run_dist(_layer_plans, W, policy, ids, timeout_s=300, collective_timeout_s=60)
    compared = moved = 0
    for i in range(R, ids.shape[0]):            # from the second step on
        for r in range(W):
            got = layer[r][i]
            assert got["balanced"], (policy, i, r, "the layer made no plan")
            want = _restricted(sim_plans[i], got["planned"])
            assert got["plan"] == want, (policy, "micro-batch", i, "rank", r, got["plan"], want)
            compared += 1
            moved += len(want["moves"])
    assert compared == W * R * (STEPS - 1) and moved > 0, (policy, compared, moved)
