"""Shared strategies for the scheduler tests (exposed as fixtures: test modules cannot import each other)."""

import numpy as np
import pytest
from hypothesis import strategies as st

from feplb.sched import Topology


@st.composite
def topo_and_counts(draw, max_nodes: int = 3):
    """A random valid Topology and skewed counts_WE for it (int64 [W, E], some zero columns)."""
    g = draw(st.sampled_from([1, 2, 4, 8]))
    nodes = draw(st.integers(1, max_nodes))
    epr = draw(st.integers(1, 6))
    dyn = draw(st.integers(0, epr))
    topo = Topology(num_ranks=g * nodes, gpus_per_node=g, num_experts=g * nodes * epr, dyn=dyn)
    seed = draw(st.integers(0, 2**32 - 1))
    alpha = draw(st.sampled_from([0.05, 0.3, 1.0, 10.0]))
    rows = draw(st.sampled_from([0, 1, 7, 300, 3000]))
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(topo.num_experts, alpha))
    counts = rng.multinomial(rows, p, size=topo.num_ranks).astype(np.int64)
    return topo, counts


@pytest.fixture(scope="session")
def strategies():
    return {"topo_and_counts": topo_and_counts}
