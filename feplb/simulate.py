"""Simulate balancing policies on routing workloads: every policy plans every (layer, micro-batch).

Legend: L layers, M measured micro-batches, W EP ranks, E experts, S tokens per rank, K top-k.

For every micro-batch of a workload (``feplb.traces``) and every layer, each policy plans from the layer's counts
with its own history (``PolicyState``), the plan is checked (``Plan.validate``), measured, and the history then
observes the counts. The first ``warmup`` micro-batches only feed the histories. Metrics (``feplb.sched``):
token straggler ``max - mean`` of per-GPU rows, max/mean, GEMM straggler from the cost model, percent of ideal
``100 * mean / max``, rows and bytes copied, and planner latency of ``make_plan``: the CPU time of the planning
thread (``planner_us``; what one dedicated core would take, free of waits for a shared CPU) and wall time
(``planner_wall_us``); and how often the overlap condition holds (``pct_hidden``: on every GPU, planning time
plus the plan's copy time and the receivers' copy-outs fit under the GEMM of its static experts, so balancing
costs nothing), and the layer's expert time with planning, copies, copy-outs and the results' return on the
critical path (``layer_ms``: ``CostModel.layer_times``, busiest GPU; ``layer_speedup`` against plain EP's busiest
GPU). The planning time in those two is the measured CPU time, or a fixed ``SimConfig.plan_us``. The layer's
backward alike (``backward_ms``, ``backward_speedup``, ``pct_backward_hidden``: ``CostModel.backward_times``), and
forward plus backward (``fwd_bwd_ms``, ``fwd_bwd_speedup``). What a step costs the policies that hold copies of
experts (``step_ms``: at each refresh, the gradients of the copies held over the step that its plans used go to
the owners, then the refresh's copies go out, each timed on its busiest GPU by ``CostModel.weights_us``; averaged
over every micro-batch, so spread over the step), and all three together (``train_ms``, ``train_speedup``).
Means run over layers and micro-batches; a reduction is ``1 - mean(policy) / mean(plain EP)``.

These are CPU simulations: token counts from the routing, and times from the cost model, never measured on a GPU.
The cost model takes the expert shape (H, F) of the model the workload comes from (``workload.expert_shape``)
unless ``SimConfig.shape_from_trace`` is False; every result records the shape it used (``SimResult.expert_shape``
and each summary's ``expert_hidden`` / ``expert_ffn``). FasterMoE's shadowing decision, the GEMM straggler, the
copy bytes and the overlap condition all depend on it.
"""

from __future__ import annotations

import math
import numbers
import operator
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from feplb.sched import CostModel, PolicyState, Topology, make_plan, parse_policy
from feplb.sched.metrics import max_over_mean, token_straggler
from feplb.sched.placement import check_min_gain
from feplb.sched.plan import Plan
from feplb.sched.state import PLACE_MIN_GAIN

DEFAULT_POLICIES = ("none", "feplb", "feplb-split", "fastermoe", "eplb", "lp")
_METRICS = ("token_straggler", "token_straggler_before", "max_over_mean", "gemm_straggler_ms",
            "gemm_straggler_before_ms", "pct_of_ideal", "rows_moved", "copy_bytes", "planner_us", "planner_wall_us",
            "hidden", "layer_ms", "layer_before_ms", "backward_ms", "backward_before_ms", "backward_hidden",
            "step_ms", "extra_weight_bytes", "extra_weight_pct")


