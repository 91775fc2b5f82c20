"""Cost model: expert grouped-GEMM time per GPU, copy times, and bytes per expert weight and per row.

Legend: W GPUs, E experts, H hidden, F expert ffn width. A row is one (token, expert) pair.

Default GEMM table (H200, ``torch._grouped_mm``, 16 experts of the GLM-5 shape H=6144, F=2048, bf16, gate/up +
SwiGLU + down; shared/design/targets.md): 566 / 585 / 577 / 596 / 603 TFLOP/s at 256 / 512 / 1024 / 2048 / 4096
rows per expert, i.e. ``rows * 6*H*F / throughput`` = 34.15 / 66.08 / 133.99 / 259.43 / 512.83 us per expert,
and about 0.42 ms for 16 experts (26.25 us each) at up to 128 rows, where reading the weights is the floor.
Times for another expert shape scale with ``H * F``. A measured table replaces it through ``from_json``
(``feplb calibrate`` measures one on the machine at hand, at any expert shape).

Layer time (``layer_times``): the forward expert time of one MoE layer on every GPU under a plan, with the
planning, the copies, the copy path's copy-outs and the results' return where the runtime puts them (the peers'
plans: where those systems put them; see its docstring). ``backward_times``: the same for the layer's backward.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from feplb.sched.plan import Plan, policy_base
from feplb.sched.topology import Topology

_DEFAULT_ROWS = (128, 256, 512, 1024, 2048, 4096)
_DEFAULT_US = (26.25, 34.15, 66.08, 133.99, 259.43, 512.83)


class LayerTimes(NamedTuple):
    """One MoE layer's forward (``CostModel.layer_times``) or backward (``CostModel.backward_times``) expert time on
    every GPU under a plan, us, float64 [W].

    static_W: the end of the GEMMs that wait for nothing (a FEPLB plan's static experts; a peer's experts whose
        weights are at hand), slowed by the copy-outs that run beside them.
    ready_W: when the plan (where the GPU waits for it), its copies and their copy-outs are done: the rest of the
        GPU's GEMMs may start.
    end_W: when its GEMMs and its sends are done, and the results of the rows it had computed elsewhere are home,
        copied out.
    """

    static_W: np.ndarray
    ready_W: np.ndarray
    end_W: np.ndarray

    @property
    def hidden(self) -> bool:
        """The overlap condition: on every GPU, planning (where it overlaps the GEMMs) and copies finish under the
        GEMMs that wait for nothing."""
        return bool(np.all(self.ready_W <= self.static_W))

    @property
    def layer_us(self) -> float:
        """The layer's time: its last GPU's end."""
        return float(self.end_W.max())


def _overlap(a0: np.ndarray, a1: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """Length of the intersection of intervals [a0, a1] and [b0, b1], elementwise."""
    return np.maximum(0.0, np.minimum(a1, b1) - np.maximum(a0, b0))


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """GEMM time of one expert as a function of its rows, plus copy bandwidths and sizes.

    table_rows / table_us: per-expert forward GEMM time (us) measured at these row counts (ascending, > 0) for an
        expert of shape (table_hidden, table_ffn). Below table_rows[0] the time is flat (weight-read floor),
        between points linear, beyond the last point linear with the last slope. Zero rows cost nothing.
    hidden, ffn, dtype_bytes: the simulated expert's shape and element size (weights 3*H*F, rows H elements).
    grad_dtype_bytes: element size of the per-step copies' gradients on their way to the owners at a step's end
        (``weights_us(..., grads=True)``): the runtime sums a 16-bit copy's gradients over the step in fp32 and
        sends that sum (``FEPLBConfig.reduce_in_fp32``, default True): None (default) is 4 where ``dtype_bytes`` is
        below 4, else ``dtype_bytes``. Set it to ``dtype_bytes`` for ``reduce_in_fp32=False`` with bf16 weights
        (the sum rounded once to bf16, half the bytes; fp16 sums travel in fp32 either way). A gradient that
        returns in a micro-batch's backward (of a weight copied for that micro-batch) travels in the weights'
        dtype.
    ce_gbps: copy-engine bandwidth between GPUs of a node (GB/s, one way; measured H100 peer copy ~375).
    net_gbps: per-GPU bandwidth between nodes (GB/s).
    d2d_gbps: bytes copied per second (GB/s) by a copy inside one GPU: the in-node copy path lands every copy in
        the receiver's inbox and copies it out into a tensor of its own (H200: 4.2 TB/s of reads and writes, i.e.
        2,100 GB/s copied; this project's 2026-11-30 H200 run, ``bench/results``: 4.23 TB/s).
    backward_factor: an expert's backward GEMM time (input and weight gradients) over its forward time at the same
        rows: 2 for GEMMs of equal speed (each gradient is one GEMM of the forward's size per projection). This
        project's 2026-11-30 H200 run (``bench/results``, host wall-clock timing) measured ``torch._grouped_mm``'s
        (dX + dW) / forward at 1.75-2.63 over its 24 GLM-5 cases, median 2.04 (2.01 at >= 1,024 rows per expert);
        this project's own kernels 2.20-3.75, median 2.63 (their dW is the slower part).
    copy_out_slowdown: how much longer a GEMM runs per unit of such a copy's time (at ``d2d_gbps``) beside it.
        0.29 from that H200 run (``bench_overlap``: a 152 MB same-GPU copy, 72 us at 2,100 GB/s, lengthened the
        static GEMM by 20.7 us); the design's notes measured a GEMM loop 19-22% slower while a copy loop ran.
        Copy-engine copies slow GEMMs too (3.9% beside a PCIe host-to-device copy in that run, 0.5% in the
        design's notes; not measured at NVLink rates) and are not modelled.
    """

    hidden: int = 6144
    ffn: int = 2048
    dtype_bytes: int = 2
    grad_dtype_bytes: int | None = None
    table_rows: tuple[int, ...] = _DEFAULT_ROWS
    table_us: tuple[float, ...] = _DEFAULT_US
    table_hidden: int = 6144
    table_ffn: int = 2048
    ce_gbps: float = 375.0
    net_gbps: float = 50.0
    d2d_gbps: float = 2100.0
    copy_out_slowdown: float = 0.29
    backward_factor: float = 2.0

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn", "dtype_bytes", "table_hidden", "table_ffn"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"CostModel.{name} must be a positive int, got {v!r}")
            if name != "dtype_bytes" and v > 2**20:   # (as feplb.traces.ExpertShape and simulate's --hidden)
                raise ValueError(f"CostModel.{name} must be at most 1048576 (2**20: no model's hidden or expert "
                                 f"width comes near), got {v}")
        for name in ("ce_gbps", "net_gbps", "d2d_gbps", "backward_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"CostModel.{name} must be a positive number, got {v!r}")
        v = self.grad_dtype_bytes
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ValueError(f"CostModel.grad_dtype_bytes must be a positive int or None, got {v!r}")
        v = self.copy_out_slowdown
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ValueError(f"CostModel.copy_out_slowdown must be a number in [0, 1] (a fraction of the GEMM's "
                             f"speed), got {v!r}")
        # whole numbers of rows and real numbers of us, taken as they are: int() / float() would truncate a row
        # count of 128.9, or read a bool or a string of a hand-written table as a number
        for name, ok in (("table_rows", (int, np.integer)), ("table_us", (int, float, np.integer, np.floating))):
            object.__setattr__(self, name, tuple(getattr(self, name)))   # (read once: an iterator given works too)
            bad = [v for v in getattr(self, name) if isinstance(v, (bool, np.bool_)) or not isinstance(v, ok)]
            if bad:
                what = "whole numbers of rows" if name == "table_rows" else "numbers of us"
                raise ValueError(f"CostModel.{name} must hold {what}, got {bad[0]!r}")
        try:
            rows, us = tuple(int(r) for r in self.table_rows), tuple(float(t) for t in self.table_us)
        except OverflowError:   # (a JSON integer of hundreds of digits)
            # (integers only: an inf or NaN beside it is refused by the finiteness check below, once this passes)
            digits = max(len(str(abs(int(t)))) for t in self.table_us if isinstance(t, int | np.integer))
            raise ValueError(f"CostModel.table_us must hold numbers a float can hold, got one of {digits} "
                             "digits") from None
        if len(rows) < 2 or len(rows) != len(us):
            raise ValueError(f"CostModel: table_rows and table_us need the same length >= 2, got {len(rows)} and "
                             f"{len(us)}")
        if rows[0] <= 0 or any(b <= a for a, b in zip(rows, rows[1:], strict=False)):
            raise ValueError(f"CostModel.table_rows must be positive and strictly ascending, got {list(rows)}")
        if rows[-1] >= 2**46:
            # (an expert's rows stay below 2**46 for any topology the planner takes, Topology.max_count; far
            # beyond, the interpolation's points would no longer ascend)
            raise ValueError(f"CostModel.table_rows must stay below 2**46 rows (the most an expert's rows reach in "
                             f"the planner), got {rows[-1]}")
        if any(not math.isfinite(t) or t <= 0 for t in us) or any(b < a for a, b in zip(us, us[1:], strict=False)):
            raise ValueError(f"CostModel.table_us must be positive and non-decreasing, got {list(us)}")
        if us[-1] <= us[-2]:
            # the last slope is carried past the table: a flat end would make any number of rows past it free
            raise ValueError(f"CostModel.table_us must grow over its last segment (its slope is carried past the "
                             f"table), got {us[-2]:g} us at {rows[-2]} rows and {us[-1]:g} us at {rows[-1]}")
        object.__setattr__(self, "table_rows", rows)
        object.__setattr__(self, "table_us", us)
        # one interpolation table for integer rows: 0 -> 0, 1..rows[0] flat, linear in between, and the last slope
        # carried to a point past any row count (2**64: an expert's rows, summed over the sources, stay below 2**46,
        # W times Topology.max_count, and callers' sums below 2**62; np.interp holds its last value past its last
        # point);
        # times already scaled to this expert's shape
        scale = (self.hidden * self.ffn) / (self.table_hidden * self.table_ffn)
        slope = (us[-1] - us[-2]) / (rows[-1] - rows[-2])
        far = float(2**64)
        floor = ((1.0,), (us[0],)) if rows[0] > 1 else ((), ())
        xs = np.array([0.0, *floor[0], *rows, far])
        ys = np.array([0.0, *floor[1], *us, us[-1] + (far - rows[-1]) * slope]) * scale
        object.__setattr__(self, "_interp", (xs, ys))

    @classmethod
    def from_json(cls, path: str | Path, **overrides: object) -> CostModel:
        """Load a measured table: ``{"rows": [...], "us": [...], "hidden": H, "ffn": F}`` (hidden/ffn optional,
        the shape the table was measured at) plus any other CostModel field; a ``meta`` entry (where and how it
        was measured, as ``feplb calibrate`` writes it) is ignored."""
        try:
            data = json.loads(Path(path).read_text())
        except RecursionError:
            raise ValueError(f"{path}: not a cost table (its JSON is nested too deeply to read)") from None
        if not isinstance(data, dict) or "rows" not in data or "us" not in data:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{path}: a cost table needs keys 'rows' and 'us', got {got}")
        data.pop("meta", None)
        inner = sorted(k for k in ("table_rows", "table_us", "table_hidden", "table_ffn") if k in data)
        if inner:   # (they silently replaced the file's rows, us, hidden or ffn)
            raise ValueError(f"{path}: a cost table gives its points and shape as 'rows', 'us', 'hidden' and 'ffn', "
                             f"not {inner}")
        kw: dict[str, object] = {"table_rows": tuple(data.pop("rows")), "table_us": tuple(data.pop("us"))}
        # (as written: the constructor refuses a shape that is not a positive int, which int() would truncate)
        if "hidden" in data:
            kw["table_hidden"] = kw["hidden"] = data.pop("hidden")
        if "ffn" in data:
            kw["table_ffn"] = kw["ffn"] = data.pop("ffn")
        kw.update(data)
        kw.update(overrides)
        return cls(**kw)

    @property
    def knee_rows(self) -> int:
        """Rows below which an expert's GEMM costs the weight-read floor: the smallest chunk worth splitting."""
        return self.table_rows[0]

    @property
    def weight_bytes(self) -> int:
        """Bytes of one expert's weights (gate/up H x 2F and down F x H)."""
        return 3 * self.hidden * self.ffn * self.dtype_bytes

    @property
    def grad_bytes(self) -> int:
        """Bytes of one expert's weight gradients as a step's end sends them to the owner (``grad_dtype_bytes``)."""
        g = self.grad_dtype_bytes
        if g is None:
            g = 4 if self.dtype_bytes < 4 else self.dtype_bytes
        return 3 * self.hidden * self.ffn * g

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one token's hidden vector)."""
        return self.hidden * self.dtype_bytes

    def gemm_us(self, rows: np.ndarray | int) -> np.ndarray:
        """Forward GEMM time (us, float64) of one expert for each entry of ``rows`` (non-negative integers, array or
        scalar): 0 for no rows, the weight-read floor up to ``table_rows[0]``, the table's line beyond."""
        return np.interp(rows, *self._interp)

    def gemm_times_W(self, plan: Plan, counts_WE: np.ndarray, topo: Topology) -> np.ndarray:
        """Per-GPU forward grouped-GEMM time (us, float64 [W]) under ``plan``: every piece of an expert (its rows
        left at home, each moved range) is one GEMM group on the GPU that computes it.

        counts_WE: int [W, E] rows per (source rank, expert), the counts the plan was made from.
        """
        counts_WE = topo.check_counts(counts_WE)
        n_E = counts_WE.sum(axis=0)
        left_E = n_E.copy()
        dst, rows = [], []
        for m in plan.moves:
            left_E[m.expert] -= m.row_end - m.row_start
            dst.append(m.dst)
            rows.append(m.row_end - m.row_start)
        t_W = np.bincount(plan.home_of(topo), weights=self.gemm_us(left_E), minlength=topo.num_ranks)
        if dst:
            t_W += np.bincount(np.asarray(dst), weights=self.gemm_us(np.asarray(rows)), minlength=topo.num_ranks)
        return t_W

    def plan_copy_bytes(self, plan: Plan) -> int:
        """Bytes the plan copies between GPUs this micro-batch: its moved rows (one way; none when rows are
        computed where they come from or dispatched straight to their GPU) and its weight copies."""
        rows = 0 if (plan.rows_from_source or plan.dispatched) else plan.rows_moved
        return rows * self.row_bytes + len(plan.weight_copies) * self.weight_bytes

    def _copy_bytes(self, plan: Plan, topo: Topology) -> tuple[np.ndarray, np.ndarray]:
        """Bytes each GPU sends and receives for the plan's copies, float64 [2, W] each ([in-node, between nodes])."""
        W, G = topo.num_ranks, topo.gpus_per_node
        out_B = np.zeros((2, W))
        in_B = np.zeros((2, W))
        if not (plan.rows_from_source or plan.dispatched):
            for m in plan.moves:
                k = int(m.src // G != m.dst // G)
                out_B[k, m.src] += m.rows * self.row_bytes
                in_B[k, m.dst] += m.rows * self.row_bytes
        sent: set[tuple[int, int]] = set()
        for e, src, dst in plan.weight_copies:
            k = int(src // G != dst // G)
            in_B[k, dst] += self.weight_bytes
            if plan.rows_from_source:
                # FasterMoE broadcasts a shadowed expert (a pipelined tree): its owner sends it about once per link
                if (e, k) not in sent:
                    sent.add((e, k))
                    out_B[k, src] += self.weight_bytes
            else:
                out_B[k, src] += self.weight_bytes
        return out_B, in_B

    def _moves(self, plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The plan's moves as arrays: source GPU, destination GPU, rows, and the rows' bytes (float64)."""
        src = np.array([m.src for m in plan.moves])
        dst = np.array([m.dst for m in plan.moves])
        rows = np.array([m.row_end - m.row_start for m in plan.moves])
        return src, dst, rows, rows.astype(np.float64) * self.row_bytes

    @staticmethod
    def _pair_bytes(topo: Topology, src, dst, nbytes, keys=None) -> tuple[np.ndarray, np.ndarray]:
        """Each GPU's send and receive bytes, float64 [2, W] each ([in-node, between nodes]), for ``nbytes[i]``
        sent from ``src[i]`` to ``dst[i]``; with ``keys``, a receiver counts the sends of one key once per kind of
        link (a reduction tree: FasterMoE's shadows' gradients)."""
        W, G = topo.num_ranks, topo.gpus_per_node
        out_B, in_B = np.zeros((2, W)), np.zeros((2, W))
        seen = set()
        for i, (a, b, n) in enumerate(zip(src, dst, nbytes, strict=True)):
            k = int(a // G != b // G)
            out_B[k, a] += n
            if keys is None or (b, keys[i], k) not in seen:
                in_B[k, b] += n
                if keys is not None:
                    seen.add((b, keys[i], k))
        return out_B, in_B

    def _landed_us(self, out_B: np.ndarray, in_B: np.ndarray, pairs) -> np.ndarray:
        """When each GPU's copies have landed (us, [W]): its own sends and receives, both ways at once, and every
        copy of each GPU that sends to it (``pairs``: (src, dst); a sender's copies complete together)."""
        send_t = self._link_us(out_B)
        landed = self._link_us(np.maximum(out_B, in_B))
        for a, b in pairs:
            landed[b] = max(landed[b], send_t[a])
        return landed

    def _link_us(self, b: np.ndarray) -> np.ndarray:
        """Time (us) to move bytes ``b`` [2, W] ([in-node, between nodes]) one after the other."""
        return b[0] / (self.ce_gbps * 1e3) + b[1] / (self.net_gbps * 1e3)

    def copy_us_W(self, plan: Plan, topo: Topology) -> np.ndarray:
        """Per-GPU time (us, float64 [W]) of the copies the plan issues: for each GPU the larger of what it sends
        and what it receives (copy engines run both ways at once), inside a node at ``ce_gbps``, between nodes at
        ``net_gbps``. Rows computed where they come from (``rows_from_source``) or dispatched straight to their GPU
        (``dispatched``) are not copied."""
        out_B, in_B = self._copy_bytes(plan, topo)
        return self._link_us(np.maximum(out_B, in_B))

    def static_us_W(self, plan: Plan, counts_WE: np.ndarray, topo: Topology) -> np.ndarray:
        """Per-GPU GEMM time (us, float64 [W]) of its static experts (at home, not in ``plan.dynamic_WD``; only
        their rows no move takes): the window that the plan and its copies must fit in to be hidden."""
        n_E = topo.check_counts(counts_WE).sum(axis=0)
        for m in plan.moves:
            n_E[m.expert] -= m.row_end - m.row_start
        t_E = self.gemm_us(n_E)
        dyn = np.zeros(topo.num_experts, dtype=bool)
        dyn[plan.dynamic_WD.ravel()] = True
        return np.bincount(plan.home_of(topo), weights=np.where(dyn, 0.0, t_E), minlength=topo.num_ranks)

    def weights_us(self, pairs, topo: Topology, *, grads: bool = False) -> float:
        """The busiest GPU's time (us) to move one expert's weights (or, with ``grads``, their step's gradients,
        ``grad_bytes``) along each (src, dst) GPU pair, all at once: per GPU the larger of what it sends and
        receives, inside a node at ``ce_gbps``, between nodes at ``net_gbps``. What a step costs a policy that
        holds copies (``feplb.simulate``: the reduction of their gradients to the owners, then the refresh's
        copies)."""
        pairs = list(pairs)
        out_B, in_B = self._pair_bytes(topo, [a for a, _ in pairs], [b for _, b in pairs],
                                       [self.grad_bytes if grads else self.weight_bytes] * len(pairs))
        return float(self._link_us(np.maximum(out_B, in_B)).max())

    def copy_us(self, nbytes: float, inter_node: bool = False) -> float:
        """Time (us) to copy ``nbytes`` one way between two GPUs."""
        return nbytes / ((self.net_gbps if inter_node else self.ce_gbps) * 1e3)

    def layer_times(self, plan: Plan, counts_WE: np.ndarray, topo: Topology, plan_us: float) -> LayerTimes:
        """One layer's forward expert time on every GPU under ``plan``, from the end of the dispatch (a first-order
        model; us).

        FEPLB's plans (rows copied from their home GPU), in the runtime's order: every GPU starts its static
        experts' GEMM (``static_us_W``) at once and plans meanwhile (``plan_us``; plain EP plans nothing); its
        dynamic work waits for the plan and, where it takes part in the plan's copies, for its own sends, for the
        sends of every GPU that sends to it (each sender's copies complete together) and for the copy-out of what
        it received inside its node: the copy path lands every copy in the receiver's inbox and copies it into a
        tensor of its own, a copy inside one GPU (``d2d_gbps``) that slows a GEMM beside it by
        ``copy_out_slowdown`` of their overlap. That is ``ready``. The dynamic work starts at
        ``max(static, ready)``: on a helper the rows it hosts first, then its send of their results home, then its
        own dynamic experts' rows kept at home. A home receives those results once every helper of its has sent
        them (no sooner than its inbound link allows) and once its own hosted GEMM and sends are issued, copies
        them out (beside its GEMM, which it slows alike) and ends when both are done; a helper ends no sooner than
        its sends.

        The peers' plans, as those systems run them: EPLB's rows (``dispatched``) reach every copy of an expert in
        the dispatch itself, split by its layout, which needs no plan in the micro-batch; FasterMoE
        (``rows_from_source``) decides before the dispatch, so its planning delays everything, and computes a
        shadowed expert's rows where they come from. Their GEMMs whose weights are at hand start at once; those
        whose weights are copied this micro-batch wait for the copies and their copy-out; nothing goes home.
        ``static_W`` is then the first kind's end, and the overlap condition says whether the copies hid under it.

        Left out: the dispatch and the combine, the backward, what copy-engine copies slow a GEMM beside them
        (see ``copy_out_slowdown``), and second-order effects (a slowed GEMM moving an overlap).

        counts_WE: int [W, E] rows per (source rank, expert), the counts the plan was made from.
        plan_us: the planner's time for this layer (us).
        """
        counts_WE = topo.check_counts(counts_WE)
        W, G = topo.num_ranks, topo.gpus_per_node
        s = self.copy_out_slowdown
        d2d = self.d2d_gbps * 1e3
        zeros = np.zeros(W)
        gemm = self.gemm_times_W(plan, counts_WE, topo)
        out_B, in_B = self._copy_bytes(plan, topo)
        # the copies land once the receiver's own copies and every sender's are done, then are copied out
        pairs = [(m.src, m.dst) for m in plan.moves] if not (plan.rows_from_source or plan.dispatched) else []
        pairs += [(src, dst) for _, src, dst in plan.weight_copies]
        copy_t = self._landed_us(out_B, in_B, pairs)
        # (the peers' broadcasts land in place: no inbox to copy out of)
        copy_out = zeros if (plan.rows_from_source or plan.dispatched) else in_B[0] / d2d

        if plan.rows_from_source or plan.dispatched:
            p = 0.0 if plan.dispatched else float(plan_us)
            copied = {(e, dst) for e, _, dst in plan.weight_copies}
            waits = np.zeros(W)
            for m in plan.moves:
                if (m.expert, m.dst) in copied:
                    waits[m.dst] += float(self.gemm_us(m.row_end - m.row_start))
            recv = waits > 0
            ready = np.where(recv, p + copy_t + copy_out, p)
            local_end = p + gemm - waits
            local_end = local_end + s * _overlap(ready - copy_out, ready, np.full(W, p), local_end)
            end = np.where(recv, np.maximum(local_end, ready) + waits, local_end)
            return LayerTimes(static_W=local_end, ready_W=np.where(recv, ready, local_end), end_W=end)

        static0 = self.static_us_W(plan, counts_WE, topo)
        dyn = gemm - static0
        p = 0.0 if policy_base(plan.policy) == "none" else float(plan_us)
        ready = p + copy_t + copy_out
        static = static0 + s * _overlap(ready - copy_out, ready, zeros, static0)
        start = np.maximum(static, ready)
        end = start + dyn
        if not plan.moves:
            return LayerTimes(static_W=static, ready_W=ready, end_W=end)
        src, dst, rows, row_B = self._moves(plan)
        intra = src // G == dst // G
        bw = np.where(intra, self.ce_gbps, self.net_gbps) * 1e3
        hosted_end = start + np.bincount(dst, weights=self.gemm_us(rows), minlength=W)
        ret_out = np.bincount(dst, weights=row_B / bw, minlength=W)   # each helper's sends of results home (us)
        ret_in = np.bincount(src, weights=row_B / bw, minlength=W)    # each home's receives (us)
        sent = hosted_end + ret_out
        last = np.full(W, -np.inf)
        first = np.full(W, np.inf)
        np.maximum.at(last, src, sent[dst])
        np.minimum.at(first, src, hosted_end[dst])
        home = np.isfinite(last)
        arrive = np.where(home, np.maximum(last, first + ret_in), 0.0)
        co0 = np.maximum(arrive, sent)   # a home issues its receive after its own hosted GEMM and sends
        co1 = co0 + np.bincount(src[intra], weights=row_B[intra], minlength=W) / d2d
        end = end + np.where(home, s * _overlap(co0, co1, start, end), 0.0)
        end = np.maximum(np.where(home, np.maximum(end, co1), end), np.where(ret_out > 0, sent, 0.0))
        return LayerTimes(static_W=static, ready_W=ready, end_W=end)

    def backward_times(self, plan: Plan, counts_WE: np.ndarray, topo: Topology, *, held: bool = False,
                       recopy: bool = False) -> LayerTimes:
        """One layer's backward expert time on every GPU under ``plan``, from the arrival of the gradients of its
        expert outputs at their homes (the reverse all-to-all's backward done) to the input gradients ready for the
        dispatch's backward (a first-order model, like ``layer_times``; us). Every GEMM's backward takes
        ``backward_factor`` times its forward time.

        FEPLB's plans, in the runtime's order (``docs/runtime.md``, *The backward*), the forward's mirrored: the
        gradients of the moved rows' results go from their homes to the helpers on the copy engines (each receiver
        waits for all of each sender's copies, then copies them out of its inbox beside its GEMMs, as in the
        forward) while every GPU computes its static experts' backward; a helper then computes the hosted rows'
        backward once their gradients are in (``ready``), and its copy engines send the rows' input gradients
        home, with the weight gradients of the experts whose weights this micro-batch copied to it, beside its
        kept dynamic rows' backward, which comes next. Weights held for the step reduce their gradients once per
        step (``step_us``), not here: ``@ema`` replicas, and with ``held`` (lazy ``@ema`` replicas,
        ``PolicyState.reads_plans``: the runtime holds what a plan copied until the step's end) this plan's copies
        too. Every GPU issues that exchange before its kept rows (the copy-outs of what a home receives slow them
        where they overlap); a home ends once the gradients are all in and copied out; a helper no sooner than its
        sends. ``static_W`` is the end of the work that waits for nothing (the static
        experts' backward), and ``hidden`` says whether the results' gradients hid under it.

        This order holds where the runtime runs the phase-2 exchanges' backward on the copy thread: over the CUDA
        IPC, shared-memory and gloo copy paths inside a node (``feplb.dispatch.BackwardJoin``); over NVSHMEM or
        NCCL copy paths they run in place, the results' gradients before the static experts' backward and the
        rows' after the kept rows', which this model does not follow.

        The peers: EPLB's replicas accumulate their gradients over the step (reduced at the step: ``step_us``) and
        its rows' gradients go back in the dispatch's backward, so every GPU computes its backward and waits for
        nothing. FasterMoE computes its shadowed experts' backward first and reduces their weight gradients to the
        owners in place on a side stream beside its other GEMMs (reduced on the way, as its forward broadcast them:
        once per expert and kind of link); an owner waits for them after its own GEMMs. (EPLB's plans that copy
        weights in the micro-batch alike.) ``ready_W`` is then when a GPU's part of the reduction is done, so
        ``hidden`` says whether it hid under the GPU's GEMMs, as it says for FEPLB's copies.

        recopy (FEPLB's plans; ``FEPLBConfig.recopy_weights``): the helpers let go of the weights they received
        after the forward, and the plan's weight copies go to them again at the start of the backward, beside the
        results' gradients (each receiver waits for all of each sender's copies and copies them out), so the
        hosted rows' backward waits for both: the CUDA IPC copy path's order (the runtime starts that copy even
        earlier, before the reverse all-to-all's backward; over other copy paths the compute stream waits for it
        at once, and the host agreement before it is left out). The peers are modelled as published (no second
        copy).

        Left out: the dispatch's and combine's backward, and what ``layer_times`` leaves out.
        """
        counts_WE = topo.check_counts(counts_WE)
        W = topo.num_ranks
        f, s = self.backward_factor, self.copy_out_slowdown
        d2d = self.d2d_gbps * 1e3
        gemm = self.gemm_times_W(plan, counts_WE, topo) * f
        zeros = np.zeros(W)

        def gather_home(sent_at, src, dst, nbytes, own_end, keys=None, copy_out=True):
            """Senders send ``nbytes`` to receivers from ``sent_at``: when each receiver has them (copied out of
            its inbox where ``copy_out``; its receive issued after its own GEMMs, ``own_end``, and its own
            sends), when each sender's sends are done (0 where none), and when each receiver's copy-out starts."""
            out_B, in_B = self._pair_bytes(topo, src, dst, nbytes, keys)
            sent = sent_at + self._link_us(out_B)
            last = np.full(W, -np.inf)
            first = np.full(W, np.inf)
            np.maximum.at(last, np.asarray(dst, dtype=np.int64), sent[np.asarray(src, dtype=np.int64)])
            np.minimum.at(first, np.asarray(dst, dtype=np.int64), sent_at[np.asarray(src, dtype=np.int64)])
            recv = np.isfinite(last)
            mine = np.where(out_B.sum(axis=0) > 0, sent, 0.0)
            arrive = np.where(recv, np.maximum(last, first + self._link_us(in_B)), 0.0)
            issued = np.maximum.reduce([arrive, own_end, mine])
            done = np.where(recv, issued + (in_B[0] / d2d if copy_out else 0.0), 0.0)
            return done, mine, issued

        if plan.rows_from_source or plan.dispatched:
            # the peers' copies of experts (FasterMoE's shadows; EPLB's replicas where the plan copies weights this
            # micro-batch) reduce their weight gradients to the owners: computed first, then reduced in place on a
            # side stream (FasterMoE's ncclReduce) beside the GPU's other GEMMs; the owner waits after its own
            cps = plan.weight_copies
            if not cps:
                return LayerTimes(static_W=gemm, ready_W=zeros, end_W=gemm)
            copied = {(e, d) for e, _, d in cps}
            first_W = np.zeros(W)
            for m in plan.moves:
                if (m.expert, m.dst) in copied:
                    first_W[m.dst] += f * float(self.gemm_us(m.row_end - m.row_start))
            done, sent, _ = gather_home(first_W, [d for _, _, d in cps], [o for _, o, _ in cps],
                                     [self.weight_bytes] * len(cps), gemm, keys=[e for e, _, _ in cps],
                                     copy_out=False)
            ready = np.maximum(done, sent)
            return LayerTimes(static_W=gemm, ready_W=ready, end_W=np.maximum(gemm, ready))

        if not plan.moves:
            return LayerTimes(static_W=gemm, ready_W=zeros, end_W=gemm)
        src, dst, rows, row_B = self._moves(plan)
        hosted = np.bincount(dst, weights=self.gemm_us(rows), minlength=W) * f
        static = self.static_us_W(plan, counts_WE, topo) * f   # waits for nothing
        kept = gemm - hosted - static          # the dynamic experts' rows kept at home: after the hosted rows
        # the results' gradients, home -> helper, beside the static experts' backward (with ``recopy``, the weights
        # again too); a receiver waits for all of each sender's copies
        cps = () if held else plan.weight_copies
        again = cps if recopy else ()
        in_src = [*src.tolist(), *(s for _, s, _ in again)]
        in_dst = [*dst.tolist(), *(d for _, _, d in again)]
        out_B, in_B = self._pair_bytes(topo, in_src, in_dst, [*row_B.tolist(), *([self.weight_bytes] * len(again))])
        copy_t = self._landed_us(out_B, in_B, zip(in_src, in_dst, strict=True))
        copy_out = in_B[0] / d2d
        recv = in_B.sum(axis=0) > 0
        ready = np.where(recv, copy_t + copy_out, 0.0)
        static_end = static + np.where(recv, s * _overlap(ready - copy_out, ready, zeros, static), 0.0)
        hosted_end = np.where(hosted > 0, np.maximum(static_end, ready) + hosted, static_end)
        # the rows' input gradients and the copied weights' gradients (unless held), helper -> home: every GPU
        # issues that exchange after its static and hosted rows, before its kept rows, whose backward runs beside
        # it (a receiver's copy-out slows it where they overlap); the GPU waits for it after them
        back_src = [*dst.tolist(), *(d for _, _, d in cps)]
        back_dst = [*src.tolist(), *(o for _, o, _ in cps)]
        back_B = [*row_B.tolist(), *([self.weight_bytes] * len(cps))]
        done, sent, out_at = gather_home(hosted_end, back_src, back_dst, back_B, hosted_end)
        own_end = hosted_end + kept + np.where(done > 0, s * _overlap(out_at, done, hosted_end, hosted_end + kept),
                                               0.0)
        end = np.maximum.reduce([own_end, done, sent])
        return LayerTimes(static_W=static_end, ready_W=ready, end_W=end)

