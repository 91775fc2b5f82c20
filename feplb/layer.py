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
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from feplb.copy_engine import make_copy_engine, make_node_groups
from feplb.dispatch import PeerComm, all_to_all_rows, exchange
from feplb.transport import make_transport

__all__ = ["FEPLBConfig", "LayerStats", "MoELayer", "expert_mlp"]

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
    dyn: dynamic experts per GPU (clipped to E / W); policy: a ``feplb.sched`` policy name, "none" = plain EP.
    transport: "torch" (torch.distributed) or "nvshmem" (nvshmem4py, CUDA only).
    weights: "per-step" (helpers hold resident replicas, refreshed by ``refresh_replicas()`` after the optimizer
        step, gradients reduced by ``reduce_replica_grads()`` before it) or "per-microbatch" (weights travel with
        the rows every micro-batch, gradients return with the backward pass).
    refresh_every: micro-batches between the policy state's slow refreshes (``@ema`` dynamic sets, EPLB replicas).
    plan_wait_ms: grace after the static GEMM before falling back to computing at home (0 = never wait).
    min_straggler_rows: balance only when the token straggler under plain EP is at least this many rows (a
        deterministic gate, identical on every rank).
    tau, min_chunk: planner options (``feplb.sched.make_plan``); min_chunk None = the cost model's knee.
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
    weights: str = "per-step"
    refresh_every: int = 8
    plan_wait_ms: float = 0.0
    min_straggler_rows: int = 0
    tau: float = 0.01
    min_chunk: int | None = None
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
        if self.min_chunk is not None:
            _pos_int("min_chunk", self.min_chunk)
        if self.recv_capacity is not None:
            _pos_int("recv_capacity", self.recv_capacity, 0)
        from feplb.sched.plan import parse_policy

        _, place, _ = parse_policy(self.policy)
        if place:
            raise ValueError(f"FEPLBConfig.policy {self.policy!r}: '+place' policies migrate expert homes, which "
                             "the layer does not do (they are simulation-only); drop '+place'")


