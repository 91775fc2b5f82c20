"""Phase-1 transport, copy path and differentiable exchanges on 4 gloo processes (2 nodes x 2 GPUs), against what
each rank can compute alone from the shared seed; the torch transport over gloo with CUDA tensors (staged through
host memory) as 2 processes on one GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feplb.testing import error_of, run_dist

pytestmark = pytest.mark.dist


def _a2a_case(tr, rank: int, world: int, seed: int, device: torch.device) -> dict:
    """Uneven all-to-all (rank W/2 sends nothing), its backward, the known split matrix and out=, checked against
    the blocks every rank derives from ``seed``."""
    from feplb.dispatch import all_to_all_rows

    out = {}
    gen = torch.Generator().manual_seed(seed)
    splits_WW = torch.randint(0, 4, (world, world), generator=gen)
    splits_WW[world // 2] = 0
    data = [torch.randn(int(splits_WW[s].sum()), 3, generator=gen) for s in range(world)]
    expect = torch.cat([data[s][int(splits_WW[s, :rank].sum()):int(splits_WW[s, :rank + 1].sum())]
                        for s in range(world)])
    x = data[rank].clone().to(device).requires_grad_(True)
    recv = all_to_all_rows(x, tr, splits_WW[rank].tolist(), splits_WW[:, rank].tolist())
    out["a2a"] = recv.device == x.device and torch.equal(recv.detach().cpu(), expect)
    (recv * (rank + 1)).sum().backward()
    # Row of source s sent to rank d gets gradient (d + 1).
    want = torch.cat([torch.full((int(splits_WW[rank, d]), 3), float(d + 1)) for d in range(world)])
    out["a2a_grad"] = torch.equal(x.grad.cpu(), want)

    # A known split matrix (as the layer derives it from the all-gathered counts), into a larger out= buffer.
    buf = torch.full((int(splits_WW[:, rank].sum()) + 2, 3), float("nan"), device=device)
    recv_m = tr.all_to_all(data[rank].to(device), splits_WW[rank].tolist(), splits_WW[:, rank].tolist(), out=buf,
                           split_matrix=splits_WW)
    out["a2a_matrix"] = torch.equal(recv_m.cpu(), expect) and recv_m.data_ptr() == buf.data_ptr()
    wrong = splits_WW.clone()
    wrong[rank, (rank + 1) % world] += 1
    err = error_of(lambda: tr.all_to_all(data[rank].to(device), splits_WW[rank].tolist(), splits_WW[:, rank].tolist(),
                                         split_matrix=wrong))
    out["a2a_matrix_refused"] = (err or "").startswith("ValueError") and "split_matrix" in err
    return out


def _comm_cases(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from feplb.control import Control
    from feplb.copy import GlooCopyEngine
    from feplb.dispatch import Exchange, PeerComm
    from feplb.layout import Item
    from feplb.transport import TorchTransport, make_transport

    g = 2
    ctl = Control(None, g)
    tr = make_transport("torch", None, ctl)
    comm = PeerComm(tr, GlooCopyEngine(ctl), g)
    out = {"kind": type(tr) is TorchTransport and tr.name == "torch"}
    # The transport moves data only: the control collectives live in Control.
    out["data_only"] = not any(hasattr(tr, a) for a in ("all_gather_counts", "all_reduce_min", "check_same"))
    out.update(_a2a_case(tr, rank, world, 0, torch.device("cpu")))

    # Bad splits: refused before any collective, naming what is wrong.
    x = torch.zeros(3, 2)
    bad = {
        "count": (lambda: tr.all_to_all(x, [3, 0, 0], [0] * world), "4 entries"),
        "sum": (lambda: tr.all_to_all(x, [1, 1, 0, 0], [0] * world), "sum to 2 but send_MD has 3 rows"),
        "negative": (lambda: tr.all_to_all(x, [4, -1, 0, 0], [0] * world), ">= 0"),
        "small_out": (lambda: tr.all_to_all(x, [3, 0, 0, 0], [1] * world, out=torch.empty(2, 2)), "cannot hold 4"),
        "name": (lambda: make_transport("tcp", None, ctl), "'tcp'"),
    }
    for name, (fn, needle) in bad.items():
        err = error_of(fn)
        out[f"bad_{name}"] = (err or "").startswith("ValueError") and needle in err

    # Exchange: every rank sends (rank*10 + dst) repeated (dst+1+rank) times to every other rank, intra + cross node.
    def block(src: int, dst: int) -> torch.Tensor:
        return torch.full((dst + 1 + src,), float(src * 10 + dst))

    peers = [p for p in range(world) if p != rank]
    w = torch.zeros(1, requires_grad=True)
    flat = torch.cat([block(rank, p) for p in peers]) + w
    items = [Item(s, d, block(s, d).numel()) for s in range(world) for d in range(world) if s != d]
    ex = Exchange(comm, items, dtype=torch.float32, device=torch.device("cpu"), op="test exchange")
    mine = [k for k, it in enumerate(items) if it.src == rank]
    cuts = np.cumsum([0] + [items[k].numel for k in mine])
    rcv = ex(ex.sends_of({k: flat[cuts[i]:cuts[i + 1]] for i, k in enumerate(mine)}), w[:0])
    got = torch.cat([rcv.items[k] for k, it in enumerate(items) if it.dst == rank])
    out["exchange"] = torch.equal(got, torch.cat([block(q, rank) for q in peers]))
    (got * 2).sum().backward()
    out["exchange_grad"] = float(w.grad) == 2.0 * flat.numel()

    # PeerComm.run with several pieces per peer, intra- and cross-node: each peer gets its pieces back to back.
    pieces = {p: [block(rank, p)[:1], block(rank, p)[1:2], block(rank, p)[2:]] for p in peers}
    got = comm.run(pieces, {q: block(q, rank).numel() for q in peers}, cross_node=True, dtype=torch.float32,
                   device=torch.device("cpu"), op="pieces")
    out["run_pieces"] = sorted(got) == peers and all(torch.equal(got[q], block(q, rank)) for q in peers)

    # Intra-node only: the copy path alone.
    node_peer = ctl.node_ranks[1] if rank == ctl.node_ranks[0] else ctl.node_ranks[0]
    t = torch.arange(4.0) + 100 * rank
    all_pairs = [Item(a, b, 4) for a in range(world) for b in range(world)
                 if a != b and a // ctl.gpus_per_node == b // ctl.gpus_per_node]
    ex = Exchange(comm, all_pairs, dtype=torch.float32, device=torch.device("cpu"), op="intra")
    out["intra_only"] = ex.layout.intra_node and not ex.layout.cross_node
    k_out = next(k for k, it in enumerate(all_pairs) if it.src == rank)
    k_in = next(k for k, it in enumerate(all_pairs) if it.dst == rank)
    got = ex(ex.sends_of({k_out: t}), t[:0]).items[k_in]
    out["intra"] = torch.equal(got, torch.arange(4.0) + 100 * node_peer)

    # The transport and the copy path run outside selective activation checkpointing's dispatch modes: communication,
    # no part of the computation (their callers' autograd nodes are), whose buffers, made and written in there, a
    # policy saving every op would cache and then refuse the writes. Any other mode (CommDebugMode, a memory
    # tracker) sees them.
    from functools import partial

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(world, 3, generator=torch.Generator().manual_seed(rank))
    t2 = t[:2]
    lp = ctl.node_ranks.index(node_peer)   # (the copy path names the node's GPUs by their place in it)

    want = torch.cat([torch.arange(4.0) + 100 * node_peer, torch.arange(2.0) + 100 * node_peer])

    def communicate(tag: str):
        y = tr.all_to_all(x, [1] * world, [1] * world)
        got = comm.copy.exchange({lp: [t, t2]}, {lp: 6}, dtype=torch.float32, device=torch.device("cpu"),
                                 op=f"under a mode, {tag}")
        probe = x.sum()   # (the modes do see the computation)
        return y, got, probe

    def right(y, got, probe) -> bool:
        return y.shape == (world, 3) and probe.shape == () and got[lp].equal(want)

    with Seen() as seen:
        res = communicate("plain")
    ok = right(*res)
    out["modes_see_communication"] = ok and "c10d.alltoall_base_.default" in seen.ops \
        and "aten.sum.default" in seen.ops, seen.ops
    save_all = partial(create_selective_checkpoint_contexts, lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE)
    sac, _ = save_all()
    with Seen() as around, sac, Seen() as inside:
        res = communicate("selective checkpoint")
    ok = right(*res)
    # (the outer mode also sees what the checkpoint's mode does with the probe: it saves a detached copy)
    out["outside_selective_checkpoint"] = ok and inside.ops == ["aten.sum.default"] \
        and set(around.ops) == {"aten.sum.default", "aten.detach.default"}, (inside.ops, around.ops)
    tr.close()
    dist.barrier()
    return out


def test_comm_paths():
    results = run_dist(_comm_cases, 4, timeout_s=120)
    for rank, res in enumerate(results):
        failed = {k: v for k, v in res.items() if not (v[0] if isinstance(v, tuple) else v)}
        assert not failed, (rank, failed)


def _staged_cases(rank: int, world: int) -> dict:
    """2 processes on GPU 0 over gloo: CUDA rows through the torch transport (staged through pinned host memory)."""
    from feplb.control import Control
    from feplb.transport import make_transport

    torch.cuda.set_device(0)
    ctl = Control(None, world)
    tr = make_transport("torch", None, ctl)
    out = {}
    for seed in range(3):
        for k, v in _a2a_case(tr, rank, world, 10 + seed, torch.device("cuda", 0)).items():
            out[f"{k}_{seed}"] = v
    return out


@pytest.mark.gpu
def test_torch_transport_gloo_cuda_staged():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # The first CUDA calls (context, kernels) differ in time between ranks: give collectives room.
    for rank, res in enumerate(run_dist(_staged_cases, 2, timeout_s=300, backend="gloo", collective_timeout_s=120)):
        assert all(res.values()), (rank, res)


def test_nvshmem_host_library_loaded_through_pathfinder(monkeypatch):
    """nvshmem4py's bindings open libnvshmem_host by name: feplb loads it first through cuda.pathfinder when that
    is installed (its path is returned), and goes on quietly without it or when the library is not found."""
    import sys
    import types

    from feplb import transport

    def load(name):
        calls.append(name)
        if found is None:
            raise RuntimeError(f"{name} not found")
        return types.SimpleNamespace(abs_path=found)

    calls, found = [], "/site/nvidia/nvshmem/lib/libnvshmem_host.so.3"
    cuda_pkg = types.ModuleType("cuda")
    cuda_pkg.__path__ = []
    monkeypatch.setitem(sys.modules, "cuda", cuda_pkg)
    monkeypatch.setitem(sys.modules, "cuda.pathfinder", types.SimpleNamespace(load_nvidia_dynamic_lib=load))
    transport._load_nvshmem_host.cache_clear()
    assert transport._load_nvshmem_host() == found and calls == ["nvshmem_host"]
    transport._load_nvshmem_host.cache_clear()
    found = None
    assert transport._load_nvshmem_host() is None and calls == ["nvshmem_host"] * 2
    transport._load_nvshmem_host.cache_clear()
    monkeypatch.setitem(sys.modules, "cuda.pathfinder", None)  # not installed: the import fails
    assert transport._load_nvshmem_host() is None and len(calls) == 2
    transport._load_nvshmem_host.cache_clear()


def _nvshmem_users(rank, world):
    """NvshmemTransport's life over a stand-in for nvshmem4py (no GPU here): what it calls, in order."""
    import types

    import feplb.transport as T
    from feplb.control import Control

    log = []
    status = types.SimpleNamespace(STATUS_NOT_INITIALIZED=0, STATUS_IS_INITIALIZED=1, STATUS_LIMITED_MPG=2,
                                   STATUS_FULL_MPG=3)

    class Core:
        InitStatus = status
        up = False

        def init_status(self):
            return status.STATUS_IS_INITIALIZED if self.up else status.STATUS_NOT_INITIALIZED

        def get_unique_id(self):
            return b"uid"

        def init(self, **kw):
            self.up = True
            log.append("init")

        def finalize(self):
            self.up = False
            log.append("finalize")

        def free_tensor(self, t):
            log.append("free" if self.up else "free after finalize")

    core = Core()
    T.nvshmem_modules = lambda: (core, None)
    T._cuda_core_device = lambda i: types.SimpleNamespace(set_current=lambda: None)
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a: None
    ctl = Control(None, world)
    first, second = T.NvshmemTransport(None, ctl), T.NvshmemTransport(None, ctl)   # two layers, in model order
    for t in (first, second):
        t._buf = t._sbuf = torch.empty(1)        # both ran a forward
    first.close()
    log.append("|")
    second.close()
    log.append("|")
    again = T.NvshmemTransport(None, ctl)        # a layer built after all were closed starts it again
    again.close()
    log.append("|")
    group = torch.distributed.group.WORLD        # layers share one transport: one pair of buffers, not one each
    first, second = T.shared_transport("nvshmem", group, ctl), T.shared_transport("nvshmem", group, ctl)
    log.append(first is second)
    first._buf = first._sbuf = torch.empty(1)
    T.release_transport(first)
    log.append("|")
    T.release_transport(second)
    log.append("|")
    core.up = True                               # initialised by the application: never finalised here
    T.NvshmemTransport(None, ctl).close()
    return log


def test_nvshmem_is_finalised_by_the_last_transport_to_close():
    """A layer closed while others still use nvshmem (the first one built, closing in model order) must not
    finalise it under them; the last one does, and only when this runtime initialised it."""
    for log in run_dist(_nvshmem_users, 2, timeout_s=120):
        assert log == ["init", "free", "free", "|", "free", "free", "finalize", "|", "init", "finalize", "|",
                       "init", True, "|", "free", "free", "finalize", "|"], log
