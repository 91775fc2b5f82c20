"""Calibrate the simulator's cost model (``feplb.sched.CostModel``) on a machine: the expert GEMM's time per row count.

The cost model needs one curve: the forward time of one expert (gate/up GEMM, SwiGLU, down GEMM) against the rows
it computes, flat up to a knee (reading the weights is the floor) and close to linear beyond. This module measures
that curve on the device at hand for a given expert shape (:func:`measure_expert_us`), or reads it from a
``bench/bench_kernels.py`` results file (:func:`expert_us_from_bench`), fits the non-decreasing table
``CostModel`` interpolates (:func:`fit_table`) and writes it as the JSON that ``CostModel.from_json`` and
``feplb simulate --cost-table`` read. ``feplb calibrate`` is the command line.

Legend: E experts timed together (one grouped launch), H hidden, F expert ffn width, R rows per expert.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from feplb.sched.cost import CostModel

__all__ = ["BENCH_IMPLS", "FLOOR_TOLERANCE", "check_row_counts", "expert_us_from_bench", "fit_table", "isotonic",
           "machine_meta", "measure_expert_us", "table_document"]

# A row count whose time is within this fraction of the smallest row count's time is still on the weight-read
# floor: the knee is the largest such row count.
FLOOR_TOLERANCE = 0.10
# A sweep whose first two row counts' times grow as their rows do (their ratio over the rows' ratio in this band:
# the two points on one line through the origin), with no point on the floor between them, starts past the floor:
# the first point is already on the linear part (a bench run stopped after its two largest counts: 0.99). A first
# point on the floor grows less (the first H200 run from 128 rows: torch._grouped_mm 0.65, feplb's kernels 0.77),
# or, before a line that starts past the floor, more.
FLOOR_MISSED = (0.9, 1.15)
# the grouped GEMMs of bench/bench_kernels.py whose records give an expert's time
BENCH_IMPLS = ("torch_grouped_mm", "feplb")
# GPU cycles of sleep queued before each timed call, so the host issues the call while the GPU still sleeps and
# the events time the GPU's work, not the host's launches (about 2 ms on an H200).
_SLEEP_CYCLES = 4_000_000


def check_row_counts(rows: Sequence[int]) -> list[int]:
    """Row counts as ints, refused unless positive and strictly ascending."""
    rows = [int(r) for r in rows]
    if not rows or rows[0] < 1 or any(b <= a for a, b in zip(rows, rows[1:], strict=False)):
        raise ValueError(f"rows must be positive and strictly ascending, got {rows}")
    return rows


def _tflops(rows: int, hidden: int, ffn: int, us: float) -> float:
    """TFLOP/s of one expert's two GEMMs (gate/up H x 2F, down F x H) over ``rows`` rows in ``us``."""
    return 6 * rows * hidden * ffn / (us * 1e-6) / 1e12


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares, all points weighted alike (pool adjacent
    violators: a run that decreases is replaced by its mean)."""
    blocks: list[list[float]] = []   # [mean, count]
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


def fit_table(rows: Sequence[int], us: Sequence[float], *, floor_tolerance: float = FLOOR_TOLERANCE,
              ) -> tuple[list[int], list[float], dict]:
    """The cost table of measured per-expert times: (table_rows, table_us, fit info).

    rows: ascending row counts (> 0); us: the measured time (us, > 0) of one expert at each. Measured times are not
    always non-decreasing (noise on the floor), while the cost model needs them so (and more rows never take less
    time): the table takes the closest non-decreasing curve (:func:`isotonic`), where a noisy point is averaged
    with its neighbours instead of lifting every point after it. The knee is the largest row count whose fitted
    time is within ``floor_tolerance`` of the first one's: the table starts there (``CostModel`` is flat below its
    first point, and its knee is that point), so the points below the knee are dropped. At least one point must lie
    past the knee, and the first must lie on the floor (a first segment whose time grows as its rows do, within
    ``FLOOR_MISSED``, is refused). info: the knee, the raw and the fitted times, and how many points the fit moved.
    """
    us = [float(t) for t in us]
    if len(rows) != len(us):
        raise ValueError(f"rows and us need the same length, got {len(rows)} and {len(us)}")
    if len(rows) < 2:
        raise ValueError(f"a cost table needs at least 2 measured row counts, got {len(rows)}")
    rows = check_row_counts(rows)
    if any(not math.isfinite(t) or t <= 0 for t in us):
        raise ValueError(f"measured times must be finite and > 0 us, got {us}")
    if not (isinstance(floor_tolerance, (int, float)) and 0 <= floor_tolerance < 10):
        raise ValueError(f"floor_tolerance must be a number in [0, 10), got {floor_tolerance!r}")
    fit = isotonic(us)
    limit = fit[0] * (1.0 + floor_tolerance)
    knee = max(i for i, t in enumerate(fit) if t <= limit)
    if knee == len(rows) - 1:
        raise ValueError(f"every fitted time is within {floor_tolerance:.0%} of the first ({fit[0]:.2f} us at "
                         f"{rows[0]} rows): the sweep never leaves the weight-read floor; measure larger row counts")
    if knee == 0 and FLOOR_MISSED[0] <= (fit[1] / fit[0]) / (rows[1] / rows[0]) <= FLOOR_MISSED[1]:
        # CostModel is flat below its first point: a first point already on the linear part (a sweep that began
        # too high, or a bench run stopped before its smaller row counts) would charge every smaller expert its time
        raise ValueError(f"the time grows about as the rows from the first row count on ({fit[0]:.2f} us at {rows[0]} "
                         f"rows, {fit[1]:.2f} us at {rows[1]}): no point lies on the weight-read floor, and the table "
                         "would charge an expert with fewer rows the first point's time; measure smaller row counts (a "
                         "bench run stopped early keeps only its largest)")
    if fit[-1] <= fit[-2]:
        # CostModel carries the last segment's slope past the table: a flat end would make more rows free
        raise ValueError(f"the fitted curve ends flat ({fit[-1]:.2f} us at {rows[-2]} and {rows[-1]} rows; measured "
                         f"{us[-2]:.2f} and {us[-1]:.2f}): the time past the last row count would not grow; measure "
                         "again with more repeats, or up to a larger row count")
    info = {"knee_rows": rows[knee], "floor_tolerance": floor_tolerance, "raw_rows": rows, "raw_us": us,
            "fitted_us": fit, "moved_points": sum(a != b for a, b in zip(us, fit, strict=True))}
    return rows[knee:], fit[knee:], info


def _expert_forward(x_MH: torch.Tensor, w1_E_H_2F: torch.Tensor, w2_EFH: torch.Tensor, offsets_E: torch.Tensor,
                    impl: str) -> Callable[[], torch.Tensor]:
    """One call = the experts' forward over grouped rows, down(silu(gate(x)) * up(x)) per group: the two grouped
    GEMMs of ``impl`` around the layer's own SwiGLU op (fused, Triton on a GPU)."""
    from feplb.kernels import grouped_mm, swiglu

    if impl == "torch":
        def run() -> torch.Tensor:
            return torch._grouped_mm(swiglu(torch._grouped_mm(x_MH, w1_E_H_2F, offs=offsets_E)), w2_EFH,
                                     offs=offsets_E)
    elif impl == "feplb":
        def run() -> torch.Tensor:
            h = grouped_mm(x_MH, w1_E_H_2F, offsets_E, check=False)
            return grouped_mm(swiglu(h), w2_EFH, offsets_E, check=False)
    else:
        raise ValueError(f"impl must be 'torch' (torch._grouped_mm) or 'feplb' (feplb.kernels), got {impl!r}")
    return run


