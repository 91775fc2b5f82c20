"""feplb's ops inside ``torch.autocast``: grouped_mm follows torch.matmul's rule (floating inputs other than float64
cast to the autocast dtype, the result in it, gradients back in the inputs' own dtypes), whether called as the
public op, as the ``torch.ops.feplb`` operator or compiled; permute, unpermute and swiglu keep their input dtype,
as torch's index and elementwise ops do. Each case is compared with the same op on inputs cast by hand outside
autocast (bit for bit) and with a float64 reference of the cast inputs.

The Triton interpreter computes bf16 and fp16 ``tl.dot`` wrongly, so on the CPU these run the pure-torch twins;
on a GPU the CUDA cases run the Triton kernels.
"""

from __future__ import annotations

import pytest
import torch

import feplb.kernels as fk

CASES = [("cpu", torch.bfloat16), ("cpu", torch.float16)]
if fk.HAVE_TRITON and torch.cuda.is_available():
    CASES += [("cuda", torch.bfloat16), ("cuda", torch.float16)]
IDS = [f"{d}-{str(t).removeprefix('torch.')}" for d, t in CASES]


def _inputs(gen, device, M=23, K=16, N=12, E=4):
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(E, K, N, generator=gen) / K ** 0.5
    sizes = torch.tensor([7, 0, 11, M - 18])          # one empty group
    return x.to(device), w.to(device), sizes.cumsum(0).to(device)


def _compile(fn):
    # autocast is applied while AOT autograd traces, which aot_eager checks; inductor's code generation around the
    # operators is test_custom_ops.py's (and costs compile time on the GPU check)
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def _call(how: str):
    if how == "public":
        return lambda x, w, offs: fk.grouped_mm(x, w, offs)
    if how == "operator":
        return lambda x, w, offs: torch.ops.feplb.grouped_mm(x, w, offs, True)
    if how == "compiled_operator":   # the operator's own autocast kernel, traced
        return _compile(lambda x, w, offs: torch.ops.feplb.grouped_mm(x, w, offs, False))
    return _compile(lambda x, w, offs: fk.grouped_mm(x, w, offs, check=False))


@pytest.mark.parametrize("how", ["public", "operator", "compiled", "compiled_operator"])
@pytest.mark.parametrize(("device", "dtype"), CASES, ids=IDS)
def test_grouped_mm_under_autocast_is_grouped_mm_of_cast_inputs(device, dtype, how, gen, kh):
    x32, w32, offs = _inputs(gen, device)
    dy = torch.randn(x32.shape[0], w32.shape[2], generator=gen).to(device)
    x, w = x32.clone().requires_grad_(), w32.clone().requires_grad_()
    with torch.autocast(device, dtype=dtype):
        y = _call(how)(x, w, offs)
    assert y.dtype == dtype
    (y.float() * dy).sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.float32

    # the same op on inputs cast by hand, outside autocast
    xc, wc = x32.to(dtype).requires_grad_(), w32.to(dtype).requires_grad_()
    want = fk.grouped_mm(xc, wc, offs)
    (want.float() * dy).sum().backward()
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, xc.grad.float(), rtol=0, atol=0)
    torch.testing.assert_close(w.grad, wc.grad.float(), rtol=0, atol=0)

    # and a float64 reference of the cast inputs (independent of feplb's kernels)
    ref = kh.grouped_mm_f64(x32.to(dtype).double(), w32.to(dtype).double(), offs)
    kh.close(y, ref, dtype)


