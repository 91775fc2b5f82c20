"""feplb.experts: the expert MLP over grouped rows, with biases."""

from __future__ import annotations

import torch

from feplb.experts import _RowBias, expert_mlp


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
