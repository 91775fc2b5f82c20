"""Copy path engines (feplb.copy) on 4 gloo processes, as 2 nodes x 2 and as 1 node x 4.

Every rank derives every (source, destination) block of every step from one shared seed, and sends it cut into
pieces at seeded points, so each checks what it receives against what it computes alone; the shm engine is also
checked against the gloo engine on the same inputs, from the main thread and from a worker thread while the main
thread computes. The known-matrix path (``matrix=``: one control collective per exchange, two inbox halves) is
checked the same way, against the agreed path and gloo, with growth and reuse in both halves, and with a slow
reader that an engine without the two halves corrupts. The CUDA IPC engine runs as 2 processes on one GPU (gloo
for control), the NCCL and NVSHMEM engines with one process per GPU; all skipped without the GPUs they need.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import time

import numpy as np
import pytest
import torch

from feplb.testing import error_of, run_dist
from feplb.transport import nvshmem_modules

GPU_COLLECTIVE_S = 120.0  # first CUDA calls and kernel compiles differ in time between ranks

pytestmark = pytest.mark.dist

SEED = 20261130
STALL_TIMEOUT_S = 3.0
# (dtype, largest block in elements): sizes jump up and down so that inboxes grow twice and are then reused.
# int16 and float8 too: the engines move bytes, whatever gloo's all-to-all takes as element types
STEPS = [(torch.float32, 40), (torch.bfloat16, 3000), (torch.int64, 0), (torch.float32, 40000),
         (torch.bfloat16, 7), (torch.int64, 70000), (torch.float32, 500), (torch.int64, 9000), (torch.int16, 300),
         (torch.float8_e4m3fn, 200)]


def _gen(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + hash(key) % (1 << 31))


def _block(step: int, src: int, dst: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """What node rank ``src`` sends node rank ``dst`` at ``step``: n values that differ from every other block's."""
    gen = _gen(step, src, dst)
    if dtype == torch.int64:
        return torch.randint(-(1 << 40), 1 << 40, (n,), generator=gen)
    if dtype == torch.int16:
        return torch.randint(-(1 << 15), 1 << 15, (n,), generator=gen).to(dtype)
    return torch.randn(n, generator=gen).to(dtype)