@pytest.mark.parametrize(("device", "dtype"), CASES, ids=IDS)
def test_grouped_mm_output_dtype_follows_torch_matmul(device, dtype, gen):
    """For every pair of input dtypes, inside and outside autocast, grouped_mm gives torch.matmul's result dtype
    (float64 is never cast; mixed inputs, an error outside autocast, are cast to one dtype inside it)."""
    x32, w32, offs = _inputs(gen, device)
    one = torch.tensor([x32.shape[0]], device=device)
    for xt, wt in [(torch.float32, torch.float32), (dtype, torch.float32), (torch.float32, dtype), (dtype, dtype),
                   (torch.float64, torch.float64)]:
        x, w = x32.to(xt), w32[:1].to(wt)
        with torch.autocast(device, dtype=dtype):
            got = fk.grouped_mm(x, w, one)
            want = torch.matmul(x, w[0])
            with torch.autocast(device, enabled=False):
                off = fk.grouped_mm(x, w, one) if xt == wt else None
        assert got.dtype == want.dtype, (xt, wt, got.dtype, want.dtype)
        tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(got.dtype, 2e-2)
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)
        if off is not None:
            assert off.dtype == xt   # autocast disabled inside: nothing cast


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(("device", "dtype"), CASES, ids=IDS)
def test_expert_block_under_autocast(device, dtype, compiled, gen, kh):
    """A SwiGLU expert block inside autocast computes its GEMMs (and the SwiGLU between them) in the autocast dtype
    and equals the block run on hand-cast inputs; permute, swiglu and unpermute keep their inputs' dtypes."""
    T, K, E, H, F = 11, 2, 4, 16, 8
    ids, _ = kh.random_routing(T, K, E, gen=gen, used_experts=3)
    ids = ids.to(device)
    leaves32 = [torch.randn(T, H, generator=gen), torch.rand(T, K, generator=gen),
                torch.randn(E, H, 2 * F, generator=gen) / H ** 0.5, torch.randn(E, F, H, generator=gen) / F ** 0.5]
    leaves32 = [t.to(device) for t in leaves32]

    def block(x, gates, w1, w2):
        meta = fk.routing_metadata(ids, E)
        x_MH = fk.permute(x, meta)
        h = fk.grouped_mm(x_MH, w1, meta.offsets_E)
        a = fk.swiglu(h)
        y = fk.grouped_mm(a, w2, meta.offsets_E)
        return fk.unpermute(y, meta, gates), (x_MH.dtype, h.dtype, a.dtype, y.dtype)

    run = _compile(block) if compiled else block
    leaves = [t.clone().requires_grad_() for t in leaves32]
    with torch.autocast(device, dtype=dtype):
        out, dtypes = run(*leaves)
    assert dtypes == (torch.float32, dtype, dtype, dtype)
    assert out.dtype == dtype
    dy = torch.randn(out.shape, generator=gen).to(device)
    grads = torch.autograd.grad((out.float() * dy).sum(), leaves)
    assert [g.dtype for g in grads] == [torch.float32] * 4

    # hand-cast: the GEMMs' operands in the autocast dtype, the routing weights as given
    cast = [leaves32[0].to(dtype), leaves32[1], leaves32[2].to(dtype), leaves32[3].to(dtype)]
    cast = [t.clone().requires_grad_() for t in cast]
    want, _ = block(*cast)
    want_grads = torch.autograd.grad((want.float() * dy).sum(), cast)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # x stays fp32 up to the GEMM: its gradient sums the K rows' gradients in fp32 where the hand-cast block's
    # rounds that sum to the autocast dtype; the other gradients are the hand-cast ones, exactly
    torch.testing.assert_close(grads[0].to(dtype), want_grads[0], rtol=0, atol=0)
    for g, e in zip(grads[1:], want_grads[1:], strict=True):
        torch.testing.assert_close(g, e.float(), rtol=0, atol=0)

    # float64 reference of the same math on the cast operands
    x64, g64, w1_64, w2_64 = (t.double() for t in (cast[0], leaves32[1], cast[2], cast[3]))
    ref = torch.zeros(T, H, dtype=torch.float64, device=device)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            hh = x64[t] @ w1_64[e]
            ref[t] += g64[t, k] * ((torch.nn.functional.silu(hh[:F]) * hh[F:]) @ w2_64[e])
    kh.close(out, ref, dtype, scale=4.0)
