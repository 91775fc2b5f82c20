"""feplb.experts.rebuilt_in_backward: weights derived from parameters every forward are not kept for the backward,
which derives them again: the same gradients, bit for bit, without the copy alive between forward and backward."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.utils.checkpoint

from feplb.experts import checked_at_backward, expert_mlp, rebuilt_in_backward

SIZES = [5, 0, 7, 3]   # rows per expert (one expert without rows)
L, H, F = len(SIZES), 8, 6


def _params(seed: int, dtype=torch.float32):
    """torchtitan's layout: w1 [L, F, H], w2 [L, H, F], w3 [L, F, H] (leaves)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=dtype).div_(s[-1] ** 0.5).requires_grad_()
            for s in ((L, F, H), (L, H, F), (L, F, H))]


class _Join:
    """[w1 | w3] joined and cast, w2 cast (feplb.titan's join), counting its calls."""

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.calls = dtype, 0

    def __call__(self, w1, w2, w3):
        self.calls += 1
        return torch.cat([w1, w3], dim=1).to(self.dtype).transpose(1, 2), w2.to(self.dtype).transpose(1, 2)


def _run(params, x, join, rebuild: bool, hold: list | None = None, twice: bool = False, one: bool = True):
    """The experts' forward (two uses of the weights: the whole bank, and expert 2 alone, as a dynamic GEMM takes a
    view; ``one=False``: the first only) and backward of a sum of squares; the gradients of x and the
    parameters."""
    offsets = torch.tensor(SIZES).cumsum(0)
    ctx = rebuilt_in_backward(join, params, "test experts") if rebuild else _plain(join, params)
    with ctx as weights:
        y = expert_mlp(x, weights, offsets)
        single = expert_mlp(x[:4], tuple(w[2:3] for w in weights), torch.tensor([4])) if one else None
        if hold is not None:
            hold.extend(weakref.ref(w) for w in weights)
    del weights, ctx   # (only autograd may hold the weights now)
    loss = (y.float() ** 2).sum() + (single.float().sum() if one else 0)
    if hold is not None:
        hold[:] = [r() is not None for r in hold]   # alive between the forward and the backward
    grads = torch.autograd.grad(loss, [x, *params], retain_graph=twice)
    if twice:
        again = torch.autograd.grad(loss, [x, *params])
        assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))
    return grads


class _plain:
    """The baseline: the weights made once, autograd saving them as they are."""

    def __init__(self, join, params):
        self.join, self.params = join, params

    def __enter__(self):
        return self.join(*self.params)

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_equal_bit_for_bit_and_the_join_is_not_kept(dtype):
    params = _params(0)
    x = torch.randn(sum(SIZES), H, generator=torch.Generator().manual_seed(1), dtype=dtype, requires_grad=True)
    plain_alive, rebuilt_alive = [], []
    want = _run(params, x, _Join(dtype), False, plain_alive)
    join = _Join(dtype)
    got = _run(params, x, join, True, rebuilt_alive, twice=True)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # without the hooks the GEMMs keep the joined weights; with them nothing keeps them (w2 cast to its own dtype
    # is a view of the parameter, saved as it is)
    assert plain_alive == [True, True] and rebuilt_alive == [False, dtype == torch.float32]
    # the forward's join, then one in the backward for every use (kept for the second backward: retain_graph)
    assert join.calls == 2


