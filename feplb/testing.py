"""Run a function on W gloo processes and collect what each returns (tests, benchmarks, examples).

``run_dist(fn, world_size, *args)`` starts ``world_size`` processes (forked from a server that imported torch once,
on a host without CUDA; spawned afresh otherwise), joins them into one gloo process group on
a free local port with a collective timeout, calls ``fn(rank, world_size, *args)`` in each, and returns the list of
results in rank order. An exception in any rank is re-raised in the caller with that rank's traceback; a process
that does not finish within ``timeout_s`` is killed and reported with the Python stack of each of its threads at the
deadline (``faulthandler``), so a communication bug fails instead of hanging, and says where it stood.

``fn`` is located in the children by its source file and name, so it may live in a pytest module imported with
``--import-mode=importlib`` (which is not importable by module name); it must be defined at module level.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib.util
import inspect
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ["DistError", "DerivedWeights", "dense_moe_reference", "error_bound", "error_of", "free_port",
           "load_global_weights", "load_module", "max_abs_error", "run_dist"]


class DistError(RuntimeError):
    """A rank of a ``run_dist`` job raised, crashed or timed out."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_module(file: str | os.PathLike) -> Any:
    """The Python file ``file`` as a module, loaded by its path once per process, as ``run_dist``'s ranks load the
    file of their function: how a test file shares another's helpers (test folders are no packages)."""
    file = os.fspath(file)
    module_name = f"_feplb_dist_{abs(hash(file))}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {file!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return module


def _load(file: str, qualname: str) -> Callable:
    obj: Any = load_module(file)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# What a forkserver imports once, before it forks the ranks of every later job: the third-party modules each rank
# of a job would otherwise import afresh (about 5 s of CPU per rank on a small machine, most of a short test's time).
# Not numpy.random on purpose, but a module below may import it: each rank draws its global state afresh (_child).
_PRELOAD = ("numpy", "torch", "torch.distributed", "triton", "transformers")
# Imported too where the caller has imported the key when the server starts (a test run that collected those tests),
# so that a run of other tests does not pay for them in its server:
_PRELOAD_IF_LOADED: dict[str, tuple[str, ...]] = {
    # Megatron-Core's and torchtitan's MoE layers: 6 and 5 s more of CPU per rank of their jobs, 12 s once
    "megatron.core.transformer.moe.moe_layer": ("megatron.core.transformer.moe.moe_layer",),
    "torchtitan.models.common.moe": ("torchtitan.models.common.moe",),
    # transformers' model registry and model base class (``import transformers`` loads neither): about 1.5 s of CPU
    # per rank of a job that builds a model, 1.5 s once
    "transformers.modeling_utils": ("transformers.models", "transformers.modeling_utils"),
    # its Trainer with feplb's mixin (1.5 s per rank of a Trainer's job: accelerate, datasets, pyarrow, peft), where
    # the caller has the Trainer or accelerate, which the Trainer's tests import when collected; and TRL's trainers
    # (0.4 s more). pyarrow's allocator would start a thread in the server, which then forked every rank while
    # holding it: _SERVER_ENV turns it off.
    "accelerate": ("transformers.trainer", "feplb.hf_trainer"),
    "transformers.trainer": ("transformers.trainer", "feplb.hf_trainer"),
    "trl": ("trl.trainer.sft_trainer", "trl.trainer.dpo_trainer", "trl.trainer.grpo_trainer"),
    # a test module a rank loads by path imports pytest: 0.15 s per rank of every job
    "pytest": ("pytest",),
}
# The caller's own feplb modules are imported too (the layer, its kernels, the adapters its tests imported): about
# 0.4 s of CPU per rank of a layer's job. These variables are read at import by them (feplb.kernels: the Triton
# interpreter and the autotuning budget) and by torch's Dynamo configuration, which feplb.layer loads (whether
# torch.compile is off), so a job whose ranks would see other values than the running server had when it imported
# them starts its ranks afresh instead (run_dist). Not every variable torch's configurations read (Inductor's, say:
# torch sets some of them itself while it compiles, in the caller too), which run_dist's doc says.
_IMPORT_ENV = ("TRITON_INTERPRET", "FEPLB_AUTOTUNE_MS", "TORCH_COMPILE_DISABLE")


def _import_env(env: Mapping[str, str]) -> dict[str, str | None]:
    """The values in ``env`` of the variables preloaded modules read at import (``_IMPORT_ENV``)."""
    return {k: env.get(k) for k in _IMPORT_ENV}


