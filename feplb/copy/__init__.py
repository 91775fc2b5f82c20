"""Phase-2 copy path: flat buffers between the GPUs (or CPU processes) of one node, one class per mechanism.

Engines, by ``make_copy_engine(kind, device, control)``:

* ``"gloo"`` ``GlooCopyEngine`` (CPU tensors): one ``all_to_all_single`` inside the node's gloo group; every byte
  goes through gloo's TCP pairs (``feplb.copy.gloo``).
* ``"shm"`` ``ShmCopyEngine`` (CPU tensors): peer tensors in POSIX shared memory, the peer-tensor protocol
  (``feplb.copy.shm``, ``feplb.copy.peer``).
* ``"ipc"`` ``IpcCopyEngine`` (CUDA tensors): peer tensors shared through CUDA IPC, the same protocol; a sender's
  writes are ``cudaMemcpyAsync`` calls into the peer's memory on the engine's copy stream, i.e. copy-engine DMA
  over NVLink between GPUs, no SM work; ordering across processes by interprocess CUDA events
  (``feplb.copy.ipc``).
* ``"nvshmem"`` ``NvshmemCopyEngine`` (CUDA tensors): on-stream puts with signals into symmetric inboxes
  (nvshmem4py), one node = the whole job, one GPU per process (``feplb.copy.nvshmem``).
* ``"nccl"`` ``NcclCopyEngine`` (CUDA tensors): one ``all_to_all`` over NCCL inside the node on the copy stream
  (correct, but that copy runs on SMs; ``feplb.copy.nccl``).

Every engine has the interface of ``CopyEngine.exchange`` (``feplb.copy.base``): per-peer lists of pieces in,
{source: tensor} out, an optional known split matrix, and on CUDA a ``ready`` event the copies wait for and a
``consumer`` stream made to wait for them, with no host sync. The control plane (size agreement, barriers, setup
handshakes) is the EP group's ``feplb.control.Control``, over gloo. Every rank of a node calls ``exchange`` in the
same order (it is collective inside the node); pairs across nodes are never handled here (the layer sends those
through the transport).
"""

from __future__ import annotations

import warnings

import torch

from feplb.control import Control
from feplb.copy.base import CopyEngine, PeerMemoryUnavailable
from feplb.copy.gloo import GlooCopyEngine
from feplb.copy.ipc import IpcCopyEngine
from feplb.copy.nccl import NcclCopyEngine
from feplb.copy.nvshmem import NvshmemCopyEngine
from feplb.copy.peer import PeerInboxEngine
from feplb.copy.shm import ShmCopyEngine
from feplb.transport import (
    NVSHMEM_HINT,
    TRANSPORTS,
    Shares,
    nvshmem_initialized,
    nvshmem_modules,
    nvshmem_shared_gpu,
)

__all__ = ["COPY_KINDS", "CopyEngine", "GlooCopyEngine", "IpcCopyEngine", "NcclCopyEngine", "NvshmemCopyEngine",
           "PeerInboxEngine", "PeerMemoryUnavailable", "ShmCopyEngine", "make_copy_engine", "release_copy_engine",
           "shared_copy_engine"]

COPY_KINDS = ("auto", "gloo", "shm", "nvshmem", "ipc", "nccl")
_CPU_KINDS = ("gloo", "shm")
_CUDA_KINDS = ("nvshmem", "ipc", "nccl")
_ENGINES = {"gloo": GlooCopyEngine, "shm": ShmCopyEngine, "ipc": IpcCopyEngine, "nvshmem": NvshmemCopyEngine,
            "nccl": NcclCopyEngine}


def _nvshmem_fits(control: Control) -> bool:
    """nvshmem4py imports, is initialised, the node is the whole job and each process has its own GPU."""
    import torch.distributed as dist

    try:
        core, _ = nvshmem_modules()
    except ImportError:
        return False
    return (control.gpus_per_node == dist.get_world_size() and nvshmem_initialized(core)
            and not nvshmem_shared_gpu(core))