def test_checked_against_an_independent_reference():
    """fp64 experts through the rebuilt weights against a per-expert loop of matmuls."""
    params = _params(2, torch.float64)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(sum(SIZES), H, generator=gen, dtype=torch.float64, requires_grad=True)
    g_out = torch.randn(sum(SIZES), H, generator=gen, dtype=torch.float64)
    with rebuilt_in_backward(_Join(torch.float64), params) as weights:
        y = expert_mlp(x, weights, torch.tensor(SIZES).cumsum(0))
    got = torch.autograd.grad(y, [x, *params], g_out)
    w1, w2, w3 = params
    rows, start = [], 0
    for e, n in enumerate(SIZES):
        xe = x[start:start + n]
        rows.append((torch.nn.functional.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        start += n
    want = torch.autograd.grad(torch.cat(rows), [x, *params], g_out)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_parameter_changed_in_place_before_the_backward_raises():
    params = _params(4)
    x = torch.randn(sum(SIZES), H, requires_grad=True)
    with rebuilt_in_backward(_Join(torch.float32), params, "layer 3's experts") as weights:
        y = expert_mlp(x, weights, torch.tensor(SIZES).cumsum(0))
    # an optimizer step between the forward and its backward (foreach: torch.optim's default on a GPU; the fused
    # implementations change no version, and are not seen)
    params[2].grad = torch.ones_like(params[2])
    torch.optim.SGD([params[2]], lr=0.1, foreach=True).step()
    with pytest.raises(RuntimeError, match=r"layer 3's experts: parameter 2 \[4, 6, 8\] .*modified in place"):
        y.sum().backward()


def test_named_sources_name_the_parameter_in_errors():
    """Sources and versioned parameters given as name -> tensor: the errors name them (with their shapes)."""
    x = torch.randn(sum(SIZES), H, requires_grad=True)
    for stepped, versioned, want in ((0, False, r"w1_EFD \[4, 6, 8\] was modified in place"),
                                     (2, True, r"w3_EFD \(the parameter\) \[4, 6, 8\] was modified in place")):
        params = _params(20 + stepped)
        views = [p.data for p in params]   # (versioned apart from the parameters, as a DTensor's local tensor)
        names = ("w1_EFD", "w2_EDF", "w3_EFD")
        extra = {f"{n} (the parameter)": p for n, p in zip(names, params, strict=True)} if versioned else {}
        with rebuilt_in_backward(_Join(torch.float32), dict(zip(names, views if versioned else params,
                                                                strict=True)), "layer 2's experts", extra) as weights:
            y = expert_mlp(x, weights, torch.tensor(SIZES).cumsum(0))
        with torch.no_grad():
            params[stepped].add_(1.0)
        with pytest.raises(RuntimeError, match="layer 2's experts: " + want):
            y.sum().backward()
    params = _params(23)
    views = [p.detach().clone().requires_grad_().view_as(p) for p in params]
    with rebuilt_in_backward(_Join(torch.bfloat16), dict(zip(("a", "b", "c"), views, strict=True))) as weights:
        y = expert_mlp(x.bfloat16(), weights, torch.tensor(SIZES).cumsum(0))
    views[0].untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=r"experts: a \[4, 6, 8\] has 0 bytes of storage at the backward"):
        y.float().sum().backward()


def test_checked_at_backward_raises_before_the_backward_of_what_made_the_output():
    """A layer's output marked ``checked_at_backward``: a changed source raises as its gradient arrives, before any
    of the layer's backward (its collectives, on a GPU rank) runs; unmarked, the layer's backward runs up to the
    GEMM that needs the weights."""
    class Mark(torch.autograd.Function):   # the layer's last step (a combine, say), seen running its backward
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            ran.append(1)
            return g

    x = torch.randn(sum(SIZES), H, dtype=torch.bfloat16, requires_grad=True)
    for checked in (True, False):
        ran, params = [], _params(24)
        with rebuilt_in_backward(_Join(torch.bfloat16), params, "layer 4's experts") as weights:
            y = Mark.apply(expert_mlp(x, weights, torch.tensor(SIZES).cumsum(0)))
            if checked:
                y = checked_at_backward(y)
        assert checked_at_backward(y) is y   # outside a block: nothing
        with torch.no_grad():
            params[0].add_(1.0)
        with pytest.raises(RuntimeError, match=r"layer 4's experts: parameter 0 \[4, 6, 8\] of the experts was "
                                               "modified in place") as raised:
            y.float().sum().backward()
        assert ran == ([] if checked else [1]), (checked, ran)
        assert ("seen as the layer's output gradient arrived" in str(raised.value)) == checked, raised.value
    # nothing derived (the weights are views of the parameters, which autograd saves and checks itself, in the
    # GEMM's backward): the output's check still comes first, and names the parameter
    ran, params = [], _params(25)
    with rebuilt_in_backward(lambda *ps: tuple(p.view_as(p) for p in ps), dict(zip("abc", params, strict=True)),
                             "layer 6's experts") as views:
        y = checked_at_backward(Mark.apply(x.float() @ views[0][0].T))
    with torch.no_grad():
        params[0].add_(1.0)
    with pytest.raises(RuntimeError, match=r"layer 6's experts: a \[4, 6, 8\] was modified in place"):
        y.sum().backward()
    assert ran == []


def test_a_tensor_saved_as_it_is_changed_in_place_raises_as_autograd_does():
    """Saved-tensor hooks take autograd's version check off what they pass through: the hooks check it instead."""
    params = _params(16)
    x0 = torch.randn(sum(SIZES), H, requires_grad=True)
    for rebuild in (False, True):
        x = x0 * 1   # (a non-leaf the experts' first GEMM saves)
        ctx = rebuilt_in_backward(_Join(torch.float32), params) if rebuild else _plain(_Join(torch.float32), params)
        with ctx as weights:
            y = expert_mlp(x, weights, torch.tensor(SIZES).cumsum(0))
        with torch.no_grad():
            x.mul_(100)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(y.sum(), params[0])


def test_sources_autograd_cannot_address_turn_the_hooks_off():
    """A tensor subclass among the sources (its storage is not the data's): the weights are saved as they are."""
    from torch.testing._internal.two_tensor import TwoTensor

    params = _params(17)
    sub = [TwoTensor(p.detach(), p.detach().clone()).requires_grad_() for p in params]
    with rebuilt_in_backward(_Join(torch.float32), sub) as weights:
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        assert isinstance(weights[0], TwoTensor)


def test_a_make_that_derives_another_layout_raises():
    params = _params(18)
    x = torch.randn(sum(SIZES), H, requires_grad=True)
    calls = []

    def join(w1, w2, w3):   # the second call (the backward's) gives [w1 | w3] contiguous in another order
        calls.append(1)
        j = torch.cat([w1, w3], dim=1)
        return (j.transpose(1, 2) if len(calls) == 1 else j.transpose(1, 2).contiguous()), w2.transpose(1, 2)

    with rebuilt_in_backward(join, params, "layer 5's experts") as weights:
        y = expert_mlp(x, weights, torch.tensor(SIZES).cumsum(0))
    with pytest.raises(RuntimeError, match="layer 5's experts: the experts' weights derived again in the backward "
                                           "have the layout"):
        y.sum().backward()


def test_storage_freed_and_gathered_again_as_fsdp_does():
    """FSDP frees the unsharded parameters' storage after the forward and gathers it again before the backward
    (keeping their version): the backward derives the weights from the gathered data. Not gathered: a clear error."""
    dt = torch.bfloat16   # (every weight derived: in fp32 w2 is a view, which autograd saves and checks itself)
    x = torch.randn(sum(SIZES), H, generator=torch.Generator().manual_seed(5), dtype=dt, requires_grad=True)
    full = _params(6)
    want = _run(full, x, _Join(dt), False)
    for gather in (True, False):
        # unsharded parameters as FSDP's: non-leaf views of a storage it frees and refills
        base = [p.detach().clone().requires_grad_() for p in full]
        views = [b.view_as(b) for b in base]
        saved = [v.detach().clone() for v in views]
        with rebuilt_in_backward(_Join(dt), views, "layer 0's experts") as weights:
            y = expert_mlp(x, weights, torch.tensor(SIZES).cumsum(0))
            one = expert_mlp(x[:4], tuple(w[2:3] for w in weights), torch.tensor([4]))
        del weights
        loss = (y.float() ** 2).sum() + one.float().sum()
        for v in views:
            v.untyped_storage().resize_(0)
        if not gather:
            with pytest.raises(RuntimeError, match=r"layer 0's experts: parameter 0 .*freed after the forward"):
                torch.autograd.grad(loss, [x, *base])
            continue
        for v, s in zip(views, saved, strict=True):
            v.untyped_storage().resize_(s.numel() * s.element_size())
            with torch.autograd._unsafe_preserve_version_counter(v):
                v.detach().copy_(s)
        got = torch.autograd.grad(loss, [x, *base])
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_nothing_holds_the_weights_derived_again_once_the_backward_ran(monkeypatch):
    """The output's check lives as long as the graph (autograd keeps a node's hooks after it ran), which the loss
    holds through the backward and a training loop may hold beyond it: it must not hold what the backward derives
    again. Two layers chained, the loss held: every weight derived again is freed by the end of the backward."""
    from feplb import experts

    rebuilt: list[weakref.ref] = []
    rebuild = experts._Recipe._rebuild

    def spy(recipe):
        rebuild(recipe)
        rebuilt.extend(weakref.ref(w) for w in (*recipe.rebuilt, *recipe.cast_rebuilt.values()) if w is not None)

    monkeypatch.setattr(experts._Recipe, "_rebuild", spy)
    offsets = torch.tensor(SIZES).cumsum(0)
    h = torch.randn(sum(SIZES), H, dtype=torch.bfloat16, requires_grad=True)
    for layer in range(2):
        with rebuilt_in_backward(_Join(torch.bfloat16), _params(28 + layer), f"layer {layer}'s experts") as weights:
            h = checked_at_backward(expert_mlp(h, weights, offsets))
        del weights
    loss = (h.float() ** 2).sum()
    loss.backward()
    assert len(rebuilt) == 4 and [r() is None for r in rebuilt] == [True] * 4, [r() for r in rebuilt]
    del loss, h


def test_the_outputs_check_leaves_freed_storage_to_fsdps_gather():
    """FSDP gathers freed parameters again from its own hook on the layer's output, which runs after the check
    ``checked_at_backward`` put there: that check looks at versions only, and the backward runs."""
    dt = torch.bfloat16
    x = torch.randn(sum(SIZES), H, generator=torch.Generator().manual_seed(26), dtype=dt, requires_grad=True)
    full = _params(27)
    want = _run(full, x, _Join(dt), False, one=False)
    base = [p.detach().clone().requires_grad_() for p in full]
    views = [b.view_as(b) for b in base]
    saved = [v.detach().clone() for v in views]
    with rebuilt_in_backward(_Join(dt), views, "layer 0's experts") as weights:
        y = checked_at_backward(expert_mlp(x, weights, torch.tensor(SIZES).cumsum(0)))
    del weights
    for v in views:
        v.untyped_storage().resize_(0)

    def gather(grad):   # FSDP's pre-backward unshard, on the same output, registered after the forward
        for v, s in zip(views, saved, strict=True):
            v.untyped_storage().resize_(s.numel() * s.element_size())
            with torch.autograd._unsafe_preserve_version_counter(v):
                v.detach().copy_(s)

    y.register_hook(gather)
    got = torch.autograd.grad((y.float() ** 2).sum(), [x, *base])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_off_under_checkpointing_and_other_saved_tensor_hooks():
    """Activation checkpointing recomputes the forward (the join included): the hooks stay off, and the gradients
    are the same. Under another saved-tensor hook (offloading, say), that hook sees the joined weights."""
    params = _params(7)
    x = torch.randn(sum(SIZES), H, generator=torch.Generator().manual_seed(8), requires_grad=True)
    offsets = torch.tensor(SIZES).cumsum(0)
    want = _run(params, x, _Join(torch.float32), False)

    def block(x_):
        with rebuilt_in_backward(_Join(torch.float32), params) as weights:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            assert top is not None and not getattr(top[0], "feplb_rebuilt", False)   # checkpoint's, not ours
            y = expert_mlp(x_, weights, offsets)
            one = expert_mlp(x_[:4], tuple(w[2:3] for w in weights), torch.tensor([4]))
        return (y ** 2).sum() + one.sum()

    loss = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    got = torch.autograd.grad(loss, [x, *params])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    seen = []
    with (torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.shape) or t, lambda t: t),
          rebuilt_in_backward(_Join(torch.float32), params) as weights):
        expert_mlp(x, weights, offsets)
    assert (L, H, 2 * F) in [tuple(s) for s in seen]