def _as_int(v: object) -> int | None:
    """``v`` as a Python int when it is an integer (a numpy one too; not a bool), else None."""
    if isinstance(v, bool | np.bool_):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def _as_number(v: numbers.Real) -> int | float:
    """A real number as a Python int or float (a numpy scalar's value, in the type its reports print)."""
    return v if type(v) in (int, float) else (operator.index(v) if isinstance(v, numbers.Integral) else float(v))


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """What to simulate: topology, micro-batch size, policies and their options.

    cost: the cost model; its expert shape (hidden, ffn) applies to workloads that carry none (synthetic ones).
    plan_us: the planning time (us) the layer time charges every plan; None: its measured CPU time on this
        machine. A fixed figure makes the layer times and the overlap condition deterministic (the same on any
        machine and in every run), where this machine's speed, which varies, otherwise enters them.
    shape_from_trace: a workload's own expert shape (its model's) replaces the cost model's; False keeps
        ``cost.hidden`` / ``cost.ffn`` for every workload.
    hidden, ffn: one dimension of the expert given for every workload (the command line's ``--hidden`` /
        ``--ffn``): it replaces that dimension of the workload's own shape, or of the cost model's; None keeps it.
    recopy_weights: FEPLB's helpers let go of the weights a plan copied them after the forward and receive them
        again at the start of the backward (``FEPLBConfig.recopy_weights``; ``CostModel.backward_times(recopy=)``).
    """

    num_ranks: int = 8
    gpus_per_node: int = 8
    tokens_per_rank: int = 2048
    dyn: int = 4
    policies: tuple[str, ...] = DEFAULT_POLICIES
    microbatches: int = 32
    warmup: int = 8
    seed: int = 0
    refresh_every: int = 8
    ema_shift: int = 2
    eplb_slots: int = 1
    eplb_groups: int = 1
    replicas_mode: str = "eager"
    place_min_gain: float = PLACE_MIN_GAIN
    tau: float = 0.01
    min_chunk: int | None = None
    validate: bool = True
    cost: CostModel = field(default_factory=CostModel)
    plan_us: float | None = None
    shape_from_trace: bool = True
    recopy_weights: bool = False
    hidden: int | None = None
    ffn: int | None = None

    def __post_init__(self) -> None:
        for name, lo in (("num_ranks", 1), ("gpus_per_node", 1), ("tokens_per_rank", 1), ("dyn", 0),
                         ("microbatches", 1), ("warmup", 0), ("seed", 0), ("refresh_every", 1), ("eplb_slots", 0),
                         ("eplb_groups", 1), ("ema_shift", 0)):
            v = _as_int(getattr(self, name))
            if v is None or v < lo:
                raise ValueError(f"SimConfig.{name} must be an int >= {lo}, got {getattr(self, name)!r}")
            object.__setattr__(self, name, v)
        object.__setattr__(self, "place_min_gain", check_min_gain(self.place_min_gain, "SimConfig.place_min_gain"))
        # (the planner's and the history's own rules, refused here by their SimConfig names rather than later by
        # simulate() without them)
        if isinstance(self.tau, bool) or not (isinstance(self.tau, numbers.Real) and 0 <= self.tau < math.inf):
            raise ValueError(f"SimConfig.tau must be a finite number >= 0, got {self.tau!r}")
        object.__setattr__(self, "tau", _as_number(self.tau))
        if self.min_chunk is not None:
            v = _as_int(self.min_chunk)
            if v is None or v < 1:
                raise ValueError(f"SimConfig.min_chunk must be None (the cost model's knee) or an int >= 1, got "
                                 f"{self.min_chunk!r}")
            object.__setattr__(self, "min_chunk", v)
        if self.replicas_mode not in ("eager", "lazy"):
            raise ValueError(f"SimConfig.replicas_mode must be 'eager' or 'lazy', got {self.replicas_mode!r}")
        if isinstance(self.policies, str):   # (its letters were taken for policies: "policy 'f'")
            raise TypeError(f"SimConfig.policies must be a sequence of policy names, got the string {self.policies!r}")
        if not self.policies:
            raise ValueError("SimConfig.policies must name at least one policy")
        object.__setattr__(self, "policies", tuple(self.policies))
        seen: dict[tuple[str, bool, str], str] = {}
        for p in self.policies:
            key = parse_policy(p)
            if key in seen:   # (also one spelled two ways: 'feplb' and 'feplb@current')
                what = repr(p) if seen[key] == p else f"{seen[key]!r} and {p!r} (the same policy)"
                raise ValueError(f"SimConfig.policies repeats a policy: {what} in {self.policies}")
            seen[key] = p
        if not isinstance(self.cost, CostModel):
            raise TypeError(f"SimConfig.cost must be a CostModel, got {type(self.cost).__name__}")
        if self.plan_us is not None:
            if (isinstance(self.plan_us, bool) or not isinstance(self.plan_us, numbers.Real)
                    or not 0 <= self.plan_us < math.inf):
                raise ValueError(f"SimConfig.plan_us must be None (measured) or a finite number of us >= 0, got "
                                 f"{self.plan_us!r}")
            object.__setattr__(self, "plan_us", _as_number(self.plan_us))
        for name in ("hidden", "ffn"):
            if getattr(self, name) is not None:
                v = _as_int(getattr(self, name))
                if v is None or v < 1:
                    raise ValueError(f"SimConfig.{name} must be None or an int >= 1, got {getattr(self, name)!r}")
                object.__setattr__(self, name, v)
        for name in ("shape_from_trace", "recopy_weights", "validate"):
            v = getattr(self, name)
            if not isinstance(v, bool | np.bool_):
                raise TypeError(f"SimConfig.{name} must be a bool, got {v!r}")
            object.__setattr__(self, name, bool(v))
        ema = [p for p in self.policies if parse_policy(p)[2] == "ema"]
        if self.recopy_weights and ema:
            raise ValueError(f"SimConfig.recopy_weights: the layer copies weights again only with per-micro-batch "
                             f"weights, and the simulator holds the @ema sets of {ema} per step; simulate them "
                             "without it")

    def topology(self, num_experts: int) -> Topology:
        W = self.num_ranks
        if num_experts % W == 0 and self.dyn > num_experts // W:
            # (by this field's name: the topology's message names its own; FEPLBConfig clips its dyn instead)
            raise ValueError(f"SimConfig.dyn must be <= experts per rank E // W = {num_experts // W}, got "
                             f"dyn={self.dyn} (E={num_experts}, W={W}; the layer clips FEPLBConfig.dyn to E // W, "
                             "the simulator takes it as given)")
        return Topology(num_ranks=W, gpus_per_node=self.gpus_per_node, num_experts=num_experts, dyn=self.dyn)

    def policy_state(self, topo: Topology, policy: str) -> PolicyState:
        """A fresh history of ``policy`` for one layer on ``topo``, with this configuration's options."""
        return PolicyState(topo=topo, policy=policy, refresh_every=self.refresh_every, ema_shift=self.ema_shift,
                           eplb_slots=self.eplb_slots, eplb_groups=self.eplb_groups,
                           replicas_mode=self.replicas_mode, place_min_gain=self.place_min_gain)

    def cost_for(self, workload: Any) -> tuple[CostModel, dict[str, Any]]:
        """The cost model for ``workload`` and a record of the expert shape it uses (model, hidden, ffn, source)."""
        shape = getattr(workload, "expert_shape", None) if self.shape_from_trace else None
        if shape is None:
            why = "SimConfig.cost (shape_from_trace=False)" if not self.shape_from_trace else \
                "SimConfig.cost (the workload names no model)"
            got = {"model": None, "hidden": self.cost.hidden, "ffn": self.cost.ffn, "source": why}
        else:
            got = shape.as_dict()
        given = [name for name in ("hidden", "ffn") if getattr(self, name) is not None]
        if given:
            got.update({name: getattr(self, name) for name in given},
                       source=f"{got['source']}; {' and '.join(given)} given (SimConfig.{', SimConfig.'.join(given)})")
        if (got["hidden"], got["ffn"]) == (self.cost.hidden, self.cost.ffn):
            return self.cost, got
        return replace(self.cost, hidden=got["hidden"], ffn=got["ffn"]), got

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["policies"] = list(self.policies)
        d["cost"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.cost).items()}
        return d


