"""The FEPLB MoE layer: expert parallelism with per-micro-batch load balancing inside the node.

Forward, per rank (see the design's "The design"): route -> all-gather counts -> phase-1 all-to-all to the
experts' home GPUs -> static experts' grouped GEMM -> CPU plan (identical on every rank, from identical counts)
-> phase-2 copies of rows (and weights, unless resident) to helper GPUs -> dynamic experts' GEMM where the plan
put them -> results home -> reverse all-to-all -> weighted combine. Every communication step is a differentiable
function (``feplb.dispatch``), so backward mirrors forward: gradients of moved rows return home and weight gradients
computed on a helper are added to the owner's ``.grad`` exactly once.

Never wait, never wrong: the plan runs on a CPU thread while the static GEMM runs; if it is not ready when the
static GEMM finishes (plus ``plan_wait_ms``), the ranks that must agree (the node for in-node policies, else the
EP group) fall back together to computing at home, decided by one tiny MIN all-reduce. Results never depend on
that decision beyond floating-point summation order.

Legend: T tokens on this rank, K top-k, H hidden, F ffn, E experts, L = E / W local experts, W EP ranks, G GPUs per
node, M = T*K rows sent by this rank, R rows at home on this rank after phase 1, D dynamic experts per GPU.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from feplb.control import Control
from feplb.copy_engine import make_copy_engine
from feplb.dispatch import PeerComm, all_to_all_rows, exchange
from feplb.transport import make_transport

__all__ = ["DirectLayout", "FEPLBConfig", "LayerStats", "MoELayer", "direct_layout", "expert_mlp"]

# Peers' policies, whose plans the phase-1 dispatch executes (rows go straight to the GPU that computes them).
_DIRECT_BASES = frozenset({"fastermoe", "eplb"})

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _pos_int(name: str, v: object, lo: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"FEPLBConfig.{name} must be an int >= {lo}, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class FEPLBConfig:
    """Configuration of one MoE layer (identical on every rank of the EP group; checked at construction).

    hidden, ffn: H and F of the SwiGLU experts. num_experts: E (divisible by the EP group size). top_k: K.
    router: "softmax" (gate = softmax probability) or "sigmoid" (gate = sigmoid, normalised over the top-k).
    router_bias: a per-expert bias buffer added to the scores for expert SELECTION only (auxiliary-loss-free
        balancing; it never enters the gate weights or the gradient).
    gpus_per_node: G, GPUs of a node (the copy path's reach); divides the EP group size.
    dyn: dynamic experts per GPU (clipped to E / W); policy: any ``feplb.sched`` policy name
        (``BASE[+place][@current|@ema]``), "none" = plain EP. ``+place`` computes experts where the placement from
        routing history puts them (weights='per-step' keeps a bank of the placed experts' weights on each GPU,
        refreshed once per step); ``fastermoe`` and ``eplb`` route rows in the phase-1 dispatch as those systems do.
    transport: "torch" (torch.distributed) or "nvshmem" (nvshmem4py, CUDA only).
    device: where parameters and activations live: "cpu", "cuda" (the current CUDA device), or "auto" (CUDA when
        the EP group's backend is NCCL or transport="nvshmem", else CPU). "cuda" over a gloo group runs several
        processes on one GPU (NCCL refuses that): gloo carries the small host collectives, NVSHMEM phase 1.
    copy_path: the in-node copy path (``feplb.copy_engine.make_copy_engine``'s kind): "auto" (CPU: shared memory;
        CUDA: nvshmem4py puts with transport="nvshmem", else CUDA IPC peer copies), "shm" or "gloo" on CPUs,
        "nvshmem", "ipc" or "nccl" (SM copies, a fallback) on GPUs.
    weights: "per-step" (helpers hold resident replicas, refreshed by ``refresh_replicas()`` after the optimizer
        step, gradients reduced by ``reduce_replica_grads()`` before it) or "per-microbatch" (weights travel with
        the rows every micro-batch, gradients return with the backward pass).
    refresh_every: micro-batches between the policy state's slow refreshes (``@ema`` dynamic sets, EPLB replicas).
    plan_wait_ms: grace after the static GEMM before falling back to computing at home (0 = never wait).
    min_straggler_rows: balance only when the token straggler with every expert at its home is at least this many
        rows (a deterministic gate, identical on every rank).
    tau, min_chunk: planner options (``feplb.sched.make_plan``); min_chunk None = the cost model's knee.
    cost: the planner's ``feplb.sched.cost.CostModel`` (FasterMoE's shadowing decision, feplb-split's default
        min_chunk); None = the H200 table scaled to this layer's expert shape and dtype.
    recv_capacity: rows the phase-1 receive buffer holds (None = sized per micro-batch). on_overflow: "grow"
        (reallocate, recorded in ``LayerStats.recv_grew``) or "error" (ValueError; rows are never dropped).
    dtype: parameter and activation dtype.
    """

    hidden: int
    ffn: int
    num_experts: int
    top_k: int
    router: str = "softmax"
    router_bias: bool = False
    gpus_per_node: int = 1
    dyn: int = 4
    policy: str = "feplb"
    transport: str = "torch"
    copy_path: str = "auto"
    device: str = "auto"
    weights: str = "per-step"
    refresh_every: int = 8
    plan_wait_ms: float = 0.0
    min_straggler_rows: int = 0
    tau: float = 0.01
    min_chunk: int | None = None
    cost: Any = None
    recv_capacity: int | None = None
    on_overflow: str = "grow"
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn", "num_experts", "top_k", "gpus_per_node", "refresh_every"):
            _pos_int(name, getattr(self, name))
        _pos_int("dyn", self.dyn, 0)
        _pos_int("min_straggler_rows", self.min_straggler_rows, 0)
        if self.top_k > self.num_experts:
            raise ValueError(f"FEPLBConfig.top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"FEPLBConfig.router must be 'softmax' or 'sigmoid', got {self.router!r}")
        from feplb.copy_engine import COPY_KINDS

        if self.copy_path not in COPY_KINDS:
            raise ValueError(f"FEPLBConfig.copy_path must be one of {COPY_KINDS}, got {self.copy_path!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"FEPLBConfig.device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.transport not in ("torch", "nvshmem"):
            raise ValueError(f"FEPLBConfig.transport must be 'torch' or 'nvshmem', got {self.transport!r}")
        if self.weights not in ("per-step", "per-microbatch"):
            raise ValueError(f"FEPLBConfig.weights must be 'per-step' or 'per-microbatch', got {self.weights!r}")
        if self.on_overflow not in ("grow", "error"):
            raise ValueError(f"FEPLBConfig.on_overflow must be 'grow' or 'error', got {self.on_overflow!r}")
        if self.dtype not in _DTYPES:
            raise TypeError(f"FEPLBConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not (isinstance(self.plan_wait_ms, (int, float)) and 0 <= self.plan_wait_ms < float("inf")):
            raise ValueError(f"FEPLBConfig.plan_wait_ms must be a finite number >= 0, got {self.plan_wait_ms!r}")
        from feplb.sched.cost import CostModel

        if self.cost is not None and not isinstance(self.cost, CostModel):
            raise TypeError(f"FEPLBConfig.cost must be a feplb.sched.cost.CostModel or None, got "
                            f"{type(self.cost).__name__}")
        if self.min_chunk is not None:
            _pos_int("min_chunk", self.min_chunk)
        if self.recv_capacity is not None:
            _pos_int("recv_capacity", self.recv_capacity, 0)
        from feplb.sched.plan import parse_policy

        parse_policy(self.policy)


@dataclass(frozen=True, kw_only=True)
class LayerStats:
    """What the last forward did. Identical on every rank of a node (``plan_us`` is this rank's); when only some
    nodes fell back, ``loads_after_W`` of other nodes shows their planned moves.

    loads_before_W: rows each GPU would compute under plain EP (every expert at its owner, no balancing).
    rows_at_home_W: rows each GPU would compute with the current placement (``+place``) and no per-micro-batch
    balancing (equal to loads_before_W without placement). loads_after_W: rows each GPU computed.
    token_straggler_before/after: max - mean of loads_before_W / loads_after_W (``feplb.sched.token_straggler``).
    rows_moved: rows computed away from their home (all GPUs); copy_bytes: forward bytes over all GPUs of phase 2
    (rows out, results back) and of weights copied this micro-batch (per-micro-batch weights, FasterMoE shadows).
    weight_copies: experts' weights copied to a helper this micro-batch. experts_placed: experts whose home is
    not their owner. plan_us: wall time of this rank's planner call (0 when no plan was made).
    balanced: the plan was executed; fell_back: a plan was wanted but not ready in time on some rank of the scope,
    so every rank there computed at home. plan_fingerprint: hash of the executed plan (equal on every rank of the
    plan's scope; nodes that fell back report 0).
    """

    loads_before_W: list[int]
    loads_after_W: list[int]
    token_straggler_before: float
    token_straggler_after: float
    rows_moved: int
    copy_bytes: int
    weight_copies: int
    plan_us: float
    balanced: bool
    fell_back: bool
    plan_fingerprint: int = 0
    recv_grew: bool = False
    policy: str = "none"
    dynamic_WD: list[list[int]] = field(default_factory=list)
    experts_placed: int = 0
    rows_at_home_W: list[int] = field(default_factory=list)


def expert_mlp(x_MH: torch.Tensor, w1_LH2F: torch.Tensor, w2_LFH: torch.Tensor,
               offsets_L: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over grouped rows: grouped_mm(x, w1) -> swiglu -> grouped_mm(., w2).

    x_MH: [M, H]; w1_LH2F: [L, H, 2F]; w2_LFH: [L, F, H]; offsets_L: int32/int64 [L] END offsets. Returns [M, H].
    """
    from feplb.kernels import grouped_mm, swiglu

    if w1_LH2F.shape[0] == 0:
        return x_MH.new_zeros((0, w2_LFH.shape[-1])) + x_MH.sum() * 0
    h = grouped_mm(x_MH, w1_LH2F, offsets_L, check=False)
    return grouped_mm(swiglu(h), w2_LFH, offsets_L, check=False)


def _digest(obj: object) -> int:
    """A process-independent 62-bit hash (Python's hash() of bytes is salted per process)."""
    return int.from_bytes(hashlib.sha256(repr(obj).encode()).digest()[:8], "little") >> 2


def _node_matrix(triples, rank: int, gpus_per_node: int) -> np.ndarray:
    """int64 [G, G]: elements node rank i of ``rank``'s node sends node rank j, from global (src rank, dst rank,
    elements) triples, identical on every rank; pairs that leave or enter the node are left out (the transport
    carries them). The copy path then needs no size agreement."""
    G = gpus_per_node
    base = rank // G * G
    m = np.zeros((G, G), dtype=np.int64)
    for s, d, n in triples:
        if base <= s < base + G and base <= d < base + G:
            m[s - base, d - base] += n
    return m


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation (int64 indices): ``x.index_select(0, perm).index_select(0, _inverse(perm))``
    is x."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _loads_after(loads_W: np.ndarray, moves) -> np.ndarray:
    """Rows each GPU computes once ``moves`` are executed (int64 [W], a new array)."""
    out = loads_W.copy()
    for m in moves:
        out[m.src] -= m.rows
        out[m.dst] += m.rows
    return out


def _ranges(pieces: list[tuple[int, int]], n: int) -> list[tuple[int, int, bool]]:
    """Split [0, n) into (start, end, moved) segments given sorted, disjoint moved ranges."""
    out, cur = [], 0
    for a, b in pieces:
        if a > cur:
            out.append((cur, a, False))
        out.append((a, b, True))
        cur = b
    if cur < n:
        out.append((cur, n, False))
    return out


class MoELayer(nn.Module):
    """FEPLB MoE layer over an EP process group.

    Args:
        config: the layer's configuration (identical on all ranks; a mismatch raises ValueError on every rank).
        group: the EP process group (default: the world). ``torch.distributed`` must be initialised.

    Parameters: ``router.weight`` [E, H] (replicated: broadcast from group rank 0 at construction; its gradient
    covers this rank's tokens only, reduce it like any data-parallel parameter), ``w1`` [L, H, 2F] and ``w2``
    [L, F, H] (this rank's experts, SwiGLU, stored grouped: the rank OWNS experts ``rank * L ...``; their optimizer
    state stays here). Buffer ``router_bias`` [E] when configured.

    Where an expert is computed: at its HOME GPU, which is its owner unless a ``+place`` policy placed it elsewhere
    (a slow-timescale placement from routing history, adopted at ``refresh_replicas()`` with weights='per-step',
    or as soon as the policy refreshes it with weights='per-microbatch'); a GPU then computes the experts placed on
    it (its SLOTS, ascending ids) from a bank of their weights. Per micro-batch the plan moves rows from the home
    to helpers: in-node policies through phase 2 (copy path), peers' policies (``fastermoe``, ``eplb``) by sending
    the rows straight to the GPU that computes them in the phase-1 dispatch, as those systems do.
    """

    testing_plan_delay_s: float = 0.0  # testing hook: the next plan sleeps this long first (then resets to 0)

    def __init__(self, config: FEPLBConfig, group: dist.ProcessGroup | None = None):
        super().__init__()
        if not isinstance(config, FEPLBConfig):
            raise TypeError(f"config must be a FEPLBConfig, got {type(config).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("MoELayer needs torch.distributed initialised (init_process_group) first")
        from feplb.sched import policies as sched_policies
        from feplb.sched.cost import CostModel
        from feplb.sched.plan import INTRA_NODE_BASES, parse_policy
        from feplb.sched.state import PolicyState
        from feplb.sched.topology import Topology

        self._sched = sched_policies
        # The planner's cost model, for this layer's expert shape (FasterMoE's shadowing decision weighs it).
        self._cost = config.cost if config.cost is not None else CostModel(
            hidden=config.hidden, ffn=config.ffn, dtype_bytes=torch.empty((), dtype=config.dtype).element_size())
        c = self.config = config
        self.group = group
        W, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.world_size = W
        if c.num_experts % W:
            raise ValueError(f"FEPLBConfig.num_experts ({c.num_experts}) must be divisible by the EP group size ({W})")
        if W % c.gpus_per_node:
            raise ValueError(f"FEPLBConfig.gpus_per_node ({c.gpus_per_node}) must divide the EP group size ({W})")
        L = self.num_local = c.num_experts // W
        self.base, self.place, _ = parse_policy(c.policy)
        self.in_node_policy = self.base in INTRA_NODE_BASES or self.base == "none"
        self.direct = self.base in _DIRECT_BASES
        self.topo = Topology(num_ranks=W, gpus_per_node=c.gpus_per_node, num_experts=c.num_experts,
                             dyn=min(c.dyn, L) if self.base != "none" else 0)
        backend = dist.get_backend(group)
        on_gpu = c.device == "cuda" or (c.device == "auto" and ("nccl" in backend or c.transport == "nvshmem"))
        if on_gpu and not torch.cuda.is_available():
            raise RuntimeError(f"FEPLBConfig.device={c.device!r} (transport {c.transport!r}, backend {backend!r}) "
                               "needs a CUDA GPU, and none is available")
        if not on_gpu and backend == "nccl":   # (a "cpu:gloo,cuda:nccl" group carries both)
            raise ValueError("FEPLBConfig.device='cpu' cannot run over an NCCL group (NCCL moves CUDA tensors only)")
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.control = Control(group, c.gpus_per_node)
        # Collective: identical configs everywhere before any other collective of this layer.
        self.control.check_same(repr(dataclasses.asdict(c)).encode() + repr((W, c.gpus_per_node)).encode(),
                                "FEPLBConfig", "every rank of the EP group must build the layer with the same config")
        self.transport = make_transport(c.transport, group, self.control)
        self.node_group, self.node_ranks = self.control.node_group, self.control.node_ranks
        copy = make_copy_engine(c.copy_path, device, self.control, transport_kind=c.transport)
        self.comm = PeerComm(self.transport, copy, c.gpus_per_node)
        self.state = PolicyState(topo=self.topo, policy=c.policy, refresh_every=c.refresh_every) \
            if (self.base != "none" or self.place) else None
        # The slow decisions the layer executes (placement, @ema sets, EPLB replicas): the policy state as of the
        # last adoption. Plans are made from it, so they always match the weights the GPUs hold.
        self._plan_state = self.state

        H, Fd = c.hidden, c.ffn
        self._w_numel = H * 2 * Fd + Fd * H   # elements of one expert's (w1, w2)
        self.router = nn.Linear(H, c.num_experts, bias=False, device=device, dtype=c.dtype)
        self.w1 = nn.Parameter(torch.randn(L, H, 2 * Fd, device=device, dtype=c.dtype) / H ** 0.5)
        self.w2 = nn.Parameter(torch.randn(L, Fd, H, device=device, dtype=c.dtype) / Fd ** 0.5)
        if c.router_bias:
            self.register_buffer("router_bias", torch.zeros(c.num_experts, device=device, dtype=torch.float32))
        else:
            self.router_bias = None
        # expert -> flat slot (home GPU * L + position among its slots); the dispatch groups rows by slot. Not a
        # buffer: data parallelism broadcasts buffers, and each EP group places its experts from its own counts.
        self._slot_of_E = torch.arange(c.num_experts, device=device)
        # a zero-size leaf that puts every collective's backward in the graph whenever autograd records
        self._grad_leaf = torch.zeros(0, device=device, dtype=c.dtype, requires_grad=True)
        self._generation = 0          # bumped by every refresh_replicas(); a late gradient marks the layer broken
        self._late_grad = False
        self._ever_held = False       # some rank has held per-step copies (a global fact: pairs are global)
        with torch.no_grad():
            dist.broadcast(self.router.weight, src=dist.get_global_rank(group, 0) if group is not None else 0,
                           group=group)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="feplb-plan") \
            if self.base != "none" else None
        self._recv_buf: torch.Tensor | None = None
        self._planning: concurrent.futures.Future | None = None   # the planner thread's latest job
        self._resident: frozenset[tuple[int, int]] = frozenset()   # (expert, gpu) replicas held besides home
        self._replicas: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # expert -> leaf (w1, w2) on this rank
        self._bank: tuple[torch.Tensor, torch.Tensor] | None = None  # per-step leaf weights of my slots (placed)
        self._step_pairs: tuple[tuple[int, int], ...] = ()   # (expert, gpu != owner) holding per-step copies
        self._replica_version: tuple[int, int] = (-1, -1)
        self._last_counts_WE: np.ndarray | None = None
        self._slot_w: tuple[torch.Tensor, torch.Tensor] = (self.w1, self.w2)
        self._set_placement(self.topo.default_home_E())
        self.last_stats: LayerStats | None = None
        self.last_plan = None
        self.last_plan_inputs = None

    # ------------------------------------------------------------------------------------------------ helpers
    def _scope_group(self) -> str:
        return "node" if self.in_node_policy else "group"

    def _owner(self, e: int) -> int:
        return e // self.num_local

    def _home(self, e: int) -> int:
        return self._home_list[e]

    @property
    def home_E(self) -> np.ndarray:
        """int64 [E]: the GPU that computes each expert by default (its owner unless placed elsewhere)."""
        return self._home_E.copy()

    def _set_placement(self, home_E: np.ndarray) -> None:
        from feplb.sched.state import slots_of

        home = np.array(home_E, dtype=np.int64)
        self._home_E = home
        self._home_list = home.tolist()
        # (expert, home) for every expert computed away from its owner under this placement
        self._placed_pairs = [(e, h) for e, h in enumerate(self._home_list) if h != self._owner(e)]
        self._slots_WS = slots_of(home, self.topo)
        self._my_slots = self._slots_WS[self.rank].tolist()
        self._slot_pos = {e: i for i, e in enumerate(self._my_slots)}
        lo = self.rank * self.num_local
        self._own_slots = self._my_slots == list(range(lo, lo + self.num_local))
        self._placed = bool(self._placed_pairs)
        slot_of = np.empty(self.config.num_experts, dtype=np.int64)
        slot_of[self._slots_WS.reshape(-1)] = np.arange(self.config.num_experts)
        with torch.no_grad():
            self._slot_of_E.copy_(torch.from_numpy(slot_of))

    def _local_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's weights of expert e (views): a slot of the bank, a resident replica, or its own parameter."""
        i = self._slot_pos.get(e)
        if i is not None:
            return self._slot_w[0][i], self._slot_w[1][i]
        if e in self._replicas:
            return self._replicas[e]
        if self._owner(e) == self.rank:
            i = e - self.rank * self.num_local
            return self.w1[i], self.w2[i]
        raise RuntimeError(f"MoELayer: GPU {self.rank} holds no weights of expert {e}")

    def _anchor(self, t: torch.Tensor) -> torch.Tensor:
        """An empty 1-D tensor that requires grad whenever the layer's rows or expert weights do. Every exchange
        takes one in its input, so that whether its backward runs (a collective) never depends on what this rank
        happens to send: the input is the same everywhere, and under autograd every rank of a node calls it."""
        a = t[:0].reshape(-1) + self.w1.reshape(-1)[:0]
        return a + self._grad_leaf if torch.is_grad_enabled() else a

    def _traffic(self, pairs) -> tuple[bool, bool]:
        """(cross_node, intra_node) of (src rank, dst rank) pairs identical on every rank: whether any pair crosses
        nodes (the transport is called, globally agreed), whether any pair stays inside this rank's node (the copy
        path is called, agreed inside the node)."""
        G = self.config.gpus_per_node
        node = self.rank // G
        pairs = list(pairs)
        return (any(s // G != d // G for s, d in pairs),
                any(s // G == node and d // G == node for s, d in pairs))

    def _stack_slots(self, got: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slot weights stacked ([L, H, 2F], [L, F, H]): received ones from ``got``, its own parameters
        for the rest."""
        lo = self.rank * self.num_local
        ws = [got[e] if e in got else (self.w1[e - lo], self.w2[e - lo]) for e in self._my_slots]
        return torch.stack([a for a, _ in ws]), torch.stack([b for _, b in ws])

    def _has_weights(self, e: int, g: int) -> bool:
        return self._home(e) == g or self._owner(e) == g or (e, g) in self._resident

    def extra_repr(self) -> str:
        c = self.config
        return (f"hidden={c.hidden}, ffn={c.ffn}, experts={c.num_experts} ({self.num_local} local), top_k={c.top_k}, "
                f"policy={c.policy!r}, weights={c.weights!r}, ranks={self.world_size}, gpus_per_node={c.gpus_per_node}")

    # ------------------------------------------------------------------------------------------------ routing
    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router: x_TD [T, H] -> (topk_ids_TK int64 [T, K], topk_weights_TK [T, K] in x's dtype, bad: bool 0-d
        tensor set when a logit is NaN or inf). Scores in fp32; the bias (if any) affects selection only."""
        c = self.config
        logits_TE = F.linear(x_TD, self.router.weight).float()
        bad = ~torch.isfinite(logits_TE).all()
        scores_TE = logits_TE.softmax(-1) if c.router == "softmax" else logits_TE.sigmoid()
        sel_TE = scores_TE.detach() if self.router_bias is None else scores_TE.detach() + self.router_bias
        sel_TE = torch.nan_to_num(sel_TE, nan=0.0, posinf=0.0, neginf=0.0)
        topk_ids_TK = sel_TE.topk(c.top_k, dim=-1).indices
        w_TK = scores_TE.gather(-1, topk_ids_TK)
        if c.router == "sigmoid":
            w_TK = w_TK / w_TK.sum(-1, keepdim=True).clamp_min(1e-20)
        return topk_ids_TK, w_TK.to(x_TD.dtype), bad

    def _routing_problem(self, x: torch.Tensor, routing: object) -> tuple[type, str] | None:
        """What is wrong with routing given to forward() (shapes, dtypes, devices), or None; values are checked
        on the device, through the counts all-gather."""
        K = self.config.top_k
        if not (isinstance(routing, (tuple, list)) and len(routing) == 2
                and all(isinstance(t, torch.Tensor) for t in routing)):
            return TypeError, "MoELayer routing must be a pair of tensors (topk_ids [T, K], topk_weights [T, K])"
        ids, w = routing
        T = x.numel() // self.config.hidden
        for name, t in (("topk_ids", ids), ("topk_weights", w)):
            if t.numel() != T * K or t.shape[-1] != K:
                return ValueError, (f"MoELayer routing {name} must be [{T}, {K}] (one row of top-{K} per token), "
                                    f"got shape {list(t.shape)}")
            if t.device != x.device:
                return ValueError, f"MoELayer routing {name} is on {t.device}, the input on {x.device}"
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            return TypeError, f"MoELayer routing topk_ids must be an integer tensor, got {ids.dtype}"
        if not w.is_floating_point():
            return TypeError, f"MoELayer routing topk_weights must be a floating tensor, got {w.dtype}"
        return None

    def _input_problem(self, x: object) -> tuple[type, str] | None:
        """What is wrong with the input (exception type, message), or None."""
        c = self.config
        if not isinstance(x, torch.Tensor):
            return TypeError, f"MoELayer input must be a torch.Tensor, got {type(x).__name__}"
        if x.dim() not in (2, 3) or x.shape[-1] != c.hidden:
            return ValueError, (f"MoELayer input must be [tokens, {c.hidden}] or [batch, seq, {c.hidden}], "
                                f"got shape {list(x.shape)}")
        if x.dtype != c.dtype:
            return TypeError, f"MoELayer input dtype must be {c.dtype} (FEPLBConfig.dtype), got {x.dtype}"
        if x.device != self.w1.device:
            return ValueError, f"MoELayer input is on {x.device} but the layer's experts are on {self.w1.device}"
        return None

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor,
                routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [T, H] or [B, S, H] in ``config.dtype`` -> same shape. Collective over the EP group.

        routing: optional (topk_ids [T, K] integer, topk_weights [T, K] floating) from a router outside the layer
            (one per token of x, in x's token order); the layer's own router is then skipped and the gradient
            flows into topk_weights. Ids outside [0, E) or non-finite weights raise on every rank together.

        Under ``torch.compile`` the routing and the combine compile; the dispatch in between (communication,
        CPU planning) is excluded with ``torch.compiler.disable``, so the graph breaks exactly there.
        """
        from feplb.kernels import permute, routing_metadata, unpermute

        problem = self._input_problem(x)
        if problem is None and routing is not None:
            problem = self._routing_problem(x, routing)
        if problem is not None:
            self._dispatch(None, None, None, problem)   # the peers learn it in the counts all-gather; raises
        x_TD = x.reshape(-1, self.config.hidden)
        if routing is None:
            topk_ids_TK, w_TK, bad = self.route(x_TD)
        else:
            ids_TK, w_TK = routing[0].reshape(-1, self.config.top_k), routing[1].reshape(-1, self.config.top_k)
            E = self.config.num_experts
            # flags, not a host check: a bad id or weight reaches every rank in the counts all-gather
            bad = (~torch.isfinite(w_TK).all()).long() + 2 * ((ids_TK < 0) | (ids_TK >= E)).any().long()
            topk_ids_TK, w_TK = ids_TK.long().clamp(0, E - 1), w_TK.to(x_TD.dtype)
        # Rows grouped by SLOT (home GPU, then the expert's place among that GPU's slots): every destination's
        # rows form one block whatever the placement, so phase 1 needs no extra gather.
        meta = routing_metadata(self._slot_of_E[topk_ids_TK], self.config.num_experts, check=False)
        x_MD = permute(x_TD, meta)
        y_MD = self._dispatch(x_MD, meta.counts_E, bad)
        return unpermute(y_MD, meta, w_TK).reshape(x.shape)

    @torch.compiler.disable
    def _dispatch(self, x_MD: torch.Tensor | None, counts_S: torch.Tensor | None, bad: torch.Tensor | None,
                  problem: tuple[type, str] | None = None) -> torch.Tensor:
        """Grouped rows x_MD [M, H] (by slot, then token, then k) -> expert outputs y_MD [M, H], same order.

        problem: this rank's input is bad (exception type, message): it still joins the counts all-gather, so that
        every rank raises together instead of leaving its peers waiting in a collective.
        """
        from feplb.sched.metrics import token_straggler

        c, W, L = self.config, self.world_size, self.num_local
        E = c.num_experts
        if torch._C._current_graph_task_id() != -1:
            # a forward inside a backward pass: activation checkpointing recomputing the layer
            raise RuntimeError("MoELayer cannot be recomputed by activation checkpointing: its forward is collective "
                               "and plans from live counts and timing, so a recompute would not repeat it; "
                               "checkpoint the attention and dense parts around the layer instead")
        if problem is None:
            flags = torch.cat([counts_S.to(torch.int64).reshape(-1), bad.to(torch.int64).reshape(1)]).cpu()
        else:
            flags = torch.zeros(E + 1, dtype=torch.int64)
        flags = torch.cat([flags, torch.tensor([int(not self._replicas_fresh()), int(problem is not None)])])
        gathered = self.control.all_gather(flags, "all_gather of expert counts")
        input_ranks = torch.nonzero(gathered[:, E + 2]).flatten().tolist()
        if problem is not None:
            raise problem[0](problem[1])
        if input_ranks:
            raise ValueError(f"MoELayer: the input of EP rank(s) {input_ranks} is malformed (see the error there); "
                             "every rank stops this step")
        id_ranks = torch.nonzero(gathered[:, E] & 2).flatten().tolist()
        if id_ranks:
            raise ValueError(f"MoELayer: routing passed to forward() holds expert ids outside [0, {E}) on EP rank(s) "
                             f"{id_ranks}")
        bad_ranks = torch.nonzero(gathered[:, E]).flatten().tolist()
        if bad_ranks:
            raise ValueError(f"MoELayer: router logits (or routing weights) contain NaN or inf on EP rank(s) "
                             f"{bad_ranks}; check the input and the router weights")
        stale_ranks = torch.nonzero(gathered[:, E + 1]).flatten().tolist()
        if stale_ranks:
            raise RuntimeError(f"MoELayer: expert weights changed since the last refresh_replicas() on EP rank(s) "
                               f"{stale_ranks}; call layer.refresh_replicas() after optimizer.step() "
                               "(weights='per-step')")
        counts_WS = gathered[:, :E].numpy()
        counts_WE = np.empty_like(counts_WS)
        counts_WE[:, self._slots_WS.reshape(-1)] = counts_WS
        loads_default = counts_WE.sum(axis=0).reshape(W, L).sum(axis=1)
        loads_home = counts_WS.sum(axis=0).reshape(W, L).sum(axis=1)
        pstate = self._plan_state

        want_plan = self.base != "none" and W > 1 and \
            token_straggler(loads_home) >= max(c.min_straggler_rows, 1e-9)
        if want_plan and self.direct:
            y_MD, plan, plan_us, moves, stats = self._forward_direct(x_MD, counts_WE, counts_WS, loads_home, pstate)
            fell_back, dyn_WD = False, np.asarray(plan.dynamic_WD)
        else:
            y_MD, plan, plan_us, fell_back, moves, dyn_WD, stats = self._forward_in_node(
                x_MD, counts_WE, counts_WS, loads_home, pstate, want_plan)

        self._last_counts_WE = counts_WE
        placed = len(self._placed_pairs)
        if self.state is not None and self.training:
            # the history follows training micro-batches only (module.eval() leaves it, and the placement, alone)
            self.state = self.state.observe(counts_WE, plan)
            if c.weights == "per-microbatch":
                self._adopt(self.state)   # nothing resident to keep consistent: slow decisions apply at once
        after = _loads_after(loads_home, moves)
        self.last_plan = plan
        self.last_plan_inputs = (counts_WE, pstate)   # what the plan was made from, for Plan.validate
        self.last_stats = LayerStats(
            loads_before_W=loads_default.tolist(), loads_after_W=after.tolist(),
            token_straggler_before=float(token_straggler(loads_default)),
            token_straggler_after=float(token_straggler(after)), rows_moved=sum(m.rows for m in moves),
            copy_bytes=stats["copy_bytes"], weight_copies=stats["weight_copies"], plan_us=plan_us,
            balanced=plan is not None, fell_back=fell_back,
            plan_fingerprint=_digest(plan.fingerprint()) if plan is not None else 0,
            recv_grew=self._recv_grew, policy=c.policy, dynamic_WD=dyn_WD.tolist(),
            experts_placed=placed, rows_at_home_W=loads_home.tolist())
        return y_MD

    def _forward_in_node(self, x_MD, counts_WE, counts_WS, loads_home, pstate, want_plan):
        """Phase 1 to the homes, static GEMM while the CPU plans, phase 2 inside the node, results home."""
        c, W, r, L = self.config, self.world_size, self.rank, self.num_local
        c_WL = counts_WS[:, r * L:(r + 1) * L]
        n_L = c_WL.sum(axis=0)
        send_splits = counts_WS[r].reshape(W, L).sum(axis=1).tolist()
        recv_splits = c_WL.sum(axis=1).tolist()

        # Dynamic experts are chosen before the static GEMM starts (cheap, identical everywhere).
        if want_plan:
            dyn_WD = np.asarray(self._sched.select_dynamic(c.policy, counts_WE, self.topo, pstate), dtype=np.int64)
            my_dyn = sorted(self._slot_pos[int(e)] for e in dyn_WD[r])
        else:
            dyn_WD = np.zeros((W, 0), dtype=np.int64)
            my_dyn = []
        dyn_set = set(my_dyn)
        static = [i for i in range(L) if i not in dyn_set]
        order = static + my_dyn

        # Phase 1: rows to their experts' home ranks, then into HOME ORDER (static block first, then dynamic).
        # rows source s sends rank d: every rank reads it off the same counts, so no transport agrees on splits
        split_WW = torch.from_numpy(counts_WS.reshape(W, W, L).sum(axis=2))
        recv_RD = self._all_to_all_in(x_MD, send_splits, recv_splits, loads_home, split_WW)
        bank_tail, bank_bytes = self._forward_bank(recv_RD)
        recv_off = np.concatenate([[0], np.cumsum(recv_splits)])
        within = np.concatenate([np.zeros((W, 1), np.int64), np.cumsum(c_WL, axis=1)], axis=1)
        perm = [np.arange(recv_off[s] + within[s, i], recv_off[s] + within[s, i + 1]) for i in order for s in range(W)]
        perm_R = torch.from_numpy(np.concatenate(perm) if perm else np.zeros(0, np.int64)).to(x_MD.device)
        h_RD = recv_RD.index_select(0, perm_R)
        blk = {}
        pos = 0
        for i in order:
            blk[i] = pos
            pos += int(n_L[i])
        n_static = sum(int(n_L[i]) for i in static)

        # Plan on a CPU thread; on a GPU the static GEMM is launched first and runs meanwhile. A planner still busy
        # with an earlier micro-batch's late plan is not queued behind: this micro-batch computes at home at once.
        busy = self._planning is not None and not self._planning.done()
        future = None
        if want_plan and x_MD.is_cuda:
            y_static = self._static_gemm(h_RD[:n_static], static, n_L)
            if not busy:
                future = self._planning = self._executor.submit(self._plan, counts_WE, pstate)
        elif want_plan:
            if not busy:
                future = self._planning = self._executor.submit(self._plan, counts_WE, pstate)
            y_static = self._static_gemm(h_RD[:n_static], static, n_L)
        else:
            y_static = self._static_gemm(h_RD[:n_static], static, n_L)
        plan, plan_us, fell_back = None, 0.0, False
        if want_plan:
            ready = 0
            if future is not None:
                if x_MD.is_cuda:
                    done = torch.cuda.Event()
                    done.record(torch.cuda.current_stream(x_MD.device))
                    while not future.done() and not done.query():
                        time.sleep(2e-6)
                try:
                    plan, plan_us = future.result(timeout=c.plan_wait_ms / 1e3)
                    ready = 1
                except concurrent.futures.TimeoutError:
                    ready = 0
            agreed = self.control.all_reduce_min(torch.tensor([ready], dtype=torch.int64), self._scope_group(),
                                                 "readiness agreement")
            if int(agreed[0]) == 0:
                plan, fell_back = None, True
        moves = () if plan is None else tuple(m for m in plan.moves if m.row_end > m.row_start)
        for m in moves:
            if m.src != self._home(m.expert):
                raise RuntimeError(f"plan move {m} does not start at expert {m.expert}'s home GPU")
            if m.src == r and self._slot_pos[m.expert] not in dyn_set:
                raise RuntimeError(f"plan moves static expert {m.expert} (dynamic set of GPU {r}: "
                                   f"{sorted(self._my_slots[i] for i in dyn_set)})")
        y_RD, stats = self._execute(h_RD, y_static, moves, my_dyn, blk, n_L)
        stats["copy_bytes"] += bank_bytes
        y_RD = torch.cat([y_RD, bank_tail.view(0, c.hidden)])
        y_back = all_to_all_rows(y_RD.index_select(0, _inverse(perm_R)), self.transport, recv_splits, send_splits,
                                 split_matrix=split_WW.t().contiguous())
        return y_back, plan, plan_us, fell_back, moves, dyn_WD, stats

    def _forward_direct(self, x_MD, counts_WE, counts_WS, loads_home, pstate):
        """Peers' policies (FasterMoE shadowing, EPLB replicas): plan first, then phase 1 sends every row straight
        to the GPU that computes it (a shadowed expert's rows stay on their source), no phase 2."""
        r, H = self.rank, self.config.hidden
        dev = x_MD.device
        plan, plan_us = self._plan(counts_WE, pstate)
        moves = tuple(m for m in plan.moves if m.row_end > m.row_start)
        for m in moves:
            if m.src != self._home(m.expert):
                raise RuntimeError(f"plan move {m} does not start at expert {m.expert}'s home GPU")
        lay = direct_layout(counts_WE, self._slots_WS, moves, r)
        recv_W = _loads_after(loads_home, moves)   # every rank receives what it computes
        send_idx = None if lay.send_idx is None else torch.from_numpy(lay.send_idx).to(dev)
        x_send = x_MD if send_idx is None else x_MD.index_select(0, send_idx)
        recv = self._all_to_all_in(x_send, lay.send_splits, lay.recv_splits, recv_W)
        bank_tail, bank_bytes = self._forward_bank(recv)
        perm = torch.from_numpy(lay.perm).to(dev)
        h = recv.index_select(0, perm)

        # Hosted experts' weights: a resident replica, the owner's parameter, or copied from the home now.
        copies = sorted({(m.expert, m.src, m.dst) for m in moves if not self._has_weights(m.expert, m.dst)})
        received_w, w_tail = self._copy_weights(copies, h, op="weights to helpers")
        n_home = int(lay.kept_L.sum())
        parts = [expert_mlp(h[:n_home], self._slot_w[0], self._slot_w[1],
                            torch.from_numpy(np.cumsum(lay.kept_L)).to(dev))]
        hosted = [moves[j] for j in lay.hosted]
        offs_I = torch.tensor([m.rows for m in hosted], dtype=torch.int64).to(dev)
        pos = n_home
        for k, m in enumerate(hosted):
            w1, w2 = received_w[m.expert] if m.expert in received_w else self._local_weights(m.expert)
            parts.append(expert_mlp(h[pos:pos + m.rows], w1.unsqueeze(0), w2.unsqueeze(0), offs_I[k:k + 1]))
            pos += m.rows
        parts += [w_tail.view(0, H), bank_tail.view(0, H), self._anchor(h).view(0, H)]
        y = torch.cat(parts)
        y_back = all_to_all_rows(y.index_select(0, _inverse(perm)), self.transport, lay.recv_splits, lay.send_splits)
        if send_idx is not None:
            y_back = y_back.index_select(0, _inverse(send_idx))
        elem = x_MD.element_size()
        w_bytes = self._w_numel * elem
        stats = {"copy_bytes": len(copies) * w_bytes + bank_bytes, "weight_copies": len(copies)}
        return y_back, plan, plan_us, moves, stats

    def _all_to_all_in(self, x_MD: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                       recv_W: np.ndarray, split_WW: torch.Tensor | None = None) -> torch.Tensor:
        """Phase-1 all-to-all into the layer's receive buffer (``recv_capacity``). Every rank knows every rank's
        receive size (recv_W, from the all-gathered counts), so an overflow is detected identically everywhere:
        all ranks grow, or all raise, and none is left waiting in a collective."""
        c = self.config
        self._recv_grew = False
        if c.recv_capacity is None:
            return all_to_all_rows(x_MD, self.transport, send_splits, recv_splits, split_matrix=split_WW,
                                   anchor=self._anchor(x_MD))
        cap = c.recv_capacity if self._recv_buf is None else self._recv_buf.shape[0]
        over = [int(w) for w in np.nonzero(recv_W > cap)[0]]
        if over:
            if c.on_overflow == "error":
                raise ValueError(f"MoELayer: phase 1 delivers {int(recv_W.max())} rows to EP rank(s) {over} but "
                                 f"recv_capacity is {cap} rows; raise FEPLBConfig.recv_capacity or set "
                                 "on_overflow='grow' (rows are never dropped)")
            cap = max(int(recv_W.max()), 2 * cap)
            self._recv_buf = None
            self._recv_grew = True
        if self._recv_buf is None:
            self._recv_buf = x_MD.new_empty((cap, c.hidden))
        return all_to_all_rows(x_MD, self.transport, send_splits, recv_splits, out=self._recv_buf,
                               split_matrix=split_WW, anchor=self._anchor(x_MD))

    def _static_gemm(self, x_SD: torch.Tensor, static: list[int], n_L: np.ndarray) -> torch.Tensor:
        """The static experts' rows (ascending slot order) through ALL slot weights, the other slots given empty
        groups, so no weight is gathered or copied."""
        if not static:
            return x_SD.new_zeros((0, self.config.hidden)) + x_SD.sum() * 0
        rows_L = np.zeros(self.num_local, dtype=np.int64)
        for i in static:
            rows_L[i] = n_L[i]
        offs = torch.from_numpy(np.cumsum(rows_L)).to(x_SD.device)
        return expert_mlp(x_SD, self._slot_w[0], self._slot_w[1], offs)

    def _plan(self, counts_WE: np.ndarray, state) -> tuple[object, float]:
        delay = self.testing_plan_delay_s
        if delay:
            self.testing_plan_delay_s = 0.0
            time.sleep(delay)
        c = self.config
        t0 = time.perf_counter()
        plan = self._sched.make_plan(c.policy, counts_WE, self.topo, state, tau=c.tau, min_chunk=c.min_chunk,
                                     cost=self._cost)
        return plan, (time.perf_counter() - t0) * 1e6

    # ------------------------------------------------------------------------------------------------ weights
    def _forward_bank(self, anchor: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Set ``self._slot_w``, the weights of this rank's slots for this forward. With weights='per-microbatch'
        and experts placed away from their owners, the owners send them now (a differentiable exchange whose input
        hangs on ``anchor``, so its backward runs before phase 1's on every rank). Returns (a 1-D empty tail of
        that exchange for the caller to keep in the graph, bytes copied)."""
        if self.config.weights == "per-step" or not self._placed:
            self._slot_w = self._bank if self._bank is not None else (self.w1, self.w2)
            return anchor[:0].reshape(-1), 0
        pairs = self._placed_pairs
        got, tail = self._copy_weights([(e, self._owner(e), h) for e, h in pairs], anchor, from_owner=True,
                                       op="expert weights to their placed homes")
        self._slot_w = (self.w1, self.w2) if self._own_slots else self._stack_slots(got)
        return tail, len(pairs) * self._w_numel * anchor.element_size()

    def _copy_weights(self, copies: list[tuple[int, int, int]], anchor: torch.Tensor, *, op: str,
                      from_owner: bool = False) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Send expert weights (expert, src, dst) between ranks (collective; ``copies`` identical everywhere).
        Returns ({expert: (w1 [H, 2F], w2 [F, H]) views} received by this rank, a 1-D empty tail of the exchange).
        from_owner: the source reads its parameter (not a bank slot or replica)."""
        r, G, H, Fd = self.rank, self.config.gpus_per_node, self.config.hidden, self.config.ffn
        empty = self._anchor(anchor)
        if not copies:
            return {}, empty
        w_numel = self._w_numel
        lo = r * self.num_local
        pieces, send_layout = [empty], []
        for p in sorted({d for _, s, d in copies if s == r}):
            n = 0
            for e, s, d in copies:
                if s == r and d == p:
                    w1, w2 = (self.w1[e - lo], self.w2[e - lo]) if from_owner else self._local_weights(e)
                    pieces += [w1.reshape(-1), w2.reshape(-1)]
                    n += w_numel
            send_layout.append((p, n))
        srcs = sorted({s for _, s, d in copies if d == r})
        recv_layout = [(q, w_numel * sum(1 for _, s, d in copies if s == q and d == r)) for q in srcs]
        cross, intra = self._traffic((s, d) for _, s, d in copies)
        got = exchange(torch.cat(pieces), self.comm, send_layout, recv_layout, cross_node=cross, intra_node=intra,
                       op=op, node_matrix=_node_matrix([(s, d, w_numel) for _, s, d in copies], r, G))
        out, pos = {}, 0
        for q in srcs:
            for e, s, d in copies:
                if s == q and d == r:
                    w1_part, w2_part = got[pos:pos + H * 2 * Fd], got[pos + H * 2 * Fd:pos + w_numel]
                    out[e] = (w1_part.view(H, 2 * Fd), w2_part.view(Fd, H))
                    pos += w_numel
        return out, got[:0]

    # ------------------------------------------------------------------------------------------------ phase 2
    def _execute(self, h_RD, y_static, moves, my_dyn, blk, n_L):
        """Phase 2 and the dynamic GEMM. Returns y_RD [R, H] in the same (home) order as h_RD, and counters."""
        c, r, L, G = self.config, self.rank, self.num_local, self.config.gpus_per_node
        H, Fd = c.hidden, c.ffn
        elem = h_RD.element_size()
        w_numel = self._w_numel
        copies = sorted({(m.expert, m.src, m.dst) for m in moves if not self._has_weights(m.expert, m.dst)})
        cross, intra = self._traffic((m.src, m.dst) for m in moves)
        stats = {"copy_bytes": sum(2 * m.rows * H * elem for m in moves) + len(copies) * w_numel * elem,
                 "weight_copies": len(copies)}

        out_moves = [m for m in moves if m.src == r]
        in_moves = [m for m in moves if m.dst == r]
        peers_out = sorted({m.dst for m in out_moves} | {cp[2] for cp in copies if cp[1] == r})
        peers_in = sorted({m.src for m in in_moves} | {cp[1] for cp in copies if cp[2] == r})

        def row_slice(m):
            b0 = blk[self._slot_pos[m.expert]]
            return h_RD[b0 + m.row_start:b0 + m.row_end]

        recv1 = recv2 = None
        received_rows: dict[int, torch.Tensor] = {}
        received_w: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if cross or intra:
            pieces, send_layout, n_sent = [self._anchor(h_RD)], [], 0
            for p in peers_out:
                n0 = n_sent
                for m in out_moves:
                    if m.dst == p:
                        pieces.append(row_slice(m).reshape(-1))
                        n_sent += m.rows * H
                for e, s, d in copies:
                    if s == r and d == p:
                        w1, w2 = self._local_weights(e)
                        pieces += [w1.reshape(-1), w2.reshape(-1)]
                        n_sent += w_numel
                send_layout.append((p, n_sent - n0))
            recv_layout = []
            for q in peers_in:
                n = sum(m.rows for m in in_moves if m.src == q) * H
                n += sum(w_numel for e, s, d in copies if s == q and d == r)
                recv_layout.append((q, n))
            nm = _node_matrix([(m.src, m.dst, m.rows * H) for m in moves] + [(s, d, w_numel) for _, s, d in copies],
                              r, G)
            recv1 = exchange(torch.cat(pieces), self.comm, send_layout, recv_layout, cross_node=cross,
                             intra_node=intra, op="phase-2 rows and weights to helpers", node_matrix=nm)
            pos = 0
            for q in peers_in:
                for i, m in enumerate(in_moves):
                    if m.src == q:
                        received_rows[i] = recv1[pos:pos + m.rows * H].view(m.rows, H)
                        pos += m.rows * H
                for e, s, d in copies:
                    if s == q and d == r:
                        w1 = recv1[pos:pos + H * 2 * Fd].view(H, 2 * Fd)
                        w2 = recv1[pos + H * 2 * Fd:pos + w_numel].view(Fd, H)
                        received_w[e] = (w1, w2)
                        pos += w_numel

        # Dynamic GEMM: my dynamic experts' rows kept at home (through all slot weights, like the static GEMM),
        # then the rows I compute for others.
        kept_x, kept, sizes = [], [], []
        kept_L = np.zeros(L, dtype=np.int64)
        for i in my_dyn:
            e = self._my_slots[i]
            moved = sorted((m.row_start, m.row_end) for m in out_moves if m.expert == e)
            for a, b, is_moved in _ranges(moved, int(n_L[i])):
                if not is_moved:
                    kept_x.append(h_RD[blk[i] + a:blk[i] + b])
                    kept_L[i] += b - a
                    sizes.append(b - a)
                    kept.append((i, a, b))
        n_kept = len(sizes)
        parts_y = []
        if kept_x:
            offs = torch.from_numpy(np.cumsum(kept_L)).to(h_RD.device)
            parts_y.append(expert_mlp(torch.cat(kept_x), self._slot_w[0], self._slot_w[1], offs))
        # One GEMM pair per hosted piece, over a view of its weights (replica or this micro-batch's copy): stacking
        # the hosted experts' weights for a single grouped call would copy them on the SMs every micro-batch.
        # Each piece is one group, so its end offset is its row count (one host-to-device transfer for all).
        offs_I = torch.tensor([m.rows for m in in_moves], dtype=torch.int64).to(h_RD.device)
        for i, m in enumerate(in_moves):
            w1, w2 = received_w[m.expert] if m.expert in received_w else self._local_weights(m.expert)
            parts_y.append(expert_mlp(received_rows[i], w1.unsqueeze(0), w2.unsqueeze(0), offs_I[i:i + 1]))
            sizes.append(m.rows)
        if recv1 is not None:
            parts_y.append(recv1[:0].view(0, H))  # keeps the exchange in the graph on every rank
        y_dyn = torch.cat(parts_y) if parts_y else h_RD[:0]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

        received_res: dict[int, torch.Tensor] = {}
        if cross or intra:
            pieces, send_layout, n_sent = [self._anchor(y_dyn)], [], 0
            for q in sorted({m.src for m in in_moves}):
                n0 = n_sent
                for j, m in enumerate(in_moves):
                    if m.src == q:
                        k = n_kept + j
                        pieces.append(y_dyn[starts[k]:starts[k + 1]].reshape(-1))
                        n_sent += m.rows * H
                send_layout.append((q, n_sent - n0))
            recv_layout = [(p, sum(m.rows for m in out_moves if m.dst == p) * H) for p in
                           sorted({m.dst for m in out_moves})]
            recv2 = exchange(torch.cat(pieces), self.comm, send_layout, recv_layout, cross_node=cross,
                             intra_node=intra, op="phase-2 results home",
                             node_matrix=_node_matrix([(m.dst, m.src, m.rows * H) for m in moves], r, G))
            pos = 0
            for p in sorted({m.dst for m in out_moves}):
                for j, m in enumerate(out_moves):
                    if m.dst == p:
                        received_res[j] = recv2[pos:pos + m.rows * H].view(m.rows, H)
                        pos += m.rows * H

        # Results in home order: static block, then each dynamic expert's segments in row order.
        parts = [y_static]
        kept_pos = {(i, a): k for k, (i, a, _) in enumerate(kept)}
        for i in my_dyn:
            e = self._my_slots[i]
            moved = sorted((m.row_start, m.row_end, j) for j, m in enumerate(out_moves) if m.expert == e)
            for a, _b, is_moved in _ranges([(a, b) for a, b, _ in moved], int(n_L[i])):
                if is_moved:
                    j = next(j for a2, _, j in moved if a2 == a)
                    parts.append(received_res[j])
                else:
                    k = kept_pos[(i, a)]
                    parts.append(y_dyn[starts[k]:starts[k + 1]])
        if recv2 is not None:
            parts.append(recv2[:0].view(0, H))
        parts.append(self._anchor(h_RD).view(0, H))   # the reverse all-to-all's backward runs on every rank
        y_RD = torch.cat(parts)
        if y_RD.shape[0] != h_RD.shape[0]:
            raise RuntimeError(f"MoELayer: assembled {y_RD.shape[0]} result rows for {h_RD.shape[0]} input rows")
        return y_RD, stats

    # ------------------------------------------------------------------------------------------------ replicas
    def _replicas_fresh(self) -> bool:
        if not self._step_pairs:
            return True
        return self._replica_version == (self.w1._version, self.w2._version)

    def _adopt(self, state) -> None:
        """Execute the slow decisions of ``state`` from now on (placement, @ema sets, EPLB replicas)."""
        self._plan_state = state
        if self.place and not np.array_equal(state.home_E, self._home_E):
            self._set_placement(state.home_E)

    def _next_resident(self) -> frozenset[tuple[int, int]]:
        """The (expert, gpu) replicas to hold for the next step (weights='per-step'), never at the expert's home
        or owner: the policy state's (``@ema`` sets, EPLB replicas) or, for in-node ``@current`` policies, every
        dynamic expert of the last micro-batch's counts on every other GPU of its home node."""
        if self.config.weights != "per-step" or self.base == "none" or self.world_size == 1:
            return frozenset()
        G = self.config.gpus_per_node
        state = self._plan_state

        def keep(e: int, g: int) -> bool:
            return g != self._home(e) and g != self._owner(e)

        if state is not None and state.resident:
            return frozenset((int(e), int(g)) for e, g in state.resident if keep(int(e), int(g)))
        if self._last_counts_WE is None or not self.in_node_policy:
            return frozenset()
        dyn_WD = self._sched.select_dynamic(self.config.policy, self._last_counts_WE, self.topo, state)
        out = set()
        for h, row in enumerate(dyn_WD.tolist()):
            n0 = h // G * G
            out.update((e, g) for e in row for g in range(n0, n0 + G) if keep(e, g))
        return frozenset(out)

    def _grads_clean(self) -> bool:
        held = [w for pair in self._replicas.values() for w in pair] + list(self._bank or ())
        return not any(w.grad is not None for w in held)

    def _watch(self, leaf: torch.Tensor) -> torch.Tensor:
        """A per-step copy's leaf, with a hook that notices a gradient arriving after the copy was replaced (a
        refresh_replicas() between a forward and its backward would otherwise lose that gradient silently)."""
        if leaf.requires_grad:
            gen, me = self._generation, weakref.ref(self)

            def hook(grad: torch.Tensor) -> torch.Tensor:
                layer = me()
                if layer is not None and layer._generation != gen:
                    layer._late_grad = True
                return grad

            leaf.register_hook(hook)
        return leaf

    def _agree_step_state(self, what: str) -> None:
        """Raise on every rank together if some rank's per-step copies lost or kept gradients (collective)."""
        flags = torch.tensor([int(self._grads_clean()), int(not self._late_grad)])
        agreed = self.control.all_reduce_min(flags, "group", f"{what} check")
        if int(agreed[1]) == 0:
            raise RuntimeError(f"MoELayer.{what}: a backward pass ran through expert weight copies that "
                               "refresh_replicas() had already replaced, so their gradients were lost; call "
                               "refresh_replicas() only after the backward of every earlier forward")
        if what == "refresh_replicas" and int(agreed[0]) == 0:
            raise RuntimeError("MoELayer.refresh_replicas: replica gradients were not reduced on some rank; call "
                               "reduce_replica_grads() before optimizer.step()")

    def _state_digest(self) -> bytes:
        st = self.state
        parts = [repr((st.policy, st.step, st.replicas, sorted(st.resident))).encode()]
        for a in (st.ema_E, st.home_E, st.dynamic_WD):
            parts.append(b"-" if a is None else np.ascontiguousarray(a).tobytes())
        return b"|".join(parts)

    @torch.no_grad()
    def refresh_replicas(self) -> None:
        """Adopt the policy's slow decisions and copy the owners' current expert weights to the GPUs that hold
        them besides their owner (collective; weights='per-step').

        Call after ``optimizer.step()`` (and after loading weights). Adopted here, identically on every rank: the
        ``+place`` placement (each GPU then keeps a bank of the experts placed on it), the ``@ema`` dynamic sets
        and EPLB replicas, and the resident replicas chosen from them (or from the last micro-batch's dynamic
        experts); experts a plan needs but that hold no replica get their weights copied per micro-batch.

        Forwards notice weights that changed since the last refresh through the parameters' version counters, which
        writes through ``.data`` bypass: call this after every change of the weights, however it is made.
        """
        if self._ever_held:
            # Agreed over the group, so that no rank enters the refresh exchange while another raises.
            self._agree_step_state("refresh_replicas")
        if self.state is not None:
            # e.g. a state restored from a checkpoint: every rank must adopt the same slow decisions
            self.control.check_same(self._state_digest(), "the policy state (MoELayer.state)",
                                    "every rank must restore the same PolicyState (same checkpoint step)")
            self._adopt(self.state)
        if self.config.weights != "per-step":
            return
        resident = self._next_resident()
        pairs = sorted(set(resident) | set(self._placed_pairs))
        self._resident = resident
        self._step_pairs = tuple(pairs)
        self._replicas = {}
        self._bank = None
        self._replica_version = (self.w1._version, self.w2._version)
        self._generation += 1
        self._ever_held = self._ever_held or bool(pairs)
        if pairs:
            got, _ = self._copy_weights([(e, self._owner(e), g) for e, g in pairs], self.w1.new_empty(0),
                                        from_owner=True, op="refresh of resident replicas")
            for e, (a, b) in got.items():
                if e not in self._slot_pos:
                    self._replicas[e] = (self._watch(a.clone().requires_grad_(self.w1.requires_grad)),
                                         self._watch(b.clone().requires_grad_(self.w2.requires_grad)))
            if not self._own_slots:
                w1, w2 = self._stack_slots(got)
                self._bank = (self._watch(w1.requires_grad_(self.w1.requires_grad)),
                              self._watch(w2.requires_grad_(self.w2.requires_grad)))
        self._slot_w = self._bank if self._bank is not None else (self.w1, self.w2)

    @torch.no_grad()
    def reduce_replica_grads(self) -> None:
        """Add the gradients accumulated on resident replicas and on the bank of placed experts to the owners'
        ``w1.grad`` / ``w2.grad`` (collective; weights='per-step'). Call once per optimizer step, after the last
        backward and before ``optimizer.step()``.
        """
        if self._ever_held:
            self._agree_step_state("reduce_replica_grads")
        if not self._step_pairs:
            return
        r, H, Fd, L, G = self.rank, self.config.hidden, self.config.ffn, self.num_local, self.config.gpus_per_node
        w_numel = self._w_numel
        lo = r * L
        pairs = self._step_pairs

        def grads_of(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            i = self._slot_pos.get(e)
            w1, w2 = (self._bank[0], self._bank[1]) if i is not None else self._replicas[e]
            g1 = w1.grad if w1.grad is not None else torch.zeros_like(w1)
            g2 = w2.grad if w2.grad is not None else torch.zeros_like(w2)
            return (g1[i], g2[i]) if i is not None else (g1, g2)

        def add_own(e: int, g1: torch.Tensor, g2: torch.Tensor) -> None:
            if self.w1.grad is None:
                self.w1.grad = torch.zeros_like(self.w1)
            if self.w2.grad is None:
                self.w2.grad = torch.zeros_like(self.w2)
            self.w1.grad[e - lo] += g1
            self.w2.grad[e - lo] += g2

        send: dict[int, list[torch.Tensor]] = {}
        for e, g in pairs:
            if g == r:
                g1, g2 = grads_of(e)
                send.setdefault(self._owner(e), []).extend([g1.reshape(-1), g2.reshape(-1)])
        if self._bank is not None:
            for e in self._my_slots:
                if self._owner(e) == r:       # own experts in the bank: their gradient stays here
                    add_own(e, *grads_of(e))
        recv_numel: dict[int, int] = {}
        for e, g in pairs:
            if self._owner(e) == r:
                recv_numel[g] = recv_numel.get(g, 0) + w_numel
        cross, intra = self._traffic((g, self._owner(e)) for e, g in pairs)
        got = self.comm.run(send, recv_numel, cross_node=cross,
                            dtype=self.w1.dtype, device=self.w1.device, op="reduction of replica gradients",
                            intra_node=intra,
                            node_matrix=_node_matrix([(g, self._owner(e), w_numel) for e, g in pairs], r, G))
        for w in [w for pair in self._replicas.values() for w in pair] + list(self._bank or ()):
            w.grad = None
        pos: dict[int, int] = {}
        for e, g in pairs:
            if self._owner(e) == r:
                p0 = pos.get(g, 0)
                buf = got[g]
                add_own(e, buf[p0:p0 + H * 2 * Fd].view(H, 2 * Fd), buf[p0 + H * 2 * Fd:p0 + w_numel].view(Fd, H))
                pos[g] = p0 + w_numel


@dataclass(frozen=True)
class DirectLayout:
    """Phase-1 layout of a plan whose rows go straight to the GPU that computes them (see ``direct_layout``)."""

    send_idx: np.ndarray | None   # int64 [M]: local rows in send order; None when that is the identity
    send_splits: list[int]        # [W] rows sent to each rank
    recv_splits: list[int]        # [W] rows received from each rank
    perm: np.ndarray              # int64 [R]: received rows in compute order
    kept_L: np.ndarray            # int64 [L]: rows of each of my slots computed here (compute order's first part)
    hosted: list[int]             # indices into moves of the moves to this rank (compute order's second part)


def direct_layout(counts_WE: np.ndarray, slots_WS: np.ndarray, moves: tuple, rank: int) -> DirectLayout:
    """Where each row goes when the plan's moves are executed by the phase-1 dispatch itself.

    counts_WE: int [W, E] rows per (source, expert); slots_WS: int [W, L] the experts computed at home on each GPU
    (ascending); moves: non-empty moves (expert, src = home, dst, row_start, row_end), ranges in the expert's HOME
    ORDER (by source rank, then the source's own order). Source s sends destination d, in this order: for each
    slot of d, s's rows of that expert that no move takes; then for each move to d (plan order), s's rows inside
    the move's range. The receiver computes its slots' rows grouped by slot (home order), then each hosted move's
    rows (home order), exactly the rows a plain EP home would give that expert, minus or plus the moved ranges.
    """
    W, E = counts_WE.shape
    L = slots_WS.shape[1]
    off_WE = np.cumsum(counts_WE, axis=0) - counts_WE
    n_E = counts_WE.sum(axis=0)
    moved: dict[int, list[tuple[int, int]]] = {}
    to: list[list[int]] = [[] for _ in range(W)]
    for j, m in enumerate(moves):
        moved.setdefault(m.expert, []).append((m.row_start, m.row_end))
        to[m.dst].append(j)
    kept_cache: dict[int, list[tuple[int, int]]] = {}

    def kept(e: int) -> list[tuple[int, int]]:
        if e not in kept_cache:
            out, cur = [], 0
            for a, b in sorted(moved[e]):
                if a > cur:
                    out.append((cur, a))
                cur = max(cur, b)
            if cur < n_E[e]:
                out.append((cur, int(n_E[e])))
            kept_cache[e] = out
        return kept_cache[e]

    def clip(s: int, e: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """ranges of e's home order intersected with source s's rows, relative to s's first row of e."""
        o, c = int(off_WE[s, e]), int(counts_WE[s, e])
        return [(max(a, o) - o, min(b, o + c) - o) for a, b in ranges if min(b, o + c) > max(a, o)]

    slots = slots_WS.tolist()

    def items(s: int, d: int) -> list[tuple[tuple[str, int], int, list[tuple[int, int]]]]:
        out = []
        for i, e in enumerate(slots[d]):
            out.append((("k", i), e, clip(s, e, kept(e)) if e in moved else [(0, int(counts_WE[s, e]))]))
        for j in to[d]:
            m = moves[j]
            out.append((("m", j), m.expert, clip(s, m.expert, [(m.row_start, m.row_end)])))
        return out

    flat = slots_WS.reshape(-1)
    slot_of = np.empty(E, dtype=np.int64)
    slot_of[flat] = np.arange(E)
    c_r = counts_WE[rank, flat]
    xoff = np.cumsum(c_r) - c_r
    idx, send_splits = [], []
    for d in range(W):
        n = 0
        for _, e, rng in items(rank, d):
            base = int(xoff[slot_of[e]])
            for a, b in rng:
                idx.append(np.arange(base + a, base + b))
                n += b - a
        send_splits.append(n)
    send_idx = np.concatenate(idx) if idx else np.zeros(0, np.int64)
    if np.array_equal(send_idx, np.arange(send_idx.size)):
        send_idx = None
    pos: dict[tuple[str, int], list[np.ndarray]] = {}
    recv_splits, start = [], 0
    for s in range(W):
        n0 = start
        for key, _, rng in items(s, rank):
            for a, b in rng:
                pos.setdefault(key, []).append(np.arange(start, start + b - a))
                start += b - a
        recv_splits.append(start - n0)
    kept_L = np.zeros(L, dtype=np.int64)
    perm = []
    for i in range(L):
        for p in pos.get(("k", i), ()):
            perm.append(p)
            kept_L[i] += p.size
    for j in to[rank]:
        got = sum(p.size for p in pos.get(("m", j), ()))
        if got != moves[j].rows:
            raise RuntimeError(f"direct dispatch: move {moves[j]} gathers {got} rows from its sources")
        perm.extend(pos.get(("m", j), ()))
    perm_R = np.concatenate(perm) if perm else np.zeros(0, np.int64)
    return DirectLayout(send_idx=send_idx, send_splits=send_splits, recv_splits=recv_splits, perm=perm_R,
                        kept_L=kept_L, hosted=list(to[rank]))