def test_off_without_autograd_or_without_a_derived_tensor():
    params = _params(9)
    with torch.no_grad(), rebuilt_in_backward(_Join(torch.float32), params) as weights:
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        assert not weights[0].requires_grad
    # a join that only views its parameters (as Megatron's GroupedMLP in its own dtype): nothing to derive again
    with rebuilt_in_backward(lambda w1, w2, w3: (w1.transpose(1, 2), w2.transpose(1, 2)), params) as weights:
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        assert weights[0]._base is params[0]


def test_autocast_casts_of_derived_weights_are_derived_too(monkeypatch):
    """Under torch.autocast the GEMMs take bf16 casts of the layer's fp32 weights (SlotWeights.for_gemms, one cast
    per forward): casts of derived weights are derived again in the backward, not kept; gradients bit-equal."""
    from feplb import experts
    from feplb.experts import derived_cast
    from feplb.kernels import autocast_matmul_inputs
    from feplb.testing import DerivedWeights

    params = _params(10)
    x = torch.randn(sum(SIZES), H, generator=torch.Generator().manual_seed(11), requires_grad=True)
    offsets = torch.tensor(SIZES).cumsum(0)
    runs, dropped = [], []
    rebuild_once = experts._Recipe._rebuild

    def spy(recipe):
        rebuild_once(recipe)
        dropped.append(list(recipe.rebuilt))

    monkeypatch.setattr(experts._Recipe, "_rebuild", spy)
    for rebuild in (False, True):
        join = _Join(torch.float32)
        ctx = rebuilt_in_backward(join, params) if rebuild else _plain(join, params)
        with DerivedWeights() as watch, torch.autocast("cpu", dtype=torch.bfloat16), ctx as weights:
            cast = autocast_matmul_inputs(*weights)
            derived_cast(cast, weights)
            y = expert_mlp(x, cast, offsets)
            one = expert_mlp(x[:4], tuple(w[2:3] for w in cast), torch.tensor([4]))
            loss = (y.float() ** 2).sum() + one.float().sum()
            watch.at_backward(loss)
            casts = [weakref.ref(c) for c in cast]
        del weights, cast
        alive = sum(r() is not None for r in casts)
        runs.append((torch.autograd.grad(loss, [x, *params]), alive, watch.made, watch.alive_at_backward))
    (want, kept, _, _), (got, alive, made, at_backward) = runs
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # the backward's fp32 join, which autograd saved only through its cast, was let go once cast
    assert dropped == [[None, None]], dropped
    # without: both casts kept; with: the join and its cast derived (w2 is a view of its parameter: its cast is
    # autocast's own, kept as autocast keeps the casts of parameters)
    assert kept == 2 and alive == 1 and made == 2 and at_backward == [0]