def make_copy_engine(kind: str, device: torch.device | str, control: Control, *,
                     transport_kind: str = "torch") -> CopyEngine:
    """The copy path for tensors on ``device`` (collective inside the node).

    Args:
        kind: ``"auto"``: CPU -> ``"shm"``, or ``"gloo"`` (with a warning) when the node's ranks cannot share
            memory; CUDA -> ``"nvshmem"`` when ``transport_kind`` is ``"nvshmem"`` (which initialised it) and the
            node is the whole job with one GPU per process, else ``"ipc"``, or ``"nccl"`` (with a warning) when
            CUDA IPC fails on the node. ``"gloo"``, ``"shm"``: CPU only.  ``"ipc"``, ``"nvshmem"``, ``"nccl"``:
            CUDA only. See the package docstring.
        device: where the exchanged tensors live (``cuda`` without an index: the current device).
        control: the EP group's ``Control``; its node is the engine's.
        transport_kind: the phase-1 transport's name (``feplb.transport.TRANSPORTS``).
    Raises:
        ValueError: unknown kind, or one that does not fit ``device``.
        ImportError: ``"nvshmem"`` without nvshmem4py.  PeerMemoryUnavailable: ``"shm"`` / ``"ipc"`` setup failed.
    """
    if kind not in COPY_KINDS:
        raise ValueError(f"copy path kind must be one of {COPY_KINDS}, got {kind!r}")
    if transport_kind not in TRANSPORTS:
        raise ValueError(f"transport_kind must be one of {TRANSPORTS}, got {transport_kind!r}")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"no copy path for device type {device.type!r} (expected 'cpu' or 'cuda'); {NVSHMEM_HINT}")
    fits = _CPU_KINDS if device.type == "cpu" else _CUDA_KINDS
    if kind != "auto" and kind not in fits:
        raise ValueError(f"copy path kind {kind!r} does not move {device.type} tensors; for {device.type} use one of "
                         f"{('auto', *fits)}")
    if kind == "gloo":
        return GlooCopyEngine(control)
    if kind == "shm":
        return ShmCopyEngine(control)
    if kind != "auto":
        return _ENGINES[kind](control, device)
    if device.type == "cpu":
        try:
            return ShmCopyEngine(control)
        except PeerMemoryUnavailable as exc:
            warnings.warn(f"feplb: falling back to the gloo copy path: {exc}", RuntimeWarning, stacklevel=2)
            return GlooCopyEngine(control)
    if transport_kind == "nvshmem" and _nvshmem_fits(control):
        return NvshmemCopyEngine(control, device)
    try:
        return IpcCopyEngine(control, device)
    except PeerMemoryUnavailable as exc:
        warnings.warn(f"feplb: falling back to the nccl copy path: {exc}", RuntimeWarning, stacklevel=2)
        return NcclCopyEngine(control, device)


_SHARED = Shares()     # the layers' engines, one per (kind, device, EP group, node), each with its own Control


def shared_copy_engine(kind: str, device: torch.device | str, control: Control, *,
                       transport_kind: str = "torch") -> CopyEngine:
    """``make_copy_engine``'s engine for a layer, shared with the other layers of this process over the same ranks
    (``feplb.transport.Shares``; collective inside the EP group when it makes one). Give it back with
    :func:`release_copy_engine`, not ``close()``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    def make() -> tuple[CopyEngine, object]:
        own = Control(control.ep_group, control.gpus_per_node)
        try:
            engine = make_copy_engine(kind, device, own, transport_kind=transport_kind)
        except BaseException:
            own.close()
            raise

        def close() -> None:
            engine.close()
            own.close()

        return engine, close

    # (the group itself: one made after destroy_process_group is another, whatever its ranks)
    key = (kind, transport_kind, str(device), control.ep_group, tuple(control.node_ranks))
    return _SHARED.take(key, make)


def release_copy_engine(engine: CopyEngine) -> None:
    """A layer's :func:`shared_copy_engine` given back (closed with its last user; one not shared, at once)."""
    if not _SHARED.give(engine):
        engine.close()
