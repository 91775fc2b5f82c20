"""The MoE layer's configuration and what each forward reports (frozen dataclasses)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from feplb.sched.policies import _REAL  # the planner's numbers (numpy scalars included)

__all__ = ["FEPLBConfig", "LayerStats", "forward_problem"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _pos_int(name: str, v: object, lo: int = 1) -> int:
    """``v`` as a Python int: a ``TypeError`` for a value that is no int (a bool or ``np.bool_``, a float, even a
    whole one, a string), a ``ValueError`` below ``lo``. Numpy integers are taken."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"FEPLBConfig.{name} must be an int >= {lo}, got {v!r} ({type(v).__name__})")
    if v < lo:
        raise ValueError(f"FEPLBConfig.{name} must be an int >= {lo}, got {v!r}")
    return int(v)


def _number(v: object) -> bool:
    """A real number: Python's or numpy's (the planner's ``_REAL``), not a bool."""
    return isinstance(v, _REAL) and not isinstance(v, bool)


def _plain(v: object) -> object:
    """A numpy scalar as the Python int or float it holds (anything else as it is): a config given numpy sizes
    compares, hashes, prints and serialises as one given Python's numbers."""
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):   # np.float64 included, a float subclass whose repr differs
        return float(v)
    return v


@dataclass(frozen=True, kw_only=True)
class FEPLBConfig:
    """Configuration of one MoE layer (identical on every rank of the EP group; checked at construction).

    Where an int is asked a numpy integer is taken too (not a bool, nor a float, even a whole one), and where a
    number is asked (plan_wait_ms, tau, swiglu_alpha, swiglu_limit) numpy's real scalars: they are stored as
    Python's int and float, so the config compares, hashes and prints as one given Python's numbers.

    hidden, ffn: H and F of the gated experts. num_experts: E (divisible by the EP group size). top_k: K.
    activation: the experts' gated activation act(gate) * up: "silu" (SwiGLU, default), "gelu_tanh" (GeGLU with
        the tanh approximation, Gemma 4's experts), "gelu" (GeGLU, erf form), "swiglu_oai" (gpt-oss's and
        MiniMax-M3's: gate * sigmoid(swiglu_alpha * gate) * (up + 1)), "silu_softcap" (Inkling 2's: SwiGLU with
        softcapped linear factors, cap(gate, c_gate) * sigmoid(gate) * cap(up, c_up), cap(x, c) = c tanh(x / c)) or
        "silu_postclamp" (Step 3.7's: SwiGLU clamped after the activation, min(silu(gate), swiglu_limit) *
        clamp(up, -swiglu_limit, swiglu_limit); needs ``swiglu_limit``).
    glu_softcap: (c_gate, c_up), finite numbers > 0: "silu_softcap"'s softcaps, given exactly with it (which takes
        no ``swiglu_limit``).
    swiglu_alpha: swiglu_oai's sigmoid slope (1.702 in gpt-oss and MiniMax-M3); the other activations ignore it.
    gated: False for non-gated experts, down(act(up(x))) (Nemotron-H's, activation "relu2": relu(h)^2; or "silu",
        "gelu_tanh", "gelu"): ``w1`` is [L, H, F] (no gate half), and there is no clamp or interleaving. The default
        cost model sizes them as gated experts 2F/3 wide (the same weights and multiply-adds); a ``cost`` given here
        is used as it is (time non-gated experts with ``feplb calibrate --ffn`` of 2F/3).
    glu_interleaved: gate and up columns of w1 alternate (gate = h[:, 0::2], up = h[:, 1::2]: gpt-oss's weights)
        instead of lying side by side.
    expert_bias: every expert has biases b1 [2F] (added to x w1) and b2 [H] (to the down projection), gpt-oss's
        experts; parameters ``b1`` [L, 2F] and ``b2`` [L, H] beside ``w1`` and ``w2``, moved with them.
    swiglu_limit: None (no clamp) or a finite limit > 0: the clamped form act(min(gate, limit)) *
        clamp(up, -limit, limit) of DeepSeek-V4's SwiGLU experts (the form of Megatron's
        ``activation_func_clamp_value``, which ``feplb.megatron`` maps here for gated SiLU).
    gate_on_input: weigh each expert's INPUT by the token's gate, sum_k expert(w_k * x) (Llama 4's MoE), instead of
        its output, sum_k w_k * expert(x) (default). Each product is computed in the wider of the gate's and the
        layer's dtype and rounded once to the layer's, as Llama 4 and Megatron (``moe_apply_probs_on_input``) do.
    masked_routes: with an external router, an id of -1 in ``topk_ids`` routes that slot of its token to no expert
        (a token dropped at an expert's capacity, Megatron's ``moe_expert_capacity_factor``): it sends no row,
        costs no compute, adds nothing to the output, and its weight gets no gradient. Other ids outside [0, E)
        still raise.
    router: "softmax" (gate = softmax probability), "sigmoid" (gate = sigmoid, normalised over the top-k), or
        "external" (no router parameter: every forward takes ``routing=(topk_ids, topk_weights)``).
    router_bias: a per-expert bias buffer added to the scores for expert SELECTION only (auxiliary-loss-free
        balancing; it never enters the gate weights or the gradient).
    gpus_per_node: G, the EP group's ranks on one node, in the group's order (the copy path's reach): a node's GPU
        count where the group spans whole nodes, the group's size where it lies within one node; divides the
        EP group size.
    dyn: dynamic experts per GPU (clipped to E / W); policy: any ``feplb.sched`` policy name
        (``BASE[+place][@current|@ema]``), "none" = plain EP. ``+place`` computes experts where the placement from
        routing history puts them (weights='per-step' keeps a bank of the placed experts' weights on each GPU,
        refreshed once per step); ``fastermoe`` and ``eplb`` route rows in the phase-1 dispatch as those systems do.
    transport: "torch" (torch.distributed) or "nvshmem" (nvshmem4py, CUDA only).
    device: where parameters and activations live: "cpu", "cuda" (the current CUDA device), or "auto" (CUDA when
        the EP group's backend is NCCL or transport="nvshmem", else CPU). "cuda" over a gloo group runs several
        processes on one GPU (NCCL refuses that): gloo carries the small host collectives, NVSHMEM phase 1.
    copy_path: the in-node copy path (``feplb.copy.make_copy_engine``'s kind): "auto" (CPU: shared memory;
        CUDA: nvshmem4py puts with transport="nvshmem", else CUDA IPC peer copies), "shm" or "gloo" on CPUs,
        "nvshmem", "ipc" or "nccl" (SM copies, a fallback) on GPUs.
    weights: "per-step" (helpers hold resident replicas, refreshed by ``refresh_replicas()`` after the optimizer
        step, gradients reduced by ``reduce_replica_grads()`` before it) or "per-microbatch" (weights travel with
        the rows every micro-batch, gradients return with the backward pass).
    replicas: which weights an ``@ema`` policy holds for the step with weights='per-step'. "eager" (default):
        every dynamic expert's weights on the other GPUs of its node, copied at each ``refresh_replicas()``.
        "lazy": a weight is copied the first time a plan needs it in the step (in that micro-batch's phase-2
        exchange) and then held until the next ``refresh_replicas()``; later plans of the step find it resident
        and copy it no more. Its gradient accumulates on the held copy and reaches its owner at
        ``reduce_replica_grads()``, like an eager replica's. Fewer bytes and less memory than eager, but each
        first copy is in its micro-batch. Needs an ``@ema`` policy of the in-node planners (``feplb``,
        ``feplb-split``, ``lp``), whose history then reads whole plans (``PolicyState.reads_plans``).
    recopy_weights: with weights='per-microbatch', a helper lets go of the expert weights it received once its
        forward has used them, and their owners copy them to it again in the backward (the paper's scheme): a
        helper holds no received weights from a micro-batch's forward to its backward, for a second pass of the
        copy path per layer and micro-batch in the backward, and one agreement (a host collective over the node, or
        the group where the copies cross nodes) that no owner changed those weights in place meanwhile. Rows
        received for helpers go in an exchange of their own (the forward's activations keep them). False
        (default): the weights are held until the backward. Activation checkpointing frees them either way (the
        recompute copies them again); under other saved-tensor hooks (``save_on_cpu``, an offloading hook) and
        without autograd the option does nothing, and those hooks decide. It covers the plans' copies to helpers,
        not the bank of experts a ``+place`` placement computes on a GPU away from their owners (sent to it every
        micro-batch with weights='per-microbatch'): the static experts' GEMM computes with that bank, which is
        held until the backward as an owner's own weights are.
    reduce_in_fp32: with weights='per-step' and 16-bit weights, the per-step copies' gradients, which each copy sums
        over the step in fp32, go to their owners at ``reduce_replica_grads()`` in fp32 (True, default: twice the
        weights' bytes) or, for bf16 weights, rounded to bf16 (False: half the bytes, and one more rounding, at
        bf16's precision, of the step's sum; Megatron's ``grad_reduce_in_fp32=False`` reduces so). fp16 sums stay
        fp32 on the wire either way: a step's sum of micro-batch gradients that each fit fp16 need not fit it.
        The owner adds them in fp32, and an fp32 parameter behind 16-bit weights receives the sum as 16-bit parts
        (``expert_weights()``' dtype) to about twice their precision (one rounding at about 2^-16 of the sum, below
        each micro-batch's own rounding out of its 16-bit GEMM). Where the owners' parameters and gradients are
        themselves 16-bit (a model trained in bf16 without fp32 master weights or gradient buffers), False costs
        next to no precision: the owner's gradient is rounded to 16 bits anyway. No effect on fp32 weights.
    refresh_every: micro-batches between the policy state's slow refreshes (``@ema`` dynamic sets, EPLB replicas).
    plan_wait_ms: grace after the static GEMM before falling back to computing at home (on a GPU; on a CPU, where
        the static GEMM runs on the main thread beside the wait, the grace counts from the wait's start, so a plan
        ready within the static GEMM may still miss a short grace). None (default): on a CPU, wait for the plan
        (there is no GEMM worth hiding it behind), on a GPU 0 (never delay the layer). Under
        ``torch.use_deterministic_algorithms(True)`` the plan is always waited for (run-to-run reproducibility:
        where the clock decides which micro-batches balance, the expert gradients' summation order follows it). No
        wait lasts longer than half the EP group's collective timeout (nor than a minute): the peers wait for this
        rank meanwhile, and a stuck planner must make it compute at home, not make them time out.
    min_straggler_rows: balance only when the token straggler with every expert at its home is at least this many
        rows (a deterministic gate, identical on every rank). None (default): the cost model's knee
        (``CostModel.knee_rows``, the smallest chunk worth a GEMM of its own), so balanced routing takes the
        plain-EP path and pays nothing.
    tau, min_chunk: planner options (``feplb.sched.make_plan``); min_chunk None = the cost model's knee.
    cost: the planner's ``feplb.sched.cost.CostModel`` (FasterMoE's shadowing decision, feplb-split's default
        min_chunk); None = the H200 table scaled to this layer's expert shape and dtype.
    recv_capacity: rows the phase-1 receive buffer holds (None = sized per micro-batch). on_overflow: "grow"
        (reallocate, recorded in ``LayerStats.recv_grew``) or "error" (ValueError; rows are never dropped).
    dtype: parameter and activation dtype (on CUDA, float32 GEMMs run on FMA units, not tensor cores: a warning
        says so; use bfloat16, or run the layer inside ``torch.autocast``). Inside ``torch.autocast`` the experts'
        GEMMs follow it like ``torch.matmul`` (their operands cast to the autocast dtype; float64 never is); rows
        travel in this dtype, and a float16, bfloat16 or float32 input is accepted and cast to this one (the
        output comes back in the input's dtype). The layer's own router (``F.linear``) follows autocast too; its
        scores are fp32, fp64 in a float64 layer (which computes in float64 throughout).
    timeline: record each forward's steps (``MoELayer.last_timeline``, a ``feplb.timeline.Timeline``).
    """

    hidden: int
    ffn: int
    num_experts: int
    top_k: int
    router: str = "softmax"
    router_bias: bool = False
    swiglu_limit: float | None = None
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    glu_softcap: tuple[float, float] | None = None
    glu_interleaved: bool = False
    expert_bias: bool = False
    gated: bool = True
    gate_on_input: bool = False
    masked_routes: bool = False
    gpus_per_node: int = 1
    dyn: int = 4
    policy: str = "feplb"
    transport: str = "torch"
    copy_path: str = "auto"
    device: str = "auto"
    weights: str = "per-step"
    replicas: str = "eager"
    recopy_weights: bool = False
    reduce_in_fp32: bool = True
    refresh_every: int = 8
    plan_wait_ms: float | None = None
    min_straggler_rows: int | None = None
    tau: float = 0.01
    min_chunk: int | None = None
    cost: Any = None
    recv_capacity: int | None = None
    on_overflow: str = "grow"
    dtype: torch.dtype = torch.float32
    timeline: bool = False

    @property
    def glu(self) -> tuple[float | None, str, float, bool, bool, tuple[float, float] | None]:
        """The experts' activation as ``feplb.experts.expert_mlp`` takes it: (limit, act, alpha, interleaved,
        gated, softcap)."""
        return self.swiglu_limit, self.activation, float(self.swiglu_alpha), self.glu_interleaved, self.gated, \
            self.glu_softcap

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn", "num_experts", "top_k", "gpus_per_node", "refresh_every"):
            object.__setattr__(self, name, _pos_int(name, getattr(self, name)))
        object.__setattr__(self, "dyn", _pos_int("dyn", self.dyn, 0))
        if self.min_straggler_rows is not None:
            object.__setattr__(self, "min_straggler_rows", _pos_int("min_straggler_rows", self.min_straggler_rows, 0))
        if self.top_k > self.num_experts:
            raise ValueError(f"FEPLBConfig.top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.router not in ("softmax", "sigmoid", "external"):
            raise ValueError(f"FEPLBConfig.router must be 'softmax', 'sigmoid' or 'external', got {self.router!r}")
        if not isinstance(self.router_bias, bool):
            raise TypeError(f"FEPLBConfig.router_bias must be a bool, got {self.router_bias!r}")
        if self.router == "external" and self.router_bias:
            raise ValueError("FEPLBConfig.router_bias needs the layer's own router (router='softmax' or 'sigmoid')")
        if not isinstance(self.timeline, bool):
            raise TypeError(f"FEPLBConfig.timeline must be a bool, got {self.timeline!r}")
        from feplb.copy import COPY_KINDS

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
        if self.plan_wait_ms is not None and not (_number(self.plan_wait_ms) and 0 <= self.plan_wait_ms < float("inf")):
            raise (ValueError if _number(self.plan_wait_ms) else TypeError)(
                f"FEPLBConfig.plan_wait_ms must be None or a finite number >= 0, got {self.plan_wait_ms!r}")
        # make_plan's rule (numpy scalars included), checked here rather than refused at every forward's plan
        tau_number = _number(self.tau)
        if not (tau_number and 0 <= self.tau < float("inf")):
            raise (ValueError if tau_number else TypeError)(
                f"FEPLBConfig.tau must be a finite number >= 0, got {self.tau!r}")
        for name in ("gate_on_input", "masked_routes", "recopy_weights", "reduce_in_fp32"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"FEPLBConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.recopy_weights and self.weights != "per-microbatch":
            raise ValueError("FEPLBConfig.recopy_weights needs weights='per-microbatch' (per-step replicas stay "
                             "resident: nothing is copied per micro-batch)")
        if not self.reduce_in_fp32 and self.weights != "per-step":
            raise ValueError("FEPLBConfig.reduce_in_fp32=False needs weights='per-step' (with 'per-microbatch' no copy "
                             "holds gradients over a step: they return in each micro-batch's backward)")
        if self.masked_routes and self.router != "external":
            raise ValueError("FEPLBConfig.masked_routes needs router='external' (the layer's own router picks top_k "
                             "experts for every token)")
        lim = self.swiglu_limit
        if lim is not None and (not _number(lim) or not math.isfinite(lim) or lim <= 0):
            raise (ValueError if _number(lim) else TypeError)(
                f"FEPLBConfig.swiglu_limit must be None or a finite number > 0, got {lim!r}")
        from feplb.kernels.activation import ACTS, PLAIN_ACTS, POSTCLAMP_ACTS, SOFTCAP_ACTS, check_glu_act

        if not isinstance(self.gated, bool):
            raise TypeError(f"FEPLBConfig.gated must be a bool, got {self.gated!r}")
        acts = ACTS + SOFTCAP_ACTS + POSTCLAMP_ACTS if self.gated else PLAIN_ACTS
        if not isinstance(self.activation, str) or self.activation not in acts:
            raise ValueError(f"FEPLBConfig.activation must be one of {acts} ({'' if self.gated else 'non-'}gated "
                             f"experts), got {self.activation!r}")
        if not self.gated and (self.swiglu_limit is not None or self.glu_interleaved):
            raise ValueError("FEPLBConfig: swiglu_limit and glu_interleaved apply to gated experts only "
                             "(gated=False)")
        a = self.swiglu_alpha
        if not _number(a) or not math.isfinite(a):
            raise (ValueError if _number(a) else TypeError)(
                f"FEPLBConfig.swiglu_alpha must be a finite number, got {a!r}")
        if self.gated:
            try:
                check_glu_act(self.activation, a, self.glu_softcap, self.swiglu_limit)
                if self.glu_softcap is not None:   # one form, whatever sequence of numbers was given
                    object.__setattr__(self, "glu_softcap", tuple(float(c) for c in self.glu_softcap))
            except ValueError as e:
                raise ValueError(f"FEPLBConfig (activation {self.activation!r}, glu_softcap, swiglu_limit): "
                                 f"{e}") from None
        elif self.glu_softcap is not None:
            raise ValueError("FEPLBConfig: glu_softcap applies to gated experts only (gated=False)")
        for name in ("glu_interleaved", "expert_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"FEPLBConfig.{name} must be a bool, got {getattr(self, name)!r}")
        from feplb.sched.cost import CostModel

        if self.cost is not None and not isinstance(self.cost, CostModel):
            raise TypeError(f"FEPLBConfig.cost must be a feplb.sched.cost.CostModel or None, got "
                            f"{type(self.cost).__name__}")
        if self.min_chunk is not None:
            object.__setattr__(self, "min_chunk", _pos_int("min_chunk", self.min_chunk))
        if self.recv_capacity is not None:
            object.__setattr__(self, "recv_capacity", _pos_int("recv_capacity", self.recv_capacity, 0))
        for name in ("plan_wait_ms", "tau", "swiglu_alpha", "swiglu_limit"):   # checked numbers, numpy's as Python's
            object.__setattr__(self, name, _plain(getattr(self, name)))
        from feplb.sched.plan import parse_policy

        base, _, mode = parse_policy(self.policy)
        if self.replicas not in ("eager", "lazy"):
            raise ValueError(f"FEPLBConfig.replicas must be 'eager' or 'lazy', got {self.replicas!r}")
        if self.replicas == "lazy" and (mode != "ema" or base not in ("feplb", "feplb-split", "lp")):
            raise ValueError(f"FEPLBConfig.replicas='lazy' applies to the @ema sets of feplb, feplb-split and lp "
                             f"(the weights a plan copies, held for the step), not to policy {self.policy!r}")
        if self.replicas == "lazy" and self.weights != "per-step":
            raise ValueError("FEPLBConfig.replicas='lazy' needs weights='per-step' (with 'per-microbatch' nothing is "
                             "held between micro-batches)")


@dataclass(frozen=True, kw_only=True)
class LayerStats:
    """What the last forward did. Identical on every rank of a node (``plan_us`` is this rank's).

    Scope: planned_ranks are the GPUs whose balancing this rank planned and reports. With an in-node policy on
    several nodes a rank plans its own node only (in-node plans of different nodes are independent), so that is
    its node's GPUs; otherwise (one node, the peers' group-wide policies, or an ``@ema`` history that keeps the
    weights a plan copied resident, ``PolicyState.reads_plans``: its readiness is then agreed over the whole group)
    every GPU. ``feplb.join_stats`` joins every rank's stats into the whole group's.

    loads_before_W: rows each GPU would compute under plain EP (every expert at its owner, no balancing).
    rows_at_home_W: rows each GPU would compute with the current placement (``+place``) and no per-micro-batch
    balancing (equal to loads_before_W without placement). loads_after_W: rows each GPU computed, for
    planned_ranks; other GPUs show their rows at home.
    token_straggler_before/after: max - mean of loads_before_W / loads_after_W over planned_ranks
    (``feplb.sched.token_straggler``).
    rows_moved: rows computed away from their home (planned_ranks); copy_bytes: forward bytes of phase 2 over
    planned_ranks (rows out, results back) and of weights copied this micro-batch (per-micro-batch weights,
    FasterMoE shadows), plus the whole group's per-micro-batch placement bank (``+place`` with
    weights='per-microbatch'). weight_copies: experts' weights a plan copied to a helper this micro-batch
    (planned_ranks). experts_placed: experts whose home is not their owner (whole group). plan_us: wall time of
    this rank's planner call (0 when no plan was made, and when it was not ready by the deadline: that late plan's
    time is its span in the timeline's ``late()``).
    balanced: the plan was executed; fell_back: a plan was wanted but not ready in time on some rank of the scope,
    so every rank there computed at home. plan_fingerprint: hash of the executed plan (equal on every rank of the
    plan's scope; nodes that fell back report 0). counts_WE: rows each EP rank sent each expert (the all-gathered
    counts; ``tokens_per_expert`` is their column sum). row_bytes_moved / weight_bytes_moved: bytes of rows (one
    way) and of expert weights the executed plan copied between GPUs this micro-batch (planned_ranks), counted
    from what the layer exchanged (the simulator's ``CostModel.plan_copy_bytes`` counts the same plan alike).
    weight_bytes_in_W: bytes of expert weights each GPU of planned_ranks received for this micro-batch through the
    plan's copies (0 elsewhere; they sum to weight_bytes_moved): in training they stay allocated until the
    micro-batch's backward, whose input gradient needs them (with ``recopy_weights``, only during the forward, and
    received again in the backward, not counted here; with lazy replicas, ``replicas='lazy'``, until the next
    ``refresh_replicas()``, and the step's later micro-batches do not receive them again). With ``+place`` and
    weights='per-microbatch' the bank of experts placed on the GPU comes on top (in copy_bytes).
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
    counts_WE: list[list[int]] = field(default_factory=list)
    row_bytes_moved: int = 0
    weight_bytes_moved: int = 0
    weight_bytes_in_W: list[int] = field(default_factory=list)
    planned_ranks: list[int] = field(default_factory=list)

    @property
    def tokens_per_expert(self) -> list[int]:
        """Rows each expert received in the last forward, over the whole EP group (int per expert)."""
        return [sum(col) for col in zip(*self.counts_WE, strict=True)] if self.counts_WE else []


def forward_problem(c: FEPLBConfig, device: torch.device, has_router: bool, x: object, routing: object,
                    ) -> tuple[type, str] | None:
    """What is wrong with ``MoELayer.forward``'s arguments on this rank (exception type, message), or None. Values are
    checked on the device and reach every rank through the counts all-gather."""
    if not isinstance(x, torch.Tensor):
        return TypeError, f"MoELayer input must be a torch.Tensor, got {type(x).__name__}"
    if x.dim() not in (2, 3) or x.shape[-1] != c.hidden:
        return ValueError, (f"MoELayer input must be [tokens, {c.hidden}] or [batch, seq, {c.hidden}], "
                            f"got shape {list(x.shape)}")
    from feplb.kernels import autocast_dtype

    # Inside torch.autocast, a floating input of another dtype is cast to the layer's (autocast never casts
    # float64, so neither does the layer)
    autocast_ok = x.is_floating_point() and x.dtype != torch.float64 and autocast_dtype(x.device.type) is not None
    if x.dtype != c.dtype and not autocast_ok:
        return TypeError, (f"MoELayer input dtype must be {c.dtype} (FEPLBConfig.dtype), got {x.dtype} (inside "
                           "torch.autocast a float16, bfloat16 or float32 input is accepted, and cast to it; layers "
                           "around it that compute in another dtype, as FSDP's MixedPrecisionPolicy(param_dtype=...) "
                           "makes those it shards while the experts stay out of it, feed it theirs: have the experts "
                           "compute in that dtype, feplb.hf.apply(model, dtype=torch.bfloat16) say, or train in "
                           "mixed precision with torch.autocast instead)")
    if x.device != device:
        return ValueError, f"MoELayer input is on {x.device} but the layer's experts are on {device}"
    if routing is None:
        if not has_router:
            return ValueError, "MoELayer with router='external' needs routing=(topk_ids, topk_weights)"
        return None
    K = c.top_k
    if not (isinstance(routing, (tuple, list)) and len(routing) == 2
            and all(isinstance(t, torch.Tensor) for t in routing)):
        return TypeError, "MoELayer routing must be a pair of tensors (topk_ids [T, K], topk_weights [T, K])"
    ids, w = routing
    T = x.numel() // c.hidden
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


# Peers' policies, whose plans the phase-1 dispatch executes (rows go straight to the GPU that computes them, not
# to the expert's owner).
DIRECT_BASES = frozenset({"fastermoe", "eplb"})


def dispatched_policy_problem(policy: str) -> str | None:
    """Why ``policy`` cannot balance rows a caller dispatched itself (``MoELayer.forward_dispatched``, Megatron's
    own token dispatcher), or None: the caller sends every row to its expert's owner, so a policy that places
    experts elsewhere or sends rows straight to a helper cannot be followed."""
    from feplb.sched.plan import parse_policy

    base, place, _ = parse_policy(policy)
    if not place and base not in DIRECT_BASES:
        return None
    return (f"policy {policy!r} moves where tokens are dispatched (+place puts experts on other GPUs; fastermoe and "
            "eplb send rows straight to helpers), which a caller's own dispatch cannot follow; use FEPLB's dispatch, "
            "or a policy among 'none', 'feplb', 'feplb-split', 'lp' (with @current / @ema) without +place")


def int_counts(counts: object) -> list[int] | None:
    """Counts given as a 1-D integer tensor (read on the host: one copy if it lives on a GPU) or a list or tuple of
    ints, as a list of ints; None if they are neither."""
    if isinstance(counts, torch.Tensor):
        if counts.dim() != 1 or counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
            return None
        return counts.tolist()
    if isinstance(counts, (list, tuple)) and all(isinstance(n, int) and not isinstance(n, bool) for n in counts):
        return list(counts)
    return None


def dispatched_problem(c: FEPLBConfig, device: torch.device, num_local: int, rows: object, counts: object,
                       ) -> tuple[tuple[type, str] | None, list[int] | None]:
    """What is wrong with ``MoELayer.forward_dispatched``'s arguments on this rank ((exception type, message), or
    None), and the counts as ints. ``counts`` is read on the host (a list, as DeepEP's dispatch returns, or a tensor:
    one host copy if it lives on a GPU)."""
    if not isinstance(rows, torch.Tensor):
        return (TypeError, f"MoELayer.forward_dispatched rows must be a torch.Tensor, got {type(rows).__name__}"), None
    if rows.dim() != 2 or rows.shape[1] != c.hidden:
        return (ValueError, f"MoELayer.forward_dispatched rows must be [rows, {c.hidden}], got shape "
                            f"{list(rows.shape)}"), None
    from feplb.kernels import autocast_dtype

    # inside torch.autocast, as forward(): rows of another floating dtype (not float64) are cast to the layer's
    autocast_ok = rows.is_floating_point() and rows.dtype != torch.float64 and autocast_dtype(rows.device.type) \
        is not None
    if rows.dtype != c.dtype and not autocast_ok:
        return (TypeError, f"MoELayer.forward_dispatched rows dtype must be {c.dtype} (FEPLBConfig.dtype), got "
                           f"{rows.dtype} (inside torch.autocast float16, bfloat16 or float32 rows are accepted, and "
                           "cast to it)"), None
    if rows.device != device:
        return (ValueError, f"MoELayer.forward_dispatched rows are on {rows.device} but the layer's experts are on "
                            f"{device}"), None
    try:
        got = int_counts(counts)
    except Exception as exc:   # a tensor the host cannot read (on the meta device, a failed device copy): this
        # rank's problem, which the others learn in the counts all-gather, like any other
        return (ValueError, f"MoELayer.forward_dispatched counts could not be read on the host: "
                            f"{type(exc).__name__}: {exc}"), None
    if got is None:
        kind = f"a {counts.dim()}-D {counts.dtype} tensor" if isinstance(counts, torch.Tensor) else f"{counts!r:.80}"
        return (TypeError, f"MoELayer.forward_dispatched counts must be a 1-D integer tensor or a list of ints, got "
                           f"{kind}"), None
    if len(got) != num_local:
        return (ValueError, f"MoELayer.forward_dispatched counts must hold one count per local expert ({num_local}), "
                            f"got {len(got)}"), None
    if any(n < 0 for n in got):
        return (ValueError, f"MoELayer.forward_dispatched counts must be >= 0, got {got}"), None
    if sum(got) != rows.shape[0]:
        return (ValueError, f"MoELayer.forward_dispatched counts add up to {sum(got)} rows but rows holds "
                            f"{rows.shape[0]}"), None
    return None, got