def test_no_forward_kind_changes_and_no_rebuild_inside_a_backward():
    """FEPLB's recompute records: a plain forward inside the block is still a plain one (its hooks are FEPLB's
    own). A reentrant checkpoint's recompute runs inside the backward, which follows at once: no hooks there, and
    the join made twice in all (its forward, its recompute), not a third time."""
    from feplb.recompute import checkpoint_frame, hooks_active, record_kind

    params = _params(12)
    x = torch.randn(sum(SIZES), H, generator=torch.Generator().manual_seed(13), requires_grad=True)
    offsets = torch.tensor(SIZES).cumsum(0)
    with rebuilt_in_backward(_Join(torch.float32), params):
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is not None   # (on)
        assert not hooks_active() and record_kind() is None and checkpoint_frame() is None
    join = _Join(torch.float32)
    seen = []

    def block(x_):
        with rebuilt_in_backward(join, params) as weights:
            seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
            return expert_mlp(x_, weights, offsets)

    want = _run(params, x, _Join(torch.float32), False, one=False)
    y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
    ((y ** 2).sum()).backward()   # (reentrant checkpointing takes no torch.autograd.grad)
    got = [x.grad, *(p.grad for p in params)]
    assert join.calls == 2 and seen == [False, False]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_versions_of_the_parameters_behind_the_sources():
    """Sources that autograd versions apart from their parameters (a DTensor's local tensor; here ``.data``): an
    in-place step of the parameter is seen through ``versioned``."""
    params = _params(14)
    x = torch.randn(sum(SIZES), H, requires_grad=True)
    for versioned in ((), params):
        with rebuilt_in_backward(_Join(torch.float32), [p.data for p in params], "layer 1's experts",
                                 versioned) as weights:
            y = expert_mlp(x, weights, torch.tensor(SIZES).cumsum(0))
        with torch.no_grad():
            params[1].add_(1.0)
        if not versioned:
            y.sum().backward()   # unseen: derived from the stepped parameters
            continue
        with pytest.raises(RuntimeError,
                           match=r"layer 1's experts: parameter 1 \[4, 8, 6\] \(behind the sources\).*in place"):
            y.sum().backward()