@dataclass(kw_only=True)
class SimResult:
    """Per-(layer, micro-batch) metrics of every policy on one workload: metrics[policy][name] is float64 [L, M]."""

    workload: str
    num_experts: int
    top_k: int
    layer_names: tuple[str, ...]
    metrics: dict[str, dict[str, np.ndarray]]
    example: dict[str, Any]
    expert_shape: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()      # what limits the result (``sampling_notes``)

    def summary(self) -> dict[str, dict[str, float]]:
        return summarize([self])


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def summarize(results: list[SimResult]) -> dict[str, dict[str, float]]:
    """Means over all layers and micro-batches of all results, per policy (the JSON's ``policies``), with the
    expert shape the cost model used (``expert_hidden`` / ``expert_ffn``; NaN when the results used several)."""
    out: dict[str, dict[str, float]] = {}
    shapes = {(r.expert_shape.get("hidden"), r.expert_shape.get("ffn")) for r in results}
    hidden, ffn = shapes.pop() if len(shapes) == 1 else (math.nan, math.nan)
    for policy in results[0].metrics:
        cat = {k: np.concatenate([r.metrics[policy][k].ravel() for r in results]) for k in _METRICS}
        before, after = cat["token_straggler_before"].mean(), cat["token_straggler"].mean()
        g_before, g_after = cat["gemm_straggler_before_ms"].mean(), cat["gemm_straggler_ms"].mean()
        out[policy] = {
            "token_straggler": float(after),
            "token_straggler_before": float(before),
            "token_straggler_reduction": float(1 - after / before) if before > 0 else 0.0,
            "max_over_mean": float(cat["max_over_mean"].mean()),
            "gemm_straggler_ms": float(g_after),
            "gemm_straggler_before_ms": float(g_before),
            "gemm_straggler_reduction": float(1 - g_after / g_before) if g_before > 0 else 0.0,
            "pct_of_ideal": float(cat["pct_of_ideal"].mean()),
            "planner_us_p50": _percentile(cat["planner_us"], 50),
            "planner_us_p99": _percentile(cat["planner_us"], 99),
            "planner_wall_us_p50": _percentile(cat["planner_wall_us"], 50),
            "planner_wall_us_p99": _percentile(cat["planner_wall_us"], 99),
            "ce_bytes_per_microbatch": float(cat["copy_bytes"].mean()),
            "rows_moved_per_microbatch": float(cat["rows_moved"].mean()),
            "worse_than_none": int(np.count_nonzero(cat["token_straggler"] > cat["token_straggler_before"])),
            "pct_hidden": float(100 * cat["hidden"].mean()),
            "layer_ms": float(cat["layer_ms"].mean()),
            "layer_speedup": float(cat["layer_before_ms"].mean() / cat["layer_ms"].mean()),
            "backward_ms": float(cat["backward_ms"].mean()),
            "backward_speedup": float(cat["backward_before_ms"].mean() / cat["backward_ms"].mean()),
            "pct_backward_hidden": float(100 * cat["backward_hidden"].mean()),
            "fwd_bwd_ms": float(cat["layer_ms"].mean() + cat["backward_ms"].mean()),
            "fwd_bwd_speedup": float((cat["layer_before_ms"].mean() + cat["backward_before_ms"].mean())
                                     / (cat["layer_ms"].mean() + cat["backward_ms"].mean())),
            "step_ms": float(cat["step_ms"].mean()),
            "train_ms": float(cat["layer_ms"].mean() + cat["backward_ms"].mean() + cat["step_ms"].mean()),
            "train_speedup": float((cat["layer_before_ms"].mean() + cat["backward_before_ms"].mean())
                                   / (cat["layer_ms"].mean() + cat["backward_ms"].mean() + cat["step_ms"].mean())),
            "extra_weight_bytes": float(cat["extra_weight_bytes"].mean()),
            "extra_weight_bytes_max": float(cat["extra_weight_bytes"].max()) if cat["extra_weight_bytes"].size else 0.0,
            "extra_weight_pct": float(cat["extra_weight_pct"].mean()),
            "samples": int(cat["token_straggler"].size),
            "expert_hidden": hidden,
            "expert_ffn": ffn,
        }
    return out


