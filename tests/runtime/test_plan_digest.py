"""``feplb.steps.plan_digest``, which the ranks of a plan's scope compare in their readiness agreement: equal in
processes whose string and bytes hashes are salted apart (``PYTHONHASHSEED``), as the ranks' are, for plans of
every policy, whole and per node; different where plans differ in what the ranks exchange."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np

CODE = r"""
import json, numpy as np
from feplb.sched import Topology, make_plan
from feplb.sched.state import PolicyState
from feplb.steps import plan_digest
out = []
rng = np.random.default_rng(5)
for W, E, G in ((4, 16, 2), (8, 64, 8), (16, 64, 8)):
    topo = Topology(num_ranks=W, num_experts=E, gpus_per_node=G)
    counts = (rng.zipf(1.4, size=(W, E)).clip(max=500) * 3).astype(np.int64)
    for policy in ("feplb", "feplb-split", "lp", "fastermoe", "eplb", "feplb-split+place", "feplb@ema"):
        state = PolicyState(topo=topo, policy=policy).observe(counts, None)
        for node in ((None, 0) if W > G and not policy.startswith(("fastermoe", "eplb")) else (None,)):
            plan = make_plan(policy, counts, topo, state, node=node)
            out.append([policy, W, node, len(plan.moves), len(plan.weight_copies), plan_digest(plan)])
print(json.dumps(out))
"""


def _digests(seed: str) -> list:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    proc = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_plan_digest_equal_across_processes():
    a, b = _digests("1"), _digests("2")
    assert a == b
    assert sum(row[3] + row[4] for row in a) > 0          # plans that move rows and copy weights
    assert len({row[5] for row in a}) > 1                # (telling plans apart: the test below)


def test_plan_digest_tells_exchanges_apart():
    from feplb.sched import Topology, make_plan
    from feplb.steps import plan_digest

    topo = Topology(num_ranks=4, num_experts=16, gpus_per_node=4)
    counts = np.full((4, 16), 4, dtype=np.int64)
    counts[:, 0] = 90
    plan = make_plan("feplb-split", counts, topo, min_chunk=2)
    m = next(m for m in plan.moves if m.row_end - m.row_start >= 2)
    shorter = [mv._replace(row_end=mv.row_end - 1) if mv is m else mv for mv in plan.moves]
    after = plan.loads_after_W.copy()
    after[m.src] += 1
    after[m.dst] -= 1
    other = dataclasses.replace(plan, moves=tuple(shorter), loads_after_W=after)
    assert plan_digest(plan) == plan_digest(make_plan("feplb-split", counts, topo, min_chunk=2))
    assert plan_digest(other) != plan_digest(plan)
    assert 0 <= plan_digest(plan) < 1 << 62