def test_derived_casts_are_held_until_the_block_ends():
    """A cast declared derived and dropped inside the block stays allocated until the block ends: no other tensor
    can take its address meanwhile, which the hooks would take for the cast."""
    from feplb.experts import derived_cast
    from feplb.kernels import autocast_matmul_inputs

    params = _params(15)
    with (torch.autocast("cpu", dtype=torch.bfloat16),
          rebuilt_in_backward(_Join(torch.float32), params) as weights):
        cast = autocast_matmul_inputs(*weights)
        derived_cast(cast, weights)
        ref = weakref.ref(cast[0])
        del cast
        assert ref() is not None
    assert ref() is None


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu,
                                    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "fp32-autocast"])
@pytest.mark.parametrize("device", ["cpu", _CUDA])
def test_on_the_device_gradients_bit_equal_and_the_join_not_kept(device, autocast):
    """On the layer's device (on a GPU: the Triton grouped GEMM, the caching allocator): bf16 weights, or fp32
    ones under ``torch.autocast`` (their bf16 casts derived too, as ``SlotWeights.for_gemms`` declares them); the
    gradients bit-equal to keeping the join, the join made once more in the backward, and nothing holding it
    between the forward and the backward. On CUDA also the memory allocated then: smaller by at least the bf16
    join's bytes (what the GEMMs would have saved)."""
    from feplb.experts import derived_cast
    from feplb.kernels import autocast_matmul_inputs

    dev = torch.device(device)
    sizes = [300, 0, 17, 128, 256, 1, 64, 512]   # rows per expert: empty, single, and uneven groups
    n, h, f = len(sizes), 256, 128
    dtype = torch.float32 if autocast else torch.bfloat16
    gen = torch.Generator().manual_seed(16)
    params = [(torch.randn(*s, generator=gen) / s[-1] ** 0.5).to(dev, dtype).requires_grad_()
              for s in ((n, f, h), (n, h, f), (n, f, h))]
    x = torch.randn(sum(sizes), h, generator=gen).to(dev, dtype).requires_grad_()
    offsets = torch.tensor(sizes, device=dev).cumsum(0)
    runs = {}
    for rebuild in (False, True):
        join = _Join(dtype)
        # no collection inside the measured window: a tensor of an earlier test freed there would count
        gc.collect()
        gc.disable()
        try:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            ctx = rebuilt_in_backward(join, params, "device experts") if rebuild else _plain(join, params)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast), ctx as weights:
                gemm = autocast_matmul_inputs(*weights)
                derived_cast(gemm, weights)
                assert gemm[0].dtype == torch.bfloat16
                y = expert_mlp(x, gemm, offsets)
                refs = [weakref.ref(w) for w in (weights[0], gemm[0])]   # the join, and its cast under autocast
            loss = (y.float() ** 2).sum()
            del weights, gemm, ctx, y
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            held = torch.cuda.memory_allocated(dev) - before if dev.type == "cuda" else None
        finally:
            gc.enable()
        alive = [r() is not None for r in refs]
        grads = torch.autograd.grad(loss, [x, *params])
        del loss
        runs[rebuild] = (grads, held, alive, join.calls)
    (want, kept_bytes, kept_alive, plain_calls), (got, rebuilt_bytes, rebuilt_alive, calls) = runs[False], runs[True]
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert plain_calls == 1 and calls == 2
    # kept: the GEMM's operand (the bf16 join, or its cast under autocast; the fp32 join itself is freed once
    # cast); rebuilt: neither
    assert kept_alive == ([False, True] if autocast else [True, True]) and rebuilt_alive == [False, False]
    if dev.type == "cuda":
        # exactly the bf16 join, by what each run saves (a 512-byte multiple: the allocator rounds nothing here)
        join_bytes = n * h * 2 * f * 2
        assert kept_bytes - rebuilt_bytes >= join_bytes, (kept_bytes, rebuilt_bytes, join_bytes)


