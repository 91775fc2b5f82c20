"""feplb.experts: the expert MLP over grouped rows, with biases; the order of the backward (``EarlyBackward``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from feplb.experts import EarlyBackward, _RowBias, expert_mlp


def test_row_bias_gradient_sums_in_fp32_whatever_the_bias_dtype():
    """The bias gradient of 8192 rows of one expert is 8192 in bf16 too (summed in fp32, rounded once: a bf16
    accumulation, as a GPU's index_add_ atomics make it, would stop at 256)."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        b = torch.ones(2, 4, dtype=dtype, requires_grad=True)
        _RowBias.apply(b, torch.zeros(8192, dtype=torch.long)).sum().backward()
        assert b.grad.dtype == dtype and (b.grad[0] == 8192).all() and (b.grad[1] == 0).all()
    b64 = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 3, (17,), generator=torch.Generator().manual_seed(0))
    assert torch.autograd.gradcheck(lambda t: _RowBias.apply(t, idx), (b64,))


def test_expert_mlp_with_biases_matches_a_per_expert_loop():
    """Biases by each row's expert (groups of 0 to 5 rows, one empty), against plain matmuls per expert, in fp64,
    gradients included; gated and non-gated."""
    gen = torch.Generator().manual_seed(1)
    sizes = [3, 0, 5, 2]
    L, H, F, M = len(sizes), 6, 4, sum(sizes)
    offsets = torch.tensor(sizes).cumsum(0)
    for gated in (True, False):
        G = 2 * F if gated else F
        ts = [torch.randn(*s, dtype=torch.float64, generator=gen, requires_grad=True)
              for s in ((M, H), (L, H, G), (L, F, H), (L, G), (L, H))]
        x, w1, w2, b1, b2 = ts
        got = expert_mlp(x, (w1, w2, b1, b2), offsets, None, "silu" if gated else "relu2", 1.0, False, gated)
        rows, start = [], 0
        for e, n in enumerate(sizes):
            h = x[start:start + n] @ w1[e] + b1[e]
            a = torch.nn.functional.silu(h[:, :F]) * h[:, F:] if gated else torch.relu(h) ** 2
            rows.append(a @ w2[e] + b2[e])
            start += n
        want = torch.cat(rows)
        torch.testing.assert_close(got, want)
        gy = torch.randn(M, H, dtype=torch.float64, generator=gen)
        g_got = torch.autograd.grad(got, ts, gy)
        g_want = torch.autograd.grad(want, ts, gy)
        for a, b in zip(g_got, g_want, strict=True):
            torch.testing.assert_close(a, b)


def _two_branches(x, w1, w2, offsets, order: list, promote: bool):
    """A grouped expert MLP made first (S) and another branch made after it (B); S promoted past B, or not."""
    early = EarlyBackward()
    s = expert_mlp(x * 2.0, (w1, w2), offsets)
    early.capture(s)
    b = (x * 3.0).cos() @ w1[0][:, :x.shape[1]]
    if promote:
        early.promote()
    if s.requires_grad:
        s.grad_fn.register_prehook(lambda g: order.append("S"))
        b.grad_fn.register_prehook(lambda g: order.append("B"))
    return s.square().sum() + b.sum()


@pytest.mark.parametrize("how", ["plain", "reentrant", "non-reentrant"])
def test_early_backward_runs_first_same_gradients(how):
    """Promoted, the nodes made first run before those made after them, and every gradient is the same bit for bit
    (also under checkpointing, whose recompute promotes again, and through a second backward); without autograd it
    captures nothing."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 4, generator=gen, dtype=torch.float64)
    w1 = torch.randn(2, 4, 6, generator=gen, dtype=torch.float64)
    w2 = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
    offsets = torch.tensor([3, 7])
    grads, orders = {}, {}
    for promote in (False, True):
        ts = [t.clone().requires_grad_(True) for t in (x, w1, w2)]
        order: list = []
        f = lambda *a, promote=promote, order=order: _two_branches(*a, offsets, order, promote)  # noqa: E731
        loss = f(*ts) if how == "plain" else checkpoint(f, *ts, use_reentrant=how == "reentrant")
        loss.backward(retain_graph=True)
        first = [t.grad.clone() for t in ts]
        loss.backward()
        grads[promote] = first + [t.grad for t in ts]
        orders[promote] = order
    assert orders[True][:2] == ["S", "B"] and orders[False][:2] == ["B", "S"], orders
    for a, b in zip(grads[False], grads[True], strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():
        early = EarlyBackward()
        early.capture(expert_mlp(x, (w1, w2), offsets))
    assert early.start is None and early.nodes == []
