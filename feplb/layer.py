"""The FEPLB MoE layer: expert parallelism with per-micro-batch load balancing inside the node.

``MoELayer.forward`` reads as the design's steps (``feplb.md``, "The design"), each a method with explicit inputs
and outputs (frozen dataclasses), the layouts pure functions of ``feplb.layout``:

1. ``route`` / ``forward``: router (or the caller's routing) -> top-k ids and gates; rows grouped by slot.
2. ``_count``: all-gather of the per-expert counts over the CPU control group; every per-rank problem (bad input,
   bad routing, stale replicas) travels in it, so all ranks raise together. The only host sync of a forward.
3. ``_split``: the dynamic experts (chosen before the static GEMM) and the home layout.
4. ``_phase1``: rows to their experts' home GPUs, gathered into home order (static block first, then dynamic rows:
   the rows phase 2 may send are ready before the static GEMM is launched).
5. ``feplb.phase2.start_phase2``: the planner thread plans while the copy thread waits for it, checks and lays the
   plan out, agrees with the node and issues the copies (``feplb.balance``) ...
6. ``_static_gemm``: ... beside the static experts' grouped GEMM (on a GPU, step 5 starts once the static GEMM is
   queued, so the planner thread, which holds the GIL while it plans, never delays its launch; on a CPU, where the
   static GEMM computes on the calling thread, step 5 starts first).
7. ``feplb.phase2.dynamic_and_return``: the rows hosted for others first (one grouped launch per weight bank, after
   their copies), their results sent home through the copy thread, the dynamic rows kept at home meanwhile ...
8. ... every result gathered into receive order; reverse all-to-all (``_in_node``).
9. combine: un-permute with the gates (``forward``).

Peers' policies (``fastermoe``, ``eplb``) plan before phase 1 and send each row straight to the GPU that computes
it (``feplb.direct.forward_direct``, ``feplb.layout.direct_layout``), with no phase 2. Every exchange is differentiable
(``feplb.dispatch``): backward mirrors forward, and output and gradients equal plain EP up to summation order.

``forward_dispatched`` runs steps 2, 3 and 5-7 on rows a caller dispatched to their experts' owners itself (DeepEP's
dispatch, say): rows at home already, by local expert, and their results returned in that order.

Activation checkpointing: a forward that runs inside a backward pass replays what its forward decided
(``feplb.recompute``): the same placement, counts and plan (or fallback), no planning, no agreement, no history,
no timeline.

Never wait, never wrong: a plan that is late (later than the static GEMM plus ``plan_wait_ms`` on a GPU) makes the
node (the group, when the policy history reads whole plans) fall back to computing at home, decided by one
agreement; results do not depend on that decision.

Legend: T tokens on this rank, K top-k, H hidden, F ffn, E experts, L = E / W experts per GPU, W EP ranks, G GPUs
per node, M = T*K rows sent by this rank, R rows at home on this rank after phase 1, D dynamic experts per GPU.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import math
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from feplb.balance import Balancer, timed_plan
from feplb.config import (
    DIRECT_BASES,
    FEPLBConfig,
    LayerStats,
    dispatched_policy_problem,
    dispatched_problem,
    forward_problem,
)
from feplb.control import Control, group_timeout
from feplb.copy import release_copy_engine, shared_copy_engine
from feplb.direct import forward_direct
from feplb.dispatch import (
    ForwardEntry,
    PeerComm,
    all_to_all_rows,
    compiled_autograd_problem,
    entered_through,
    forget_joins,
    refuse_compiled_autograd,
    settle_abandoned,
    settle_joins,
)
from feplb.experts import EarlyBackward, expert_mlp, ready_event, span, to_device
from feplb.layout import (
    DirectLayout,
    HomeLayout,
    direct_layout,
    home_layout,
)
from feplb.phase2 import Phase2, dynamic_and_return, no_phase2, start_phase2
from feplb.recompute import (
    Record,
    Records,
    checkpoint_frame,
    hidden_from_selective_checkpoint,
    in_backward,
    record_kind,
    reentrant_inputs_need_grad,
)
from feplb.replicas import Placement, Replicas, state_fingerprint
from feplb.sharded import ExpertShards, expert_named_params, register
from feplb.steps import (
    AUTOCAST_SHIFT,
    ENTRIES,
    ENTRY_RECOMPUTE,
    HEADER,
    LAYER,
    PROBLEM,
    Counts,
    Split,
    args_digest,
    autocast_code,
    layer_stats,
    read_counts,
    read_recompute,
    read_step,
    step_row,
)
from feplb.timeline import Timeline
from feplb.training import (
    _LAYERS,
    TrainingSteps,
    _plain_scaler,  # noqa: F401 (named by GradScalers pickled when it lived here)
    forward_began,
    scaler_skips,
)
from feplb.transport import release_transport, shared_transport

__all__ = ["DirectLayout", "FEPLBConfig", "LayerStats", "MoELayer", "direct_layout", "expert_mlp",
           "ignore_experts_in_ddp"]


# The next layer number (MoELayer.layer_id) of this process.
_NEXT_LAYER_ID = 0
_LAYER_ID_LOCK = threading.Lock()
# The width of the counts all-gather's rows past their header, per EP group (its global ranks): the largest number of
# experts of the layers built over it, agreed when each is built. Every row of the group is padded to it, so that
# ranks running layers of different sizes in one forward meet in an all-gather of equal rows (and raise, naming the
# layers) instead of one the backend aborts the process over.
_COUNTS_WIDTH: dict[tuple[int, ...], int] = {}


class MoELayer(TrainingSteps, ExpertShards, nn.Module):
    """FEPLB MoE layer over an EP process group.

    Args:
        config: the layer's configuration (identical on all ranks; a mismatch raises ValueError on every rank).
        group: the EP process group (default: the world). ``torch.distributed`` must be initialised.

    Parameters: ``router.weight`` [E, H] (unless ``router="external"``; replicated: broadcast from group rank 0 at
    construction; its gradient covers this rank's tokens only, reduce it like any data-parallel parameter), ``w1``
    [L, H, 2F] and ``w2`` [L, F, H] (this rank's experts, SwiGLU, stored grouped: the rank OWNS experts
    ``rank * L ...``; their optimizer state stays here). Buffer ``router_bias`` [E] when configured. A subclass may
    store its experts otherwise by overriding ``_init_experts`` and ``expert_weights`` (``feplb.hf`` does).

    Where an expert is computed: at its HOME GPU, its owner unless a ``+place`` policy placed it elsewhere; per
    micro-batch the plan moves rows from the home to helpers (see the module docstring). Use as a context manager
    or call ``close()`` to release the copy path, the transport and the helper threads.

    The policy ``state`` and the calls around ``optimizer.step()`` (``attach_optimizer``, ``refresh_replicas``,
    ``reduce_replica_grads``, ``average_expert_grads``) are ``feplb.training.TrainingSteps``'; how the expert
    shards map onto the full model's tensors and state dicts, ``feplb.sharded.ExpertShards``'.
    """

    # why a subclass's experts cannot serve forward_dispatched (its forward does per-call work of its own), or None
    _no_forward_dispatched: str | None = None

    def __init__(self, config: FEPLBConfig, group: dist.ProcessGroup | None = None):
        super().__init__()
        if not isinstance(config, FEPLBConfig):
            raise TypeError(f"config must be a FEPLBConfig, got {type(config).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("MoELayer needs torch.distributed initialised (init_process_group) first")
        # the group itself, not None: a layer stays on the group it was built on (after destroy_process_group and a
        # new init_process_group, not on the new default group with its old rank numbers)
        group = group if group is not None else dist.group.WORLD
        # (an earlier backward that raised may have left exchanges on copy threads, of a layer not closed: they end
        # before this construction's first collective meets them on the same groups)
        settle_abandoned()
        from feplb.sched import policies as sched_policies
        from feplb.sched.cost import CostModel

        self._sched = sched_policies
        c = self.config = config
        # the cost model's experts are gated (3 H F weights and multiply-adds per row); a non-gated expert's 2 H F
        # are those of a gated one 2F/3 wide
        nbytes = torch.empty((), dtype=c.dtype).element_size()
        self._cost = c.cost if c.cost is not None else CostModel(
            hidden=c.hidden, ffn=c.ffn if c.gated else max(1, 2 * c.ffn // 3), dtype_bytes=nbytes,
            grad_dtype_bytes=None if c.reduce_in_fp32 or c.dtype != torch.bfloat16 else nbytes)
        self.group = group
        W, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.world_size = W
        # Every host control collective (counts, agreements, checks) over gloo, never the device. Its construction
        # agrees on gpus_per_node, then the configs are compared: every check below sees the same config on every
        # rank, so a bad one raises everywhere, none waits for a peer that raised alone.
        self.control = Control(group, c.gpus_per_node)
        try:
            self._build(group)
        except BaseException:
            self.close()      # what was built so far: threads, copy path, transport, hooks
            raise
        register(self)     # state dicts shard the experts over the EP group (feplb.sharded)
        self._built_dtypes = tuple(p.dtype for p in self.expert_params())
        self._note_params()
        # load_state_dict(assign=True) replaces them knowingly
        self.register_load_state_dict_post_hook(lambda module, _keys: module._note_params())

    def _note_params(self) -> None:
        """Remember which parameter objects are the expert shards (weakly): :meth:`_params_problem`."""
        self._expert_param_refs = tuple(weakref.ref(p) for p in self.expert_params())

    def _params_problem(self) -> tuple[type, str] | None:
        """Why the forward cannot run on these expert parameters: other objects than those the layer made (or
        loaded with ``load_state_dict(assign=True)``) were registered in their place, as FSDP's ``fully_shard``
        does to every parameter it shards, which here would gather into each rank's tensor the shards of other
        ranks' experts."""
        now = self.expert_params()
        if len(now) == len(self._expert_param_refs) and all(r() is p for r, p in zip(self._expert_param_refs, now,
                                                                                            strict=True)):
            return None
        if torch.nn.utils.parametrize.is_parametrized(self):
            return RuntimeError, (f"{type(self).__name__}: its expert parameters are parametrized "
                                  "(torch.nn.utils.parametrize, as PEFT's LoRA on the expert weights, "
                                  "target_parameters, does in its forward): the layer computes on its own shards, "
                                  "never on a parametrization's output. LoRA on the experts is not supported; on "
                                  "other modules (attention, say) it is")
        return RuntimeError, (f"{type(self).__name__}: its expert parameters are no longer the tensors it holds its "
                              "experts in: a wrapper registered others in their place (FSDP's fully_shard over "
                              "them, which would gather the shards of other ranks' experts into this rank's). "
                              "Leave the experts out: fully_shard(..., ignored_params=set(expert_parameters(model))) "
                              "(feplb.hf / feplb.titan), and for DDP feplb.ignore_experts_in_ddp(model)")

    def _build(self, group: dist.ProcessGroup) -> None:
        """The rest of ``__init__``, once the Control exists (a failure here releases what was built). Its local
        steps (parameters, buffers: an allocation may fail on one rank only) are agreed before the router's
        broadcast: every rank raises together, none keeps a layer its peers lack."""
        from feplb.sched.plan import INTRA_NODE_BASES, parse_policy
        from feplb.sched.state import PolicyState
        from feplb.sched.topology import Topology

        c, W = self.config, self.world_size
        fields = {f.name: repr(getattr(c, f.name)) for f in dataclasses.fields(c)}
        self.control.check_same(repr(dataclasses.asdict(c)).encode() + repr((W, c.gpus_per_node)).encode(),
                                "FEPLBConfig", "every rank of the EP group must build the layer with the same config",
                                fields={**fields, "EP group size": repr(W)})
        # A number naming this layer alike on every rank of the group (the largest of the ranks' next numbers), sent
        # with every forward's counts: ranks that run different layers in one forward raise instead of mixing them.
        global _NEXT_LAYER_ID
        key = self.control.ranks
        got = self.control.all_gather(torch.tensor([_NEXT_LAYER_ID, max(_COUNTS_WIDTH.get(key, 0), c.num_experts)],
                                                   dtype=torch.int64),
                                      "agreement on the layer number")
        self.layer_id = int(got[:, 0].max())
        with _LAYER_ID_LOCK:   # layers of other groups may be built on other threads meanwhile
            _NEXT_LAYER_ID = max(_NEXT_LAYER_ID, self.layer_id + 1)
            _COUNTS_WIDTH[key] = max(_COUNTS_WIDTH.get(key, 0), int(got[:, 1].max()))
        self._counts_key = key
        if c.num_experts % W:
            raise ValueError(f"FEPLBConfig.num_experts ({c.num_experts}) must be divisible by the EP group size ({W})")
        L = self.num_local = c.num_experts // W
        self.base, self.place, mode = parse_policy(c.policy)
        # per-step copies of other ranks' experts (held to the next refresh: @ema replicas of the in-node policies,
        # a +place bank, EPLB's replicas), whose share follows their holder's requires_grad flags: the forward agrees
        # the flags over the ranks that share copies (``_frozen_code``), a node's where the copies stay in it
        ema_set = mode == "ema" and self.base in INTRA_NODE_BASES
        self._copies_per_step = c.weights == "per-step" and (self.place or ema_set or self.base == "eplb")
        self._frozen_within = c.gpus_per_node if not (self.place or self.base == "eplb") else 0
        self.in_node_policy = self.base in INTRA_NODE_BASES or self.base == "none"
        self.direct = self.base in DIRECT_BASES
        self.topo = Topology(num_ranks=W, gpus_per_node=c.gpus_per_node, num_experts=c.num_experts,
                             dyn=min(c.dyn, L) if self.base != "none" else 0)
        backend = dist.get_backend(group)
        on_gpu = c.device == "cuda" or (c.device == "auto" and ("nccl" in backend or c.transport == "nvshmem"))

        def device_of() -> torch.device:
            if on_gpu and not torch.cuda.is_available():
                raise RuntimeError(f"FEPLBConfig.device={c.device!r} (transport {c.transport!r}, backend "
                                   f"{backend!r}) needs a CUDA GPU, and none is available")
            if not on_gpu and backend == "nccl":   # (a "cpu:gloo,cuda:nccl" group carries both)
                raise ValueError("FEPLBConfig.device='cpu' cannot run over an NCCL group (NCCL moves CUDA tensors "
                                 "only)")
            return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")

        device = self._agreed("finding the layer's device", device_of)
        if on_gpu and c.dtype == torch.float32:
            warnings.warn("FEPLBConfig.dtype=float32 on CUDA: outside torch.autocast the experts' GEMMs run on FMA "
                          "units, not tensor cores; use dtype=torch.bfloat16, or run the layer inside torch.autocast",
                          stacklevel=2)
        self.transport = shared_transport(c.transport, group, self.control)
        self.node_ranks = self.control.node_ranks
        # shared with the process's other layers over these ranks, given back by close(): a layer never closed keeps
        # its share (closing may be collective, and a collection happens at different times on different ranks)
        self._copy = shared_copy_engine(c.copy_path, device, self.control, transport_kind=c.transport)
        self.comm = PeerComm(self.transport, self._copy, c.gpus_per_node)
        self.state = PolicyState(topo=self.topo, policy=c.policy, refresh_every=c.refresh_every,
                                 replicas_mode=c.replicas) \
            if (self.base != "none" or self.place) else None
        # The slow decisions the layer executes (placement, @ema sets, EPLB replicas): the policy state as of the
        # last adoption. Plans are made from it, so they always match the weights the GPUs hold.
        self._plan_state = self.state
        # In-node plans of different nodes are independent: with several nodes a rank plans its own node only
        # (make_plan(..., node=k)), unless the policy's history folds in whole plans (PolicyState.reads_plans).
        self._node = self.topo.node_of(self.rank) if self.in_node_policy and self.topo.num_nodes > 1 else None
        self._min_straggler = c.min_straggler_rows if c.min_straggler_rows is not None else self._cost.knee_rows
        wait = c.plan_wait_ms if c.plan_wait_ms is not None else (0.0 if on_gpu else None)
        limit = group_timeout(self.control.group)

        def local() -> None:
            # threads, parameters, buffers: what may fail on one rank only (an allocation, a thread)
            self._balancer = Balancer(plan_wait_s=None if wait is None else wait / 1e3, device=device,
                                      group_timeout_s=None if limit is None else limit.total_seconds()) \
                if self.base != "none" else None
            H, Fd = c.hidden, c.ffn
            self.router = None if c.router == "external" else nn.Linear(H, c.num_experts, bias=False,
                                                                          device=device, dtype=c.dtype)
            self._init_experts(L, H, Fd, device, c.dtype)
            if c.router_bias:
                self.register_buffer("router_bias", torch.zeros(c.num_experts, device=device, dtype=torch.float32))
            else:
                self.router_bias = None
            self._device = device
            # the steps this process's GradScalers skipped before the layer was made (its forwards compare those
            # skipped since: feplb.training.scaler_skips)
            self._skips_base = scaler_skips(device)
            # a zero-size leaf that puts every collective's backward in the graph whenever autograd records
            self._grad_leaf = torch.zeros(0, device=device, dtype=c.dtype, requires_grad=True)
            self._set_placement(self.topo.default_home_E())

        self._agreed("building the layer", local)
        if self.router is not None:
            with torch.no_grad():
                dist.broadcast(self.router.weight, src=dist.get_global_rank(group, 0), group=group)
        self._recv_buf: torch.Tensor | None = None
        self._recv_grew = False
        # what forwards that activation checkpointing may recompute decided (feplb.recompute)
        self._records = Records()
        # the last forward's BackwardJoins: exchanges its backward left on the copy thread end before the next
        # forward's first (feplb.dispatch.BackwardJoin)
        self._backward_join = None
        self.replicas = Replicas(self)
        self._hooks: list = []
        self._digest_key: tuple | None = None
        _LAYERS.add(self)     # an unattached optimizer stepping its experts marks its copies stale (_stepped)
        self.last_stats: LayerStats | None = None
        self.last_plan = None
        self.last_plan_inputs = None
        self.last_timeline: Timeline | None = None

    def _agreed(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, local steps that may fail on one rank only (no GPU there, an allocation, a thread), then one
        all-gather: if any rank's failed, every rank raises together (that rank its own error), none goes on to a
        collective its peer will never join, nor keeps a layer its peer lacks."""
        failed: Exception | None = None
        out = None
        try:
            out = fn()
        except Exception as exc:    # noqa: BLE001 - agreed below, then raised on this rank as it was
            failed = exc
        bad = self.control.all_gather(torch.tensor([int(failed is not None)]), what)[:, 0]
        if failed is not None:
            raise failed
        if bool(bad.any()):
            raise RuntimeError(f"MoELayer: {what} failed on EP rank(s) {bad.nonzero().flatten().tolist()} (the "
                               "error is raised there); no rank keeps the layer")
        return out

    # ------------------------------------------------------------------------------------------------ experts
    def _init_experts(self, L: int, H: int, F_: int, device: torch.device, dtype: torch.dtype) -> None:
        """Create this rank's expert parameters (override to store them in another layout)."""
        G = 2 * F_ if self.config.gated else F_
        self.w1 = nn.Parameter(torch.randn(L, H, G, device=device, dtype=dtype) / H ** 0.5)
        self.w2 = nn.Parameter(torch.randn(L, F_, H, device=device, dtype=dtype) / F_ ** 0.5)
        if self.config.expert_bias:
            self.b1 = nn.Parameter(torch.zeros(L, G, device=device, dtype=dtype))
            self.b2 = nn.Parameter(torch.zeros(L, H, device=device, dtype=dtype))

    def expert_weights(self) -> tuple[torch.Tensor, ...]:
        """This rank's own experts as (w1 [L, H, 2F], w2 [L, F, H]), or (w1, w2, b1 [L, 2F], b2 [L, H]) with
        ``expert_bias`` (:attr:`part_shapes`; F instead of 2F for non-gated experts): the layer reads them only
        through this (views of the parameters allowed; gradients flow back through them)."""
        if self.config.expert_bias:
            return self.w1, self.w2, self.b1, self.b2
        return self.w1, self.w2

    @property
    def part_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shape of one expert's slice of each tensor of ``expert_weights()``: ([H, 2F], [F, H]), then [2F]
        and [H] with ``expert_bias`` (F for 2F with non-gated experts). Copies of an expert carry every part."""
        H, F_ = self.config.hidden, self.config.ffn
        G = 2 * F_ if self.config.gated else F_
        return ((H, G), (F_, H)) + (((G,), (H,)) if self.config.expert_bias else ())

    @property
    def part_sizes(self) -> list[int]:
        """The elements of each of :attr:`part_shapes` (what a copy of one expert sends per part)."""
        return [math.prod(s) for s in self.part_shapes]

    def expert_params(self) -> tuple[nn.Parameter, ...]:
        """The parameters behind ``expert_weights()`` (what an optimizer steps)."""
        # (what parameters(recurse=False) yields, without its generators: this is called several times a forward)
        router = None if self.router is None else self.router.weight
        seen: set = set()
        out = []
        for p in self._parameters.values():
            if p is None or p in seen:
                continue
            seen.add(p)
            if p is not router:
                out.append(p)
        return tuple(out)

    def _set_placement(self, home_E: np.ndarray) -> None:
        self.placement = Placement.of(home_E, self.world_size, self.rank)
        self._slot_of_E = to_device(self.placement.slot_of_E, self._device)   # no host sync mid-forward

    @property
    def home_E(self) -> np.ndarray:
        """int64 [E]: the GPU that computes each expert by default (its owner unless placed elsewhere)."""
        return self.placement.home_E.copy()

    def _weights_of(self, slot_w) -> Callable[[int], tuple[torch.Tensor, ...]]:
        """This rank's weights of an expert e (views, one per part): a slot, a per-step replica, or its own
        parameters (read when asked for)."""
        return self._lookup(slot_w.parts, self.replicas.view(self.replicas.replica_bank), self.expert_weights,
                            self.replicas.mark_used)

    def _send_weights(self, slot_w) -> Callable[[int], tuple[torch.Tensor, ...]]:
        """:meth:`_weights_of` for another thread: made now, on the forward's thread, from detached aliases of the
        banks (no autograd metadata), so the copy thread indexes tensors that no other thread uses. Views of the
        banks themselves, made there, would go through the autograd metadata of tensors the forward's GEMMs are
        using at the same moment (a torch call holding the GIL there can wait for a lock the other thread holds
        while it waits for the GIL)."""
        slot = tuple(w.detach() for w in slot_w.parts)
        bank = self.replicas.replica_bank
        replica = None if bank is None else tuple(w.detach() for w in bank)
        # the slots are the own experts unless experts are placed away from their owners
        own = slot if self.placement.own_slots else tuple(w.detach() for w in self.expert_weights())
        return self._lookup(slot, replica, lambda: own)

    def _lookup(self, slot, replica, own: Callable[[], tuple[torch.Tensor, ...]],
                used: Callable[[int], None] | None = None) -> Callable[[int], tuple[torch.Tensor, ...]]:
        """used(e): called when a replica's weights are handed out (``Replicas.mark_used``: their gradient
        may then be nonzero)."""
        slot_pos, replica_of = dict(self.placement.slot_pos), dict(self.replicas.replica_of)
        r, L = self.rank, self.num_local

        def local(e: int) -> tuple[torch.Tensor, ...]:
            i = slot_pos.get(e)
            if i is not None:
                return tuple(w[i] for w in slot)
            j = replica_of.get(e)
            if j is not None:
                if used is not None:
                    used(e)
                return tuple(w[j] for w in replica)
            if e // L == r:
                return tuple(w[e - r * L] for w in own())
            raise RuntimeError(f"MoELayer: GPU {r} holds no weights of expert {e}")

        return local

    def _anchor(self, t: torch.Tensor) -> torch.Tensor:
        """An empty 1-D tensor that requires grad whenever the layer's rows or expert weights do. Every exchange
        takes one, so whether its backward runs (a collective) never depends on what this rank sends, nor on which
        of them a backward asks for (``torch.autograd.grad(..., inputs=[w2])`` too: every part is in it)."""
        leaf = (self._grad_leaf,) if torch.is_grad_enabled() else ()
        return _Anchor.apply(t, *self.expert_weights(), *leaf)

    def extra_repr(self) -> str:
        c = self.config
        return (f"hidden={c.hidden}, ffn={c.ffn}, experts={c.num_experts} ({self.num_local} local), top_k={c.top_k}, "
                f"policy={c.policy!r}, weights={c.weights!r}, ranks={self.world_size}, gpus_per_node={c.gpus_per_node}")

    # ------------------------------------------------------------------------------------------------ 1. route
    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router: x_TD [T, H] -> (topk_ids_TK int64 [T, K], topk_weights_TK [T, K] in x's dtype, bad: int64 0-d
        tensor, nonzero when a logit or the selection bias is NaN or inf). Scores in fp32, fp64 in a float64 layer
        (from logits that ``torch.autocast``, like any ``F.linear``, computes in its dtype); the bias (if any)
        affects selection only."""
        c = self.config
        logits_TE = F.linear(x_TD, self.router.weight)
        logits_TE = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32))
        bad = ~torch.isfinite(logits_TE).all()
        if self.router_bias is not None:   # (a bias update that wrote NaN would drop its expert from selection)
            bad = bad | ~torch.isfinite(self.router_bias).all()
        bad = bad.long()
        scores_TE = logits_TE.softmax(-1) if c.router == "softmax" else logits_TE.sigmoid()
        sel_TE = scores_TE.detach() if self.router_bias is None else scores_TE.detach() + self.router_bias
        sel_TE = torch.nan_to_num(sel_TE, nan=0.0, posinf=0.0, neginf=0.0)
        topk_ids_TK = sel_TE.topk(c.top_k, dim=-1).indices
        w_TK = scores_TE.gather(-1, topk_ids_TK)
        if c.router == "sigmoid":
            w_TK = w_TK / w_TK.sum(-1, keepdim=True).clamp_min(1e-20)
        return topk_ids_TK, w_TK.to(x_TD.dtype), bad

    def forward(self, x: torch.Tensor,
                routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [T, H] or [B, S, H] in ``config.dtype`` (any strides) -> same shape and dtype. Collective over the EP
        group. Inside ``torch.autocast`` the experts' GEMMs run in the autocast dtype (like ``torch.matmul``), the
        rows travel and combine in ``config.dtype``, and x may be float16, bfloat16 or float32 (cast to
        ``config.dtype`` first, the output returned in x's).

        routing: optional (topk_ids [T, K] integer, topk_weights [T, K] floating, any strides) from a router outside
            the layer (one per token of x, in x's token order); the layer's own router is then skipped and the
            gradient flows into topk_weights. float32 weights weigh the experts' outputs in float32 (the combine
            accumulates in fp32 whatever the layer's dtype), and so do float64 ones (cast to float32) in a layer of
            lower precision; others are cast to ``config.dtype``. Ids outside
            [0, E) or non-finite weights raise on every rank together (non-finite ones, or non-finite router
            logits: ``feplb.NonFiniteRoutingError``, a ValueError).

        Under ``torch.compile`` the routing and the combine compile; the dispatch in between (communication, CPU
        planning) is excluded with ``torch.compiler.disable``, so the graph breaks exactly there.
        """
        from feplb.kernels import permute, routing_metadata, unpermute

        self._check_open()
        problem = self._cast_hint(forward_problem(self.config, self._device, self.router is not None, x, routing)) \
            or self._params_problem()
        if problem is not None:
            self._experts(None, None, None, problem)   # the peers learn it in the counts all-gather; raises
        c = self.config
        skip_TK = None   # masked routes (FEPLBConfig.masked_routes): the slots routed to no expert
        # Inside torch.autocast an input of another floating dtype (forward_problem allows it) travels in the
        # layer's dtype; the output returns in x's dtype.
        x_TD = x.reshape(-1, c.hidden).to(c.dtype).contiguous()
        if routing is None:
            topk_ids_TK, w_TK, bad = self.route(x_TD)
        else:
            # int64 (a uint8 tensor would wrap -1 around)
            ids_TK = routing[0].reshape(-1, c.top_k).long().contiguous()
            w_TK = routing[1].reshape(-1, c.top_k).contiguous()
            E = c.num_experts
            # flags, not a host check: a bad id or weight reaches every rank in the counts all-gather
            bad = (~torch.isfinite(w_TK).all()).long() + \
                2 * ((ids_TK < (-1 if c.masked_routes else 0)) | (ids_TK >= E)).any().long()
            if c.masked_routes:
                skip_TK = ids_TK < 0
            # float32 weights stay float32 (the combine accumulates in fp32; a router's fp32 scores lose nothing),
            # float64 ones become float32 (Megatron's fp64 router weighs in fp64: one fp32 rounding, not a bf16 one),
            # others take the layer's dtype
            topk_ids_TK = ids_TK.clamp(0, E - 1)
            if w_TK.dtype not in (torch.float32, x_TD.dtype):
                w_TK = w_TK.to(torch.float32 if w_TK.dtype == torch.float64 else x_TD.dtype)
        # A recompute by activation checkpointing groups its rows as its forward did (feplb.recompute)
        replay = None
        if not torch.compiler.is_compiling() and in_backward():
            replay = self._find_record(_expert_counts(topk_ids_TK, skip_TK, c.num_experts))
        slot_of_E = self._slot_of_E if replay is None else replay.slot_of_E
        # Rows grouped by SLOT (home GPU, then the expert's place among that GPU's slots): every destination's rows
        # form one block whatever the placement, so phase 1 needs no extra gather. Masked routes go to one slot
        # past the last (their rows end the grouped rows, and never leave this rank).
        slot_TK = slot_of_E[topk_ids_TK]
        if skip_TK is not None:
            slot_TK = torch.where(skip_TK, c.num_experts, slot_TK)
        meta = routing_metadata(slot_TK, c.num_experts + (skip_TK is not None), check=False)
        x_MD = permute(x_TD, meta)
        if c.gate_on_input:
            # each row weighed by its token's gate before the experts (Llama 4, Megatron's moe_apply_probs_on_input):
            # the product in the wider of the two dtypes, rounded once to the rows' (both models' rule); the
            # combine then sums the rows' outputs unweighed
            w_M = w_TK.new_zeros(x_MD.shape[0]).index_put((meta.dst_idx_TK.reshape(-1).long(),), w_TK.reshape(-1))
            x_MD = (x_MD * w_M[:, None]).to(x_MD.dtype)
            w_TK = torch.ones(w_TK.shape, dtype=torch.float32, device=w_TK.device)
        if skip_TK is not None:   # masked routes weigh nothing (their rows are zero, but post_expert may change them)
            w_TK = w_TK.masked_fill(skip_TK, 0)
        y_MD = self._experts(x_MD, meta.counts_E[:c.num_experts], bad, replay=replay)
        tl = self.last_timeline if replay is None else None   # a recompute leaves the last forward's timeline alone
        try:
            # each row's expert, for a post-expert step that depends on it (scattered on the device: no host sync)
            # (out of place: a selective activation checkpoint saving every op caches the new tensor, and refuses a
            # write)
            expert_M = topk_ids_TK.new_empty(y_MD.shape[0]).index_put(
                (meta.dst_idx_TK.reshape(-1).long(),), topk_ids_TK.reshape(-1)) if self.post_expert_ids else None
            y_MD = self._post_expert(y_MD, expert_M)
            if tl is None:
                return unpermute(y_MD, meta, w_TK).reshape(x.shape).to(x.dtype)
            with tl.span("combine"):
                return unpermute(y_MD, meta, w_TK).reshape(x.shape).to(x.dtype)
        finally:
            if tl is not None:
                tl.close()       # (what ends later, a late plan, goes to its late spans; also after an error)

    def _cast_hint(self, problem: tuple[type, str] | None) -> tuple[type, str] | None:
        """``problem``, with the likely cause added to a wrong input dtype where the expert parameters no longer
        have the dtypes the layer was built with: the model was cast after the layer was made (the layer computes
        in ``FEPLBConfig.dtype``, fixed when it is built); likewise to a wrong input device where they were moved."""
        if problem is not None and problem[0] is ValueError and "the layer's experts are on" in problem[1]:
            moved = sorted({str(p.device) for p in self.expert_params()} - {str(self._device)})
            if moved:
                return problem[0], (f"{problem[1]} (where it was built): its expert parameters were moved to "
                                    f"{', '.join(moved)} after it was built (model.to(device), or accelerate's "
                                    "prepare, after building it or after feplb.hf.apply / feplb.titan / "
                                    "feplb.megatron replaced the experts); move the model first, then build or apply")
            return problem
        if problem is None or problem[0] is not TypeError or "dtype" not in problem[1]:
            return problem
        now = tuple(p.dtype for p in self.expert_params())
        if now == self._built_dtypes:
            return problem
        was = ", ".join(sorted({str(d) for d in self._built_dtypes}))
        cast = ", ".join(sorted({str(d) for d in now}))
        return problem[0], (f"{problem[1]}. The layer's expert parameters were cast from {was} to {cast} after "
                            f"it was built for {self.config.dtype} (model.to(dtype), .half() or .bfloat16() after "
                            "building it or after feplb.hf.apply / feplb.titan / feplb.megatron replaced the experts): "
                            "cast the model first, then build or apply")

    # whether post_expert needs each row's expert id (a subclass's per-expert step after the experts)
    post_expert_ids = False

    def _post_expert(self, y_MD: torch.Tensor, expert_M: torch.Tensor | None) -> torch.Tensor:
        # one argument where no ids are asked for: overrides written post_expert(self, y_MD) keep working
        return self.post_expert(y_MD) if expert_M is None else self.post_expert(y_MD, expert_M)

    def post_expert(self, y_MD: torch.Tensor, expert_M: torch.Tensor | None = None) -> torch.Tensor:
        """Every row's expert output, [M, H] in the layer's dtype, back on its token's GPU and before the gates weigh
        and sum them: the identity here; a subclass applies a row-wise module there (transformers' post-expert
        norm, or Ergo's per-expert one). Row by row, so where a row was computed does not change it.

        expert_M: each row's (global) expert id, int64 [M] on the layer's device, where the class sets
        :attr:`post_expert_ids` (0 for a masked route's row, which weighs nothing); else None (not computed)."""
        return y_MD

    @torch.compiler.disable
    def forward_dispatched(self, rows: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """Experts for a caller that dispatches the tokens itself (DeepEP's ``Buffer.dispatch``, a hand-written
        all-to-all): the rows this rank received for its own experts, grouped by local expert, -> each row's expert
        output, in the same order, the node's GPUs sharing the work (steps 2-3 and 5-7: no phase 1, no reverse
        all-to-all, no router, no combine: the caller weighs the outputs and sends them back).

        rows: [R, H] in ``config.dtype`` on the layer's device, local expert 0's rows first (expert ``rank * L``),
            then expert 1's, ...; counts: rows per local expert ([L] ints: a list, as DeepEP returns
            ``num_recv_tokens_per_expert_list``, or an integer tensor), summing to R. Returns [R, H] in
            ``config.dtype`` (``post_expert`` applied), differentiable with respect to rows and the experts. Inside
            ``torch.autocast`` the rows may be float16, bfloat16 or float32, as ``forward``'s input (cast to
            ``config.dtype`` first, the outputs returned in the rows' dtype).

        Collective over the EP group (every rank calls it, once per micro-batch, in the same order as its other
        layers' forwards); a bad argument on one rank raises on every rank together. The experts stay at their
        owners: a policy that places experts elsewhere (``+place``) or sends rows straight to a helper
        (``fastermoe``, ``eplb``) needs the layer's own dispatch and is refused. Activation checkpointing, replicas,
        stats and the timeline work as for ``forward``; ``last_stats.counts_WE`` holds each rank's rows as if it had
        sent them to itself. The gates are the caller's: it weighs the outputs (or, for experts gated on their input,
        ``gate_on_input``, the rows before the call).
        """
        if self._no_forward_dispatched is not None:
            # (raised on every rank together, as any refusal here: a peer may be in the layer's forward meanwhile)
            self._check_open()
            self._experts(None, None, None, (TypeError, f"{type(self).__name__}.forward_dispatched: "
                                                        f"{self._no_forward_dispatched}"), dispatched=True)
        return self._forward_dispatched(rows, counts)

    def _forward_dispatched(self, rows: torch.Tensor, counts: torch.Tensor | list[int],
                            problem: tuple[type, str] | None = None) -> torch.Tensor:
        """:meth:`forward_dispatched` for a subclass whose own ``forward`` receives dispatched rows (Megatron's
        experts behind Megatron's token dispatcher); ``problem``: what the subclass found wrong with its other
        arguments on this rank, raised on every rank with the rest."""
        self._check_open()
        c = self.config
        # (the policy is the same on every rank, but a peer may call the layer's own forward meanwhile: every
        # refusal here goes through the counts all-gather, so that all raise together)
        policy = (ValueError, f"{type(self).__name__}.forward_dispatched: {dispatched_policy_problem(c.policy)}") \
            if self.place or self.direct else None
        got, counts_L = dispatched_problem(c, self._device, self.num_local, rows, counts)
        problem = policy or self._cast_hint(got) or problem or self._params_problem()
        if problem is not None:
            # the peers learn it in the counts all-gather; raises
            self._experts(None, None, None, problem, dispatched=True)
        L, r = self.num_local, self.rank
        counts_S = _dispatched_counts(c.num_experts, r * L, counts_L)
        # (no +place: every expert at its owner, so slot = expert and phase 1's receive order is the caller's)
        # Inside torch.autocast rows of another floating dtype (dispatched_problem allows it) are computed in the
        # layer's dtype, as forward() does, and the outputs return in the rows' dtype.
        y = self._experts(rows.to(c.dtype), counts_S, torch.zeros((), dtype=torch.int64), dispatched=True)
        if self.last_timeline is not None:
            self.last_timeline.close()
        expert_M = to_device(np.repeat(np.arange(r * L, (r + 1) * L), counts_L), self._device) \
            if self.post_expert_ids else None
        return self._post_expert(y, expert_M).to(rows.dtype)

    @torch.compiler.disable
    def _experts(self, x_MD: torch.Tensor | None, counts_S: torch.Tensor | None, bad: torch.Tensor | None,
                 problem: tuple[type, str] | None = None, replay: Record | None = None,
                 dispatched: bool = False) -> torch.Tensor:
        """Grouped rows x_MD [M, H] (by slot, then token, then k) -> expert outputs y_MD [M, H], same order.
        dispatched: x_MD are this rank's rows at home already, by local expert (``forward_dispatched``)."""
        # (an earlier backward that raised may have left exchanges on copy threads, this layer's or another's: they
        # end before this forward's first collective meets them on the same groups)
        settle_abandoned()
        if problem is None and in_backward():
            # activation checkpointing recomputing the layer: execute what its forward did (feplb.recompute)
            if replay is None and dispatched:   # (no +place: slot = expert)
                replay = self._find_record(counts_S, dispatched=True)
            elif replay is None:   # a compiled forward() grouped the rows with the current placement
                replay = self._find_record(_by_slot(counts_S, self._slot_of_E))
                if replay.placement is not self.placement:
                    raise RuntimeError("MoELayer: a compiled forward cannot be recomputed under another placement "
                                       "than its first run's (weights='per-microbatch' with '+place'); use "
                                       "weights='per-step', or do not compile the checkpointed block")
            # (a forward that found nothing needing grad on any rank made no graph: neither does its recompute, which
            # saves what it saved)
            with torch.no_grad() if replay.grad_free else contextlib.nullcontext():
                entry = ForwardEntry(self) if torch.is_grad_enabled() else None
                rows = self._valid(x_MD, replay.counts)
                if dispatched and entry is not None:
                    # as the forward's (below): rows that need no grad of their own need it here too, through the
                    # expert parameters, so that the recompute records (and saves for its backward) what the forward
                    # did
                    rows = _entered_rows(entry, rows, *self.expert_params(), self._grad_leaf)
                with entered_through(entry):
                    y_MD = self._padded(self._replay(rows, replay), x_MD)
                self._watch_backward_flags(y_MD)
                if entry is not None and y_MD.requires_grad:
                    y_MD.register_hook(entry.arrived)
            return y_MD
        if problem is None and torch.is_grad_enabled():   # (every rank alike: the mode is the training loop's)
            refused = compiled_autograd_problem("forward", forward=True)
            problem = None if refused is None else (RuntimeError, refused)
        # (made the layer's last_timeline with its last_stats, by _observe: a forward that raises before then leaves
        # both as the last forward that returned had them)
        tl = Timeline(device_spans=self._device.type == "cuda") if self.config.timeline else None
        # (what the GEMMs read: the weights, which an adapter derives from its own tensors, as feplb.titan_ep's
        # engine, holding no parameters, from its module's shards; and the parameters themselves)
        needs = problem is None and torch.is_grad_enabled() and (
            x_MD.requires_grad or any(w.requires_grad for w in self.expert_weights())
            or any(p.requires_grad for p in self.expert_params()))
        with span(tl, "counts"):
            counts = self._count(counts_S, bad, problem, dispatched, needs)
        # autograd on, yet nothing the layer reads needs grad on any rank (frozen experts behind frozen layers, an
        # evaluation with grad on): as torch's own ops, the layer then makes an output that needs none, and no
        # backward runs through it (which the anchors would make every rank run). Agreed: a rank whose rows need
        # grad makes every rank keep the graph, as its backward exchanges are collective.
        grad_free = torch.is_grad_enabled() and not counts.needs_grad
        kind = record_kind()
        with torch.no_grad() if grad_free else contextlib.nullcontext():
            placement, slot_of_E, plan_state = self.placement, self._slot_of_E, self._plan_state
            direct = counts.want_plan and self.direct
            x_all, x_MD = x_MD, self._valid(x_MD, counts)
            # (the backward nodes of this forward's exchanges check that their backward started at its output)
            entry = ForwardEntry(self) if torch.is_grad_enabled() else None
            if dispatched and entry is not None:
                # (no phase 1 here, and a node whose plan moves nothing makes no exchange: this node, on the way to the
                # expert parameters on every rank, checks where the backward started. With the layer's zero-size leaf
                # the rows need grad on every rank, as phase 1's anchor makes forward()'s: where neither they nor the
                # expert parameters did, the output needed grad only on ranks whose plan made an exchange, and only
                # those ran the layer's backward (or a checkpoint's recompute), waiting for the others)
                x_MD = _entered_rows(entry, x_MD, *self.expert_params(), self._grad_leaf)
            with entered_through(entry):
                if direct:
                    y_MD, p2 = forward_direct(self, x_MD, counts, tl)
                else:
                    y_MD, p2 = self._in_node(x_MD, counts, tl, dispatched=dispatched)
            if p2.recopy is None:
                self._check_weights_at_backward(y_MD)
            else:
                # recopy_weights: the weights go to the helpers again as soon as this output's gradient arrives, before
                # the backward of the reverse all-to-all (on a GPU, beside it where the copy path allows: feplb.recopy)
                p2.recopy.start_at(y_MD)
            y_MD = self._restricted(self._padded(y_MD, x_all))
            self._watch_backward_flags(y_MD)
            if entry is not None and y_MD.requires_grad:
                y_MD.register_hook(entry.arrived)   # (the last hook on it: it runs before any node of the layer's)
            self._observe(counts, p2, tl)
            if kind is not None:
                frame = checkpoint_frame() if kind == "hooks" else None
                self._records.add(Record(kind=kind, placement=placement, slot_of_E=slot_of_E, plan_state=plan_state,
                                         counts=counts, direct=direct, plan=None if p2.fell_back else p2.result.plan,
                                         fell_back=p2.fell_back, generation=self.replicas.generation,
                                         requires=self.replicas.forward_requires(),
                                         frame=None if frame is None else weakref.ref(frame), dispatched=dispatched,
                                         grad_free=grad_free))
        return y_MD

    @hidden_from_selective_checkpoint
    def _restricted(self, y_MD: torch.Tensor) -> torch.Tensor:
        """y_MD, through :class:`_RestrictedBackward` where per-step copies hold part of the experts' gradients: a
        backward restricted to chosen tensors would leave out their share, and is refused in its backward, on every
        rank alike. A forward's own (its recompute, which replays, has none): hidden from selective checkpointing,
        so that selective activation checkpointing sees the same ops in the forward and in its recompute."""
        if self.config.weights != "per-step" or (self.base == "none" and not self.place) or not y_MD.requires_grad:
            return y_MD
        # (from the parameters themselves: an adapter's expert_weights() may cast or stack them all)
        weights = sum(p[:0].reshape(-1) for p in self.expert_params() if p.requires_grad)
        if not isinstance(weights, torch.Tensor) or weights.grad_fn is None:
            return y_MD
        full = self._grad_leaf[:0]
        return _RestrictedBackward.apply(weakref.ref(self), (weights.grad_fn, full.grad_fn), y_MD, weights, full)

    def _check_weights_at_backward(self, y_MD: torch.Tensor) -> None:
        """Have the expert weights this forward's GEMMs saved (the parameters themselves: not under an autocast that
        casts them) checked for in-place changes when y_MD's gradient arrives, before any of the layer's backward
        collectives. An optimizer step between a forward and its backward (a training loop's mistake, which every
        rank makes alike) then raises on every rank at that one point, as autograd's own check would, instead of
        on the ranks whose GEMM backward comes first while a helper waits in the exchange that sends its homes'
        gradients. (With ``recopy_weights`` the copies' agreement over the node does it, also for a change on one
        rank only.) Only versions: writes autograd does not see either (``.data``) are not seen here."""
        if not y_MD.requires_grad:
            return
        from feplb.kernels import autocast_dtype
        cast = autocast_dtype(self._device.type)
        # (the stacked weight matrices [L, ., .]: the GEMMs save those, not the biases [L, .])
        saved = [p for p in self.expert_params() if p.requires_grad and p.dim() >= 3
                 and (cast is None or p.dtype in (cast, torch.float64))]
        if not saved:
            return
        versions = [p._version for p in saved]
        layer = weakref.ref(self)

        def check(grad: torch.Tensor) -> None:
            for p, v in zip(saved, versions, strict=True):
                if p._version != v:
                    me = layer()
                    name = next((n for n, q in me.named_parameters() if q is p), "an expert parameter") \
                        if me is not None else "an expert parameter"
                    raise RuntimeError(
                        f"MoELayer (layer {me.layer_id if me is not None else '?'}): {name} {list(p.shape)} was "
                        f"modified in place between the forward and its backward (version {v} -> {p._version}), as "
                        "an optimizer step there does; the backward needs the experts' weights as the forward read "
                        "them (step the optimizer after the backward). Raised on every rank that changed them, "
                        "ahead of the layer's backward exchanges")

        y_MD.register_hook(check)

    def _valid(self, x_MD: torch.Tensor, counts: Counts) -> torch.Tensor:
        """The grouped rows that go to an expert: all of them, but for masked routes (``masked_routes``), whose rows
        end x_MD and which the counts (known on the host by now) leave out."""
        rows = int(counts.counts_WS[self.rank].sum())
        return x_MD if rows == x_MD.shape[0] else x_MD[:rows]

    @staticmethod
    def _padded(y_MD: torch.Tensor, x_MD: torch.Tensor) -> torch.Tensor:
        """y_MD with a zero row per masked route, back to x_MD's rows."""
        missing = x_MD.shape[0] - y_MD.shape[0]
        return y_MD if missing == 0 else torch.cat([y_MD, y_MD.new_zeros((missing, y_MD.shape[1]))])

    # ------------------------------------------------------------------------------------------------ recompute
    @hidden_from_selective_checkpoint
    def _find_record(self, local_counts_E: torch.Tensor, dispatched: bool = False) -> Record:
        """The record of the forward a recompute repeats (``feplb.recompute``), agreed by every rank in one
        all-gather of bit masks (``Records.candidates``, ``Records.choose``; and a host sync for this rank's
        counts)."""
        settle_abandoned()   # (before its all-gather, as a forward's counts: an earlier backward's that raised)
        now = self.replicas.requires()
        cand = self._records.candidates(local_counts_E.to(torch.int64).cpu().numpy(), self.rank,
                                        self.replicas.generation, self.replicas.ever_held, dispatched, self.layer_id,
                                        refused=lambda rec: rec.kind == "hooks" and self._flags_changed(rec, now))
        # shaped like the forward's counts row (feplb.steps.step_row): a rank that does not recompute, in the next
        # forward's counts all-gather, meets it there and every rank raises (the candidates ride in the counts'
        # place where they fit, else in an all-gather of their own after it)
        width = _COUNTS_WIDTH[self._counts_key]
        row = step_row(self.layer_id, width, ENTRY_RECOMPUTE, as_numpy=True)
        inline = width >= cand.size
        if inline:
            row[len(HEADER):len(HEADER) + cand.size] = cand
        what = "recompute: finding the recorded forward"
        gathered = self.control.all_gather(torch.tensor(row.tolist(), dtype=torch.int64), what).numpy()
        read_recompute(gathered)
        rows = gathered[:, len(HEADER):len(HEADER) + cand.size] if inline else \
            self.control.all_gather(torch.tensor(cand.tolist(), dtype=torch.int64), what).numpy()
        return self._records.choose(rows, self.replicas.generation, self.replicas.ever_held, checkpoint_frame(),
                                    refusal=lambda ranks, rec: self._flags_error(ranks, rec.requires, now))

    def _replay(self, x_MD: torch.Tensor, rec: Record) -> torch.Tensor:
        """Execute a recorded forward again: its placement, policy state, counts and plan (or fallback); the same
        collectives in the same order on every rank, no planning, no agreement, no history update."""
        saved = self.placement, self._slot_of_E, self._plan_state
        self.placement, self._slot_of_E, self._plan_state = rec.placement, rec.slot_of_E, rec.plan_state
        # a non-reentrant checkpoint's recompute refills what its forward's graph saves: the per-step copies are
        # taken with that forward's flags; a reentrant one's builds the graph the backward runs, with the flags now
        self.replicas.begin_forward(rec.requires if rec.kind == "hooks" else None)
        try:
            if rec.direct:
                y_MD, _ = forward_direct(self, x_MD, rec.counts, None, replay_plan=rec.plan)
            else:
                y_MD, _ = self._in_node(x_MD, rec.counts, None, replay=rec, dispatched=rec.dispatched)
        finally:
            self.placement, self._slot_of_E, self._plan_state = saved
        return y_MD

    def _flags_changed(self, rec: Record, now: tuple[bool, ...]) -> bool:
        """Whether the expert parameters' requires_grad flags (``now``) changed since a non-reentrant checkpoint's
        forward (``rec``) in a way that changes which of the experts' weights its GEMMs take with autograd: its
        recompute would save other tensors than the forward, which torch's checkpoint refuses for any module (plain
        EP's too), but only once it sees them, on the ranks that changed them, maybe after the recompute's first
        collective. ``_find_record`` tells every rank, which all raise before the recompute's exchanges. Called
        hidden from selective checkpointing (``_find_record``): telling which parts the flags feed may compute masks
        (``Replicas.part_requires``), which a selective activation checkpoint's recompute must not dispatch."""
        rep, was = self.replicas, tuple(rec.requires)
        return bool(was) and now != was and rep.part_requires(now) != rep.part_requires(was)

    def _flags_error(self, ranks: list[int], was: tuple[bool, ...], now: tuple[bool, ...]) -> Exception:
        """The error every rank raises when the recompute's record is one whose flags ``ranks`` changed since
        (``_flags_changed``), naming the parameters on the ranks that changed them."""
        from torch.utils.checkpoint import CheckpointError

        names = {id(p): n for n, p in self.named_parameters()}
        changed = [f"{names.get(id(p), f'expert parameter {i}')} ({a} at the forward, {b} now)"
                   for i, (p, a, b) in enumerate(zip(self.expert_params(), was, now, strict=True)) if a != b]
        here = f" (here: {', '.join(changed)})" if self.rank in ranks else ""
        return CheckpointError(
            "MoELayer: the experts' requires_grad flags changed between a non-reentrant activation checkpoint's "
            f"forward and its recompute in this backward, on EP rank(s) {ranks}{here}. The recompute would save "
            "other tensors than the forward did, which torch's checkpoint refuses for any module; change the flags "
            "before the checkpointed forward or after its backward, or use a reentrant checkpoint, which builds "
            "its graph at the recompute. Raised on every EP rank, before the recompute's exchanges")

    def _slow_digest(self) -> int:
        """56 bits of the slow decisions this forward plans from (the adopted policy state, the placement): equal
        on every rank unless their histories diverged (say, some ranks ran training forwards in eval mode)."""
        key = self._digest_key
        if key is None or key[0] is not self._plan_state or key[1] is not self.placement:
            h = hashlib.blake2b(self.placement.home_E.tobytes(), digest_size=7)
            if self._plan_state is not None:
                h.update(state_fingerprint(self._plan_state))
            self._digest_key = (self._plan_state, self.placement, int.from_bytes(h.digest(), "little"))
        return self._digest_key[2]

    # ------------------------------------------------------------------------------------------------ 2. count
    @hidden_from_selective_checkpoint
    def _count(self, counts_S: torch.Tensor | None, bad: torch.Tensor | None,
               problem: tuple[type, str] | None, dispatched: bool, needs: bool = False) -> Counts:
        """All-gather the counts (and every rank's problems); raise on every rank together if any rank has one.
        Each rank's way of calling travels with them (training mode, autograd on, ``forward_dispatched``, whether
        it leaves a record for a recompute under saved-tensor hooks): ranks that differ would run different
        collectives, in the forward or in its backward, or keep different records. ``needs``: this rank's rows or
        expert parameters need grad (or-ed over the ranks: ``Counts.needs_grad``)."""
        E = self.config.num_experts
        # the per-step copies' owners changed since the copies were made: a sample of their bits, compared on the
        # device (no host sync of its own: it travels in the counts' copy to the host), or-ed with what the
        # optimizer step hook and the version counters tell
        # (and the steps this process's GradScalers skipped, counted on the device: in the same copy)
        skips, base = scaler_skips(self._device), self.__dict__.get("_skips_base")
        skips = skips if base is None or skips is None else skips - base
        if problem is None:
            changed = self.replicas.changed()
            counts = counts_S.to(torch.int64).reshape(-1)
            row = torch.cat([bad.to(torch.int64).reshape(1),
                             counts.new_zeros(1) if changed is None else changed.to(counts.device),
                             counts.new_zeros(1) if skips is None else skips.to(counts.device), counts]).cpu()
        else:
            row = torch.cat([torch.zeros(2, dtype=torch.int64),
                             torch.zeros(1, dtype=torch.int64) if skips is None else skips.cpu(),
                             torch.zeros(E, dtype=torch.int64)])
        # (row is on the host here: its first three entries read as Python ints, no tensor op per flag)
        flags, stale, skipped = row[:3].tolist()
        self.replicas.begin_forward()
        stale |= int(not self.replicas.fresh())
        if stale and not self.replicas.stepped:
            # (2: an optimizer attached to the layer, whose step refreshed the copies, is not the cause)
            stale |= 2 * int(bool(self.__dict__.get("_attached_to")))
        stale |= 4 * int(self.replicas.unfinished)     # (a refresh, or the attached step ending in one, raised)
        # (the header first, then the counts padded to the group's width: steps.read_counts)
        from feplb.kernels import autocast_dtype

        grad = torch.is_grad_enabled()
        row = torch.cat([torch.tensor([flags, stale, int(problem is not None), self.layer_id,
                                       int(self.training) | int(grad) << 1
                                       | int(dispatched) << 2 | int(record_kind() == "hooks") << 3
                                       | int(not grad and reentrant_inputs_need_grad()) << 4
                                       | autocast_code(autocast_dtype(self._device.type)) << AUTOCAST_SHIFT,
                                       self._slow_digest(),
                                       skipped,
                                       int(self._grads_dropped()), self._frozen_code(), int(needs),
                                       # (its per-layer calls after the backward handshake again, and the calls
                                       # made since, compared: training.handshaken)
                                       forward_began(self.group)],
                                      dtype=torch.int64),
                         row[3:],
                         row.new_zeros(_COUNTS_WIDTH[self._counts_key] - E)])
        gathered = self.control.all_gather(row, "all_gather of expert counts")
        refused = None
        if gathered[:, PROBLEM].any() and (gathered[:, LAYER] >= 0).all():
            # Every rank is in a forward's counts and one refused its input (all read that from the same rows, so
            # all take part): each learns what each refused, to say it (only on this failing path).
            refused = self.control.all_gather_object(
                None if problem is None else f"{problem[0].__name__}: {problem[1]}", "group",
                "all_gather of the errors of a refused forward")
        if problem is not None:
            raise problem[0](problem[1])
        return read_counts(gathered.numpy(), self.placement.slots_WS,
                           balance=self.base != "none" and self.world_size > 1, min_straggler=self._min_straggler,
                           frozen_within=self._frozen_within, refused=refused)

    def _watch_backward_flags(self, y_MD: torch.Tensor) -> None:
        """Where the layer keeps per-step copies across ranks, note this rank's expert parameters' requires_grad
        flags when y_MD's gradient arrives (every backward of the layer starts there, on every rank): the copies'
        node masks with this rank's flags then (``feplb.replicas._Gate``), so a rank that froze its experts between a
        forward and its backward while others did not would lose its copies' share of that backward silently; the
        reduction agrees the noted flags over the ranks that share copies (``_backward_flags_apart``)."""
        if not self._copies_per_step or not y_MD.requires_grad:
            return
        me = weakref.ref(self)

        def note(_grad: torch.Tensor) -> None:
            layer = me()
            if layer is not None:
                rep = layer.replicas
                rep.backward_flags = args_digest((rep.backward_flags,) + rep.requires())

        y_MD.register_hook(note)

    def _backward_flags_vector(self) -> torch.Tensor:
        """int64 [2 x blocks] for the reduction's MIN over the group (``Replicas.agree``): for this rank's block of
        ranks sharing copies (its node, or the whole group), the noted flags and their negation; for the others the
        largest int64 (ignored by the MIN). Empty where the layer keeps no per-step copies across ranks."""
        if not self._copies_per_step:
            return torch.zeros(0, dtype=torch.int64)
        n = self._frozen_within or self.world_size
        out = torch.full((2 * (self.world_size // n),), torch.iinfo(torch.int64).max, dtype=torch.int64)
        b = self.rank // n
        code = self.replicas.backward_flags
        out[2 * b], out[2 * b + 1] = code, -code
        return out

    def _backward_flags_apart(self, agreed: torch.Tensor) -> list[list[int]]:
        """The blocks of ranks (as rank lists) whose noted backward flags differ, from the MIN of
        ``_backward_flags_vector`` over the group."""
        n = self._frozen_within or self.world_size
        pairs = agreed.view(-1, 2).tolist()
        return [list(range(b * n, b * n + n)) for b, (lo, neg_hi) in enumerate(pairs) if lo != -neg_hi]

    def _frozen_code(self) -> int:
        """The counts row's FROZEN field: 0 where the layer keeps no per-step copies of other ranks' experts, else a
        nonzero digest of which of this rank's expert parameters require grad (a copy's share follows its holder's
        flags, ``Replicas.view`` and ``Replicas._keep``, so the ranks must freeze alike: ``read_counts``). Also
        without autograd: a reentrant checkpoint's forward runs without it, and its recompute compares nothing."""
        if not self._copies_per_step:
            return 0
        req = self.replicas.requires()
        key = self.__dict__.get("_frozen_key")
        if key is None or key[0] != req:
            self._frozen_key = key = (req, args_digest(("requires_grad",) + req) | 1)
        return key[1]

    def _step_handshake(self, entry: int, problem: int = 0, args: int = 0) -> None:
        """The first collective of a call between a backward and the next forward over this layer's group
        (``feplb.training.handshaken``): an all-gather shaped like the forward's counts (``feplb.steps.step_row``),
        so that a rank that skipped the call, already in the next forward's counts all-gather, meets it and every
        rank raises together (``read_step``, ``read_counts``)."""
        row = step_row(self.layer_id, _COUNTS_WIDTH[self._counts_key], entry, problem, args=args)
        read_step(self.control.all_gather(row, f"handshake of {ENTRIES[entry]}").numpy())

    # ------------------------------------------------------------------------------------------------ in node
    def _in_node(self, x_MD: torch.Tensor, counts: Counts, tl: Timeline | None,
                 replay: Record | None = None, dispatched: bool = False) -> tuple[torch.Tensor, Phase2]:
        """Steps 3-8: phase 1 to the homes, static GEMM beside planning and copies, dynamic GEMM, results home.
        A replay (a recompute) executes its record's plan, or computes at home where its forward did.
        dispatched: x_MD are the rows at home already, in receive order (``forward_dispatched``): no phase 1 and
        no reverse all-to-all; the results come back in that order."""
        if self._backward_join is not None:
            joins, self._backward_join = self._backward_join, None
            errors = []
            for join in joins:   # every one settled; the first error raised after
                try:
                    join.settle()
                except BaseException as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]
        split = self._split(counts)
        if dispatched:
            self._recv_grew = False
            recv_RD = x_MD
        else:
            with span(tl, "phase1"):
                recv_RD = self._phase1(x_MD, counts, split.send_splits, split.home.recv_splits, split.split_WW)
        slot_w = self.replicas.forward_slot_weights(self.placement, recv_RD).for_gemms()
        with span(tl, "gather"):
            h_RD = recv_RD.index_select(0, to_device(split.home.perm, recv_RD.device))
        # The rows phase 2 may send are ready here: on a GPU the copy stream waits for this event, not for the
        # static GEMM queued after it.
        want = counts.want_plan and (replay is None or not replay.fell_back)
        replay_plan = None if replay is None else replay.plan
        ready = ready_event(h_RD) if want else None
        plan_first = want and self._plan_first(h_RD)
        job = start_phase2(self, h_RD, counts, split, slot_w, tl, ready, replay_plan) if plan_first else None
        try:
            try:
                with span(tl, "static_gemm"):
                    early = EarlyBackward()
                    y_static = self._static_gemm(h_RD, split.home, slot_w)
                    early.capture(y_static)
                if want and not plan_first:
                    job = start_phase2(self, h_RD, counts, split, slot_w, tl, ready, replay_plan)
            finally:
                if job is not None:
                    job.static_launched()   # (also on an error here: the copy thread must not wait for it forever)
            p2 = job.result() if job is not None else no_phase2()
        except BaseException:
            if job is not None:
                # The copy thread finishes this forward's agreement and copies (its peers' take part in them, so
                # this ends) before an error (or an interrupt while waiting) leaves the layer: a collective the
                # caller runs next must not meet one still issued behind its back; and a recompute that
                # non-reentrant checkpointing stops early must not have its placement restored under copies that
                # read it.
                concurrent.futures.wait([job.future])
            raise
        y_RD, tail, recopy = dynamic_and_return(self, h_RD, y_static, early, split, p2, slot_w, tl)
        if replay is None and p2.copies and self._holds(self._plan_state):
            # lazy replicas: what this plan copied is resident for the rest of the step (on every rank alike)
            self._plan_state = dataclasses.replace(
                self._plan_state, resident=self._plan_state.resident | {(e, d) for e, _, d in p2.copies})
        p2 = dataclasses.replace(p2, bank_bytes=slot_w.copied_bytes, recopy=recopy)
        # the empty tails keep the exchanges' backward (collective) in the graph
        y_RD = torch.cat([y_RD, tail.view(0, self.config.hidden), slot_w.tail.view(0, self.config.hidden)])
        if dispatched:
            return y_RD, p2
        with span(tl, "phase1_reverse"):
            y_back = all_to_all_rows(y_RD, self.transport, split.home.recv_splits, split.send_splits,
                                     split_matrix=split.split_WW.t().contiguous())
        return y_back, p2

    def _holds(self, state) -> bool:
        """Whether the weights a plan made from ``state`` copies are held until the next refresh (lazy replicas:
        an ``@ema`` history that keeps them resident, ``PolicyState.reads_plans``, with weights='per-step')."""
        return self.config.weights == "per-step" and state is not None and state.reads_plans

    def _plan_first(self, h_RD: torch.Tensor) -> bool:
        """Whether step 5 starts before the static GEMM (a CPU: it computes on this thread, and planning runs
        beside it) or once the static GEMM is queued (a GPU: the planner thread holds the GIL while it plans, and
        started first it could delay the static GEMM's launches, and leave the GPU idle, by up to a plan)."""
        return not h_RD.is_cuda

    def _static_gemm(self, h_RD: torch.Tensor, home: HomeLayout, slot_w) -> torch.Tensor:
        """Step 6: the static block of home order through all slot weights (the dynamic slots given empty groups,
        so no weight is gathered)."""
        return expert_mlp(h_RD[:home.n_static], slot_w.gemm(), to_device(np.cumsum(home.static_L), h_RD.device),
                          *self.config.glu)

    def _split(self, counts: Counts) -> Split:
        """Step 3: this micro-batch's dynamic experts (before the static GEMM; identical everywhere) and the home
        layout of this rank's phase-1 rows."""
        c, W, r, L = self.config, self.world_size, self.rank, self.num_local
        if counts.want_plan:
            dyn_WD = np.asarray(self._sched.select_dynamic(c.policy, counts.counts_WE, self.topo, self._plan_state),
                                dtype=np.int64)
            mine = [self.placement.slot_pos[int(e)] for e in dyn_WD[r]]
        else:
            dyn_WD, mine = np.zeros((W, 0), dtype=np.int64), []
        c_WL = counts.counts_WS[:, r * L:(r + 1) * L]
        return Split(dynamic_WD=dyn_WD, home=home_layout(c_WL, mine),
                     send_splits=counts.counts_WS[r].reshape(W, L).sum(axis=1).tolist(),
                     split_WW=torch.from_numpy(counts.counts_WS.reshape(W, W, L).sum(axis=2)))

    def _phase1(self, x_MD: torch.Tensor, counts: Counts, send_splits: list[int], recv_splits: list[int],
                split_WW: torch.Tensor | None, recv_W: np.ndarray | None = None) -> torch.Tensor:
        """Step 4: phase-1 all-to-all into the receive buffer (``recv_capacity``). Every rank knows every rank's
        receive size, so an overflow is detected identically everywhere: all ranks grow, or all raise."""
        c = self.config
        self._recv_grew = False
        anchor = self._anchor(x_MD)
        if c.recv_capacity is None:
            return all_to_all_rows(x_MD, self.transport, send_splits, recv_splits, split_matrix=split_WW,
                                   anchor=anchor)
        recv_W = counts.loads_home_W if recv_W is None else recv_W
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
            # (hidden from selective checkpointing: a forward's own allocation, which its recompute, finding the buffer,
            # does not repeat; selective activation checkpointing matches the recompute's ops to the forward's)
            self._recv_buf = hidden_from_selective_checkpoint(x_MD.new_empty)((cap, c.hidden))
        return all_to_all_rows(x_MD, self.transport, send_splits, recv_splits, out=self._recv_buf,
                               split_matrix=split_WW, anchor=anchor)

    def _plan_node(self, state) -> int | None:
        """The node this rank plans (its own, for in-node policies on several nodes), or None for the whole group:
        also when the history the layer folds plans into (``self.state``, which a user may have replaced since
        ``state`` was adopted) reads whole plans."""
        if any(s is not None and s.reads_plans for s in (state, self.state)):
            return None
        return self._node

    def _plan(self, counts_WE: np.ndarray, state, tl: Timeline | None):
        c = self.config
        node = self._plan_node(state)
        with span(tl, "plan", "planner"):
            return timed_plan(lambda: self._sched.make_plan(c.policy, counts_WE, self.topo, state, tau=c.tau,
                                                            min_chunk=c.min_chunk, cost=self._cost, node=node))

    # ------------------------------------------------------------------------------------------------ stats
    def _scope_group(self, state=None) -> str:
        """The scope that agrees on a plan's readiness: the node (in-node policies planned per node) or the EP group
        (the peers' policies, and whole in-node plans on several nodes, whose history needs every rank to execute
        the same plan or none)."""
        if self.in_node_policy and (self._node is None or self._plan_node(state) is not None):
            return "node"
        return "group"

    @hidden_from_selective_checkpoint
    def _observe(self, counts: Counts, p2: Phase2, tl: Timeline | None) -> None:
        """Fold the micro-batch into the policy's history (training only) and report what the forward did. A
        forward's own, host bookkeeping: hidden from selective checkpointing (as :meth:`_restricted`)."""
        plan = None if p2.fell_back else p2.result.plan
        planned_from = self._plan_state   # before _adopt below replaces it
        if self.state is not None and self.training:
            # the history follows training micro-batches only (module.eval() leaves it, and the placement, alone)
            self.state = self.state.observe(counts.counts_WE, plan)
            if self.config.weights == "per-microbatch":
                self._adopt(self.state)   # nothing resident to keep consistent: slow decisions apply at once
        self.last_plan = plan
        self.last_plan_inputs = (counts.counts_WE, planned_from)
        if self.config.timeline:
            self.last_timeline = tl
        node = self._plan_node(planned_from)
        self.last_stats = layer_stats(self.config, counts, p2, plan, recv_grew=self._recv_grew,
                                      experts_placed=len(self.placement.placed_pairs),
                                      planned_ranks=None if node is None else self.topo.node_ranks(node))

    def _check_open(self) -> None:
        if self.__dict__.get("_closed"):
            raise RuntimeError(f"{type(self).__name__}: this layer was closed (close(), the end of a `with layer:` "
                               "block, or the interpreter's exit): it holds no threads, copy path or process-group "
                               "handles any more; build a new one")

    def close(self) -> None:
        """Release the helper threads, the copy path and the transport (NVSHMEM buffers). Idempotent; the layer
        must not be used afterwards (its forward refuses, naming it)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.__dict__.get("_open", [True])[0] = False   # (the forwards' ForwardEntry objects hold it)
        _LAYERS.discard(self)
        for h in getattr(self, "_hooks", ()):
            h.remove()
        # (also a layer whose construction failed part way: what it got to build)
        error = None
        if getattr(self, "_balancer", None) is not None:
            # what a backward that raised left on the copy thread ends first, waited for: the balancer's close
            # cancels what is still queued, and a peer's copy thread may have started it already (that peer then
            # waited in it, and its collective met this rank's next one: the next layer's construction)
            try:
                settle_joins(self._balancer.copier)
            except BaseException as exc:  # noqa: BLE001 - the layer is released all the same; raised at the end
                error = exc
            self._balancer.close()
            # (nothing of this layer's is left for settle_abandoned, which kept it alive, and settled it in another
            # layer's forward)
            forget_joins(self._balancer.copier)
        # the copy path first: an NVSHMEM one frees its buffers before the transport may finalise NVSHMEM
        if getattr(self, "_copy", None) is not None:
            release_copy_engine(self._copy)
        if getattr(self, "transport", None) is not None:
            release_transport(self.transport)
        self.control.close()
        if error is not None:   # (the exchange's error: a peer never came, say)
            raise error

    def __deepcopy__(self, memo: dict) -> MoELayer:
        raise TypeError(self._no_copy("deep-copied (copy.deepcopy)"))

    def __reduce_ex__(self, protocol: int):
        raise TypeError(self._no_copy("pickled (torch.save of the module, pickle)"))

    def _no_copy(self, how: str) -> str:
        return (f"{type(self).__name__} cannot be {how}: it holds its EP group's threads, copy path and transport, "
                "which a copy cannot share. For a second model (an EMA or a reference model), copy the model before "
                "FEPLB replaces its experts (feplb.hf.apply, feplb.titan, feplb.megatron) and replace them in both; "
                "to save it, use state_dict() (feplb.dropin.full_state_dict for the whole model's weights)")

    def __enter__(self) -> MoELayer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@atexit.register
def _close_at_exit() -> None:
    """At the interpreter's exit, release every layer still open (its threads, copy path and transport; local, no
    collective): a script that ends without closing them (a transformers Trainer run keeps the model to the end)
    could abort at teardown ("terminate called without an active exception", exit status 1) after a run that
    succeeded."""
    for layer in list(_LAYERS):
        with contextlib.suppress(Exception):
            layer.close()


class _Anchor(torch.autograd.Function):
    """An empty 1-D tensor (in the first input's dtype) made from the given tensors: autograd records it whenever one
    of them requires grad, and its node lies on the path to each of them, so the backward of what takes it runs
    whichever of them a backward asks for. It gives them no gradient: made of their empty slices
    (``w[:0].reshape(-1)``, summed), it did, as full-size zeros: every anchored exchange's backward allocated and
    filled a zero gradient the size of every expert weight of the layer, and of the rows, and added it to theirs."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        ctx.inputs = 1 + len(others)
        return t.new_empty(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None,) * ctx.inputs


class _EnteredRows(torch.autograd.Function):
    """The identity on the rows a caller dispatched itself (``forward_dispatched``), made with the expert parameters:
    its node lies on the way to them on every rank, and its backward checks that the backward started at the
    layer's output (``feplb.dispatch.ForwardEntry``), as the exchanges' do, before the parameters' gradients."""

    @staticmethod
    def forward(ctx, entry, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.entry, ctx.params = entry, len(params)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.entry.check("dispatched rows, backward")
        return (None, grad, *(None,) * ctx.params)


class _RestrictedBackward(torch.autograd.Function):
    """The identity on a per-step layer's expert outputs, made with two empty tensors: one from the expert
    parameters, one from the layer's zero-size leaf, which only a full backward reaches. Its backward raises where a
    backward restricted to chosen tensors (``backward(inputs=...)``, ``torch.autograd.grad``) reaches the expert
    parameters while per-step copies (resident replicas, the ``+place`` bank, lazy replicas) hold part of their
    gradient: their share would be left out, silently. The decision reads only what every rank shares (the
    backward's inputs, and the copies, identical on every rank), so every rank raises at the same node, before any
    collective of the layer's backward."""

    @staticmethod
    def forward(ctx, layer_ref, nodes, y, weights, full):
        ctx.layer_ref, ctx.nodes = layer_ref, nodes
        return y.detach()   # (not a view: a caller may modify the outputs in place, as before)

    @staticmethod
    def backward(ctx, dy):
        refuse_compiled_autograd("the experts' output, backward")
        layer = ctx.layer_ref()
        weights, full = ctx.nodes
        if layer is not None and layer.replicas.all_pairs() and _executes(weights) and not _executes(full):
            raise RuntimeError(
                "MoELayer: a backward restricted to chosen tensors (backward(inputs=...), torch.autograd.grad) "
                "reaches the experts' weights, but with weights='per-step' copies of them on other GPUs (replicas, "
                "the +place bank) hold part of their gradient, which only a full backward accumulates (and "
                "reduce_replica_grads() adds to the owners); run a full backward, or use weights='per-microbatch', "
                "whose copies return their gradients within the backward itself")
        return None, None, dy, None, None   # (an empty gradient would become full-size zeros of every weight)


@hidden_from_selective_checkpoint
def _entered_rows(entry, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
    """:class:`_EnteredRows` of a ``forward_dispatched`` forward, hidden from selective checkpointing: its recompute,
    which replays, has none, and selective activation checkpointing must see the same ops in both (its view_as would
    shift every later view of the recompute by one)."""
    return _EnteredRows.apply(entry, x, *params)


@hidden_from_selective_checkpoint
def _dispatched_counts(num_experts: int, first: int, counts_L: list[int]) -> torch.Tensor:
    """int64 [E]: a ``forward_dispatched`` call's rows per expert (its own experts', from ``first``), host control
    hidden from selective checkpointing (there a saved slice would hand the recompute the forward's tensor, and the
    recompute's counts would stay zero)."""
    counts_S = torch.zeros(num_experts, dtype=torch.int64)
    counts_S[first:first + len(counts_L)] = torch.tensor(counts_L, dtype=torch.int64)
    return counts_S


@hidden_from_selective_checkpoint
def _by_slot(counts_S: torch.Tensor, slot_of_E: torch.Tensor) -> torch.Tensor:
    """A compiled forward's recompute: its rows per expert, from its rows per slot (recompute only: outside the
    dispatch modes)."""
    return counts_S[slot_of_E]


@hidden_from_selective_checkpoint
def _expert_counts(ids: torch.Tensor, skip: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """Rows per expert of ``ids``, masked routes (``skip``) left out: a recompute's key to its record, host control
    hidden from selective checkpointing (which would match it to no forward op), the masking
    included: a masked_fill here would be handed a forward's masked_fill output (the gates')."""
    if skip is not None:
        # (masked routes counted in a bucket past the last and left out: a weighted bincount is not
        # deterministic on CUDA)
        ids = ids.masked_fill(skip, num_experts)
    return torch.bincount(ids.reshape(-1), minlength=num_experts + 1)[:num_experts]


def _executes(node) -> bool:
    """Whether the running backward executes autograd node ``node`` (not a leaf's: see _RestrictedBackward)."""
    return bool(torch._C._will_engine_execute_node(node))


def ignore_experts_in_ddp(module: nn.Module) -> list[str]:
    """Make ``DistributedDataParallel(module, ...)`` leave the expert shards of every ``MoELayer`` in ``module``
    alone; call it before wrapping. Returns the names added to DDP's ignore list (relative to ``module``; a root
    MoELayer's shards under both spellings DDP uses), besides those already in it.

    Needed when DDP's process group holds several ranks of one EP group (data parallel over the EP group, the
    usual layout): there DDP would broadcast rank 0's expert shards to every rank at construction and all-reduce
    shards of different experts, silently. The layer's dispatch already sums every rank's gradient into each
    shard's owner; ``MoELayer.average_expert_grads`` turns that sum into the mean DDP gives the rest. EP x DP
    (several EP groups on different data): wrap the model in DDP over all their ranks with this too, and pass the
    data-parallel group (the ranks holding the same experts) to ``average_expert_grads``; DDP over the
    data-parallel groups alone would average the router over them only, and miss the replicas' gradients.
    """
    from torch.nn.parallel import DistributedDataParallel

    names = []
    for prefix, m in module.named_modules():
        if isinstance(m, MoELayer):
            for n, _ in expert_named_params(m):   # an adapter may keep them in a child module (feplb.titan)
                # DDP's broadcast names the root's parameters "w1", its gradient reducer ".w1": both
                names += [f"{prefix}.{n}"] if prefix else [n, f".{n}"]
    already = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        module, already + [n for n in names if n not in already])
    return names

