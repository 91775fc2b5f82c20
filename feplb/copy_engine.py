"""The phase-2 copy path under its historical name: everything lives in ``feplb.copy`` (one module per mechanism,
the interface in ``feplb.copy.base``, the peer-tensor protocol in ``feplb.copy.peer``)."""

from feplb.copy import (
    COPY_KINDS,
    CopyEngine,
    GlooCopyEngine,
    IpcCopyEngine,
    NcclCopyEngine,
    NvshmemCopyEngine,
    PeerInboxEngine,
    PeerMemoryUnavailable,
    ShmCopyEngine,
    make_copy_engine,
)

__all__ = ["COPY_KINDS", "CopyEngine", "GlooCopyEngine", "IpcCopyEngine", "NcclCopyEngine", "NvshmemCopyEngine",
           "PeerInboxEngine", "PeerMemoryUnavailable", "ShmCopyEngine", "make_copy_engine"]
