"""CPU planning for FEPLB, numpy only (imported as ``feplb.sched``).

Legend: W EP ranks (= GPUs), G GPUs per node, E experts, D dynamic experts per GPU.
"""

from feplb.sched.cost import CostModel, LayerTimes
from feplb.sched.metrics import gemm_straggler, max_over_mean, pct_of_ideal, token_straggler
from feplb.sched.placement import eplb_layout, eplb_replicas, place_experts
from feplb.sched.plan import BASE_POLICIES, INTRA_NODE_BASES, Move, Plan, parse_policy, policy_base
from feplb.sched.policies import POLICIES, make_plan, select_dynamic
from feplb.sched.state import PolicyState
from feplb.sched.topology import Topology

__all__ = [
    "BASE_POLICIES", "INTRA_NODE_BASES", "POLICIES", "CostModel", "LayerTimes", "Move", "Plan", "PolicyState",
    "Topology", "eplb_layout", "eplb_replicas", "gemm_straggler", "make_plan", "max_over_mean", "parse_policy",
    "pct_of_ideal", "place_experts", "policy_base", "select_dynamic", "token_straggler",
]