def extra_weights(state: PolicyState, plan: Any, topo: Topology) -> int:
    """Experts' weights the busiest GPU holds beyond its own ``E / W`` experts while it computes this micro-batch:
    the per-step copies the policy state keeps there (``@ema`` dynamic sets: ``state.resident``, none on an
    expert's owner), the experts
    ``+place`` placed there away from their owners (who keep the parameters and the optimizer state), and the
    copies this plan sends it (kept until the micro-batch's backward). EPLB's layout alike: the simulator keeps
    every expert's parameters on its owner and charges each slot of the layout away from the owner as a copy
    re-sent at every step (``step_us``, the copy bytes), so a GPU holds every such slot (``state.resident``), not
    only its ``eplb_slots`` redundant ones: balanced packing leaves few experts on their owners."""
    held = np.zeros(topo.num_ranks, dtype=np.int64)
    owner = topo.default_home_E()
    for e, g in state.resident:
        if g != owner[e]:   # (the owner holds its parameters: a replica there is no extra weight)
            held[g] += 1
    home = owner if state.home_E is None else np.asarray(state.home_E)
    np.add.at(held, home[home != owner], 1)
    for _, _, dst in plan.weight_copies:
        held[dst] += 1
    return int(held.max())


def plan_uses(plan: Plan) -> set[tuple[int, int]]:
    """(expert, GPU) pairs whose weights on that GPU ``plan`` computes rows with (its moves' destinations) or copies
    from (its weight copies' sources): where a copy held there gets a gradient (``Replicas.mark_used``)."""
    used = {(m.expert, m.dst) for m in plan.moves if m.row_end > m.row_start}
    return used | {(e, src) for e, src, _ in plan.weight_copies}


