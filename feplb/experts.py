"""Small pieces every step of the MoE layer shares: the gated experts over grouped rows, weights derived from
parameters that the backward derives again instead of keeping, host index arrays to the device without a blocking
copy, the hand-off of device work to a helper thread, the order of the backward (``EarlyBackward``), and
timeline spans."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from feplb.timeline import Timeline

__all__ = ["EarlyBackward", "derived_cast", "expert_mlp", "ready_event", "rebuilding_applies", "rebuilt_in_backward",
           "span", "to_device"]


def expert_mlp(x_MH: torch.Tensor, weights: tuple[torch.Tensor, ...], offsets_L: torch.Tensor,
               limit: float | None = None, act: str = "silu", alpha: float = 1.0,
               interleaved: bool = False, gated: bool = True,
               softcap: tuple[float, float] | None = None) -> torch.Tensor:
    """Experts over grouped rows: grouped_mm(x, w1) [+ b1] -> act(gate) * up -> grouped_mm(., w2) [+ b2], or
    act(.) for non-gated experts (``gated=False``: w1 [L, H, F]).

    x_MH: [M, H]; weights: (w1 [L, H, 2F], w2 [L, F, H]) or (w1, w2, b1 [L, 2F], b2 [L, H]) (``expert_bias``);
    offsets_L: int32/int64 [L] END offsets; limit: the clamp's limit, None for none; act, alpha, interleaved,
    gated, softcap: the activation (``FEPLBConfig.glu`` gives all six: ``swiglu_limit``, ``activation``,
    ``swiglu_alpha``, ``glu_interleaved``, ``gated``, ``glu_softcap``). Returns [M, H]
    in x's dtype: inside ``torch.autocast`` the GEMMs (and the SwiGLU between them) run in the autocast dtype, and
    their result is cast back, so the rows the layer exchanges keep the layer's dtype.
    """
    from feplb.kernels import autocast_matmul_inputs, glu, grouped_mm, mlp_act

    w1_LH2F, w2_LFH, *bias = weights
    if w1_LH2F.shape[0] == 0 and x_MH.shape[0] > 0:
        raise ValueError(f"expert_mlp: {x_MH.shape[0]} rows for no expert (weights of 0 experts)")
    if w1_LH2F.shape[0] == 0 or x_MH.shape[0] == 0:
        return x_MH.new_zeros((0, w2_LFH.shape[-1])) + (x_MH.sum() + sum(w.sum() for w in weights)) * 0
    # Inside torch.autocast the weights' casts are made here (grouped_mm then casts nothing) and declared derived:
    # in a rebuilt_in_backward block (received weights under recopy_weights) the backward casts the rebuilt
    # weights again instead of autograd keeping these casts from the forward to the backward.
    cast = autocast_matmul_inputs(w1_LH2F, w2_LFH)
    derived_cast(cast, (w1_LH2F, w2_LFH))   # (nothing outside a block, nor for a weight left as it was)
    w1_LH2F, w2_LFH = cast
    h = grouped_mm(x_MH, w1_LH2F, offsets_L, check=False)
    group_M = None
    if bias:   # each row's expert: the number of group ends at or before it (on the device, no host sync)
        group_M = torch.searchsorted(offsets_L, torch.arange(x_MH.shape[0], device=x_MH.device,
                                                             dtype=offsets_L.dtype), right=True)
        # in the wider of the two dtypes (under torch.autocast: a bf16 GEMM plus the fp32 bias, as a biased
        # F.linear's output would be promoted in eager code such as gpt-oss's)
        h = h + _RowBias.apply(bias[0], group_M)
    a = glu(h, limit, act, alpha, interleaved, softcap) if gated else mlp_act(h, act)
    y = grouped_mm(a, w2_LFH, offsets_L, check=False)
    if bias:
        y = y + _RowBias.apply(bias[1], group_M)
    return y if y.dtype == x_MH.dtype else y.to(x_MH.dtype)


class EarlyBackward:
    """Autograd nodes made now whose backward should run as if they were made later (``promote``).

    Autograd runs a ready node's backward before those of nodes made earlier (a higher sequence number first). The
    layer computes its static experts first in the forward, so that the copies run beside them; left alone, their
    backward would then come last in phase 2's backward: after the hosted rows' GEMMs and after the exchange that
    returns the gradients to their homes, which a home would wait for with nothing of its own queued. Promoted just
    before the results-home exchange is made, they run right after that exchange's backward has started (on the
    copy thread), beside its copies, as the static GEMM runs beside the forward's copies.

    Only the order of nodes that are ready together changes, never a dependency: ``capture`` records the nodes made
    on this thread between this object's making and the call that lead to a tensor, ``promote`` gives them all
    one new sequence number, above every node made before. What is computed is the same, except for the order in
    which a tensor's gradient sums three or more contributions (floating-point rounding); in the layer the static
    GEMM's contributions go to rows and weights no other GEMM of the micro-batch touches.
    """

    def __init__(self):
        self.start = fresh_sequence_nr() if torch.is_grad_enabled() else None
        self.nodes: list = []

    def capture(self, *ys: torch.Tensor) -> None:
        """The nodes made since ``__init__`` (on this thread) that ``ys`` were computed through."""
        stack = [y.grad_fn for y in ys if y.grad_fn is not None]
        if self.start is None or not stack:
            return
        end = fresh_sequence_nr()   # (other threads count their own: a node of theirs may lie in either range)
        seen = set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if self.start < node._sequence_nr() < end:
                self.nodes.append(node)
                stack.extend(f for f, _ in node.next_functions)

    def promote(self) -> None:
        """Give the captured nodes a new sequence number, above every node made so far on this thread (once)."""
        if self.nodes:
            n = fresh_sequence_nr()
            for node in self.nodes:
                node._set_sequence_nr(n)
            self.nodes = []


def fresh_sequence_nr() -> int:
    """A sequence number no other node takes: that of a node made (and dropped) for it, above every node made
    before on this thread and below every node made after."""
    with torch.enable_grad():
        return torch.empty(0, requires_grad=True).view(0).grad_fn._sequence_nr()


class _RowBias(torch.autograd.Function):
    """Each row's expert bias, ``bias_LN[group_M]``; the gradient summed in fp32 (fp64 for fp64) and rounded to the
    bias's dtype once (``index_select``'s own backward adds in the bias's dtype: bf16 atomics on a GPU round after
    every row)."""

    @staticmethod
    def forward(bias_LN: torch.Tensor, group_M: torch.Tensor) -> torch.Tensor:
        return bias_LN.index_select(0, group_M)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        bias_LN, group_M = inputs
        ctx.save_for_backward(group_M)
        ctx.shape, ctx.dtype = tuple(bias_LN.shape), bias_LN.dtype

    @staticmethod
    def backward(ctx, grad_MN: torch.Tensor):
        (group_M,) = ctx.saved_tensors
        acc = torch.float64 if ctx.dtype == torch.float64 else torch.float32
        total = torch.zeros(ctx.shape, dtype=acc, device=grad_MN.device).index_add_(0, group_M, grad_MN.to(acc))
        return total.to(ctx.dtype), None


@contextlib.contextmanager
def rebuilt_in_backward(make: Callable[..., tuple[torch.Tensor, ...]],
                        sources: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
                        name: str = "experts", versioned: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] = ()
                        ) -> Iterator[tuple[torch.Tensor, ...]]:
    """Yield ``make(*sources)``: weights derived from parameters (joined, stacked, cast: a new tensor each forward),
    which autograd inside the block saves as a recipe rather than as the tensors. The backward derives them again
    from ``sources`` (once, shared by every use; freed when the last use's backward has run). Casts of them made
    inside the block through :func:`derived_cast` (the GEMMs' copies under ``torch.autocast``) are derived alike.

    Adapters whose experts' parameters are not in the layer's layout (torchtitan's separate ``w1`` / ``w3``,
    Megatron's one module per expert) join them every forward; the experts' GEMMs save the joined weights for the
    backward, which would keep a second copy of every layer's experts alive from its forward to its backward
    (about 1.9 GB a layer for DeepSeek-V3's ``w1 | w3`` at EP 8, where the parameters themselves cost nothing extra
    to keep, or are freed and gathered again by FSDP). The cost instead: one more pass over the weights in each
    layer's backward.

    Tensors sharing a source's storage (a view, a cast to the same dtype), and every other tensor saved in the
    block, are saved as they are, with their version checked at the backward as autograd checks it. The hooks stay
    off under other saved-tensor hooks (non-reentrant checkpointing recomputes the forward, derived weights
    included; an offloading hook decides for itself), inside a backward (a reentrant checkpoint's recompute, whose
    backward follows at once), and outside autograd. They change no forward's kind for FEPLB's own recompute
    records (``feplb.recompute.hooks_active``).

    The backward derives the weights from the sources as they are then. It raises, naming ``name``, if one of
    ``sources`` or ``versioned`` (the parameters behind the sources, where the sources are views autograd versions
    apart from them, such as a DTensor's local tensor) was changed in place where autograd sees it (an optimizer
    step between a forward and its backward, as autograd raises for a tensor it saved), or if a source's storage was
    freed (FSDP's unsharded parameters not gathered again). A write autograd does not see (through ``.data``, or a
    fused optimizer's) goes unnoticed: training loops do not step between a forward and its backward. Given as
    mappings (parameter names to tensors, ``make`` taking the values in order), ``sources`` and ``versioned`` give
    those errors the parameters' names; given as sequences, their positions. A layer's output marked
    :func:`checked_at_backward` inside the block has the versions checked when its gradient arrives (also where
    ``make`` derives nothing, only views of the sources, which autograd saves and checks itself).
    """
    sources, source_names = _named(sources, "parameter {k} {shape} of the experts")
    versioned, versioned_names = _named(versioned, "parameter {k} {shape} (behind the sources)")
    weights = make(*sources)
    plain = (torch.Tensor, torch.nn.Parameter)
    if not rebuilding_applies() or not all(type(t) in plain for t in (*sources, *weights)):
        yield weights
        return
    own = {_storage_key(s) for s in sources}
    derived: dict[tuple[torch.device, int], tuple[int, torch.dtype]] = {}
    for i, w in enumerate(weights):
        key = _storage_key(w)
        if key[1] != 0 and key not in own:
            derived.setdefault(key, (i, w.dtype))
    recipe = _Recipe(make, sources, versioned, weights, name, (*source_names, *versioned_names))

    # (autograd keeps the hooks as long as what they saved: they must not hold the weights)
    def pack(t: torch.Tensor):
        if type(t) is torch.Tensor and t.layout is torch.strided:
            i, dtype = derived.get(_storage_key(t), (None, None))
            if i is not None and t.dtype == dtype:
                recipe.saved.add(i)
                return _Derived(recipe, i, t.shape, t.stride(), t.storage_offset())
        return _Kept.of(t)

    def unpack(p):
        return p.tensor() if isinstance(p, (_Derived, _Kept)) else p

    pack.feplb_rebuilt = True   # (read by feplb.recompute: these hooks make no forward a checkpointed one)
    outer = getattr(_ACTIVE, "block", None)
    # The block holds every derived tensor until it ends: a storage freed inside it could be handed to another
    # tensor at the same address, which the hooks would then take for a derived one.
    held: list[torch.Tensor] = []
    _ACTIVE.block = (derived, recipe, held)
    try:
        if derived:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield weights
        else:   # views of the sources only: autograd keeps them (and checks them) itself; the block still serves
            yield weights   # checked_at_backward
    finally:
        _ACTIVE.block = outer


def rebuilding_applies() -> bool:
    """Whether a :func:`rebuilt_in_backward` block entered now would save its weights as a recipe: grad enabled,
    outside a backward, and no saved-tensor hooks active but those of an enclosing block (an adapter's around the
    layer: the inner block's hooks then save everything made inside it, the outer's derived weights as they are)."""
    from feplb.recompute import in_backward

    if not torch.is_grad_enabled() or in_backward() or not torch._C._autograd._saved_tensors_hooks_is_enabled():
        return False
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is None or getattr(top[0], "feplb_rebuilt", False)


_ACTIVE = threading.local()   # .block: (derived storages, recipe, held) of this thread's innermost block


def derived_cast(casts: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...]) -> None:
    """Declare ``casts[i]`` (a new tensor: ``inputs[i]`` cast to another dtype) derived like ``inputs[i]`` where
    that is a weight the innermost active :func:`rebuilt_in_backward` block derives: the backward casts the rebuilt
    weight again instead of autograd keeping the cast. Outside such a block, or for other inputs, nothing."""
    block = getattr(_ACTIVE, "block", None)
    if block is None:
        return
    derived, recipe, held = block
    for out, inp in zip(casts, inputs, strict=True):
        if out is inp or type(inp) is not torch.Tensor or inp.layout is not torch.strided:
            continue
        parent = derived.get(_storage_key(inp))
        key = _storage_key(out)
        if parent is None or parent[1] != inp.dtype or key[1] == 0 or key in derived:
            continue
        j = recipe.add_cast(parent[0], inp, out)
        derived[key] = (j, out.dtype)
        held.append(out)


def checked_at_backward(y: torch.Tensor) -> torch.Tensor:
    """``y``, made inside a :func:`rebuilt_in_backward` block from its weights: when ``y``'s gradient arrives, the
    block's sources are checked for in-place changes before the backward of what made ``y`` runs. A
    layer's output gets this, so that every rank meets a bad source at the same point, ahead of the layer's backward
    collectives, rather than wherever each first needs the weights again (a rank raising inside a collective
    exchange leaves its peers a lost connection instead of the reason). Outside a block, or without a gradient:
    nothing. Only versions are checked here: storage is checked where the weights are derived again, as FSDP may
    gather a freed source from a hook of its own that runs after this one. The hook lives as long as the graph does
    (autograd keeps a node's hooks after it ran), so it holds the versions only, not the recipe and the weights it
    derives again."""
    block = getattr(_ACTIVE, "block", None)
    if block is None or not y.requires_grad:
        return y
    seen = block[1].seen

    def check(grad: torch.Tensor) -> None:
        seen.check("seen as the layer's output gradient arrived")

    y.register_hook(check)
    return y


class _Versions:
    """The versions a block's sources (and the parameters behind them) had at the forward, and how errors call
    each: what the recipe and the output's check (:func:`checked_at_backward`) both hold."""

    __slots__ = ("tensors", "versions", "labels", "name")

    def __init__(self, tensors: tuple[torch.Tensor, ...], labels: tuple[str, ...], name: str):
        self.tensors, self.labels, self.name = tensors, labels, name
        self.versions = tuple(t._version for t in tensors)

    def check(self, where: str = "") -> None:
        """Raise if one changed in place since the forward."""
        for k, (t, v) in enumerate(zip(self.tensors, self.versions, strict=True)):
            if t._version != v:
                raise RuntimeError(f"{self.name}: {self.labels[k]} was modified in place between the forward and "
                                   f"its backward (version {v} -> {t._version}{', ' + where if where else ''}); "
                                   "the backward needs the experts' weights as the forward read them (step the "
                                   "optimizer after the backward)")


def _named(ts: Sequence[torch.Tensor] | Mapping[str, torch.Tensor], unnamed: str
           ) -> tuple[tuple[torch.Tensor, ...], tuple[str, ...]]:
    """The tensors, and how errors call each: its name and shape where ``ts`` maps names to them, else ``unnamed``
    with its position and shape."""
    if isinstance(ts, Mapping):
        return tuple(ts.values()), tuple(f"{n} {list(t.shape)}" for n, t in ts.items())
    ts = tuple(ts)
    return ts, tuple(unnamed.format(k=k, shape=list(t.shape)) for k, t in enumerate(ts))


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


def _layout(w: torch.Tensor) -> tuple:
    return tuple(w.shape), w.stride(), w.storage_offset(), w.dtype, w.untyped_storage().nbytes()


class _Recipe:
    """How one forward's derived weights are made again: ``make``, its sources (as the forward read them: their
    versions and storage sizes), and the layout the rebuilt weights must have; then the casts of them
    (``derived_cast``: which weight, the view of it that was cast, to what)."""

    __slots__ = ("make", "sources", "seen", "nbytes", "layouts", "casts", "rebuilt", "cast_rebuilt", "saved",
                 "__weakref__")

    def __init__(self, make, sources: tuple[torch.Tensor, ...], versioned: tuple[torch.Tensor, ...],
                 weights: tuple[torch.Tensor, ...], name: str, labels: tuple[str, ...]):
        self.make, self.sources = make, sources
        self.seen = _Versions((*sources, *versioned), labels, name)   # (with the layer's name and the labels)
        self.nbytes = tuple(s.untyped_storage().nbytes() for s in sources)
        self.layouts = tuple(_layout(w) for w in weights)
        self.casts: list[tuple[int, tuple, torch.dtype, tuple]] = []
        self.rebuilt: list[torch.Tensor | None] | None = None
        self.cast_rebuilt: dict[int, torch.Tensor] = {}
        self.saved: set[int] = set()   # the entries autograd saved views of (not only through their casts)

    def add_cast(self, parent: int, view: torch.Tensor, out: torch.Tensor) -> int:
        self.casts.append((parent, (view.shape, view.stride(), view.storage_offset()), out.dtype, _layout(out)))
        return len(self.layouts) + len(self.casts) - 1

    def weight(self, i: int) -> torch.Tensor:
        """Derived weight ``i`` (``make``'s output i, or a declared cast: ``len(layouts)`` on), derived again."""
        if self.rebuilt is None:
            self._rebuild()
        return self.rebuilt[i] if i < len(self.layouts) else self.cast_rebuilt[i]

    def _rebuild(self) -> None:
        self.seen.check()
        for k, (s, n_) in enumerate(zip(self.sources, self.nbytes, strict=True)):
            if s.untyped_storage().nbytes() != n_:
                raise RuntimeError(f"{self.seen.name}: {self.seen.labels[k]} has "
                                   f"{s.untyped_storage().nbytes()} bytes of storage at the backward, {n_} at the "
                                   "forward (freed after the forward and not gathered again?); the backward "
                                   "derives the experts' weights from it")
        n = len(self.layouts)
        with torch.no_grad():
            rebuilt = list(self.make(*self.sources))
            self._check_layout(tuple(_layout(w) for w in rebuilt), self.layouts)
            # the casts now (in the order declared: a cast's parent comes first), then let go of the weights saved
            # only through their casts (an fp32 join under autocast)
            for j, (parent, (size, stride, offset), dtype, layout) in enumerate(self.casts, start=n):
                src = rebuilt[parent] if parent < n else self.cast_rebuilt[parent]
                out = src.as_strided(size, stride, offset).to(dtype)
                self._check_layout((_layout(out),), (layout,))
                self.cast_rebuilt[j] = out
        self.rebuilt = [w if j in self.saved else None for j, w in enumerate(rebuilt)]

    def _check_layout(self, got: tuple, want: tuple) -> None:
        if got != want:
            raise RuntimeError(f"{self.seen.name}: the experts' weights derived again in the backward have the layout "
                               f"{got}, the forward's had {want}")


class _Kept:
    """A tensor saved as it is, with its version then: autograd checks no version of what passes through saved-tensor
    hooks, so the unpack does (an in-place change between the forward and the backward raises as autograd's own
    check would)."""

    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor, version: int):
        self.t, self.version = t, version

    @staticmethod
    def of(t: torch.Tensor):
        try:
            return _Kept(t, t._version)
        except RuntimeError:   # (an inference tensor has no version)
            return t

    def tensor(self) -> torch.Tensor:
        now = self.t._version
        if now != self.version:
            raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an inplace "
                               f"operation: [{self.t.type()} {list(self.t.shape)}] is at version {now}; expected "
                               f"version {self.version} instead (saved inside an expert layer's forward, under "
                               "feplb.experts.rebuilt_in_backward)")
        return self.t


class _Derived:
    """What autograd keeps of one saved view of a derived weight: its recipe and where it lies in the weight."""

    __slots__ = ("recipe", "index", "size", "stride", "offset")

    def __init__(self, recipe: _Recipe, index: int, size, stride, offset: int):
        self.recipe, self.index, self.size, self.stride, self.offset = recipe, index, size, stride, offset

    def tensor(self) -> torch.Tensor:
        return self.recipe.weight(self.index).as_strided(self.size, self.stride, self.offset)


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host int64 array on ``device`` without a blocking copy (pinned staging on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def ready_event(t: torch.Tensor) -> torch.cuda.Event | None:
    """The event that work a worker thread issues must wait for: recorded now on the calling thread's stream of
    ``t``'s device (not the current device's, should the two differ), after whatever produced ``t`` (None on a CPU,
    where the calling thread's work is already done)."""
    if not t.is_cuda:
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


def span(tl: Timeline | None, name: str, lane: str = "compute", stream=None):
    return contextlib.nullcontext() if tl is None else tl.span(name, lane, stream=stream)