_server_env: dict[str, str | None] = {}   # _import_env as the running server saw it (_ensure_forkserver)
# the server's environment while it loads them (_ensure_forkserver): no thread pools, no allocator thread (the
# server forks every rank from its one thread)
_SERVER_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "JE_ARROW_MALLOC_CONF": "background_thread:false"}
_SERVER_LOCK = threading.Lock()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _start_method(backend: str) -> str:
    """``forkserver`` for gloo jobs on a host without CUDA (FEPLB_RUN_DIST_START=spawn to opt out), else ``spawn``:
    forked ranks start in a fraction of a second from a server that imported torch once; on a GPU host the ranks
    keep fresh processes, as CUDA wants."""
    chosen = os.environ.get("FEPLB_RUN_DIST_START", "").strip()
    if chosen not in ("", "forkserver", "spawn"):
        raise ValueError(f"FEPLB_RUN_DIST_START must be 'forkserver' or 'spawn', got {chosen!r}")
    if chosen:
        return chosen
    if backend != "gloo" or "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    import torch

    return "spawn" if torch.cuda.is_available() else "forkserver"


def _preload(loaded: Collection[str]) -> list[str]:
    """What a forkserver started now imports, given the names of the modules the caller has loaded."""
    own = sorted(m for m in list(loaded) if m == "feplb" or m.startswith("feplb."))
    mods = [*_PRELOAD, *(m for key, mods in _PRELOAD_IF_LOADED.items() if key in loaded for m in mods), *own]
    return list(dict.fromkeys(mods))


