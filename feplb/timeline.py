"""What one forward of the MoE layer did, and when: spans per step and per lane (thread or stream).

``FEPLBConfig(timeline=True)`` makes every forward record a ``Timeline``: the spans of counts, phase 1, the row
gather, the static GEMM, planning, the readiness agreement, each copy, the dynamic GEMM, the results' return,
phase 1 reversed and the combine, each on the lane it ran on: ``compute`` (the main thread, or the compute stream),
``planner`` (the planner thread), ``copy`` (the copy thread: the CPU stand-in for the copy stream, or the copy
stream itself). On the CPU a span is wall-clock time; on a GPU, device spans are CUDA events resolved when the
timeline is read (``spans()`` synchronises on them, so read it after the step, not inside it).

Export: ``to_chrome_trace`` writes Chrome-trace JSON (open it in Perfetto or chrome://tracing), ``plot`` an image
(PNG, SVG, PDF, ... by the path's suffix).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from feplb.files import write_outputs

__all__ = ["LANES", "Span", "Timeline", "plot", "to_chrome_trace"]

LANES = ("compute", "planner", "copy")


@dataclass(frozen=True, kw_only=True)
class Span:
    """One step of a forward: ``name`` ran on ``lane`` from ``start_us`` to ``end_us`` (microseconds since the
    forward began)."""

    name: str
    lane: str
    start_us: float
    end_us: float


class Timeline:
    """Spans of one forward. Thread-safe (the planner and copy threads record into it too).

    The layer closes it when its forward returns: what ends after that (a plan the forward stopped waiting for, which
    its planner thread finishes later) is kept apart, in :meth:`late`, so that ``spans()`` is the same whenever it is
    read after the forward.

    device_spans: record CUDA events on the current stream (GPU) instead of wall-clock time.
    """

    def __init__(self, *, device_spans: bool = False):
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._host: list[Span] = []
        self._late: list[Span] = []
        self._closed = False
        self._device: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event]] = []
        self._device_late: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event]] = []
        self._base = None
        if device_spans:
            self._base = torch.cuda.Event(enable_timing=True)
            self._base.record()

    def _now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def add(self, name: str, lane: str, start_us: float, end_us: float) -> None:
        with self._lock:
            (self._late if self._closed else self._host).append(Span(name=name, lane=lane, start_us=start_us,
                                                                     end_us=end_us))

    def close(self) -> None:
        """The forward returned: spans added from now on go to :meth:`late`."""
        with self._lock:
            self._closed = True

    def late(self) -> list[Span]:
        """Spans that ended after the forward returned (its late plan's, on the planner lane), sorted by start."""
        with self._lock:
            host, device = list(self._late), list(self._device_late)
        return self._sorted(host, device)

    @contextlib.contextmanager
    def span(self, name: str, lane: str = "compute", *, stream=None) -> Iterator[None]:
        """Time the block: wall clock, or (GPU timelines) CUDA events on ``stream``, by default the current stream
        for the compute lane (other lanes without a stream are timed on the host: the issue of their work)."""
        if self._base is not None and (stream is not None or lane == "compute"):
            s = stream if stream is not None else torch.cuda.current_stream()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            yield
            b.record(s)
            with self._lock:
                (self._device_late if self._closed else self._device).append((name, lane, a, b))
            return
        t = self._now_us()
        try:
            yield
        finally:
            self.add(name, lane, t, self._now_us())

    def spans(self) -> list[Span]:
        """Every span of the forward, sorted by start (synchronises on a GPU timeline's events); not the late ones."""
        with self._lock:
            host, device = list(self._host), list(self._device)
        return self._sorted(host, device)

    def _sorted(self, host: list[Span], device: list) -> list[Span]:
        out = list(host)
        for name, lane, a, b in device:
            b.synchronize()
            out.append(Span(name=name, lane=lane, start_us=self._base.elapsed_time(a) * 1e3,
                            end_us=self._base.elapsed_time(b) * 1e3))
        return sorted(out, key=lambda s: (s.start_us, s.end_us))

    def get(self, name: str) -> list[Span]:
        return [s for s in self.spans() if s.name == name]


def to_chrome_trace(timelines: Sequence[Timeline | Sequence[Span]], path: str | os.PathLike | None = None, *,
                    pid: int = 0) -> dict:
    """Chrome-trace JSON of consecutive forwards (placed one after the other, 10 us apart); written to ``path``
    (atomically) when given. Returns the trace dict."""
    events, offset = [], 0.0
    tids = {lane: i for i, lane in enumerate(LANES)}
    for tl in timelines:
        spans = tl.spans() if isinstance(tl, Timeline) else list(tl)
        for s in spans:
            if not (math.isfinite(s.start_us) and math.isfinite(s.end_us)):   # (JSON has no NaN or inf)
                raise ValueError(f"to_chrome_trace: span {s.name!r} on lane {s.lane!r} has a time that is not a "
                                 f"finite number (start_us={s.start_us}, end_us={s.end_us})")
            tid = tids.setdefault(s.lane, len(tids))
            events.append({"name": s.name, "cat": "feplb", "ph": "X", "pid": pid, "tid": tid,
                           "ts": round(offset + s.start_us, 3), "dur": round(max(s.end_us - s.start_us, 0.0), 3)})
        offset += max((s.end_us for s in spans), default=0.0) + 10.0
    events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": t, "args": {"name": lane}}
               for lane, t in tids.items()]
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        write_outputs([(Path(path), lambda tmp: Path(tmp).write_text(json.dumps(trace, allow_nan=False)))])
    return trace


def plot(spans: Timeline | Sequence[Span], path: str | os.PathLike, *, title: str = "MoE layer forward") -> None:
    """An image of one forward's spans (a ``Timeline``, such as ``layer.last_timeline``, or its ``spans()``), one
    row per lane, in the format of ``path``'s suffix (``.png``, ``.svg``, ``.pdf``, ...; PNG without one)."""
    spans = spans.spans() if isinstance(spans, Timeline) else list(spans)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    p = Path(path)
    # (written through a temporary name, whose suffix would otherwise choose the format)
    fmt = p.suffix[1:].lower() or "png"
    supported = Figure().canvas.get_supported_filetypes()   # (a figure pyplot does not track)
    if fmt not in supported:
        raise ValueError(f"timeline plot {p}: unknown image format {fmt!r}; expected one of "
                         f"{', '.join(sorted(supported))}")

    lanes = [lane for lane in LANES if any(s.lane == lane for s in spans)]
    lanes += sorted({s.lane for s in spans} - set(lanes))
    names = sorted({s.name for s in spans})
    colors = {n: plt.cm.tab20(i % 20) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(10, 0.8 + 0.6 * len(lanes)))
    for row, lane in enumerate(lanes):
        for s in spans:
            if s.lane == lane:
                ax.broken_barh([(s.start_us / 1e3, max(s.end_us - s.start_us, 1.0) / 1e3)], (row - 0.35, 0.7),
                               color=colors[s.name], edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the forward began")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names]
    ax.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.05 * len(lanes)), ncol=6,
              fontsize=7, frameon=False)
    fig.tight_layout()
    try:
        write_outputs([(p, lambda tmp: fig.savefig(tmp, dpi=120, format=fmt))])
    finally:
        plt.close(fig)