def step_us(state: PolicyState, new_state: PolicyState, cost: CostModel, topo: Topology,
            plan: Plan | None = None, used: set[tuple[int, int]] | None = None) -> float:
    """The weight traffic of a step's end (us), for a refresh that turned ``state`` into ``new_state`` after the
    micro-batch that executed ``plan``: the gradients of the copies held over the step (``state.resident``:
    ``@ema`` sets and EPLB replicas; under lazy replicas, ``state.reads_plans``, also what ``plan`` copied; the
    experts ``+place`` put away from their owners) to their owners, then the copies the refresh sends. FEPLB's
    runtime does both between micro-batches (``reduce_replica_grads`` before the optimizer step,
    ``refresh_replicas`` after it), so neither hides behind a GEMM; EPLB's replicas are charged alike. The
    gradients travel at ``CostModel.grad_bytes`` per expert (the runtime's fp32 sums of 16-bit copies, by
    default: twice the weights' bytes).

    used: the (expert, GPU) pairs the step's plans used (``plan_uses`` of each, ``plan``'s included): the runtime
    sends the gradients of those held copies only (``Replicas.idle_flags``: an unused replica's is zero), and of
    every copy of the experts ``+place`` puts away from their owners (computed by the static GEMM at their home).
    None: every held copy sends."""
    owner = topo.default_home_E()
    held = set(state.resident)
    if plan is not None and state.reads_plans:
        held |= {(e, d) for e, _, d in plan.weight_copies}
    if used is not None:
        held &= used
    back = [(g, int(owner[e])) for e, g in held if g != owner[e]]
    if state.home_E is not None:
        back += [(int(h), int(owner[e])) for e, h in enumerate(np.asarray(state.home_E).tolist()) if h != owner[e]]
    out = [(src, dst) for _, src, dst in new_state.last_weight_copies]
    return cost.weights_us(back, topo, grads=True) + cost.weights_us(out, topo)