def _time_us(run: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> list[float]:
    """Times (us) of ``repeats`` calls after ``warmup`` untimed ones: CUDA events behind a queued GPU sleep on a GPU,
    wall clock on a CPU."""
    for _ in range(warmup):
        run()
    out = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            torch.cuda._sleep(_SLEEP_CYCLES)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize(device)
            out.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def measure_expert_us(rows: Sequence[int], *, hidden: int, ffn: int, experts: int = 16,
                      dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", impl: str = "torch",
                      repeats: int = 10, warmup: int = 3, seed: int = 0) -> list[dict]:
    """Per-expert forward time at each row count: ``experts`` experts of shape (hidden, ffn), every one with R rows,
    in one grouped call (gate/up GEMM, SwiGLU, down GEMM), timed ``repeats`` times after ``warmup`` calls.

    Returns one dict per row count: rows, us (the median call over ``experts``), min_us, tflops (of the two GEMMs),
    samples. The inputs are random and the same weights serve every row count.
    """
    device = torch.device(device)
    for name, v in (("hidden", hidden), ("ffn", ffn), ("experts", experts), ("repeats", repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        # the first call compiles and tunes kernels: it is never timed
        raise ValueError(f"warmup must be an int >= 1, got {warmup!r}")
    rows = check_row_counts(rows)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: CUDA is not available here")
    # drawn on the device: a GLM-5 sweep's inputs are about 1.2 G values, seconds of work for a CPU generator
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        # the sleep, the events and the launches on the measured GPU (the current one may be another)
        return _measure(rows, hidden, ffn, experts, dtype, device, impl, repeats, warmup, seed)


def _measure(rows: list[int], hidden: int, ffn: int, experts: int, dtype: torch.dtype, device: torch.device,
             impl: str, repeats: int, warmup: int, seed: int) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype).mul_(scale)

    w1 = rand(experts, hidden, 2 * ffn, scale=hidden ** -0.5)
    w2 = rand(experts, ffn, hidden, scale=ffn ** -0.5)
    out = []
    for r in rows:
        x = rand(experts * r, hidden, scale=1.0)
        offsets = torch.arange(1, experts + 1, dtype=torch.int32, device=device) * r
        run = _expert_forward(x, w1, w2, offsets, impl)
        samples = [t / experts for t in _time_us(run, device, repeats, warmup)]
        med = statistics.median(samples)
        out.append({"rows": r, "us": med, "min_us": min(samples), "tflops": _tflops(r, hidden, ffn, med),
                    "samples": samples})
        del x
    return out


def expert_us_from_bench(doc: dict, *, impl: str = "torch_grouped_mm", dist: str = "uniform",
                         ) -> tuple[list[dict], dict]:
    """Per-expert forward time per row count from a ``bench/bench_kernels.py`` results document (its JSON): the
    forward gate/up and down GEMMs of ``impl`` (``torch_grouped_mm`` or ``feplb``) at ``dist`` routing, summed and
    divided by the benchmark's experts. SwiGLU is not in those records: the table then holds the two GEMMs only.
    Returns (rows as :func:`measure_expert_us` gives them, the benchmark's shape)."""
    if impl not in BENCH_IMPLS:
        raise ValueError(f"impl must be one of {BENCH_IMPLS}, got {impl!r} (the benchmark's 'dense' baseline is one "
                         "GEMM of the same FLOPs through a single weight, not an expert's time)")
    if not isinstance(doc, dict) or not isinstance(doc.get("meta"), dict) or not isinstance(doc.get("results"), list):
        raise ValueError("not a bench_kernels results document: expected keys 'meta' (with 'shape') and 'results'")
    shape = doc["meta"].get("shape")
    if not isinstance(shape, dict) or not {"hidden", "ffn", "local_experts"} <= set(shape):
        raise ValueError("bench_kernels meta.shape must give hidden, ffn and local_experts, got "
                         f"{sorted(shape) if isinstance(shape, dict) else shape!r}")
    experts, hidden, ffn = (shape[k] for k in ("local_experts", "hidden", "ffn"))
    # (as written: int() would truncate a hidden of 2048.7, or read true as 1 and "2048" as a number)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (experts, hidden, ffn)):
        raise ValueError(f"bench_kernels meta.shape must hold integers, got {shape}")
    if min(experts, hidden, ffn) < 1:
        raise ValueError(f"bench_kernels meta.shape must hold positive local_experts, hidden and ffn, got {shape}")
    if max(hidden, ffn) > 2**20:    # (the cost model's limit: CostModel.hidden and .ffn)
        raise ValueError(f"bench_kernels meta.shape's hidden and ffn must be at most 2**20, got {shape}"[:300])
    found: dict[int, dict[str, dict]] = {}
    for i, row in enumerate(doc["results"]):
        if (isinstance(row, dict) and row.get("bench") == "grouped_mm" and row.get("op") == "forward"
                and row.get("impl") == impl and row.get("dist") == dist):
            r = row.get("rows_per_expert")
            if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r < 2**46:
                # (2**46: the cost model's limit on an expert's rows; a JSON integer beyond a float overflowed)
                raise ValueError(f"results[{i}] ({impl} forward) has no positive integer rows_per_expert below "
                                 f"2**46: {r!r}"[:300])
            proj = row.get("proj")
            if proj not in ("gate_up", "down"):   # (a record without one was taken for "a second run's")
                raise ValueError(f"results[{i}] ({impl} forward at {r} rows per expert) has no proj 'gate_up' or "
                                 f"'down': {proj!r}")
            if proj in found.get(r, {}):   # (the last one was kept without a word: two runs in one file)
                raise ValueError(f"results[{i}]: a second {impl} forward {proj!r} record at {r} rows per expert; one "
                                 "run's results per file")
            # the GEMM the record timed, where it says ([M, K] x [K, N]), is the shape's
            want = {"M": r * experts, "K": hidden if proj == "gate_up" else ffn,
                    "N": 2 * ffn if proj == "gate_up" else hidden}
            apart = {k: row[k] for k in want if k in row and row[k] != want[k]}
            if apart:
                raise ValueError(f"results[{i}] ({impl} forward {proj} at {r} rows per expert) timed a GEMM of "
                                 f"{apart}, not the meta.shape's {want} (hidden {hidden}, ffn {ffn}, {experts} "
                                 "experts)")
            found.setdefault(r, {})[proj] = row
    if not found:
        impls = sorted({str(r.get("impl")) for r in doc["results"]
                        if isinstance(r, dict) and r.get("bench") == "grouped_mm"})
        raise ValueError(f"no forward grouped_mm records of impl {impl!r} at {dist!r} routing (impls present: "
                         f"{impls})")
    out = []
    for r in sorted(found):
        parts = found[r]
        for proj in ("gate_up", "down"):
            rec = parts.get(proj)
            if rec is None:
                raise ValueError(f"{impl} forward at {r} rows per expert: no {proj!r} record")
            t = rec.get("us")
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
                raise ValueError(f"{impl} forward {proj} at {r} rows per expert has no time (us: {t!r}; its record "
                                 f"says {rec.get('error', 'nothing')!r})")
        us = (float(parts["gate_up"]["us"]) + float(parts["down"]["us"])) / experts
        out.append({"rows": r, "us": us, "tflops": _tflops(r, hidden, ffn, us)})
    return out, {"hidden": hidden, "ffn": ffn, "experts": experts}


def table_document(measured: Sequence[dict], *, hidden: int, ffn: int, meta: dict,
                   floor_tolerance: float = FLOOR_TOLERANCE, **fields: object) -> dict:
    """The cost-table JSON for ``CostModel.from_json``: rows, us, hidden, ffn, any other CostModel field given
    (dtype_bytes, ce_gbps, net_gbps, d2d_gbps, copy_out_slowdown), and ``meta`` (what was measured, where and
    how; ignored by the model). Raises ValueError unless it makes a valid CostModel."""
    table_rows, table_us, info = fit_table([m["rows"] for m in measured], [m["us"] for m in measured],
                                           floor_tolerance=floor_tolerance)
    given = {k: v for k, v in fields.items() if v is not None}
    CostModel(table_rows=tuple(table_rows), table_us=tuple(table_us), hidden=hidden, ffn=ffn, table_hidden=hidden,
              table_ffn=ffn, **given)
    doc: dict = {"rows": table_rows, "us": list(table_us), "hidden": hidden, "ffn": ffn, **given}
    doc["meta"] = {**meta, "fit": info, "measured": [{k: v for k, v in m.items() if k != "samples"}
                                                      for m in measured]}
    return doc


def machine_meta(device: torch.device) -> dict:
    """Where a measurement ran: device name, versions, the date."""
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "torch": torch.__version__,
            "python": platform.python_version(), "device_type": device.type}
    if device.type == "cuda":
        meta.update(device=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    else:
        meta.update(device=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return meta