def _ensure_forkserver(ctx: Any) -> None:
    """Start this process's forkserver (once; again if it died) with the preloaded modules, and with one thread for
    OpenMP and OpenBLAS while they load: numpy sizes its BLAS pool at import, which a forked rank keeps, where a
    spawned one imported numpy under its job's ``OMP_NUM_THREADS``."""
    from multiprocessing import forkserver

    # one module that imports the others, going past any that raises (feplb._preload)
    ctx.set_forkserver_preload(["feplb._preload"])
    server_env = {**_SERVER_ENV, "FEPLB_RUN_DIST_PRELOAD": ",".join(_preload(sys.modules))}
    with _SERVER_LOCK:
        saved = {k: os.environ.get(k) for k in server_env}
        os.environ.update(server_env)
        try:
            server = getattr(forkserver, "_forkserver", None)
            before = getattr(server, "_forkserver_pid", None)
            seen = _import_env(os.environ)
            forkserver.ensure_running()
            if getattr(server, "_forkserver_pid", None) != before or before is None:   # started now, with seen
                _server_env.clear()
                _server_env.update(seen)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class _CallersFd:
    """The caller's file descriptor ``fd`` (stdout, stderr) as it is when a job starts, handed to each rank by
    multiprocessing's own fd passing: a rank forked from the server would otherwise write where the caller's fd
    pointed when the server started (another test's captured output, say)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _CallersFd._received, (self.fd, reduction.DupFd(self.fd))

    @staticmethod
    def _received(fd: int, dup: Any) -> tuple[int, int]:
        return fd, dup.detach()


# The signal on which a rank writes every thread's Python stack to its stack file (a straggler, before it is killed).
_STACK_SIGNAL = signal.SIGUSR1
# How long the parent waits for a straggler's stacks (the dump is a few writes: it takes far less unless the machine
# is swamped).
_STACK_WAIT_S = 3.0


def _child(rank: int, world_size: int, port: int, file: str, qualname: str, args: tuple, collective_timeout_s: float,
           threads: int, env: dict, results: Any, backend: str, fds: tuple = (), stack_file: str | None = None,
           feplb_file: str | None = None) -> None:
    if stack_file is not None:
        # kept open for the process's life: faulthandler writes to its descriptor from the signal handler, with no
        # lock and no GIL, so the stacks come out even where a thread hangs in native code holding the GIL
        stacks = open(stack_file, "w")  # noqa: SIM115
        faulthandler.register(_STACK_SIGNAL, file=stacks, all_threads=True, chain=False)
    # The caller's whole environment and output, as a spawned rank inherits them: a forked one starts from the
    # server's
    os.environ.clear()
    os.environ.update(env)
    if fds:
        sys.stdout.flush()
        sys.stderr.flush()
    for fd, dup in fds:
        os.dup2(dup, fd)
        os.close(dup)
    if "numpy.random" in sys.modules:
        # numpy's global random state, where the server imported it (Megatron-Core's import does), would be the
        # server's in every forked rank: drawn afresh from the OS, as a spawned process draws it (Python's random
        # reseeds itself at fork)
        import numpy as np

        np.random.seed()
    try:
        ours = sys.modules["feplb"].__file__
        if feplb_file is not None and os.path.realpath(ours) != feplb_file:
            # a server imports from the path its environment gives (Python 3.11's forkserver ignores the caller's
            # sys.path), which may find another copy than the caller's sys.path did
            raise RuntimeError(f"this rank runs feplb from {ours}, the caller's is {feplb_file}: the forkserver found "
                               f"another copy (FEPLB_RUN_DIST_START=spawn starts the ranks with the caller's)")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        try:
            fn = _load(file, qualname)
            out = fn(rank, world_size, *args)
            # Plain pickle bytes: tensors sent through the queue as shared-memory handles would die with this
            # process before the parent reads them.
            results.put((rank, True, pickle.dumps(out)))
        finally:
            # A rank that failed must not wait on peers in a teardown barrier.
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with its traceback
        failed = getattr(sys.modules.get("feplb._preload"), "failed", None)
        note = f"\n(the forkserver could not preload {sorted(failed)}: {failed})" if failed else ""
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}{note}"))


def run_dist(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0, collective_timeout_s: float = 30.0,
             threads: int = 1, env: dict[str, str] | None = None, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return the results in rank order.

    Args:
        fn: a module-level function; its return value must be picklable (tensors are fine).
        world_size: number of processes (ranks).
        timeout_s: wall-clock limit for the whole job; stragglers are killed and a ``DistError`` names them.
        collective_timeout_s: ``init_process_group(timeout=...)``: any collective that waits longer raises.
        threads: ``torch.set_num_threads`` in every child (keep 1 on small machines).
        env: extra environment variables for the children (which get the caller's environment, with these and
            ``OMP_NUM_THREADS=threads`` on top). A forked rank's modules preloaded by the server (see ``_PRELOAD``;
            the caller's feplb modules; torch's Dynamo and Inductor, which feplb.layer, Megatron-Core, torchtitan and
            transformers' model code load) read the variables they read at import from the caller's environment when
            the server started. A job whose ``TRITON_INTERPRET``, ``FEPLB_AUTOTUNE_MS`` or ``TORCH_COMPILE_DISABLE``
            differs from the server's gets spawned ranks without asking; one that sets another such variable (an
            Inductor or Dynamo setting) starts its ranks afresh with ``FEPLB_RUN_DIST_START=spawn``. A module whose
            preload raises is left out (``feplb._preload``): a rank that imports it meets its error, and a rank's
            error names what was left out. A rank whose feplb is not the caller's copy (the server found another on
            its path) fails, saying so.
        backend: "gloo" (CPU tensors) or "nccl" (one GPU per rank, rank % device_count).
    Raises:
        DistError: a rank raised (its traceback is in the message), died, or did not finish in time.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    file = inspect.getsourcefile(fn)
    if file is None or "<locals>" in fn.__qualname__:
        raise ValueError(f"fn must be a module-level function defined in a file, got {fn!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    child_env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})}
    method = _start_method(backend)
    ctx = mp.get_context(method)
    if method == "forkserver":
        _ensure_forkserver(ctx)
        if _import_env(child_env) != _server_env:
            method, ctx = "spawn", mp.get_context("spawn")   # the server's modules would not see them
    results = ctx.Queue()
    port = free_port()
    # a spawned rank inherits the caller's stdout and stderr as they are now
    fds = tuple(_CallersFd(fd) for fd in (1, 2) if _is_open(fd)) if method == "forkserver" else ()
    stack_dir = tempfile.mkdtemp(prefix="feplb-run-dist-")
    stack_files = [os.path.join(stack_dir, f"rank{r}.txt") for r in range(world_size)]
    procs = [ctx.Process(target=_child, args=(r, world_size, port, os.path.abspath(file), fn.__qualname__, args,
                                               collective_timeout_s, threads, child_env, results, backend, fds,
                                               stack_files[r], os.path.realpath(sys.modules["feplb"].__file__)),
                          daemon=True)
             for r in range(world_size)]
    outs: dict[int, tuple[bool, Any]] = {}
    stacks: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(outs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, out = results.get(timeout=min(remaining, 0.5))
                outs[rank] = (ok, out)
            except queue.Empty:
                # A child killed by a signal, or ended by os._exit, never reports; stop waiting for it once it is
                # gone (one that reported flushed its result into the queue before it exited: read first).
                dead = [r for r, p in enumerate(procs) if r not in outs and not p.is_alive()]
                if dead and results.empty():
                    time.sleep(0.2)
                    if results.empty():
                        for r in dead:
                            outs[r] = (False, f"process exited with code {procs[r].exitcode} without reporting")
        stacks = _stragglers_stacks([(r, p) for r, p in enumerate(procs) if r not in outs], stack_files)
    finally:
        started = [p for p in procs if p.pid is not None]
        for p in started:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in started:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(stack_dir, ignore_errors=True)
    errors = [f"rank {r}: {out}" for r, (ok, out) in sorted(outs.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outs]
    if missing:
        errors.append(f"ranks {missing} did not finish within {timeout_s:.0f} s (killed)")
        errors += [f"rank {r}'s threads at the deadline (most recent call first):\n{stacks.get(r) or '(no stack came)'}"
                   for r in missing]
    if errors:
        raise DistError("run_dist failed:\n" + "\n".join(errors))
    return [pickle.loads(outs[r][1]) for r in range(world_size)]


def _stragglers_stacks(stragglers: list[tuple[int, Any]], files: list[str]) -> dict[int, str]:
    """{rank: every thread's Python stack} of the ranks still running past the deadline: each is signalled to write
    them (``_STACK_SIGNAL``), and its file is read once it stops growing (or after ``_STACK_WAIT_S``)."""
    alive = [(r, p) for r, p in stragglers if p.is_alive() and p.pid is not None]
    for _, p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, _STACK_SIGNAL)
    out: dict[int, str] = {}
    end = time.monotonic() + _STACK_WAIT_S
    for r, _ in alive:
        size = -1
        while time.monotonic() < end:
            time.sleep(0.1)
            now = os.path.getsize(files[r]) if os.path.exists(files[r]) else 0
            if now and now == size:
                break
            size = now
        with contextlib.suppress(OSError), open(files[r], errors="replace") as f:
            out[r] = f.read().strip()
    return out


def dense_moe_reference(x_TD, router_EH, w1_EH2F, w2_EFH, top_k: int, router: str = "softmax", bias_E=None,
                        swiglu_limit: float | None = None, gate_on_input: bool = False, activation: str = "silu",
                        swiglu_alpha: float = 1.702, glu_interleaved: bool = False, b1_E2F=None, b2_EH=None,
                        gated: bool = True, glu_softcap: tuple[float, float] | None = None):
    """Single-process dense MoE (no dispatch, no kernels), the independent reference of ``MoELayer``.

    Expert selection uses the logits as the layer computes them (so ties resolve the same way): in x's and the
    router's dtype, then scored in fp32 at least (fp64 for fp64 inputs); gates and expert math run in x's dtype.
    Every expert is applied with plain matmuls to the tokens that chose it.

    Args:
        x_TD: [T, H]; router_EH: [E, H]; w1_EH2F: [E, H, 2F]; w2_EFH: [E, F, H]; bias_E: optional fp32 [E]
            added to the scores for selection only; swiglu_limit: the clamped SwiGLU's limit (torch.clamp);
            gate_on_input: each expert's input weighed by the gate instead of its output; activation: the gate's
            ("silu", "gelu_tanh", "gelu": torch.nn.functional's; "swiglu_oai": gate * sigmoid(swiglu_alpha * gate)
            * (up + 1)); glu_interleaved: gate and up alternate in w1's columns; b1_E2F [E, 2F], b2_EH [E, H]:
            the experts' biases (both or neither); gated=False: non-gated experts, w1 [E, H, F], act(x w1) w2
            (activation also "relu2": relu^2); glu_softcap (c_gate, c_up): "silu_softcap"'s, c_gate tanh(gate /
            c_gate) sigmoid(gate) * c_up tanh(up / c_up).
    Returns:
        out_TD [T, H] in x's dtype, differentiable w.r.t. every input.
    """
    import torch

    F2 = w1_EH2F.shape[-1] // 2
    dt = torch.promote_types(x_TD.dtype, router_EH.dtype)
    logits32 = torch.nn.functional.linear(x_TD.detach().to(dt), router_EH.detach().to(dt))
    logits32 = logits32.to(torch.promote_types(dt, torch.float32))
    sel = logits32.softmax(-1) if router == "softmax" else logits32.sigmoid()
    if bias_E is not None:
        sel = sel + bias_E
    ids_TK = sel.topk(top_k, dim=-1).indices
    logits = x_TD @ router_EH.t()
    scores = logits.softmax(-1) if router == "softmax" else logits.sigmoid()
    g_TK = scores.gather(-1, ids_TK)
    if router == "sigmoid":
        g_TK = g_TK / g_TK.sum(-1, keepdim=True)
    out = torch.zeros_like(x_TD)
    for e in range(w1_EH2F.shape[0]):
        t_idx, k_idx = torch.nonzero(ids_TK == e, as_tuple=True)
        if t_idx.numel() == 0:
            continue
        g = g_TK[t_idx, k_idx, None]
        h = (x_TD[t_idx] * g if gate_on_input else x_TD[t_idx]) @ w1_EH2F[e]
        if b1_E2F is not None:
            h = h + b1_E2F[e]
        if not gated:
            act = torch.relu(h).square() if activation == "relu2" else \
                torch.nn.functional.silu(h) if activation == "silu" else \
                torch.nn.functional.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none")
            y = act @ w2_EFH[e] + (b2_EH[e] if b2_EH is not None else 0)
            out = out.index_add(0, t_idx, y if gate_on_input else g * y)
            continue
        gate, up = (h[:, 0::2], h[:, 1::2]) if glu_interleaved else (h[:, :F2], h[:, F2:])
        if swiglu_limit is not None:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        if activation == "swiglu_oai":
            act, up = gate * torch.sigmoid(swiglu_alpha * gate), up + 1
        elif activation == "silu_softcap":
            (cg, cu) = glu_softcap
            act, up = cg * torch.tanh(gate / cg) * torch.sigmoid(gate), cu * torch.tanh(up / cu)
        elif activation == "silu":
            act = torch.nn.functional.silu(gate)
        else:
            act = torch.nn.functional.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none")
        y = (act * up) @ w2_EFH[e]
        if b2_EH is not None:
            y = y + b2_EH[e]
        out = out.index_add(0, t_idx, y if gate_on_input else g * y)
    return out


def load_global_weights(layer, router_EH, w1_EH2F, w2_EFH, b1_E2F=None, b2_EH=None) -> None:
    """Copy global weights into an EP ``MoELayer``: the router whole, and this rank's shard of the experts.

    Args:
        router_EH: [E, H]; w1_EH2F: [E, H, 2F]; w2_EFH: [E, F, H]; b1_E2F [E, 2F], b2_EH [E, H]: the biases of a
            layer with ``expert_bias`` (all E experts, the same on every rank).
    """
    import torch

    lo = layer.rank * layer.num_local
    with torch.no_grad():
        layer.router.weight.copy_(router_EH)
        layer.w1.copy_(w1_EH2F[lo:lo + layer.num_local])
        layer.w2.copy_(w2_EFH[lo:lo + layer.num_local])
        if (b1_E2F is None) != (not layer.config.expert_bias) or (b2_EH is None) != (not layer.config.expert_bias):
            raise ValueError("load_global_weights: give b1 and b2 exactly when the layer has expert_bias")
        if b1_E2F is not None:
            layer.b1.copy_(b1_E2F[lo:lo + layer.num_local])
            layer.b2.copy_(b2_EH[lo:lo + layer.num_local])


class ReceivedBuffers:
    """Watches the buffers the layer's exchanges return, inside ``with ReceivedBuffers() as seen:``, through weak
    references to their storages (alive while any view of them is, such as a buffer cut from a larger receive), by
    kind: ``weights`` (expert weights received in a forward: phase 2's exchange of rows and weights, or of weights
    alone; the direct path's), ``rows`` (phase 2's rows to helpers, with ``recopy_weights``) and ``again`` (weights
    received again in a backward, ``feplb.recopy.Recopy.start``). ``seen.runs`` counts those runs; ``seen.mark()`` and
    ``seen.since(mark)`` give, per kind, the buffers received since and how many of them something still holds."""

    WEIGHT_OPS = ("phase-2 rows and weights to helpers", "phase-2 weights to helpers", "weights to helpers")
    ROWS_OP = "phase-2 rows to helpers"
    KINDS = ("weights", "rows", "again")

    def __init__(self) -> None:
        self.bufs: dict[str, list[weakref.ref]] = {k: [] for k in self.KINDS}
        self.runs = 0

    def __enter__(self) -> ReceivedBuffers:
        from feplb import dispatch, recopy

        self._dispatch, self._recopy = dispatch, recopy
        call, start = dispatch.Exchange.__call__, recopy.Recopy.start
        self._orig = call, start

        def spy_call(ex, *a, **kw):
            got = call(ex, *a, **kw)
            kind = "weights" if ex.op in self.WEIGHT_OPS else "rows" if ex.op == self.ROWS_OP else None
            if kind is not None:
                self.bufs[kind].extend(weakref.ref(b.untyped_storage()) for b in got.bufs.values())
            return got

        def spy_start(rc):
            got = start(rc)
            if got is not None:   # (None: started already in this backward)
                self.runs += 1
                self.bufs["again"].extend(weakref.ref(b.untyped_storage()) for b in got.values())
            return got

        dispatch.Exchange.__call__, recopy.Recopy.start = spy_call, spy_start
        return self

    def __exit__(self, *exc) -> None:
        self._dispatch.Exchange.__call__, self._recopy.Recopy.start = self._orig

    def mark(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.bufs.items()}

    def since(self, mark: dict[str, int]) -> dict[str, tuple[int, int]]:
        """Per kind: (buffers received since ``mark``, how many of them are alive)."""
        return {k: (len(v) - mark[k], sum(r() is not None for r in v[mark[k]:])) for k, v in self.bufs.items()}


class DerivedWeights:
    """Watches the weights that ``feplb.experts.rebuilt_in_backward`` derives (joined, cast: not views of the
    parameters; and their casts for the GEMMs under autocast) inside ``with DerivedWeights() as watch:``, through
    weak references: ``watch.made`` counts them,
    ``watch.alive()`` how many something still holds (called between a forward and its backward: 0 when autograd
    keeps recipes, not the weights). ``watch.at_backward(y)`` records ``alive()`` as y's backward begins, in
    ``watch.alive_at_backward``. ``watch.after_backward()``, called once the backward has run while its output is
    still held, records in ``watch.alive_after_backward`` how many of the blocks' recipes (and so the weights they
    derived again) something still holds: 0 when nothing outlives the backward but the graph's husk."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        self._recipes: list[weakref.ref] = []
        self.alive_at_backward: list[int] = []
        self.alive_after_backward: list[int] = []

    @property
    def made(self) -> int:
        return len(self._refs)

    def alive(self) -> int:
        return sum(r() is not None for r in self._refs)

    def at_backward(self, y) -> None:
        y.register_hook(lambda g: self.alive_at_backward.append(self.alive()))

    def after_backward(self) -> None:
        self.alive_after_backward.append(sum(r() is not None for r in self._recipes))

    def __enter__(self) -> DerivedWeights:
        from feplb import experts

        self._experts = experts
        self._init, self._add_cast = experts._Recipe.__init__, experts._Recipe.add_cast
        init, add_cast = self._init, self._add_cast

        def spy(recipe, make, sources, versioned, weights, *rest):
            own = {s.untyped_storage().data_ptr() for s in sources}
            self._refs.extend(weakref.ref(w) for w in weights if w.untyped_storage().data_ptr() not in own)
            self._recipes.append(weakref.ref(recipe))
            init(recipe, make, sources, versioned, weights, *rest)

        def spy_cast(recipe, parent, view, out):
            self._refs.append(weakref.ref(out))
            return add_cast(recipe, parent, view, out)

        experts._Recipe.__init__, experts._Recipe.add_cast = spy, spy_cast
        return self

    def __exit__(self, *exc) -> None:
        self._experts._Recipe.__init__, self._experts._Recipe.add_cast = self._init, self._add_cast


def error_of(fn: Callable[[], Any]) -> str | None:
    """Call ``fn()``; return ``"ExceptionType: message"`` if it raised, else None (tests inspect type and message,
    and a worker keeps going with its remaining collective cases)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the caller inspects type and message
        return f"{type(exc).__name__}: {exc}"
    return None


def max_abs_error(got, want) -> float:
    """max |got - want|, computed in fp64 (0.0 for empty tensors); the shapes must match."""
    if got.shape != want.shape:
        raise ValueError(f"max_abs_error: shapes differ, {tuple(got.shape)} vs {tuple(want.shape)}")
    return (got.double() - want.double()).abs().max().item() if want.numel() else 0.0


def error_bound(want, floor: float = 0.0, tol: float = 1e-5) -> tuple[float, float]:
    """(scale, bound) of the project's exactness criterion: a result equals ``want`` when its max abs error is at
    most ``bound = max(tol * scale, 2 * floor)``, ``scale`` = max |want| (at least 1e-6 in the bound) and ``floor``
    the error torch's own fp32 makes on the same math (0 when not known)."""
    scale = want.abs().max().item() if want.numel() else 0.0
    return scale, max(tol * max(scale, 1e-6), 2 * floor)
