"""Host-side control collectives of one EP group, in one place.

Everything the runtime agrees on before or beside moving data goes through ``Control``: the per-step counts
all-gather, readiness and consistency agreements (``all_reduce_min``), config checks (``check_same``), the copy
path's size agreements, setup handshakes and end-of-writes barriers. It all runs over small CPU ``int64`` tensors
(or picklable objects, for setup) in GLOO groups, so no control step ever launches a device kernel, copies a flag
to or from a GPU, or waits for a stream: on a GPU the host decides while the device computes.

Groups. ``Control(group, gpus_per_node)`` is collective over the EP group's ranks. It reuses the EP group when its
backend speaks gloo (``"gloo"`` or ``"cpu:gloo,cuda:nccl"``), else creates a gloo group over the same ranks; and it
creates the gloo group of this rank's node (node n holds EP ranks ``n*G .. n*G+G-1``; with one node it is the EP
control group itself). Created groups inherit the EP group's timeout, so a stall fails after the same time on
every path.

Errors. Every collective runs under ``guard(op)``: a backend timeout becomes a ``TimeoutError`` naming the
operation and the rank, a peer that vanished a ``RuntimeError``, instead of a hang or an opaque gloo message (the
timeout itself is the process group's, ``init_process_group(timeout=...)`` or ``new_group(timeout=...)``). One
stalled rank can give both: the ranks that wait out the timeout raise ``TimeoutError``, and one whose ring partner
gave up first sees it close the connection and raises ``RuntimeError``; both messages name the operation.
Agreements are built so that a problem on one rank raises on every rank together (``check_same``; the callers'
flag columns in ``all_gather`` rows).

Threads. Calls may come from any thread (the layer's copy thread issues the copy path's collectives), one thread
at a time per group: a lock per group serialises calls within this process, but the ORDER of collectives on a
group must still be the same on every rank, which is the callers' contract.

Legend: W ranks in the EP group, G ranks per node, N entries of a row.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import threading
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = ["SCOPES", "Control", "group_timeout", "guard"]

SCOPES = ("node", "group")
_TIMEOUT_MARKERS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "peer")


@contextlib.contextmanager
def guard(op: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Re-raise a communication failure inside the block as ``TimeoutError`` (stall) or ``RuntimeError`` (peer gone)
    whose message names ``op`` and this rank."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc).lower()
        if not any(m in text for m in _TIMEOUT_MARKERS):
            raise
        rank = dist.get_rank() if dist.is_initialized() else -1
        size = dist.get_world_size(group) if dist.is_initialized() else -1
        kind = TimeoutError if ("timed out" in text or "timeout" in text) else RuntimeError
        raise kind(f"feplb: {op} failed on global rank {rank} (group of {size}): a peer died or stalled "
                   "past the process group's timeout (or ran fewer forwards of the model: every rank must run every "
                   "forward, evaluation included; or abandoned a backward that raised on it alone: the layers' "
                   f"backwards are collective too); backend said: {str(exc).splitlines()[0][:300]}") from exc


def group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta | None:
    """The collective timeout of ``group`` (None when the backend does not say: torch's default applies)."""
    pg = group if group is not None else dist.group.WORLD
    for dev in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(dev)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


# The gloo groups Controls made, by (ranks, timeout): every layer over the same ranks shares one (a group per layer
# held its sockets and threads until destroy_process_group, however many layers were closed). A group dropped by
# destroy_process_group is made anew. One lock per group: a group's collectives, from any layer or thread, one at a
# time.
_GROUPS: dict[tuple, dist.ProcessGroup] = {}
_GROUPS_LOCK = threading.Lock()
# (held weakly: a lock kept a group destroyed by destroy_process_group alive, with its sockets, after its layers
# were closed; the default group, None, has one lock of its own)
_LOCKS: weakref.WeakKeyDictionary[dist.ProcessGroup, threading.Lock] = weakref.WeakKeyDictionary()
_DEFAULT_LOCK = threading.Lock()


def _lock_of(group: dist.ProcessGroup | None) -> threading.Lock:
    if group is None:
        return _DEFAULT_LOCK
    with _GROUPS_LOCK:
        return _LOCKS.setdefault(group, threading.Lock())


def _registered(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):
        return False
    return True


def _smaller_group_hint(gpus_per_node: object, world: int) -> str:
    """What to pass instead where ``gpus_per_node`` is a node's GPU count larger than the EP group."""
    if isinstance(gpus_per_node, int) and not isinstance(gpus_per_node, bool) and gpus_per_node > world:
        return (f" (it counts the EP group's ranks on one node, in the group's order: an EP group of {world} ranks "
                f"within one node of {gpus_per_node} GPUs is gpus_per_node={world})")
    return ""


def _speaks_gloo(group: dist.ProcessGroup | None) -> bool:
    return "gloo" in str(dist.get_backend(group))


class Control:
    """The control plane of one EP group (see the module docstring). Constructing it is collective over the group.

    Args:
        group: the EP process group (None: the default group), any backend.
        gpus_per_node: G, ranks per node; must divide the group size.
    Attributes:
        rank, world_size: this rank's index in the EP group, W.  ranks: the EP group's GLOBAL ranks, in group
        order.  gpus_per_node: G.
        group: the gloo control group over the EP group's ranks.  ep_group: the group given.
        node_group: the gloo group of this rank's node.  node_ranks: the node's GLOBAL ranks, in node order.
        node_rank: this rank's index in its node (0..G-1).
    """

    def __init__(self, group: dist.ProcessGroup | None, gpus_per_node: int):
        if not dist.is_initialized():
            raise RuntimeError("feplb: torch.distributed is not initialised; call init_process_group first")
        world = dist.get_world_size(group)
        valid = not isinstance(gpus_per_node, bool) and isinstance(gpus_per_node, int) and gpus_per_node >= 1 \
            and world % gpus_per_node == 0
        self.ep_group = group
        self.rank = dist.get_rank(group)
        self.world_size = world
        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        self.ranks = tuple(ranks)
        timeout = group_timeout(group)
        if _speaks_gloo(group):
            self.group = group
        else:
            # Only the EP group's ranks create it (local synchronisation): the EP group may be a subgroup of the job.
            self.group = self._new_group(ranks, timeout)
        self._locks = {id(self.group): _lock_of(self.group)}
        self._closed = False
        # Every rank must cut the group into the same nodes before any rank creates its node's group (a rank that
        # disagrees would leave its peers waiting in the group creation): agreed here, raised on every rank.
        mine = gpus_per_node if valid else -1
        got = self.all_gather(torch.tensor([mine], dtype=torch.int64), "agreement on gpus_per_node")[:, 0].tolist()
        if not valid:
            raise ValueError(f"gpus_per_node must be a positive int dividing the EP group size ({world}), "
                             f"got {gpus_per_node!r}" + _smaller_group_hint(gpus_per_node, world))
        if len(set(got)) != 1:
            raise ValueError(f"gpus_per_node differs across the ranks of the EP group (per rank, -1 = invalid: "
                             f"{got}); every rank must pass the same value")
        self.gpus_per_node = gpus_per_node
        self.node_rank = self.rank % gpus_per_node
        node = self.rank // gpus_per_node
        self.node_ranks = ranks[node * gpus_per_node:(node + 1) * gpus_per_node]
        if world == gpus_per_node:
            self.node_group = self.group
        else:
            self.node_group = self._new_group(self.node_ranks, timeout)
        self._locks.setdefault(id(self.node_group), _lock_of(self.node_group))

    def _new_group(self, ranks: list[int], timeout) -> dist.ProcessGroup:
        """The gloo group of ``ranks`` (made by them alone, or shared with an earlier Control: every rank of
        ``ranks`` has made the same Controls over them, so they all find it or all make it)."""
        key = (tuple(ranks), timeout)
        g = _GROUPS.get(key)
        if g is not None and _registered(g):
            return g
        kw = {} if timeout is None else {"timeout": timeout}
        g = _GROUPS[key] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True, **kw)
        return g

    # -- helpers ------------------------------------------------------------------------------------------------------
    def _scope(self, scope: str) -> dist.ProcessGroup | None:
        if self._closed:
            raise RuntimeError("feplb: this Control was closed (its MoE layer was closed: close(), the end of a "
                               "`with layer:` block, or the interpreter's exit); build a new layer")
        if scope == "node":
            return self.node_group
        if scope == "group":
            return self.group
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")

    @contextlib.contextmanager
    def collective(self, scope: str, op: str) -> Iterator[dist.ProcessGroup | None]:
        """``with control.collective(scope, op) as g:`` runs a collective of the caller's own on the gloo group of
        ``scope``, under this group's lock and ``guard(op)`` (the gloo copy path's data all-to-all)."""
        g = self._scope(scope)
        with self._locks[id(g)], guard(op, g):
            yield g

    @staticmethod
    def _check_row(t: torch.Tensor, name: str) -> None:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1 or t.device.type != "cpu":
            got = (f"{type(t).__name__}" if not isinstance(t, torch.Tensor)
                   else f"{t.dtype} {t.dim()}-D tensor on {t.device}")
            raise ValueError(f"Control: {name} must be a 1-D int64 CPU tensor (control never touches the device), "
                             f"got {got}")

    def size(self, scope: str) -> int:
        """Ranks in ``scope``: W for "group", G for "node"."""
        return dist.get_world_size(self._scope(scope))

    # -- collectives --------------------------------------------------------------------------------------------------
    def all_gather(self, row: torch.Tensor, op: str, *, scope: str = "group") -> torch.Tensor:
        """Every rank's ``row`` (int64 [N] CPU, the same N on every rank) -> int64 [W, N] (or [G, N] with
        scope="node"), row s from rank s of the scope."""
        self._check_row(row, "row")
        parts = [torch.empty_like(row) for _ in range(self.size(scope))]
        with self.collective(scope, op) as g:
            dist.all_gather(parts, row.contiguous(), group=g)
        return torch.stack(parts)

    def all_reduce_min(self, flags: torch.Tensor, scope: str, op: str) -> torch.Tensor:
        """Elementwise MIN over the ranks of ``scope`` ("node" or "group") of ``flags`` (int64 [N] CPU); returns a
        new tensor, ``flags`` is left as it was."""
        self._check_row(flags, "flags")
        out = flags.clone()
        with self.collective(scope, op) as g:
            dist.all_reduce(out, op=dist.ReduceOp.MIN, group=g)
        return out

    def all_gather_object(self, obj: object, scope: str, op: str) -> list:
        """Every rank's picklable ``obj``, in rank order (setup handshakes: file names, IPC handles, unique ids)."""
        got = [None] * self.size(scope)
        with self.collective(scope, op) as g:
            dist.all_gather_object(got, obj, group=g)
        return got

    def barrier(self, scope: str, op: str) -> None:
        """Wait until every rank of ``scope`` reached this call."""
        with self.collective(scope, op) as g:
            dist.barrier(group=g)

    def check_same(self, blob: bytes, what: str, hint: str = "", fields: dict[str, str] | None = None) -> None:
        """Raise ValueError on every rank of the group unless ``blob`` is byte-identical on all of them (one
        all-gather of a 56-bit hash). The message names ``what``, which ranks hold which version, and ``hint``;
        with ``fields`` (what ``blob`` is made of, by name, as text), also the fields that differ and each rank's
        value (a second all-gather, only where they differ: every rank sees that alike)."""
        if not isinstance(blob, bytes | bytearray):
            raise ValueError(f"Control.check_same: blob must be bytes, got {type(blob).__name__}")
        digest = int.from_bytes(hashlib.sha256(blob).digest()[:7], "little")
        allh = self.all_gather(torch.tensor([digest], dtype=torch.int64), f"consistency check of {what}")[:, 0]
        versions: dict[int, list[int]] = {}
        for r, h in enumerate(allh.tolist()):
            versions.setdefault(h, []).append(r)
        if len(versions) > 1:
            mine = versions[digest]
            others = [rs for h, rs in versions.items() if h != digest]
            detail = ""
            if fields is not None:
                got = self.all_gather_object(dict(fields), "group", f"consistency check of {what}: its fields")
                names = sorted({k for d in got for k in d}, key=lambda k: (k not in fields, k))
                apart = [k for k in names if len({d.get(k, "(none)") for d in got}) > 1]
                detail = "; " + "; ".join(f"{k}: " + ", ".join(f"rank {r} {d.get(k, '(none)')}"
                                                            for r, d in enumerate(got)) for k in apart[:8])
            raise ValueError(f"feplb: {what} differs across ranks: rank {self.rank} holds the version of ranks "
                             f"{mine}, ranks {others} hold other versions{detail}" + (f"; {hint}" if hint else ""))

    def close(self) -> None:
        """Stop using this control plane (local, idempotent; later calls raise RuntimeError). The gloo groups it
        uses stay, for the next Control over the same ranks, until ``destroy_process_group()``: a subgroup cannot be
        torn down by one rank while its peers may still be inside a collective on it."""
        self._closed = True

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