def sampling_notes(workload: Any, config: SimConfig) -> tuple[str, ...]:
    """What the sampling of ``workload`` under ``config`` limits in the result, in words (empty when nothing):

    * a per-token trace too short for a micro-batch: each rank takes S consecutive tokens (wrapping at the end),
      so with S a multiple of T every rank routes the whole trace in every micro-batch (the seed changes
      nothing), with S > T the ranks differ in S mod T tokens only, and with W x S > T their slices overlap;
    * fewer sample starts than rank slices drawn: slices repeat, so a measured micro-batch may hold slices the
      histories have seen (a new combination, not unseen tokens);
    * per-step costs (the step's gradient reduction and refresh: ``@ema``, ``eplb``, ``+place``) over a window
      that is not a whole number of steps: only the refreshes inside the measured micro-batches are charged."""
    notes = []
    ids = getattr(workload, "topk_ids_TLK", None)
    W, S, name = config.num_ranks, config.tokens_per_rank, workload.name
    if ids is not None:
        T = workload.num_tokens
        if S % T == 0:
            notes.append(f"{name}: each rank's S={S} tokens wrap around the whole trace of T={T}: every rank routes "
                         f"the same tokens in every micro-batch ({workload.num_layers} distinct samples, one per "
                         f"layer, whatever --seed); take S <= T / W = {T // W} for micro-batches that differ")
        elif S > T:
            notes.append(f"{name}: each rank's S={S} tokens wrap around the whole trace of T={T}: every rank routes "
                         f"all of it {S // T} time(s), and the ranks and micro-batches differ only in their other "
                         f"{S % T} tokens")
        elif W * S > T:
            notes.append(f"{name}: a micro-batch takes W x S = {W * S} tokens from a trace of T={T}: the ranks' "
                         "slices overlap")
        drawn = W * (config.warmup + config.microbatches)
        starts = workload.sample_starts().size
        if S < T and starts < drawn:
            notes.append(f"{name}: {starts} sample starts for {drawn} rank slices: slices repeat, so a measured "
                         "micro-batch may hold slices the histories have seen")
    stepped = []
    for p in config.policies:
        base, place, mode = parse_policy(p)
        if mode == "ema" or place or base == "eplb":
            stepped.append(p)
    # the refreshes the measured micro-batches hold (PolicyState.refreshed: after the first micro-batch, then every
    # refresh_every), against the M / refresh_every a whole number of steps holds
    w, M, r = config.warmup, config.microbatches, config.refresh_every
    refreshes = sum(1 for s in range(w + 1, w + M + 1) if s == 1 or s % r == 0)
    if stepped and refreshes * r != M:
        why = (f"--microbatches {M} is not a multiple of --refresh-every {r}" if M % r else
               f"with --warmup {w} the measured micro-batches hold {refreshes} refreshes (the first micro-batch's "
               f"refresh among them), not {M // r}")
        notes.append(f"{why}: the per-step costs of {', '.join(stepped)} count only the refreshes inside the "
                     "measured micro-batches (too few or too many per micro-batch)")
    return tuple(notes)