class _Derived(_Join):
    """A join deriving both weights (w2 copied, not a view of its parameter): as the received banks of
    recopy_weights, every weight derived from a buffer."""

    def __call__(self, w1, w2, w3):
        joined, w2t = super().__call__(w1, w2, w3)
        return joined, w2t.mul(1)


def test_autocast_casts_of_the_weights_are_not_kept(monkeypatch):
    """Inside torch.autocast the GEMMs' bf16 casts of derived weights are derived again in the backward too: the
    block keeps nothing of a derived weight's shape (grouped_mm cast them, undeclared, and the block kept both casts
    from the forward to the backward: the received banks of recopy_weights under autocast), and the gradients equal
    the plain run's bit for bit. A weight that is a view of its parameter (w2 in _Join: torchtitan's, in its own
    dtype) is no derived weight: its cast is kept, as autograd keeps it without the block."""
    from feplb import experts

    kept = []
    real = experts._Kept.of
    monkeypatch.setattr(experts._Kept, "of", staticmethod(lambda t: kept.append(tuple(t.shape)) or real(t)))
    params = _params(4)
    x = torch.randn(sum(SIZES), H, generator=torch.Generator().manual_seed(5), requires_grad=True)
    for join, derived in ((_Derived, {(L, H, 2 * F), (L, F, H)}), (_Join, {(L, H, 2 * F)})):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = _run(params, x, join(torch.float32), False, one=False)
            kept.clear()
            got = _run(params, x, join(torch.float32), True, one=False)
        assert not derived & set(kept), (join.__name__, kept)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