@dataclass(frozen=True, kw_only=True)
class LayerStats:
    """What the last forward did. Identical on every rank of a node (``plan_us`` is this rank's); when only some
    nodes fell back, ``loads_after_W`` of other nodes shows their planned moves.

    loads_before_W / loads_after_W: rows each GPU computed without / with this micro-batch's balancing.
    token_straggler_before/after: max - mean of those loads (``feplb.sched.token_straggler``).
    rows_moved: rows computed away from home (all GPUs); copy_bytes: forward phase-2 bytes over all GPUs (rows out,
    results back, weights). plan_us: wall time of this rank's planner call (0 when no plan was made).
    balanced: the plan was executed; fell_back: a plan was wanted but not ready in time on some rank of the scope,
    so every rank there computed at home. plan_fingerprint: hash of the executed plan (equal on every rank).
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
    [L, F, H] (this rank's experts, SwiGLU, stored grouped). Buffer ``router_bias`` [E] when configured.
    """

    testing_plan_delay_s: float = 0.0  # testing hook: the next plan sleeps this long first (then resets to 0)

    def __init__(self, config: FEPLBConfig, group: dist.ProcessGroup | None = None):
        super().__init__()
        if not isinstance(config, FEPLBConfig):
            raise TypeError(f"config must be a FEPLBConfig, got {type(config).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("MoELayer needs torch.distributed initialised (init_process_group) first")
        from feplb.sched import policies as sched_policies
        from feplb.sched.plan import INTRA_NODE_BASES, policy_base
        from feplb.sched.state import PolicyState
        from feplb.sched.topology import Topology

        self._sched = sched_policies
        c = self.config = config
        self.group = group
        W, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.world_size = W
        if c.num_experts % W:
            raise ValueError(f"FEPLBConfig.num_experts ({c.num_experts}) must be divisible by the EP group size ({W})")
        if W % c.gpus_per_node:
            raise ValueError(f"FEPLBConfig.gpus_per_node ({c.gpus_per_node}) must divide the EP group size ({W})")
        L = self.num_local = c.num_experts // W
        self.base = policy_base(c.policy)
        self.in_node_policy = self.base in INTRA_NODE_BASES or self.base == "none"
        self.topo = Topology(num_ranks=W, gpus_per_node=c.gpus_per_node, num_experts=c.num_experts,
                             dyn=min(c.dyn, L) if self.base != "none" else 0)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
            else torch.device("cpu")
        self.transport = make_transport(c.transport, group)
        # Collective: identical configs everywhere before any other collective of this layer.
        self.transport.check_same(repr(dataclasses.asdict(c)).encode() + repr((W, c.gpus_per_node)).encode(),
                                  "FEPLBConfig")
        self.node_group, self.node_ranks = make_node_groups(group, c.gpus_per_node)
        copy = make_copy_engine(device, self.node_group, c.gpus_per_node, use_nvshmem=c.transport == "nvshmem")
        self.comm = PeerComm(self.transport, copy, c.gpus_per_node)
        self.state = PolicyState(topo=self.topo, policy=c.policy, refresh_every=c.refresh_every) \
            if self.base != "none" else None

        H, Fd = c.hidden, c.ffn
        self.router = nn.Linear(H, c.num_experts, bias=False, device=device, dtype=c.dtype)
        self.w1 = nn.Parameter(torch.randn(L, H, 2 * Fd, device=device, dtype=c.dtype) / H ** 0.5)
        self.w2 = nn.Parameter(torch.randn(L, Fd, H, device=device, dtype=c.dtype) / Fd ** 0.5)
        if c.router_bias:
            self.register_buffer("router_bias", torch.zeros(c.num_experts, device=device, dtype=torch.float32))
        else:
            self.router_bias = None
        with torch.no_grad():
            dist.broadcast(self.router.weight, src=dist.get_global_rank(group, 0) if group is not None else 0,
                           group=group)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="feplb-plan") \
            if self.base != "none" else None
        self._recv_buf: torch.Tensor | None = None
        self._resident: frozenset[tuple[int, int]] = frozenset()   # (expert, gpu) replicas held besides home
        self._replicas: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # expert -> leaf (w1, w2) on this rank
        self._replica_version: tuple[int, int] = (-1, -1)
        self._last_dyn_WD: np.ndarray | None = None
        self.last_stats: LayerStats | None = None
        self.last_plan = None
        self.last_plan_inputs = None

    # ------------------------------------------------------------------------------------------------ helpers
    def _scope_group(self):
        return self.node_group if self.in_node_policy else self.group

    def _home(self, e: int) -> int:
        return e // self.num_local

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

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MoELayer input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() not in (2, 3) or x.shape[-1] != c.hidden:
            raise ValueError(f"MoELayer input must be [tokens, {c.hidden}] or [batch, seq, {c.hidden}], "
                             f"got shape {list(x.shape)}")
        if x.dtype != c.dtype:
            raise TypeError(f"MoELayer input dtype must be {c.dtype} (FEPLBConfig.dtype), got {x.dtype}")
        if x.device != self.w1.device:
            raise ValueError(f"MoELayer input is on {x.device} but the layer's experts are on {self.w1.device}")
        return x.reshape(-1, c.hidden)

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] or [B, S, H] in ``config.dtype`` -> same shape. Collective over the EP group.

        Under ``torch.compile`` the routing and the combine compile; the dispatch in between (communication,
        CPU planning) is excluded with ``torch.compiler.disable``, so the graph breaks exactly there.
        """
        from feplb.kernels import permute, routing_metadata, unpermute

        x_TD = self._check_input(x)
        topk_ids_TK, w_TK, bad = self.route(x_TD)
        meta = routing_metadata(topk_ids_TK, self.config.num_experts, check=False)
        x_MD = permute(x_TD, meta)
        y_MD = self._dispatch(x_MD, meta.counts_E, bad)
        return unpermute(y_MD, meta, w_TK).reshape(x.shape)

    @torch.compiler.disable
    def _dispatch(self, x_MD: torch.Tensor, counts_E: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
        """Grouped rows x_MD [M, H] (by expert, then token, then k) -> expert outputs y_MD [M, H], same order."""
        c, W, r, L = self.config, self.world_size, self.rank, self.num_local
        E = c.num_experts
        flags = torch.cat([counts_E.to(torch.int64).reshape(-1), bad.to(torch.int64).reshape(1)]).cpu()
        gathered = self.transport.all_gather_counts(flags).cpu()
        bad_ranks = torch.nonzero(gathered[:, E]).flatten().tolist()
        if bad_ranks:
            raise ValueError(f"MoELayer: router logits contain NaN or inf on EP rank(s) {bad_ranks}; "
                             "check the input and the router weights")
        counts_WE = gathered[:, :E].numpy()
        c_WL = counts_WE[:, r * L:(r + 1) * L]
        n_L = c_WL.sum(axis=0)
        send_splits = counts_WE[r].reshape(W, L).sum(axis=1).tolist()
        recv_splits = c_WL.sum(axis=1).tolist()
        loads_before = counts_WE.sum(axis=0).reshape(W, L).sum(axis=1)

        # Dynamic experts are chosen before the static GEMM starts (cheap, identical everywhere).
        want_plan = self.base != "none" and W > 1
        if want_plan:
            from feplb.sched.metrics import token_straggler

            want_plan = token_straggler(loads_before) >= max(c.min_straggler_rows, 1e-9)
        state = self.state
        if want_plan:
            dyn_WD = np.asarray(self._sched.select_dynamic(c.policy, counts_WE, self.topo, state), dtype=np.int64)
        else:
            dyn_WD = np.zeros((W, 0), dtype=np.int64)
        if want_plan and self.in_node_policy:
            my_dyn = sorted(int(e) - r * L for e in dyn_WD[r])
        elif want_plan:
            my_dyn = list(range(L))   # peers' policies may move any expert: nothing is static
        else:
            my_dyn = []
        dyn_set = set(my_dyn)
        static = [i for i in range(L) if i not in dyn_set]
        order = static + my_dyn

        # Phase 1: rows to their experts' home ranks, then into HOME ORDER (static block first, then dynamic).
        recv_RD = self._all_to_all_in(x_MD, send_splits, recv_splits, loads_before)
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

        # Plan on a CPU thread; on a GPU the static GEMM is launched first and runs meanwhile.
        future = None
        if want_plan and x_MD.is_cuda:
            y_static = self._static_gemm(h_RD[:n_static], static, n_L)
            future = self._executor.submit(self._plan, counts_WE, state)
        elif want_plan:
            future = self._executor.submit(self._plan, counts_WE, state)
            y_static = self._static_gemm(h_RD[:n_static], static, n_L)
        else:
            y_static = self._static_gemm(h_RD[:n_static], static, n_L)
        plan, plan_us, fell_back = None, 0.0, False
        if want_plan:
            if x_MD.is_cuda:
                done = torch.cuda.Event()
                done.record()
                while not future.done() and not done.query():
                    time.sleep(2e-6)
            try:
                plan, plan_us = future.result(timeout=c.plan_wait_ms / 1e3)
                ready = 1
            except concurrent.futures.TimeoutError:
                ready = 0
            fresh = int(self._replicas_fresh())
            agreed = self.transport.all_reduce_min(torch.tensor([ready, fresh], dtype=torch.int64),
                                                   self._scope_group(), "readiness agreement")
            if int(agreed[1]) == 0:
                raise RuntimeError("MoELayer: expert weights changed since the last refresh_replicas() on a rank of "
                                   "this node; call layer.refresh_replicas() after optimizer.step() "
                                   "(weights='per-step')")
            if int(agreed[0]) == 0:
                plan, fell_back = None, True
            self._last_dyn_WD = dyn_WD
        if self.state is not None:
            self.state = self.state.observe(counts_WE, plan)
        moves = () if plan is None else tuple(m for m in plan.moves if m.row_end > m.row_start)
        for m in moves:
            if m.src != self._home(m.expert):
                raise RuntimeError(f"plan move {m} does not start at expert {m.expert}'s home GPU")
            if m.src == r and (m.expert - r * L) not in dyn_set:
                raise RuntimeError(f"plan moves static expert {m.expert} (dynamic set of GPU {r}: {sorted(dyn_set)})")
        y_RD, stats = self._execute(h_RD, y_static, moves, order, static, my_dyn, blk, n_L, plan)
        inv_R = torch.empty_like(perm_R)
        inv_R[perm_R] = torch.arange(perm_R.numel(), device=perm_R.device)
        y_back = all_to_all_rows(y_RD.index_select(0, inv_R), self.transport, recv_splits, send_splits)

        from feplb.sched.metrics import token_straggler

        after = loads_before.copy()
        for m in moves:
            after[m.src] -= m.rows
            after[m.dst] += m.rows
        self.last_plan = plan
        self.last_plan_inputs = (counts_WE, state)   # what the plan was made from, for Plan.validate
        self.last_stats = LayerStats(
            loads_before_W=loads_before.tolist(), loads_after_W=after.tolist(),
            token_straggler_before=float(token_straggler(loads_before)),
            token_straggler_after=float(token_straggler(after)), rows_moved=sum(m.rows for m in moves),
            copy_bytes=stats["copy_bytes"], weight_copies=stats["weight_copies"], plan_us=plan_us,
            balanced=plan is not None, fell_back=fell_back,
            plan_fingerprint=_digest(plan.fingerprint()) if plan is not None else 0,
            recv_grew=stats["recv_grew"], policy=c.policy, dynamic_WD=dyn_WD.tolist())
        return y_back

    def _all_to_all_in(self, x_MD: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                       recv_W: np.ndarray) -> torch.Tensor:
        """Phase-1 all-to-all into the layer's receive buffer (``recv_capacity``). Every rank knows every rank's
        receive size (recv_W, from the all-gathered counts), so an overflow is detected identically everywhere:
        all ranks grow, or all raise, and none is left waiting in a collective."""
        c = self.config
        self._recv_grew = False
        if c.recv_capacity is None:
            return all_to_all_rows(x_MD, self.transport, send_splits, recv_splits)
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
        return all_to_all_rows(x_MD, self.transport, send_splits, recv_splits, out=self._recv_buf)

    def _static_gemm(self, x_SD: torch.Tensor, static: list[int], n_L: np.ndarray) -> torch.Tensor:
        """The static experts' rows (ascending expert order) through ALL local weights, the other experts given
        empty groups, so no weight is gathered or copied."""
        if not static:
            return x_SD.new_zeros((0, self.config.hidden)) + x_SD.sum() * 0
        rows_L = np.zeros(self.num_local, dtype=np.int64)
        for i in static:
            rows_L[i] = n_L[i]
        offs = torch.from_numpy(np.cumsum(rows_L)).to(x_SD.device)
        return expert_mlp(x_SD, self.w1, self.w2, offs)

    def _plan(self, counts_WE: np.ndarray, state) -> tuple[object, float]:
        delay = self.testing_plan_delay_s
        if delay:
            self.testing_plan_delay_s = 0.0
            time.sleep(delay)
        c = self.config
        t0 = time.perf_counter()
        plan = self._sched.make_plan(c.policy, counts_WE, self.topo, state, tau=c.tau, min_chunk=c.min_chunk)
        return plan, (time.perf_counter() - t0) * 1e6

    # ------------------------------------------------------------------------------------------------ phase 2
    def _weights_of(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w1[e - self.rank * self.num_local], self.w2[e - self.rank * self.num_local]

    def _execute(self, h_RD, y_static, moves, order, static, my_dyn, blk, n_L, plan):
        """Phase 2 and the dynamic GEMM. Returns y_RD [R, H] in the same (home) order as h_RD, and counters."""
        c, r, L, G = self.config, self.rank, self.num_local, self.config.gpus_per_node
        H, Fd = c.hidden, c.ffn
        node = r // G
        elem = h_RD.element_size()
        w_numel = H * 2 * Fd + Fd * H
        resident = self._resident
        copies = sorted({(m.expert, m.src, m.dst) for m in moves if (m.expert, m.dst) not in resident})
        cross = any(m.src // G != m.dst // G for m in moves)
        intra = any(m.src // G == node and m.dst // G == node for m in moves)
        stats = {"copy_bytes": sum(2 * m.rows * H * elem for m in moves) + len(copies) * w_numel * elem,
                 "weight_copies": len(copies), "recv_grew": self._recv_grew}

        out_moves = [m for m in moves if m.src == r]
        in_moves = [m for m in moves if m.dst == r]
        peers_out = sorted({m.dst for m in out_moves} | {cp[2] for cp in copies if cp[1] == r})
        peers_in = sorted({m.src for m in in_moves} | {cp[1] for cp in copies if cp[2] == r})

        def row_slice(m):
            b0 = blk[m.expert - r * L]
            return h_RD[b0 + m.row_start:b0 + m.row_end]

        recv1 = recv2 = None
        received_rows: dict[int, torch.Tensor] = {}
        received_w: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if cross or intra:
            pieces, send_layout = [h_RD[:0].reshape(-1)], []
            for p in peers_out:
                n0 = sum(t.numel() for t in pieces)
                for m in out_moves:
                    if m.dst == p:
                        pieces.append(row_slice(m).reshape(-1))
                for e, s, d in copies:
                    if s == r and d == p:
                        w1, w2 = self._weights_of(e)
                        pieces += [w1.reshape(-1), w2.reshape(-1)]
                send_layout.append((p, sum(t.numel() for t in pieces) - n0))
            recv_layout = []
            for q in peers_in:
                n = sum(m.rows for m in in_moves if m.src == q) * H
                n += sum(w_numel for e, s, d in copies if s == q and d == r)
                recv_layout.append((q, n))
            recv1 = exchange(torch.cat(pieces), self.comm, send_layout, recv_layout, cross_node=cross,
                             intra_node=intra, op="phase-2 rows and weights to helpers")
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

        # Dynamic GEMM: my dynamic experts' rows kept at home (through all local weights, like the static GEMM),
        # then the rows I compute for others.
        kept_x, kept, sizes = [], [], []
        kept_L = np.zeros(L, dtype=np.int64)
        for i in my_dyn:
            e = r * L + i
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
            parts_y.append(expert_mlp(torch.cat(kept_x), self.w1, self.w2, offs))
        # One GEMM pair per hosted piece, over a view of its weights (replica or this micro-batch's copy): stacking
        # the hosted experts' weights for a single grouped call would copy them on the SMs every micro-batch.
        # Each piece is one group, so its end offset is its row count (one host-to-device transfer for all).
        offs_I = torch.tensor([m.rows for m in in_moves], dtype=torch.int64).to(h_RD.device)
        for i, m in enumerate(in_moves):
            w1, w2 = received_w[m.expert] if m.expert in received_w else self._replicas[m.expert]
            parts_y.append(expert_mlp(received_rows[i], w1.unsqueeze(0), w2.unsqueeze(0), offs_I[i:i + 1]))
            sizes.append(m.rows)
        if recv1 is not None:
            parts_y.append(recv1[:0].view(0, H))  # keeps the exchange in the graph on every rank
        y_dyn = torch.cat(parts_y) if parts_y else h_RD[:0]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

        received_res: dict[int, torch.Tensor] = {}
        if cross or intra:
            pieces, send_layout = [y_dyn[:0].reshape(-1)], []
            for q in sorted({m.src for m in in_moves}):
                n0 = sum(t.numel() for t in pieces)
                for j, m in enumerate(in_moves):
                    if m.src == q:
                        k = n_kept + j
                        pieces.append(y_dyn[starts[k]:starts[k + 1]].reshape(-1))
                send_layout.append((q, sum(t.numel() for t in pieces) - n0))
            recv_layout = [(p, sum(m.rows for m in out_moves if m.dst == p) * H) for p in
                           sorted({m.dst for m in out_moves})]
            recv2 = exchange(torch.cat(pieces), self.comm, send_layout, recv_layout, cross_node=cross,
                             intra_node=intra, op="phase-2 results home")
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
            e = r * L + i
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
        y_RD = torch.cat(parts)
        if y_RD.shape[0] != h_RD.shape[0]:
            raise RuntimeError(f"MoELayer: assembled {y_RD.shape[0]} result rows for {h_RD.shape[0]} input rows")
        return y_RD, stats

    # ------------------------------------------------------------------------------------------------ replicas
    def _replicas_fresh(self) -> bool:
        if not self._resident:
            return True
        return self._replica_version == (self.w1._version, self.w2._version)

    def _next_resident(self) -> frozenset[tuple[int, int]]:
        if self.config.weights != "per-step" or self.base == "none" or self.world_size == 1:
            return frozenset()
        G = self.config.gpus_per_node
        if self.state is not None and self.state.resident:
            return frozenset((int(e), int(g)) for e, g in self.state.resident if g != self._home(int(e)))
        if self._last_dyn_WD is None or not self.in_node_policy:
            return frozenset()
        out = set()
        for h, row in enumerate(self._last_dyn_WD):
            n0 = h // G * G
            out.update((int(e), g) for e in row for g in range(n0, n0 + G) if g != h)
        return frozenset(out)

    def _replica_traffic(self, pairs: frozenset[tuple[int, int]]) -> tuple[bool, bool]:
        G = self.config.gpus_per_node
        node = self.rank // G
        cross = any(self._home(e) // G != g // G for e, g in pairs)
        intra = any(self._home(e) // G == node and g // G == node for e, g in pairs)
        return cross, intra

    @torch.no_grad()
    def refresh_replicas(self) -> None:
        """Copy the owners' current expert weights into the resident replicas (collective; weights='per-step').

        Call after ``optimizer.step()`` (and after loading weights). The replica set is chosen here, identically
        on every rank, from the policy state (``@ema`` dynamic sets, EPLB replicas) or the last micro-batch's
        dynamic experts; experts a plan needs but that hold no replica get their weights copied per micro-batch.
        """
        if self._resident:
            # Agreed over the group, so that no rank enters the refresh exchange while another raises.
            clean = int(not any(w.grad is not None for pair in self._replicas.values() for w in pair))
            if int(self.transport.all_reduce_min(torch.tensor([clean]), self.group, "refresh_replicas check")[0]) == 0:
                raise RuntimeError("MoELayer.refresh_replicas: replica gradients were not reduced on some rank; call "
                                   "reduce_replica_grads() before optimizer.step()")
        new = self._next_resident()
        r, H, Fd = self.rank, self.config.hidden, self.config.ffn
        w_numel = H * 2 * Fd + Fd * H
        self._replicas = {}
        self._resident = new
        self._replica_version = (self.w1._version, self.w2._version)
        if not new:
            return
        cross, intra = self._replica_traffic(new)
        pairs = sorted(new)
        send: dict[int, list[torch.Tensor]] = {}
        for e, g in pairs:
            if self._home(e) == r:
                w1, w2 = self._weights_of(e)
                send.setdefault(g, []).extend([w1.reshape(-1), w2.reshape(-1)])
        recv_numel: dict[int, int] = {}
        for e, g in pairs:
            if g == r:
                recv_numel[self._home(e)] = recv_numel.get(self._home(e), 0) + w_numel
        dt, dev = self.w1.dtype, self.w1.device
        got = self.comm.run({p: torch.cat(t) for p, t in send.items()}, recv_numel, cross_node=cross, dtype=dt,
                            device=dev, op="refresh of resident replicas", intra_node=intra)
        pos: dict[int, int] = {}
        for e, g in pairs:
            if g == r:
                h = self._home(e)
                p0 = pos.get(h, 0)
                buf = got[h]
                w1 = buf[p0:p0 + H * 2 * Fd].view(H, 2 * Fd).clone().requires_grad_(True)
                w2 = buf[p0 + H * 2 * Fd:p0 + w_numel].view(Fd, H).clone().requires_grad_(True)
                self._replicas[e] = (w1, w2)
                pos[h] = p0 + w_numel

    @torch.no_grad()
    def reduce_replica_grads(self) -> None:
        """Add the gradients accumulated on resident replicas to the owners' ``w1.grad`` / ``w2.grad`` (collective;
        weights='per-step'). Call once per optimizer step, after the last backward and before ``optimizer.step()``.
        """
        if not self._resident:
            return
        r, H, Fd, L = self.rank, self.config.hidden, self.config.ffn, self.num_local
        w_numel = H * 2 * Fd + Fd * H
        cross, intra = self._replica_traffic(self._resident)
        pairs = sorted(self._resident)
        send: dict[int, list[torch.Tensor]] = {}
        for e, g in pairs:
            if g == r:
                w1, w2 = self._replicas[e]
                g1 = w1.grad if w1.grad is not None else torch.zeros_like(w1)
                g2 = w2.grad if w2.grad is not None else torch.zeros_like(w2)
                send.setdefault(self._home(e), []).extend([g1.reshape(-1), g2.reshape(-1)])
                w1.grad = None
                w2.grad = None
        recv_numel: dict[int, int] = {}
        for e, g in pairs:
            if self._home(e) == r:
                recv_numel[g] = recv_numel.get(g, 0) + w_numel
        got = self.comm.run({p: torch.cat(t) for p, t in send.items()}, recv_numel, cross_node=cross,
                            dtype=self.w1.dtype, device=self.w1.device, op="reduction of replica gradients",
                            intra_node=intra)
        if not recv_numel:
            return
        if self.w1.grad is None:
            self.w1.grad = torch.zeros_like(self.w1)
        if self.w2.grad is None:
            self.w2.grad = torch.zeros_like(self.w2)
        pos: dict[int, int] = {}
        for e, g in pairs:
            if self._home(e) == r:
                p0 = pos.get(g, 0)
                buf = got[g]
                self.w1.grad[e - r * L] += buf[p0:p0 + H * 2 * Fd].view(H, 2 * Fd)
                self.w2.grad[e - r * L] += buf[p0 + H * 2 * Fd:p0 + w_numel].view(Fd, H)
                pos[g] = p0 + w_numel
