"""The two helper threads of a MoE layer: the planner (CPU scheduler) and the copy thread.

Per micro-batch, beside the static experts' GEMM (on a CPU before it computes on the main thread; on a GPU once it
is queued: the planner holds the GIL while it plans, so it starts after the launches it would otherwise delay), the
layer hands the node's counts to the PLANNER thread and a job to the COPY thread: wait for the plan (no longer than
the static GEMM plus ``plan_wait_ms``), agree with the node (the group, when the policy history reads whole plans)
that every rank has it (one tiny MIN all-reduce over the CPU control group), then issue the phase-2 copies. On a GPU
the copies go on the copy path's stream while the static GEMM still runs on the compute stream; on a CPU the copy
thread is the stand-in for that stream and copies while the main thread computes. The main thread meets the copy
thread only after the static GEMM.

The planner signals completion through its future (a condition variable, no sleep poll); on a GPU the copy thread
also watches the static GEMM's end event, the deadline after which waiting would delay the layer.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Balancer", "PlanResult"]

# how long the copy thread sleeps between looks at a GPU static GEMM's end event while the plan is not ready
_GPU_POLL_S = 20e-6
# on a CPU (plan_wait_ms=None: wait for the plan) a plan later than this (or than half the control group's
# timeout) is given up (a stuck planner)
_CPU_PLAN_CAP_S = 60.0


class _DaemonWorker:
    """One daemon thread running the calls submitted to it, in order (the planner's). Unlike ThreadPoolExecutor's
    threads, which ``close()`` and the interpreter's exit join, a call that never returns (a stuck planner, which
    its layer already gives up on) holds up neither. The thread starts at the first call and ends when the worker
    is shut down or collected; it keeps no reference to a call it has done (to its layer)."""

    def __init__(self, name: str):
        self._name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(self._calls,), name=self._name, daemon=True)
            self._thread.start()
            weakref.finalize(self, self._calls.put, None)   # (the thread holds the queue, never the worker)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn))
        return future

    def shutdown(self) -> None:
        """Cancel what has not started and let the thread end after its current call, without waiting for it."""
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call[0].cancel()
        self._calls.put(None)


def _copy_thread_init(device: torch.device) -> None:
    # Grad mode is per thread and on in a new one: the copy thread records no autograd graph. (It is also handed
    # detached tensors only, MoELayer._send_weights: a titan test's rank hung, grad mode off or not, with this thread
    # indexing weights the compute thread was using in its graph at the same moment.)
    torch.set_grad_enabled(False)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _serve(calls: queue.SimpleQueue) -> None:
    while (call := calls.get()) is not None:
        future, fn = call
        del call
        if future.set_running_or_notify_cancel():
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
                del exc
            else:
                future.set_result(result)
                del result
        del future, fn


@dataclass(frozen=True, kw_only=True, eq=False)
class PlanResult:
    """What the planner thread produced for one micro-batch, as the copy thread saw it at its deadline."""

    plan: Any | None       # the plan, or None (late, busy, failed or never wanted)
    plan_us: float         # the planner call's wall time (0 without a plan)
    ready: int             # 1: the plan is here; 0: late or planner busy
    error: str | None      # the planner raised (this text)


class Balancer:
    """The planner and copy threads of one layer.

    plan_wait_s: grace after the static GEMM's end before giving up on the plan; None = wait for it (CPU default,
        and whenever ``torch.use_deterministic_algorithms(True)`` is on).
    device: the layer's device; on CUDA the copy thread makes it its current device (a new thread starts on
        device 0, whatever the main thread set).
    group_timeout_s: the control group's collective timeout (None: unknown). No wait for a plan lasts longer than
        half of it (nor than a minute): the peers wait in the readiness agreement meanwhile, and a stuck planner
        must make its rank compute at home, not make its peers time out.
    """

    def __init__(self, *, plan_wait_s: float | None, device: torch.device, group_timeout_s: float | None = None):
        self.plan_wait_s = plan_wait_s
        self.cap_s = _CPU_PLAN_CAP_S if group_timeout_s is None else min(_CPU_PLAN_CAP_S, group_timeout_s / 2)
        self.planner = _DaemonWorker("feplb-plan")
        self.copier = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="feplb-copy",
                                                            initializer=_copy_thread_init, initargs=(device,))
        self._planning: concurrent.futures.Future | None = None

    def submit_plan(self, fn: Callable[[], tuple[Any, float]]) -> concurrent.futures.Future | None:
        """Start planning; None when the planner is still busy with an earlier (late) plan: the micro-batch then
        computes at home at once instead of queueing behind it."""
        if self._planning is not None and not self._planning.done():
            if not torch.are_deterministic_algorithms_enabled():
                return None
            # reproducible runs: whether a micro-batch balances never depends on the planner's timing (this wait
            # and the plan's share one cap: the peers wait in the readiness agreement meanwhile)
            t0 = time.perf_counter()
            concurrent.futures.wait([self._planning], timeout=self.cap_s)
            if not self._planning.done():
                return None
            waited = time.perf_counter() - t0
        else:
            waited = 0.0
        self._planning = self.planner.submit(fn)
        self._planning.feplb_waited_s = waited   # (on the future: read by this plan's job alone, on the copy thread)
        return self._planning

    def wait_plan(self, future: concurrent.futures.Future | None, static_end: Callable[[], bool] | None,
                  ) -> PlanResult:
        """Wait for ``future`` (on the copy thread) until the static GEMM ended (``static_end()`` true, GPU) plus
        ``plan_wait_s``; without ``static_end`` (CPU) the static GEMM runs on the main thread meanwhile, and the
        deadline is ``plan_wait_s`` after now (None: wait for the plan)."""
        if future is None:
            return PlanResult(plan=None, plan_us=0.0, ready=0, error=None)
        t0 = time.perf_counter()
        if static_end is not None:
            done = threading.Event()
            future.add_done_callback(lambda _f: done.set())
            while not done.wait(_GPU_POLL_S) and not static_end():
                pass
        # under torch.use_deterministic_algorithms(True), the plan is waited for, as on a CPU by default (no longer
        # than the cap): a fallback decided by the clock changes the expert gradients' summation order from run to
        # run (where rows are split, or per-step copies sum micro-batches), and lazy replicas' later plans
        wait = self.plan_wait_s if not torch.are_deterministic_algorithms_enabled() else None
        # (the cap bounds all of this plan's waits: for an earlier plan in submit_plan, for the static GEMM, here)
        cap = max(0.0, self.cap_s - getattr(future, "feplb_waited_s", 0.0) - (time.perf_counter() - t0))
        timeout = cap if wait is None else min(wait, cap)
        try:
            plan, plan_us = future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            return PlanResult(plan=None, plan_us=0.0, ready=0, error=None)
        except BaseException as exc:  # noqa: BLE001 - the planner's error is agreed with the scope, which falls back
            # (any: a planner's SystemExit or GeneratorExit raised here left this rank before the readiness agreement,
            # its peers waiting there until the timeout, and ended the caller's process; no signal reaches a thread
            # other than the main one, so nothing here is the user's interrupt)
            return PlanResult(plan=None, plan_us=0.0, ready=0, error=f"{type(exc).__name__}: {exc}")
        return PlanResult(plan=plan, plan_us=plan_us, ready=1, error=None)

    def close(self) -> None:
        """Stop both threads: the copy thread once its current job (collectives its peers take part in) is done;
        the planner without waiting for a plan still running."""
        self.planner.shutdown()
        self.copier.shutdown(wait=True, cancel_futures=True)


def timed_plan(make: Callable[[], Any]) -> tuple[Any, float]:
    """(make(), its wall time in us): the planner thread's job."""
    t0 = time.perf_counter()
    plan = make()
    return plan, (time.perf_counter() - t0) * 1e6