def simulate(workload: Any, config: SimConfig, progress: Any = None) -> SimResult:
    """Run every policy of ``config`` over ``warmup + microbatches`` micro-batches of ``workload``.

    progress: an object with ``update(n)`` (e.g. a tqdm bar) advanced once per micro-batch, or None.
    """
    topo = config.topology(workload.num_experts)
    L, M, W = workload.num_layers, config.microbatches, config.num_ranks
    cost, shape = config.cost_for(workload)
    rows_per_rank = config.tokens_per_rank * workload.top_k
    states = {p: [config.policy_state(topo, p) for _ in range(L)] for p in config.policies}
    metrics = {p: {k: np.zeros((L, M)) for k in _METRICS} for p in config.policies}
    used: dict[str, list[set[tuple[int, int]]]] = {p: [set() for _ in range(L)] for p in config.policies}
    example: dict[str, Any] = {}
    gen = workload.microbatches(np.random.default_rng(config.seed), W, config.tokens_per_rank)
    for step in range(config.warmup + M):
        counts_LWE = next(gen)
        sums = counts_LWE.sum(axis=2)
        if counts_LWE.shape != (L, W, topo.num_experts) or np.any(sums != rows_per_rank):
            raise ValueError(f"{workload.name}: micro-batch {step} has counts of shape {list(counts_LWE.shape)} "
                             f"with per-rank sums {np.unique(sums).tolist()}, expected [L, W, E] = "
                             f"{[L, W, topo.num_experts]} and S * K = {rows_per_rank} rows per rank")
        m = step - config.warmup
        for layer in range(L):
            counts_WE = counts_LWE[layer]
            loads_after: dict[str, list[int]] = {}
            for p in config.policies:
                state = states[p][layer]
                c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                plan = make_plan(p, counts_WE, topo, state, tau=config.tau, min_chunk=config.min_chunk, cost=cost)
                t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
                if config.validate:
                    plan.validate(counts_WE, topo, state)
                new_state = state.observe(counts_WE, plan)
                states[p][layer] = new_state
                # the held copies the step's plans use, whose gradients the refresh's reduction sends
                used[p][layer] |= plan_uses(plan)
                step_used = used[p][layer]
                if new_state.refreshed:
                    used[p][layer] = set()
                if m < 0:
                    continue
                rec = metrics[p]
                # weights the refresh sends (a +place bank's copies, @ema and EPLB replicas), after each step
                refresh = len(new_state.last_weight_copies)
                g_before = cost.gemm_us(counts_WE.sum(axis=0)).reshape(W, -1).sum(axis=1)
                g_after = cost.gemm_times_W(plan, counts_WE, topo)
                rec["token_straggler"][layer, m] = token_straggler(plan.loads_after_W)
                rec["token_straggler_before"][layer, m] = token_straggler(plan.loads_before_W)
                rec["max_over_mean"][layer, m] = max_over_mean(plan.loads_after_W)
                rec["pct_of_ideal"][layer, m] = 100.0 / max_over_mean(plan.loads_after_W)
                rec["gemm_straggler_ms"][layer, m] = token_straggler(g_after) / 1e3
                rec["gemm_straggler_before_ms"][layer, m] = token_straggler(g_before) / 1e3
                rec["rows_moved"][layer, m] = plan.rows_moved
                rec["copy_bytes"][layer, m] = cost.plan_copy_bytes(plan) + refresh * cost.weight_bytes
                rec["planner_us"][layer, m] = (c1 - c0) / 1e3
                rec["planner_wall_us"][layer, m] = (t1 - t0) / 1e3
                # the layer's expert time with planning, copies, copy-outs and the results' return on the
                # critical path (CostModel.layer_times), and the overlap condition: planning and copies fit under
                # the static experts' GEMM on every GPU
                plan_us = (c1 - c0) / 1e3 if config.plan_us is None else config.plan_us
                times = cost.layer_times(plan, counts_WE, topo, plan_us)
                rec["hidden"][layer, m] = times.hidden
                rec["layer_ms"][layer, m] = times.layer_us / 1e3
                rec["layer_before_ms"][layer, m] = float(g_before.max()) / 1e3
                # its backward (CostModel.backward_times), against plain EP's busiest GPU's
                back = cost.backward_times(plan, counts_WE, topo, held=state.reads_plans,
                                           recopy=config.recopy_weights)
                rec["backward_ms"][layer, m] = back.layer_us / 1e3
                rec["backward_before_ms"][layer, m] = cost.backward_factor * float(g_before.max()) / 1e3
                rec["backward_hidden"][layer, m] = back.hidden
                # a refresh ends a step: the copies held over it return their gradients to the owners, then the
                # refresh copies the new weights (both between the step's micro-batches: charged here, once)
                if new_state.refreshed:
                    rec["step_ms"][layer, m] = step_us(state, new_state, cost, topo, plan, step_used) / 1e3
                # expert weights the busiest GPU holds beyond its own (bytes, and % of its own experts' weights)
                extra = extra_weights(state, plan, topo)
                rec["extra_weight_bytes"][layer, m] = extra * cost.weight_bytes
                rec["extra_weight_pct"][layer, m] = 100.0 * extra / topo.experts_per_rank
                loads_after[p] = plan.loads_after_W.tolist()
            if m == 0:
                # the example for the plot: first measured micro-batch, the layer where plain EP is worst
                before = counts_WE.sum(axis=0).reshape(W, -1).sum(axis=1)
                if not example or token_straggler(before) > example["straggler_before"]:
                    example.update(layer=workload.layer_names[layer], straggler_before=token_straggler(before),
                                   loads_before=before.tolist(), loads_after=loads_after)
        if progress is not None:
            progress.update(1)
    return SimResult(workload=workload.name, num_experts=topo.num_experts, top_k=workload.top_k,
                     layer_names=tuple(workload.layer_names), metrics=metrics, example=example,
                     expert_shape=shape, notes=sampling_notes(workload, config))