def _plan(step: int, g: int, most: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """splits_GG[s, d] elements s sends d (a third zero, diagonal zero); list_send/list_recv: whether a zero-sized
    pair is still named in send / recv_numel (absent peers and present-but-empty peers both occur)."""
    gen = _gen(step, g, -1)
    splits = torch.randint(0, most + 1, (g, g), generator=gen)
    splits[torch.rand(g, g, generator=gen) < 0.33] = 0
    splits.fill_diagonal_(0)
    return splits, torch.rand(g, g, generator=gen) < 0.5, torch.rand(g, g, generator=gen) < 0.5


def _pieces(step: int, src: int, dst: int, blk: torch.Tensor) -> list[torch.Tensor]:
    """``blk`` cut at 1-3 seeded points (empty pieces included, when a cut repeats or falls on an end); even-sized
    pieces sometimes as 2-D views (any contiguous shape is a piece)."""
    gen = _gen(step, src, dst, -2)
    cuts = sorted(torch.randint(0, blk.numel() + 1, (int(torch.randint(1, 4, (1,), generator=gen)),),
                                generator=gen).tolist())
    bounds = [0, *cuts, blk.numel()]
    pieces = [blk[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return [t.view(2, -1) if t.numel() % 2 == 0 and t.numel() and i % 2 else t for i, t in enumerate(pieces)]


def _step_args(step: int, me: int, g: int, dtype: torch.dtype, most: int):
    """(send, recv_numel, expected) of node rank ``me``: each block sent as a list of pieces."""
    splits, list_send, list_recv = _plan(step, g, most)
    send, recv, expect = {}, {}, {}
    for p in range(g):
        if p == me:
            continue
        n = int(splits[me, p])
        if n or list_send[me, p]:
            send[p] = _pieces(step, me, p, _block(step, me, p, n, dtype))
        m = int(splits[p, me])
        if m or list_recv[p, me]:
            recv[p] = m
            expect[p] = _block(step, p, me, m, dtype)
    return send, recv, expect


def _same(got: dict, expect: dict, dtype: torch.dtype) -> bool:
    return sorted(got) == sorted(expect) and all(
        got[q].dtype == dtype and got[q].dim() == 1
        and torch.equal(got[q].view(torch.uint8), expect[q].view(torch.uint8)) for q in expect)


def _shm_files(token: str) -> list[str]:
    return glob.glob(f"/dev/shm/feplb-{token}-*")


def _expect_value_error(fn, *needles: str) -> bool:
    try:
        fn()
    except ValueError as exc:
        return all(n in str(exc) for n in needles)
    return False


def _compute(n: int = 160, reps: int = 20) -> float:
    """Main-thread work while an exchange runs on a worker thread."""
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(1)) / n ** 0.5
    for _ in range(reps):
        a = torch.tanh(a @ a + 1)
    return float(a.sum())


def _engine_cases(rank: int, world: int, g: int) -> dict:
    """Correctness of the shm engine against the seed and against gloo, from the main thread and from a worker
    thread; bad arguments; kinds; shared-memory files."""
    import concurrent.futures

    import torch.distributed as dist

    import feplb.copy as ce
    from feplb import copy as cp
    from feplb.control import Control

    ctl = Control(None, g)
    me = ctl.node_rank
    cpu = torch.device("cpu")
    out: dict = {}
    shm = ce.make_copy_engine("auto", cpu, ctl)
    gloo = ce.make_copy_engine("gloo", cpu, ctl)
    out["auto_is_shm"] = type(shm) is ce.ShmCopyEngine and shm.name == "shm"
    out["gloo_kind"] = type(gloo) is ce.GlooCopyEngine
    tokens = [shm.token]
    ctl.barrier("node", "files check")
    # Every rank has mapped every inbox once construction returns: no file is left to leak.
    out["no_files_after_setup"] = _shm_files(shm.token) == []

    # Consecutive exchanges; results of earlier steps are kept and checked again at the end, so a result that
    # aliases the reused inbox (instead of being copied out) fails.
    kept, caps, grows = [], [], []
    for step, (dtype, most) in enumerate(STEPS):
        send, recv, expect = _step_args(step, me, g, dtype, most)
        a = shm.exchange(send, recv, dtype=dtype, device=cpu, op=f"step {step}")
        b = gloo.exchange(send, recv, dtype=dtype, device=cpu, op=f"step {step}")
        out[f"step{step}_shm"] = _same(a, expect, dtype)
        out[f"step{step}_gloo"] = _same(b, expect, dtype)
        kept.append((a, expect, dtype))
        caps.append(shm.capacity)
        grows.append(shm.grows)
    out["kept_intact"] = all(_same(a, e, d) for a, e, d in kept)
    out["caps"], out["grows"] = caps, grows
    out["no_files_after_growth"] = _shm_files(shm.token) == []

    # From a worker thread (the layer's copy thread) while the main thread computes: the same results. The
    # engines' collectives run on the worker; the main thread makes none meanwhile.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="copy") as pool:
        for step in (60, 61, 62):
            send, recv, expect = _step_args(step, me, g, torch.float32, 20000)
            for name, eng in (("shm", shm), ("gloo", gloo)):
                fut = pool.submit(eng.exchange, send, recv, dtype=torch.float32, device=cpu, op=f"thread {step}")
                _compute()
                out[f"thread{step}_{name}"] = _same(fut.result(timeout=60), expect, torch.float32)

    # Through the layer's differentiable exchange (intra-node pairs on shm, the rest on the transport) and back.
    from feplb.dispatch import Exchange, PeerComm
    from feplb.layout import Item
    from feplb.transport import TorchTransport

    def block(src: int, dst: int) -> torch.Tensor:
        return _block(50, src, dst, 3 + src + 2 * dst, torch.float32)

    peers = [p for p in range(world) if p != rank]
    w = torch.zeros(1, requires_grad=True)
    flat = torch.cat([block(rank, p) for p in peers]) + w
    items = [Item(s, d, block(s, d).numel()) for s in range(world) for d in range(world) if s != d]
    ex = Exchange(PeerComm(TorchTransport(None, ctl), shm, g), items, dtype=torch.float32, device=cpu, op="dispatch")
    mine = [k for k, it in enumerate(items) if it.src == rank]
    cuts = np.cumsum([0] + [items[k].numel for k in mine])
    rcv = ex(ex.sends_of({k: flat[cuts[i]:cuts[i + 1]] for i, k in enumerate(mine)}), w[:0])
    got = torch.cat([rcv.items[k] for k, it in enumerate(items) if it.dst == rank])
    out["dispatch"] = torch.equal(got, torch.cat([block(q, rank) for q in peers]))
    (got * torch.arange(1.0, got.numel() + 1)).sum().backward()
    # Element i of what I sent lands at position j on its receiver; its gradient is j + 1, computed here alone.
    want = sum(float(sum(block(q, p).numel() for q in range(world) if q != p and q < rank))
               * block(rank, p).numel() + block(rank, p).numel() * (block(rank, p).numel() + 1) / 2 for p in peers)
    out["dispatch_grad"] = float(w.grad) == want

    # A slow reader and a slow writer: fast ranks rush into the next exchange with new data. A missing start barrier
    # (writes of n+1 before the reader read n) or end barrier (reads before the writes landed) corrupts the result.
    slow = _slow_engine(ctl, slow_reader=g - 1, slow_writer=0)
    tokens.append(slow.token)
    ok = True
    for step in range(100, 104):
        send, recv, expect = _step_args(step, me, g, torch.float32, 2000)
        ok &= _same(slow.exchange(send, recv, dtype=torch.float32, device=cpu, op="slow"), expect, torch.float32)
    out["slow_peers"] = ok
    slow.close()

    # One exchange in flight per engine: a second one (here from inside the first) is refused, before any
    # collective, and the first completes.
    class Reentrant(ce.ShmCopyEngine):
        inner = None

        def _read(self, parity, blocks, dtype, consumer):
            self.inner = error_of(lambda: self.exchange({}, {}, dtype=dtype, device=cpu, op="inner"))
            return super()._read(parity, blocks, dtype, consumer)

    reentrant = Reentrant(ctl)
    tokens.append(reentrant.token)
    send, recv, expect, _ = _full_args(105, me, g, 100)
    got = reentrant.exchange(send, recv, dtype=torch.float32, device=cpu, op="outer")
    out["in_flight_refused"] = _same(got, expect, torch.float32) and (reentrant.inner or "").startswith(
        "RuntimeError") and "in flight" in reentrant.inner
    reentrant.close()

    # Bad arguments on one rank: every rank raises ValueError (nobody waits for a timeout), and the engine goes on.
    full = {p: [torch.ones(2)] for p in range(g) if p != me}
    full_recv = {p: 2 for p in range(g) if p != me}
    other = (me + 1) % g
    bad_cases = {
        "self_peer": ({me: [torch.ones(2)]} if me == 0 else full, full_recv if me != 0 else {}, 0, "another GPU"),
        "peer_out_of_range": (full, {**full_recv, g: 1} if me == 1 else full_recv, 1, "got " + str(g)),
        "negative_recv": (full, {**full_recv, other: -1} if me == 1 else full_recv, 1, "must be an int"),
        "float_recv": (full, {**full_recv, other: 2.0} if me == 0 else full_recv, 0, "must be an int"),
        "not_a_tensor": ({p: [[1.0, 2.0]] for p in full} if me == 0 else full, full_recv, 0, "[0] must be a tensor"),
        "bare_tensor": ({p: torch.ones(2) for p in full} if me == 1 else full, full_recv, 1,
                        "must be a list of tensors"),
        "non_contiguous": ({**full, other: [torch.ones(2, 2)[:, 0]]} if me == 0 else full, full_recv, 0,
                           f"send[{other}][0] must be contiguous"),
        "wrong_dtype": ({**full, other: [torch.ones(1), torch.ones(1, dtype=torch.float64)]} if me == 1 else full,
                        full_recv, 1, f"send[{other}][1] must have dtype torch.float32"),
        "wrong_device": ({**full, other: [torch.ones(2, device="meta")]} if me == 0 else full, full_recv, 0,
                         "is on meta"),
    }
    for name, (send, recv, culprit, needle) in bad_cases.items():
        want = needle if me == culprit else f"node rank(s) [{culprit}] passed invalid arguments"
        for eng in (shm, gloo):
            out[f"bad_{name}_{eng.name}"] = _expect_value_error(
                lambda s=send, r=recv, e=eng: e.exchange(s, r, dtype=torch.float32, device=cpu, op="bad"), want)
    out["bad_pair_mismatch"] = _expect_value_error(
        lambda: shm.exchange(full, {**full_recv, 1: 3} if me == 0 else full_recv, dtype=torch.float32, device=cpu,
                             op="mismatch"), "node rank 1 sends 2 elements to node rank 0, which expects 3")
    out["bad_dtype_mismatch"] = _expect_value_error(
        lambda: shm.exchange({p: [torch.ones(2, dtype=torch.int64 if me == 0 else torch.float32)] for p in full},
                             full_recv, dtype=torch.int64 if me == 0 else torch.float32, device=cpu, op="dt"),
        "disagree on the dtype", "int64", "float32")
    # Same element size, other type: still refused (the bytes would be reinterpreted).
    out["bad_dtype_same_size"] = _expect_value_error(
        lambda: gloo.exchange({p: [torch.ones(2, dtype=torch.float16 if me == 0 else torch.bfloat16)] for p in full},
                              full_recv, dtype=torch.float16 if me == 0 else torch.bfloat16, device=cpu, op="dt"),
        "disagree on the dtype", "float16", "bfloat16")
    out["bad_ready_on_cpu"] = _expect_value_error(
        lambda: shm.exchange(full, full_recv, dtype=torch.float32, device=cpu, op="r", consumer=object()),
        "ready and consumer order CUDA streams")
    for eng in (shm, gloo):
        got = eng.exchange(full, full_recv, dtype=torch.float32, device=cpu, op="after errors")
        out[f"usable_after_errors_{eng.name}"] = sorted(got) == sorted(full_recv) and all(
            torch.equal(t, torch.ones(2)) for t in got.values())

    # Kinds: what does not fit the device is refused before any collective.
    out["kind_errors"] = [
        _expect_value_error(lambda k=k: ce.make_copy_engine(k, cpu, ctl), k, "does not move cpu")
        for k in ("ipc", "nvshmem", "nccl")]
    out["kind_unknown"] = _expect_value_error(lambda: ce.make_copy_engine("tcp", cpu, ctl), "'tcp'")
    out["kind_meta"] = _expect_value_error(lambda: ce.make_copy_engine("auto", torch.device("meta"), ctl), "meta")
    out["kind_transport"] = _expect_value_error(lambda: ce.make_copy_engine("auto", cpu, ctl, transport_kind="mpi"),
                                                "transport_kind", "'mpi'")
    out["kind_control"] = _expect_value_error(lambda: ce.GlooCopyEngine(None), "control must be")
    if not torch.cuda.is_available():
        # The CUDA engines without a GPU (or nvshmem4py): a clear error on this rank, before any collective.
        for cls in (ce.IpcCopyEngine, ce.NcclCopyEngine):
            out[f"no_gpu_{cls.name}"] = "needs a CUDA GPU" in str(error_of(lambda c=cls: c(ctl)))
        if importlib.util.find_spec("nvshmem") is None:
            out["no_nvshmem"] = "pip install 'feplb[nvshmem]'" in str(error_of(lambda: ce.NvshmemCopyEngine(ctl)))

    # Processes that do not see each other's files (as in separate /dev/shm namespaces): every rank raises
    # PeerMemoryUnavailable, no file stays behind, and "auto" falls back to gloo on all of them.
    private = f"/dev/shm/feplb-test-{shm.token}-{rank}"
    os.makedirs(private)
    cp.shm.os = _PeersInvisible()
    try:
        try:
            ce.ShmCopyEngine(ctl, shm_dir=private)
            out["unshared_raises"] = False
        except ce.PeerMemoryUnavailable as exc:
            out["unshared_raises"] = "cannot map node rank" in str(exc)
        cp.shm.SHM_DIR = private
        with pytest.warns(RuntimeWarning, match="falling back to the gloo copy path"):
            fb = ce.make_copy_engine("auto", cpu, ctl)
        out["auto_fallback"] = type(fb) is ce.GlooCopyEngine
        out["unshared_no_files"] = os.listdir(private) == []
    finally:
        cp.shm.os, cp.shm.SHM_DIR = os, "/dev/shm"
        os.rmdir(private)
    try:
        ce.ShmCopyEngine(ctl, shm_dir="/nonexistent-feplb-dir")
        out["missing_dir_raises"] = False
    except ce.PeerMemoryUnavailable as exc:
        out["missing_dir_raises"] = "cannot create" in str(exc)

    shm.close()
    shm.close()
    out["closed_refuses"] = "closed" in str(error_of(lambda: shm.exchange({}, {}, dtype=torch.float32, device=cpu,
                                                                           op="closed")))
    with ce.ShmCopyEngine(ctl) as scoped:
        tokens.append(scoped.token)
        got = scoped.exchange(full, full_recv, dtype=torch.float32, device=cpu, op="scoped")
    out["context_manager"] = all(torch.equal(t, torch.ones(2)) for t in got.values()) and scoped.capacity == 0 \
        and "closed" in str(error_of(lambda: scoped.exchange({}, {}, dtype=torch.float32, device=cpu, op="x")))
    # This engine is left open on purpose: process exit must not leave files either.
    left_open = ce.ShmCopyEngine(ctl)
    left_open.exchange(*_step_args(200, me, g, torch.float32, 30000)[:2], dtype=torch.float32, device=cpu, op="x")
    tokens.append(left_open.token)
    if g == 2:
        out.update(_stall_cases(rank, world, g, me, tokens))
    out["tokens"] = tokens
    dist.barrier()
    return out


class _PeersInvisible:
    """Stands in for ``os`` in feplb.copy.shm: opening an existing file (no O_CREAT) fails, as it does for a
    peer's inbox when the node's processes do not share /dev/shm."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def open(path, flags, *args):
        if not flags & os.O_CREAT:
            raise FileNotFoundError(2, "not visible from this process", path)
        return os.open(path, flags, *args)


def _slow_engine(ctl, *, slow_reader: int, slow_writer: int):
    """A ShmCopyEngine whose node rank ``slow_writer`` dawdles before each write and ``slow_reader`` before reading."""
    from feplb.copy import ShmCopyEngine

    class Slow(ShmCopyEngine):
        def _write(self, p, parity, offset, pieces, dtype):
            if self.node_rank == slow_writer:
                time.sleep(0.05)
            super()._write(p, parity, offset, pieces, dtype)

        def _read(self, parity, blocks, dtype, consumer):
            if self.node_rank == slow_reader:
                time.sleep(0.1)
            return super()._read(parity, blocks, dtype, consumer)

    return Slow(ctl)


def _stall_cases(rank: int, world: int, g: int, me: int, tokens: list) -> dict:
    """Node 0: node rank 1 never calls exchange. Node 1: node rank 1 stalls in its writes. Their partners must get
    a TimeoutError naming the step, after the group's timeout, and no file may stay behind."""
    import datetime

    import torch.distributed as dist

    from feplb.control import Control
    from feplb.copy import ShmCopyEngine

    groups = [dist.new_group(list(range(n * g, (n + 1) * g)), backend="gloo",
                             timeout=datetime.timedelta(seconds=STALL_TIMEOUT_S)) for n in range(world // g)]
    # One node per EP group here: the control's node group is the short-timeout group itself.
    ctl = Control(groups[rank // g], g)
    node = rank // g

    class Stalling(ShmCopyEngine):
        def _write(self, p, parity, offset, pieces, dtype):
            if node == 1 and self.node_rank == 1:
                time.sleep(2 * STALL_TIMEOUT_S)
                raise _Abandoned
            super()._write(p, parity, offset, pieces, dtype)

    eng = Stalling(ctl)
    tokens.append(eng.token)
    out = {}
    send, recv = {1 - me: [torch.ones(5)]}, {1 - me: 5}
    if node == 0 and me == 1:
        time.sleep(2 * STALL_TIMEOUT_S)
        out["stall"] = "stalled"
    else:
        t0 = time.monotonic()
        try:
            eng.exchange(send, recv, dtype=torch.float32, device=torch.device("cpu"), op="stall test")
            out["stall"] = "no error"
        except _Abandoned:
            out["stall"] = "stalled"
        except TimeoutError as exc:
            where = "split exchange" if node == 0 else "end of writes"
            out["stall"] = "ok" if f"copy path (stall test): {where}" in str(exc) else str(exc)
            out["stall_waited_s"] = time.monotonic() - t0
    eng.close()
    return out


class _Abandoned(Exception):
    """A stalled rank gives up."""


# Two rounds of STEPS (the second 4x larger, so the inboxes grow again), with one small step between them.
MATRIX_STEPS = STEPS + [(torch.float32, 5)] + [(d, 4 * m) for d, m in STEPS]


def _as_matrix(splits: torch.Tensor, step: int):
    """The forms callers pass: tuple of tuples, int64 numpy array, list of lists."""
    return (tuple(map(tuple, splits.tolist())), splits.numpy(), splits.tolist())[step % 3]


def _full_args(step: int, me: int, g: int, n: int):
    """Every pair exchanges n fp32 elements that differ from step to step: (send, recv_numel, expected, matrix)."""
    send = {p: _pieces(step, me, p, _block(step, me, p, n, torch.float32)) for p in range(g) if p != me}
    expect = {q: _block(step, q, me, n, torch.float32) for q in range(g) if q != me}
    matrix = [[0 if i == j else n for j in range(g)] for i in range(g)]
    return send, {q: n for q in expect}, expect, matrix


def _matrix_cases(rank: int, world: int, g: int) -> dict:
    """The known-matrix path of the shm engine against the seed, the agreed path and gloo; its ordering without the
    start barrier; local argument checks."""
    import torch.distributed as dist

    import feplb.copy as ce
    from feplb.control import Control
    from feplb.dispatch import Exchange, PeerComm
    from feplb.layout import Item
    from feplb.transport import TorchTransport

    class Counting(ce.ShmCopyEngine):
        """Counts size agreements (all-gathers), which the matrix path must skip."""

        agreements = 0

        def _agree(self, *args):
            self.agreements += 1
            return super()._agree(*args)

    ctl = Control(None, g)
    me = ctl.node_rank
    cpu = torch.device("cpu")
    out: dict = {}
    fast = Counting(ctl)           # matrix on every exchange
    mixed = ce.ShmCopyEngine(ctl)  # matrix on odd steps only: the two paths share the halves
    gloo = ce.GlooCopyEngine(ctl)  # checks the matrix, then ignores it
    tokens = [fast.token, mixed.token]

    kept, events, last_grow_parity, fillers = [], [], None, 0
    for step, (dtype, most) in enumerate(MATRIX_STEPS):
        send, recv, expect = _step_args(step, me, g, dtype, most)
        splits = _plan(step, g, most)[0]
        need = int(splits.sum(0).max()) * dtype.itemsize
        if need > fast.capacity and fast.exchanges % 2 == last_grow_parity:
            # One small exchange first, so that growth happens in both halves (decided alike on every rank).
            fs, fr, fe, fm = _full_args(1000 + step, me, g, 3)
            out[f"filler{step}"] = _same(fast.exchange(fs, fr, dtype=torch.float32, device=cpu, op="filler",
                                                       matrix=fm), fe, torch.float32)
            fillers += 1
        matrix = _as_matrix(splits, step)
        parity, grows = fast.exchanges % 2, fast.grows
        a = fast.exchange(send, recv, dtype=dtype, device=cpu, op=f"matrix step {step}", matrix=matrix)
        b = mixed.exchange(send, recv, dtype=dtype, device=cpu, op=f"mixed step {step}",
                           matrix=matrix if step % 2 else None)
        c = gloo.exchange(send, recv, dtype=dtype, device=cpu, op=f"gloo step {step}", matrix=matrix)
        out[f"step{step}"] = [_same(a, expect, dtype), _same(b, expect, dtype), _same(c, expect, dtype)]
        if splits.any():
            grew = fast.grows != grows
            events.append((parity, grew))
            if grew:
                last_grow_parity = parity
        kept.append((a, expect, dtype))
    out["kept_intact"] = all(_same(a, e, d) for a, e, d in kept)
    out["no_agreement"] = fast.agreements == 0
    out["events"] = events
    out["fillers"] = fillers
    out["counter"] = fast.exchanges == len(events) + fillers
    out["mixed_counter"] = mixed.exchanges == len(events)

    # A slow reader (the last node rank sleeps before reading). Fast ranks rush into the next exchange with new
    # data: the second half keeps their writes away from what it has not read yet. The same engine writing every
    # exchange into one half must corrupt it (this is what makes the check above able to fail).
    class SlowReader(ce.ShmCopyEngine):
        def _read(self, parity, blocks, dtype, consumer):
            if self.node_rank == g - 1:
                time.sleep(0.2)
            return super()._read(parity, blocks, dtype, consumer)

    class OneHalf(SlowReader):
        def _next_parity(self):
            super()._next_parity()
            return 0

    for name, cls in (("slow_reader", SlowReader), ("one_half", OneHalf)):
        eng = cls(ctl)
        tokens.append(eng.token)
        res = []
        for step in range(300, 304):
            send, recv, expect, matrix = _full_args(step, me, g, 500)
            res.append(_same(eng.exchange(send, recv, dtype=torch.float32, device=cpu, op=name, matrix=matrix),
                             expect, torch.float32))
        out[name] = res
        eng.close()
    # The slow writer and reader of the agreed path's test, on the matrix path with random plans.
    slow = _slow_engine(ctl, slow_reader=g - 1, slow_writer=0)
    tokens.append(slow.token)
    ok = True
    for step in range(100, 104):
        send, recv, expect = _step_args(step, me, g, torch.float32, 2000)
        ok &= _same(slow.exchange(send, recv, dtype=torch.float32, device=cpu, op="slow",
                                  matrix=_plan(step, g, 2000)[0]), expect, torch.float32)
    out["slow_peers"] = ok
    slow.close()

    # Arguments against the matrix: ValueError on this rank before any collective. Every rank errs alike here (a
    # refusal on one rank alone: at the end, "out_of_step").
    send, recv, _, good = _full_args(400, me, g, 2)
    off = [row[:] for row in good]
    off[(me + 1) % g][me] += 1
    bad_cases = {
        "row": (send, recv, [[0 if i == j else 1 for j in range(g)] for i in range(g)],
                f"node rank {me} sends 2 elements to node rank"),
        "column": (send, recv, off, f"node rank {me} expects 2 elements from node rank {(me + 1) % g}"),
        "absent_peer": ({p: t for p, t in send.items() if p != (me + 1) % g}, recv, good,
                        f"sends 0 elements to node rank {(me + 1) % g}"),
        "shape": (send, recv, [row + [0] for row in good], f"{g} x {g} array"),
        "floats": (send, recv, [[float(v) for v in row] for row in good], "integer element counts"),
        "ragged": (send, recv, [good[0], good[1][:1]], "matrix must be"),
        "diagonal": (send, recv, [[1 if i == j else v for j, v in enumerate(row)] for i, row in enumerate(good)],
                     "zero diagonal"),
        "negative": (send, recv, [[-1 if (i, j) == (0, 1) else v for j, v in enumerate(row)]
                                  for i, row in enumerate(good)], "counts >= 0"),
        "self_peer": ({**send, me: [torch.ones(2)]}, recv, good, "another GPU"),
        "bare_tensor": ({p: torch.cat(t) for p, t in send.items()}, recv, good, "must be a list of tensors"),
    }
    counter = fast.exchanges
    for name, (s_, r_, m_, needle) in bad_cases.items():
        t0 = time.monotonic()
        out[f"bad_{name}"] = _expect_value_error(
            lambda s_=s_, r_=r_, m_=m_: fast.exchange(s_, r_, dtype=torch.float32, device=cpu, op="bad",
                                                      matrix=m_), needle)
        out[f"bad_{name}_fast"] = time.monotonic() - t0 < 1.0
    out["bad_gloo"] = _expect_value_error(
        lambda: gloo.exchange(send, recv, dtype=torch.float32, device=cpu, op="bad", matrix=off), "expects 2")
    out["bad_kept_counter"] = fast.exchanges == counter
    dist.barrier()
    ok = True
    for step in (401, 402, 403):
        s_, r_, e_, m_ = _full_args(step, me, g, 7)
        ok &= _same(fast.exchange(s_, r_, dtype=torch.float32, device=cpu, op="after", matrix=m_), e_, torch.float32)
    out["usable_after_errors"] = ok

    # Through the layer's Exchange (the node's matrix derived from its items: no size agreement), forward and
    # backward (the transpose), against the same blocks moved by PeerComm.run without a matrix (agreed sizes).
    def block(src: int, dst: int) -> torch.Tensor:
        return _block(50, src, dst, 3 + src + 2 * dst, torch.float32)

    base = rank // g * g
    node_matrix = [[0 if i == j else block(base + i, base + j).numel() for j in range(g)] for i in range(g)]
    peers = [p for p in range(world) if p != rank]
    comm = PeerComm(TorchTransport(None, ctl), fast, g)
    items = [Item(s, d, block(s, d).numel()) for s in range(world) for d in range(world) if s != d]
    ex = Exchange(comm, items, dtype=torch.float32, device=cpu, op="dispatch")
    out["dispatch_matrix"] = ex.layout.node_matrix.tolist() == node_matrix
    w = torch.zeros(1, requires_grad=True)
    flat = torch.cat([block(rank, p) for p in peers]) + w
    mine = [k for k, it in enumerate(items) if it.src == rank]
    cuts = np.cumsum([0] + [items[k].numel for k in mine])
    agreed, xs = fast.agreements, fast.exchanges
    rcv = ex(ex.sends_of({k: flat[cuts[i]:cuts[i + 1]] for i, k in enumerate(mine)}), w[:0])
    got = torch.cat([rcv.items[k] for k, it in enumerate(items) if it.dst == rank])
    (got * torch.arange(1.0, got.numel() + 1)).sum().backward()
    out["dispatch_agreements_False"] = fast.agreements - agreed == 0
    out["dispatch_exchanges_False"] = fast.exchanges - xs == 2
    agreed, xs = fast.agreements, fast.exchanges
    plain = comm.run({p: [block(rank, p)] for p in peers}, {q: block(q, rank).numel() for q in peers},
                     cross_node=g < world, intra_node=True, dtype=torch.float32, device=cpu, op="dispatch, agreed")
    out["dispatch_agreements_True"] = fast.agreements - agreed == 1
    out["dispatch_exchanges_True"] = fast.exchanges - xs == 1
    out["dispatch"] = torch.equal(got.detach(), torch.cat([block(q, rank) for q in peers])) and torch.equal(
        got.detach(), torch.cat([plain[q] for q in peers]))
    want = sum(float(sum(block(q, p).numel() for q in range(world) if q != p and q < rank))
               * block(rank, p).numel() + block(rank, p).numel() * (block(rank, p).numel() + 1) / 2 for p in peers)
    grads = [float(w.grad)] * 2
    out["dispatch_grad"] = grads == [want, want]
    bad_nm = [row[:] for row in node_matrix]
    bad_nm[(me + 1) % g][me] += 1
    out["dispatch_bad_matrix"] = _expect_value_error(
        lambda: comm.run({}, {}, cross_node=False, dtype=torch.float32, device=cpu, op="d", node_matrix=bad_nm),
        "matrix")

    # Node rank 0 alone is refused an exchange its peers run (its matrix apart), catches the ValueError and goes on:
    # its next exchange, of other sizes, meets theirs. Every rank raises there, naming it (none takes the other
    # exchange's data, and gloo does not abort the process on sizes apart: the shm engine compares the exchanges
    # begun in its end-of-writes collective, gloo before its all-to-all), and the engine refuses every exchange after.
    s_, r_, _, m_ = _full_args(500, me, g, 5 if me == 0 else 3)
    for eng in (fast, gloo):
        if me == 0:
            out[f"bad_alone_{eng.name}"] = _expect_value_error(
                lambda e=eng: e.exchange(send, recv, dtype=torch.float32, device=cpu, op="alone", matrix=off),
                "expects")
        got = error_of(lambda e=eng: e.exchange(s_, r_, dtype=torch.float32, device=cpu,
                                                op="next" if me == 0 else "refused on rank 0", matrix=m_))
        out[f"out_of_step_{eng.name}"] = got is not None and got.startswith("RuntimeError: copy path (") and \
            "the node's ranks are at different exchanges" in got
        again = error_of(lambda e=eng: e.exchange(s_, r_, dtype=torch.float32, device=cpu, op="again", matrix=m_))
        out[f"refused_after_{eng.name}"] = again is not None and "it cannot be used again" in again
    for e in (fast, mixed):
        e.close()
    out["tokens"] = tokens
    return out


@pytest.mark.timing   # a refused bad input fails within a second
@pytest.mark.parametrize("g", [2, 4], ids=["2nodes_x2", "1node_x4"])
def test_shm_matrix_path(g):
    results = run_dist(_matrix_cases, 4, g, timeout_s=180)
    events, fillers = results[0]["events"], results[0]["fillers"]
    # Growth and reuse both happened in each half (the step list and the fillers make sure of it).
    assert {p for p, grew in events if grew} == {0, 1}, events
    assert {p for p, grew in events if not grew} == {0, 1}, events
    for rank, res in enumerate(results):
        assert res.pop("events") == events and res.pop("fillers") == fillers, rank
        tokens, one_half = res.pop("tokens"), res.pop("one_half")
        failed = {k: v for k, v in res.items() if not (all(v) if isinstance(v, list) else v)}
        assert not failed, (rank, failed)
        assert ("bad_alone_shm" in res) == ("bad_alone_gloo" in res) == (rank % g == 0)
        for t in tokens:
            assert glob.glob(f"/dev/shm/feplb-{t}*") == [], t
        # One half instead of two: the slow reader reads what the fast ranks wrote for the next exchange.
        if rank % g == g - 1:
            assert not all(one_half), one_half
        assert one_half[-1], one_half      # the last exchange has no successor to overwrite it


def _expected_caps(g: int) -> list[int]:
    """Inbox bytes after each step: the smallest power of two >= the largest need so far (at least the minimum)."""
    from feplb.copy import PeerInboxEngine

    caps, cap = [], PeerInboxEngine.min_capacity
    for step, (dtype, most) in enumerate(STEPS):
        need = int(_plan(step, g, most)[0].sum(0).max()) * dtype.itemsize
        while cap < need:
            cap *= 2
        caps.append(cap)
    return caps


# a stalled partner is reported within bounds of the timeout: with 2 GPUs per node only (timing: run alone)
@pytest.mark.parametrize("g", [pytest.param(2, marks=pytest.mark.timing), 4], ids=["2nodes_x2", "1node_x4"])
def test_shm_engine(g):
    results = run_dist(_engine_cases, 4, g, timeout_s=180)
    caps = _expected_caps(g)
    assert len(set(caps)) >= 3, caps          # the schedule must make the inboxes grow at least twice
    # The file-name token is agreed inside a node and differs between nodes.
    assert len({r["tokens"][0] for r in results}) == 4 // g
    assert all(results[r]["tokens"][0] == results[r - r % g]["tokens"][0] for r in range(4))
    for rank, res in enumerate(results):
        got_caps, grows, tokens = res.pop("caps"), res.pop("grows"), res.pop("tokens")
        stall, waited = res.pop("stall", None), res.pop("stall_waited_s", None)
        failed = {k: v for k, v in res.items() if not (all(v) if isinstance(v, list) else v)}
        assert not failed, (rank, failed)
        assert got_caps == caps, (rank, got_caps, caps)
        assert [b - a for a, b in zip(grows, grows[1:], strict=False)] == \
            [int(b != a) for a, b in zip(caps, caps[1:], strict=False)], (grows, caps)
        for t in tokens:
            assert glob.glob(f"/dev/shm/feplb-{t}*") == [], t
        if g == 2:
            # Node rank 1 of each node stalls; its partner fails after the group's timeout, naming the step.
            assert stall == ("stalled" if rank % 2 else "ok"), (rank, stall)
            if waited is not None:
                assert 0.8 * STALL_TIMEOUT_S < waited < 4 * STALL_TIMEOUT_S, waited


def _ipc_cases(rank: int, world: int) -> dict:
    """2 processes on GPU 0: the IPC engine against the seed, with a slow producer and a slow reader, on the agreed
    path (even steps) and the known-matrix path (odd steps), so both inbox halves and their events are reused;
    explicit ``ready`` / ``consumer`` streams; calls from a worker thread; no host sync once the inboxes are large
    enough (``torch.cuda.set_sync_debug_mode("error")``)."""
    import concurrent.futures

    from feplb.control import Control
    from feplb.copy import IpcCopyEngine, make_copy_engine

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    ctl = Control(None, world)

    class SlowReader(IpcCopyEngine):
        """Node rank 1's copy-outs queue behind a long sleep on its copy stream: the peer's writes into that half
        two exchanges later must wait for them (the "consumed" events)."""

        def _read(self, parity, blocks, dtype, consumer):
            if self.node_rank == 1:
                with torch.cuda.stream(self.stream):
                    torch.cuda._sleep(50_000_000)
            return super()._read(parity, blocks, dtype, consumer)

    auto = make_copy_engine("auto", dev, ctl)
    out = {"kind": type(auto) is IpcCopyEngine and auto.name == "ipc"}
    auto.close()
    eng = SlowReader(ctl, dev)
    producer, consumer = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    kept = []
    for step, (dtype, most) in enumerate(STEPS + STEPS[:3]):
        send, recv, expect = _step_args(step, rank, world, dtype, most)
        explicit = step % 3 == 2
        staged = {p: [t.to(dev) for t in ps] for p, ps in send.items()}
        torch.cuda.synchronize()
        # The producer writes the pieces late on its stream: the copy stream must wait for it.
        prod = producer if explicit else torch.cuda.current_stream(dev)
        with torch.cuda.stream(prod):
            dsend = {p: [torch.empty_like(t) for t in ps] for p, ps in staged.items()}
            torch.cuda._sleep(20_000_000)
            for p, ps in staged.items():
                for d, t in zip(dsend[p], ps, strict=True):
                    d.copy_(t)
        ready = None
        if explicit:
            ready = torch.cuda.Event()
            ready.record(producer)
        matrix = _plan(step, world, most)[0].numpy() if step % 2 else None
        got = eng.exchange(dsend, recv, dtype=dtype, device=dev, op=f"ipc step {step}", matrix=matrix, ready=ready,
                           consumer=consumer if explicit else None)
        if explicit:
            # Read on the consumer stream only: it was made to wait for the copies.
            with torch.cuda.stream(consumer):
                got = {q: t * 1 for q, t in got.items()}
        kept.append((got, expect, dtype))
    # Back-to-back matrix exchanges (no start barrier) behind a slow reader, under the sync debug mode: only the
    # halves' events keep the producer's writes off what the reader has not copied out yet, and nothing in the
    # exchange waits on the host (the inboxes are large enough already, so they do not grow).
    args = [_full_args(step, rank, world, 1 << 14) for step in range(500, 506)]
    dargs = [({p: [t.to(dev) for t in ps] for p, ps in s_.items()}, r_, e_, m_) for s_, r_, e_, m_ in args]
    torch.cuda.synchronize()
    grows = eng.grows
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, (s_, r_, e_, m_) in enumerate(dargs):
            got = eng.exchange(s_, r_, dtype=torch.float32, device=dev, op=f"ipc matrix {i}",
                               matrix=m_ if i % 2 else None)
            kept.append((got, e_, torch.float32))
        out["no_host_sync"] = True
    except RuntimeError as exc:
        out["no_host_sync"] = str(exc)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out["no_growth_in_sync_check"] = eng.grows == grows
    # From a worker thread while the main thread runs GEMMs on its stream; ready recorded and results read there.
    main = torch.cuda.current_stream(dev)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="copy") as pool:
        for step in range(600, 603):
            s_, r_, e_, m_ = _full_args(step, rank, world, 5000)
            ds = {p: [t.to(dev) for t in ps] for p, ps in s_.items()}
            ready = torch.cuda.Event()
            ready.record(main)
            fut = pool.submit(eng.exchange, ds, r_, dtype=torch.float32, device=dev, op=f"thread {step}",
                              matrix=m_ if step % 2 else None, ready=ready, consumer=main)
            a = torch.randn(2048, 2048, device=dev)
            for _ in range(8):
                a = a @ a / 64
            got = fut.result(timeout=120)
            kept.append(({q: t * 1 for q, t in got.items()}, e_, torch.float32))
    torch.cuda.synchronize()
    out["steps"] = [_same({q: t.cpu() for q, t in a.items()}, e, d) and all(t.device == dev for t in a.values())
                    for a, e, d in kept]
    out["grows"] = eng.grows
    out["exchanges"] = eng.exchanges == 9 + sum(bool(_plan(step, world, most)[0].any())
                                                for step, (_, most) in enumerate(STEPS + STEPS[:3]))
    eng.close()
    eng.close()
    return out


@pytest.mark.gpu
def test_ipc_engine_one_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    results = run_dist(_ipc_cases, 2, timeout_s=300, backend="gloo", collective_timeout_s=GPU_COLLECTIVE_S)
    for rank, res in enumerate(results):
        assert res["kind"] and res["no_host_sync"] is True and res["no_growth_in_sync_check"], (rank, res)
        assert all(res["steps"]) and res["grows"] >= 3 and res["exchanges"], (rank, res)


def _one_gpu_each_cases(rank: int, world: int, kind: str) -> dict:
    """One GPU per process: the nccl or nvshmem engine against the seed on the agreed and known-matrix paths."""
    from feplb.control import Control
    from feplb.copy import make_copy_engine
    from feplb.transport import make_transport

    dev = torch.device("cuda", torch.cuda.current_device())
    ctl = Control(None, world)
    transport = make_transport("nvshmem" if kind == "nvshmem" else "torch", None, ctl)   # nvshmem: initialises it
    eng = make_copy_engine(kind, dev, ctl, transport_kind=transport.name)
    out = {"kind": eng.name == kind, "steps": []}
    for step, (dtype, most) in enumerate(STEPS + STEPS[:3]):
        send, recv, expect = _step_args(step, rank, world, dtype, most)
        dsend = {p: [t.to(dev) for t in ps] for p, ps in send.items()}
        matrix = _plan(step, world, most)[0].numpy() if step % 2 else None
        got = eng.exchange(dsend, recv, dtype=dtype, device=dev, op=f"{kind} step {step}", matrix=matrix)
        out["steps"].append(_same({q: t.cpu() for q, t in got.items()}, expect, dtype))
    eng.close()
    transport.close()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nccl", "nvshmem"])
def test_cuda_engines_one_gpu_each(kind):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (one process per GPU)")
    if kind == "nvshmem":
        try:
            nvshmem_modules()
        except Exception as exc:  # noqa: BLE001 - nvshmem4py's own import (feplb's modules are imported above)
            cause = exc.__cause__ or exc
            pytest.skip(f"NVSHMEM unavailable: {type(cause).__name__}: {cause} (pip install 'feplb[nvshmem]')")
    world = min(torch.cuda.device_count(), 4)
    for rank, res in enumerate(run_dist(_one_gpu_each_cases, world, kind, backend="nccl", timeout_s=300,
                                        collective_timeout_s=GPU_COLLECTIVE_S)):
        assert res["kind"] and all(res["steps"]), (rank, res)


def _killed_in_setup_worker(rank, world, shm_dir):
    """Rank 1 is killed (SIGKILL: no cleanup of its own) while its peers agree on the new inboxes' names."""
    import signal

    import feplb.copy as ce
    from feplb.control import Control

    ctl = Control(None, world)
    if rank == 1:
        agree = ce.ShmCopyEngine._agree_setup

        def die(self, *args, **kwargs):
            if "inbox names" in args[2]:
                os.kill(os.getpid(), signal.SIGKILL)
            return agree(self, *args, **kwargs)

        ce.ShmCopyEngine._agree_setup = die
    ce.ShmCopyEngine(ctl, shm_dir=shm_dir)


def test_a_rank_killed_in_setup_leaves_no_inbox_file(tmp_path):
    from feplb.testing import DistError

    shm_dir = f"/dev/shm/feplb-test-killed-{os.getpid()}"
    os.makedirs(shm_dir)
    try:
        with pytest.raises(DistError, match="rank 1"):
            run_dist(_killed_in_setup_worker, 2, shm_dir, timeout_s=60, collective_timeout_s=5)
        assert os.listdir(shm_dir) == [], "the killed rank's inbox stayed behind"
    finally:
        for name in os.listdir(shm_dir):
            os.unlink(os.path.join(shm_dir, name))
        os.rmdir(shm_dir)
