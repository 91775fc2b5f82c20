"""Triton kernels through their launchers (on a GPU, or on the CPU under TRITON_INTERPRET=1), against their
pure-torch twins and independent float64 computations. Every output is poisoned with NaN (or -1) before the
kernel runs, so an element a kernel never writes fails.
"""

from __future__ import annotations

import pytest
import torch

from feplb.kernels import HAVE_TRITON, INTERPRET, poison_outputs
from feplb.kernels.activation import (
    ACTS,
    PLAIN_ACTS,
    glu_bwd_ref,
    glu_bwd_triton,
    glu_ref,
    glu_triton,
    mlp_act_bwd_ref,
    mlp_act_bwd_triton,
    mlp_act_ref,
    mlp_act_triton,
)
from feplb.kernels.activation import HOPPER_CONFIGS as GLU_HOPPER_CONFIGS
from feplb.kernels.grouped_gemm import (
    DW_FALLBACK_CONFIGS,
    DW_HOPPER_CONFIGS,
    FWD_FALLBACK_CONFIGS,
    FWD_HOPPER_CONFIGS,
    _dot_meta,
    grouped_mm_dw_ref,
    grouped_mm_dw_triton,
    grouped_mm_ref,
    grouped_mm_triton,
)
from feplb.kernels.permutation import (
    PERMUTE_HOPPER_CONFIGS,
    UNPERMUTE_BWD_HOPPER_CONFIGS,
    UNPERMUTE_HOPPER_CONFIGS,
    permute_ref,
    permute_triton,
    unpermute_bwd_ref,
    unpermute_bwd_triton,
    unpermute_ref,
    unpermute_triton,
)
from feplb.kernels.routing import routing_metadata_ref, routing_metadata_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALPHA = 1.702   # swiglu_oai's sigmoid slope (gpt-oss's); the other activations ignore it
pytestmark = pytest.mark.skipif(not HAVE_TRITON or (DEVICE == "cpu" and not INTERPRET),
                                reason="needs Triton and a GPU, or TRITON_INTERPRET=1")

ROUTING_CASES = {  # id: (T, K, E, used_experts, block_m, block_e)
    "one-block": (40, 4, 8, None, None, None),
    "many-blocks": (45, 3, 6, None, 16, None),
    "expert-chunks": (30, 2, 40, 25, 16, 16),
    "empty-experts": (21, 2, 9, 3, 32, None),
    "single-expert": (7, 1, 1, None, None, None),
    "T0": (0, 3, 4, None, None, None),
}


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["ids32", "ids64"])
@pytest.mark.parametrize("case", list(ROUTING_CASES), ids=list(ROUTING_CASES))
def test_routing_metadata_kernels(case, ids_dtype, gen, kh):
    T, K, E, used, block_m, block_e = ROUTING_CASES[case]
    ids, _ = kh.random_routing(T, K, E, gen=gen, used_experts=used, ids_dtype=ids_dtype)
    with poison_outputs():
        got = routing_metadata_triton(ids.to(DEVICE), E, block_m=block_m, block_e=block_e)
    for g, r, f in zip(got, routing_metadata_ref(ids, E), kh.routing_f64(ids, E), strict=True):
        assert g.dtype == torch.int32
        assert torch.equal(g.cpu(), r)
        assert torch.equal(g.cpu().long(), f.long())


def _routing(T, K, E, gen, kh, used=None):
    ids, w = kh.random_routing(T, K, E, gen=gen, used_experts=used)
    _, offsets, src, dst = routing_metadata_ref(ids, E)
    return offsets, src, dst, w


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
# the activations also in fp64: their constants and scalar arguments made in fp64 (an fp32 constant would err by
# about 1e-8)
ACT_DTYPES, ACT_DTYPE_IDS = [*DTYPES, torch.float64], [*DTYPE_IDS, "fp64"]


def assert_same_rounding(actual, expected):
    """Bit-equal, except that the interpreter rounds fp32 -> bf16 towards zero (a GPU rounds to nearest even),
    so there bf16 results may differ by one unit in the last place."""
    if actual.dtype == torch.bfloat16 and actual.device.type == "cpu":
        torch.testing.assert_close(actual, expected, rtol=2**-7, atol=1e-30)
    else:
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_permute_unpermute_kernels_bit_exact(dtype, gen, kh):
    T, K, E, D = 37, 3, 6, 200  # D spans two column blocks with a remainder
    _, src, dst, w = _routing(T, K, E, gen, kh, used=4)
    src, dst, w = src.to(DEVICE), dst.to(DEVICE), w.to(DEVICE)
    x = torch.randn(T, D, generator=gen).to(dtype).to(DEVICE)
    y = torch.randn(T * K, D, generator=gen).to(dtype).to(DEVICE)
    with poison_outputs():
        x_MD = permute_triton(x, src, dst)
        out = unpermute_triton(y, src, dst, w)
        out_unweighted = unpermute_triton(y, src, dst, None)
    # Same reads, same fp32 operation order as the twin: equal to the bit.
    assert torch.equal(x_MD, permute_ref(x, src, dst))
    assert_same_rounding(out, unpermute_ref(y, src, dst, w))
    assert_same_rounding(out_unweighted, unpermute_ref(y, src, dst, None))
    kh.close(out.cpu(), kh.unpermute_f64(y.cpu(), dst.cpu(), w.cpu()), dtype)


@pytest.mark.parametrize("need_dw", [True, False], ids=["dw", "no-dw"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_unpermute_backward_kernel(dtype, need_dw, gen, kh):
    T, K, E, D = 29, 4, 5, 150
    _, src, dst, w = _routing(T, K, E, gen, kh)
    src, dst, w = src.to(DEVICE), dst.to(DEVICE), w.to(DEVICE)
    y = torch.randn(T * K, D, generator=gen).to(dtype).to(DEVICE)
    grad = torch.randn(T, D, generator=gen).to(dtype).to(DEVICE)
    with poison_outputs():
        dy, dw = unpermute_bwd_triton(grad, y, src, dst, w, need_dw)
    dy_ref, dw_ref = unpermute_bwd_ref(grad, y, src, dst, w, need_dw)
    assert_same_rounding(dy, dy_ref)
    if need_dw:
        dw_f64 = (grad.cpu().double()[:, None, :] * y.cpu().double()[dst.cpu().long()]).sum(-1)
        torch.testing.assert_close(dw.cpu().double(), dw_f64, rtol=1e-4, atol=1e-4 * D**0.5)
        torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-5 * D**0.5)
    else:
        assert dw.numel() == 0


def test_permute_unpermute_kernels_T0():
    src, dst = torch.zeros(0, dtype=torch.int32, device=DEVICE), torch.zeros(0, 2, dtype=torch.int32, device=DEVICE)
    assert permute_triton(torch.zeros(0, 8, device=DEVICE), src, dst).shape == (0, 8)
    weights = torch.zeros(0, 2, device=DEVICE)
    assert unpermute_triton(torch.zeros(0, 8, device=DEVICE), src, dst, weights).shape == (0, 8)
    dy, dw = unpermute_bwd_triton(torch.zeros(0, 8, device=DEVICE), torch.zeros(0, 8, device=DEVICE), src, dst,
                                  weights, True)
    assert dy.shape == (0, 8) and dw.shape == (0, 2)


GMM_CASES = {  # id: (group sizes, K, N); interpreter tiles are 32 x 32 x 32
    "multi-tile": ([40, 33, 7], 40, 36),
    "empty-groups": ([0, 12, 0, 0, 21, 0], 24, 17),
    "group-larger-than-tiles": ([70], 33, 20),
    "single-rows": ([1, 1, 0, 1], 16, 16),
    "M0": ([0, 0, 0], 8, 8),
    "K0": ([3, 5], 0, 6),
}


def _gmm_inputs(case, dtype, offsets_dtype, gen, layout="contiguous"):
    sizes, K, N = GMM_CASES[case]
    M, E = sum(sizes), len(sizes)
    offsets = torch.tensor(sizes).cumsum(0).to(offsets_dtype).to(DEVICE)
    x = torch.randn(M, K, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(E, K, N, generator=gen) / max(K, 1) ** 0.5).to(dtype).to(DEVICE)
    if layout == "strided":
        # x a column slice of a wider buffer, w stored as [E, N, K] and viewed transposed.
        x = torch.cat([x, torch.zeros_like(x)], dim=1)[:, :K]
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    return x, w, offsets


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64], ids=["off32", "off64"])
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=[*DTYPE_IDS, "fp64"])
@pytest.mark.parametrize("case", list(GMM_CASES), ids=list(GMM_CASES))
def test_grouped_mm_forward_kernel(case, dtype, offsets_dtype, gen, kh):
    x, w, offsets = _gmm_inputs(case, dtype, offsets_dtype, gen)
    with poison_outputs():
        y = grouped_mm_triton(x, w, offsets)
    expected = kh.grouped_mm_f64(x.cpu(), w.cpu(), offsets.cpu())
    kh.close(y.cpu(), expected, dtype, scale=2.0)
    kh.close(y.cpu(), grouped_mm_ref(x, w, offsets).cpu(), dtype, scale=2.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", ["multi-tile", "empty-groups", "group-larger-than-tiles"])
def test_grouped_mm_backward_kernels(case, dtype, gen, kh):
    x, w, offsets = _gmm_inputs(case, dtype, torch.int64, gen)
    dy = torch.randn(x.shape[0], w.shape[2], generator=gen).to(dtype).to(DEVICE)
    with poison_outputs():
        dx = grouped_mm_triton(dy, w.transpose(1, 2), offsets)
        dw = grouped_mm_dw_triton(x, dy, offsets)
    dx_f64 = kh.grouped_mm_f64(dy.cpu(), w.cpu().transpose(1, 2), offsets.cpu())
    dw_f64 = kh.grouped_mm_dw_f64(x.cpu(), dy.cpu(), offsets.cpu())
    kh.close(dx.cpu(), dx_f64, dtype, scale=2.0)
    kh.close(dw.cpu(), dw_f64, dtype, scale=2.0 * x.shape[0] ** 0.5)
    kh.close(dw.cpu(), grouped_mm_dw_ref(x, dy, offsets).cpu(), dtype, scale=2.0 * x.shape[0] ** 0.5)
    # Empty groups get a zero gradient, not garbage.
    empty = torch.diff(offsets.cpu(), prepend=offsets.new_zeros(1).cpu()) == 0
    assert torch.all(dw.cpu()[empty] == 0)


@pytest.fixture
def matmul_precision():
    """torch.backends.cuda.matmul's fp32 precision, restored after the test (set through either API)."""
    m = torch.backends.cuda.matmul
    before = m.fp32_precision
    yield m
    m.fp32_precision = before


@pytest.mark.parametrize("how, want", [("fp32_precision=tf32", "tf32"), ("fp32_precision=ieee", "ieee"),
                                       ("allow_tf32=True", "tf32"), ("allow_tf32=False", "ieee"),
                                       ("global tf32", "tf32"), ("default", "ieee")])
def test_fp32_dots_follow_torchs_matmul_precision_set_either_way(how, want, matmul_precision, gen, kh):
    """fp32 GEMMs take TF32 dots where torch's matmuls do, set through torch's current API (fp32_precision, on which
    reading the older allow_tf32 raises) or the older one; the kernels run with either (TF32 is the GPU's: the
    interpreter computes both in fp32)."""
    before = torch.backends.fp32_precision
    try:
        if how == "global tf32":
            matmul_precision.fp32_precision = "none"         # (inherits the global setting)
            torch.backends.fp32_precision = "tf32"
        elif how.startswith("fp32_precision="):
            matmul_precision.fp32_precision = how.split("=")[1]
        elif how.startswith("allow_tf32="):
            matmul_precision.allow_tf32 = how.endswith("True")
        else:
            matmul_precision.fp32_precision = "none"
        x, w, offsets = _gmm_inputs("multi-tile", torch.float32, torch.int32, gen)
        assert _dot_meta(x)["DOT_PRECISION"] == want
        assert _dot_meta(x.to(torch.bfloat16))["DOT_PRECISION"] is None
        y = grouped_mm_triton(x, w, offsets)
        dw = grouped_mm_dw_triton(x, y, offsets)
        kh.close(y.cpu(), kh.grouped_mm_f64(x.cpu(), w.cpu(), offsets.cpu()), torch.float32, scale=2.0)
        kh.close(dw.cpu(), kh.grouped_mm_dw_f64(x.cpu(), y.cpu(), offsets.cpu()), torch.float32,
                 scale=2.0 * x.shape[0] ** 0.5)
    finally:
        torch.backends.fp32_precision = before


def test_grouped_mm_kernels_strided_inputs(gen, kh):
    x, w, offsets = _gmm_inputs("multi-tile", torch.float32, torch.int32, gen, layout="strided")
    assert not x.is_contiguous() and not w.is_contiguous()
    dy = torch.randn(x.shape[0], w.shape[2], generator=gen).to(DEVICE)[:, :].T.contiguous().T  # column-major
    with poison_outputs():
        y = grouped_mm_triton(x, w, offsets)
        dw = grouped_mm_dw_triton(x, dy, offsets)
    kh.close(y.cpu(), kh.grouped_mm_f64(x.cpu(), w.cpu(), offsets.cpu()), torch.float32, scale=2.0)
    kh.close(dw.cpu(), kh.grouped_mm_dw_f64(x.cpu(), dy.cpu(), offsets.cpu()), torch.float32, scale=20.0)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")   # the interpreter's sigmoid
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("limit", [None, 2.5], ids=["plain", "clamped"])
@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=ACT_DTYPE_IDS)
def test_glu_kernels(dtype, limit, act, interleaved, gen, kh):
    M, F = 70, 150  # spans row and column blocks with remainders
    h = (torch.randn(M, 2 * F, generator=gen) * 3).to(dtype)
    if limit is not None:   # about a third of the gates and ups beyond the limit, and some exactly on it
        h[::7, ::5] = limit
        h[3::7, ::5] = -limit
        assert (h[:, :F] > limit).any() and (h[:, F:].abs() > limit).any()
    h = h.to(DEVICE)
    g = torch.randn(M, F, generator=gen).to(dtype).to(DEVICE)
    with poison_outputs():
        out = glu_triton(h, limit, act, ALPHA, interleaved)
        dh = glu_bwd_triton(g, h, limit, act, ALPHA, interleaved)
    kh.close(out.cpu(), glu_ref(h, limit, act, ALPHA, interleaved).cpu(), dtype, scale=4.0)
    # alpha: swiglu_oai's only
    kh.close(out.cpu(), kh.glu_f64(h.cpu(), limit, act, ALPHA, interleaved), dtype, scale=4.0)
    kh.close(dh.cpu(), glu_bwd_ref(g, h, limit, act, ALPHA, interleaved).cpu(), dtype, scale=4.0)
    h64 = h.cpu().double().requires_grad_()
    (dh_f64,) = torch.autograd.grad(kh.glu_f64(h64, limit, act, ALPHA, interleaved), h64, g.cpu().double())
    kh.close(dh.cpu(), dh_f64, dtype, scale=8.0)
    if limit is not None:   # the clamps' flat parts pass no gradient
        def halves(t):
            return (t[:, 0::2], t[:, 1::2]) if interleaved else t.chunk(2, dim=1)

        (gate, up), (d_gate, d_up) = halves(h.cpu().double()), halves(dh.cpu())
        assert (d_gate[gate > limit] == 0).all() and (d_up[up.abs() > limit] == 0).all()
        assert (d_gate[gate <= limit] != 0).any()
    if interleaved:   # not the side-by-side layout under another name
        assert not torch.allclose(out.cpu().double(), kh.glu_f64(h.cpu(), limit, act, ALPHA), rtol=0.05)


if HAVE_TRITON:
    from feplb.kernels._triton import tl, triton
    from feplb.kernels.activation import _tanh

    @triton.jit
    def _tanh_kernel(x_ptr, y_ptr, N, ACC: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        tl.store(y_ptr + offs, _tanh(tl.load(x_ptr + offs, mask=m, other=0.0), ACC), mask=m)

    @triton.jit
    def _row_sum(x):
        return tl.sum(x, axis=0)

    @triton.jit
    def _row_sums_kernel(x_ptr, out_ptr, N: tl.constexpr):
        x = tl.load(x_ptr + tl.program_id(0) * N + tl.arange(0, N))
        tl.store(out_ptr + tl.program_id(0), _row_sum(x) + tl.sum(x * x, axis=0) + tl.cdiv(N, 3))


@pytest.mark.skipif(not INTERPRET, reason="about Triton's interpreter")
def test_the_interpreter_patches_the_language_once_per_launch(monkeypatch, gen):
    """conftest.py: under the interpreter, a launch patches triton.language once, not again at each call of a
    @triton.jit helper inside it (the kernels' own, tl.sum, tl.cdiv), and the kernel computes the same."""
    import inspect

    from triton.runtime import interpreter

    if getattr(interpreter._patch_lang, "__wrapped__", None) is None:
        pytest.skip(f"conftest.py's patch does not apply to Triton {triton.__version__}'s interpreter (the kernels "
                    "run as they are, more slowly)")
    calls = []
    getmembers = inspect.getmembers
    monkeypatch.setattr(inspect, "getmembers", lambda obj, *a: calls.append(obj) or getmembers(obj, *a))
    x = torch.randn(16, 32, generator=gen)
    for _ in range(3):
        out = torch.full((16,), float("nan"))
        calls.clear()
        _row_sums_kernel[(16,)](x, out, N=32)
        torch.testing.assert_close(out, x.sum(1) + (x * x).sum(1) + 11)
        # triton.language, its tensor class, tl.math and the descriptors' class, for the launch; once ever,
        # triton.language.core (tl.sum's module), its tensor class and the descriptors' class (without the patch:
        # three or four more at each of the 64 helper calls, 353 with Triton 3.9)
        assert len(calls) <= 7, len(calls)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_kernel_tanh_keeps_relative_precision(dtype):
    """The kernels' own tanh (softcaps), element by element against fp64 torch.tanh, relative to each value: a few
    ulps from 1e-30 to 20 and beyond, where 2 sigmoid(2x) - 1 would lose the small values to cancellation."""
    mags = torch.cat([torch.logspace(-30, 1.3, 600, dtype=torch.float64), torch.linspace(0.3, 0.7, 401,
                                                                                          dtype=torch.float64)])
    x = torch.cat([mags, -mags]).to(dtype)
    y = torch.empty_like(x)
    x_d, y_d = x.to(DEVICE), y.to(DEVICE)
    _tanh_kernel[(triton.cdiv(x.numel(), 256),)](x_d, y_d, x.numel(), ACC=tl.float32 if dtype == torch.float32 else
                                           tl.float64, BLOCK=256)
    want = torch.tanh(x.double())
    rel = ((y_d.cpu().double() - want).abs() / want.abs()).max().item()
    # a few ulps under the interpreter; the bound leaves room for a GPU's divisions (div.full.f32)
    assert rel <= 8 * torch.finfo(dtype).eps, rel


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")   # the interpreter's sigmoid
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=ACT_DTYPE_IDS)
def test_softcapped_glu_kernels(dtype, interleaved, gen, kh):
    """Inkling 2's softcapped SwiGLU: against the twin, the fp64 formula and fp64 autograd, on values from far below
    to far beyond the caps (the kernels' own tanh: tiny values keep their relative precision); NaN stays NaN, +-inf
    saturates as torch's tanh does."""
    M, F, caps = 70, 150, (4.0, 2.5)
    h = torch.randn(M, 2 * F, generator=gen) * 6
    h[::5] *= 1e-4   # tiny gates and ups: where 2 sigmoid(2x) - 1 would cancel
    h = h.to(dtype).to(DEVICE)
    g = torch.randn(M, F, generator=gen).to(dtype).to(DEVICE)
    with poison_outputs():
        out = glu_triton(h, None, "silu_softcap", 1.0, interleaved, caps)
        dh = glu_bwd_triton(g, h, None, "silu_softcap", 1.0, interleaved, caps)
    kh.close(out.cpu(), glu_ref(h, None, "silu_softcap", 1.0, interleaved, caps).cpu(), dtype, scale=4.0)
    want = kh.glu_f64(h.cpu(), None, "silu_softcap", interleaved=interleaved, softcap=caps)
    kh.close(out.cpu(), want, dtype, scale=4.0)
    tiny = slice(None, None, 5)   # the tiny rows alone, relative to their own scale
    kh.close(out.cpu()[tiny], want[tiny], dtype, scale=4.0)
    kh.close(dh.cpu(), glu_bwd_ref(g, h, None, "silu_softcap", 1.0, interleaved, caps).cpu(), dtype, scale=4.0)
    h64 = h.cpu().double().requires_grad_()
    (dh_f64,) = torch.autograd.grad(kh.glu_f64(h64, None, "silu_softcap", interleaved=interleaved, softcap=caps),
                                    h64, g.cpu().double())
    kh.close(dh.cpu(), dh_f64, dtype, scale=8.0)
    # the caps bound the linear factors: |out| < c_gate * c_up
    assert out.cpu().double().abs().max() < caps[0] * caps[1]
    if dtype != torch.float64:   # the specials, in float32 and below
        nan, inf = float("nan"), float("inf")
        hs = torch.tensor([[nan, 1.0, inf, -inf, 2.0, nan, -inf, inf]], dtype=torch.float64)
        gs = torch.ones(1, 4, dtype=torch.float64)
        h64 = hs.clone().requires_grad_()
        gate, up = h64.chunk(2, dim=1)
        ref = caps[0] * torch.tanh(gate / caps[0]) * torch.sigmoid(gate) * caps[1] * torch.tanh(up / caps[1])
        (ref_dh,) = torch.autograd.grad(ref, h64, gs)
        hd, gd = hs.to(dtype).to(DEVICE), gs.to(dtype).to(DEVICE)
        torch.testing.assert_close(glu_triton(hd, None, "silu_softcap", 1.0, False, caps).cpu().double(),
                                   ref.detach(), equal_nan=True, rtol=2e-2, atol=1e-2)
        torch.testing.assert_close(glu_bwd_triton(gd, hd, None, "silu_softcap", 1.0, False, caps).cpu().double(),
                                   ref_dh, equal_nan=True, rtol=2e-2, atol=1e-2)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")   # the interpreter's sigmoid
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=ACT_DTYPE_IDS)
def test_postclamped_glu_kernels(dtype, interleaved, gen, kh):
    """Step 3.7's SwiGLU clamped after the activation, min(silu(gate), limit) * clamp(up, -limit, limit): against
    the twin, the fp64 formula and fp64 autograd; gates whose silu lies beyond the limit pass no gradient, gates
    beyond it whose silu does not (negative ones, where the clamp before the activation would cut) do; NaN and
    +-inf as torch.clamp treats them."""
    M, F, limit = 70, 150, 0.75
    h = torch.randn(M, 2 * F, generator=gen) * 3
    h[::9, :F] = -2.0   # silu(-2) = -0.24: within the limit after the activation
    h = h.to(dtype).to(DEVICE)
    g = torch.randn(M, F, generator=gen).to(dtype).to(DEVICE)
    with poison_outputs():
        out = glu_triton(h, limit, "silu_postclamp", 1.0, interleaved)
        dh = glu_bwd_triton(g, h, limit, "silu_postclamp", 1.0, interleaved)
    kh.close(out.cpu(), glu_ref(h, limit, "silu_postclamp", 1.0, interleaved).cpu(), dtype, scale=4.0)
    kh.close(out.cpu(), kh.glu_f64(h.cpu(), limit, "silu_postclamp", interleaved=interleaved), dtype, scale=4.0)
    kh.close(dh.cpu(), glu_bwd_ref(g, h, limit, "silu_postclamp", 1.0, interleaved).cpu(), dtype, scale=4.0)
    h64 = h.cpu().double().requires_grad_()
    (dh_f64,) = torch.autograd.grad(kh.glu_f64(h64, limit, "silu_postclamp", interleaved=interleaved), h64,
                                    g.cpu().double())
    kh.close(dh.cpu(), dh_f64, dtype, scale=8.0)
    # not the clamp before the activation
    assert not torch.allclose(out.cpu().double(), kh.glu_f64(h.cpu(), limit, "silu", interleaved=interleaved),
                              rtol=0.05)
    gate, up = (h.cpu().double()[:, 0::2], h.cpu().double()[:, 1::2]) if interleaved else \
        h.cpu().double().chunk(2, dim=1)
    d_gate, d_up = (dh.cpu()[:, 0::2], dh.cpu()[:, 1::2]) if interleaved else dh.cpu().chunk(2, dim=1)
    a = torch.nn.functional.silu(gate)
    beyond = a > limit * (1 + 1e-2)   # clear of the bound in every dtype
    assert beyond.any() and (d_gate[beyond] == 0).all() and (d_up[up.abs() > limit * (1 + 1e-2)] == 0).all()
    assert (d_gate[(gate > limit) & (a < limit * (1 - 1e-2))] != 0).any()   # gates above the limit, silu below it
    nan, inf = float("nan"), float("inf")
    hs = torch.tensor([[nan, 0.5, 2.0, inf, 1.0, nan, 0.5, -inf],
                       [-inf, nan, -3.0, 0.6, nan, 1.5, inf, -0.5]], dtype=torch.float64)
    gs = torch.tensor([[1.0, -2.0, 0.5, 3.0], [2.0, 1.0, -1.0, 0.5]], dtype=torch.float64)
    h64 = hs.clone().requires_grad_()
    sg, su = h64.chunk(2, dim=1)
    ref = torch.nn.functional.silu(sg).clamp(max=limit) * su.clamp(-limit, limit)
    (ref_dh,) = torch.autograd.grad(ref, h64, gs)
    hd, gd = hs.to(dtype).to(DEVICE), gs.to(dtype).to(DEVICE)
    for o, d in ((glu_triton(hd, limit, "silu_postclamp"), glu_bwd_triton(gd, hd, limit, "silu_postclamp")),
                 (glu_ref(hd, limit, "silu_postclamp"), glu_bwd_ref(gd, hd, limit, "silu_postclamp"))):
        torch.testing.assert_close(o.cpu().double(), ref.detach(), equal_nan=True, rtol=2e-2, atol=1e-2)
        torch.testing.assert_close(d.cpu().double(), ref_dh, equal_nan=True, rtol=2e-2, atol=1e-2)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")   # the interpreter's sigmoid
@pytest.mark.parametrize("act", PLAIN_ACTS)
@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=ACT_DTYPE_IDS)
def test_mlp_act_kernels(dtype, act, gen, kh):
    """Non-gated experts' activation: against the twin, fp64 formulas and fp64 autograd; zeros included."""
    M, F = 70, 150
    h = (torch.randn(M, F, generator=gen) * 3).to(dtype)
    h[::9, ::4] = 0.0
    h = h.to(DEVICE)
    g = torch.randn(M, F, generator=gen).to(dtype).to(DEVICE)
    with poison_outputs():
        out = mlp_act_triton(h, act)
        dh = mlp_act_bwd_triton(g, h, act)
    kh.close(out.cpu(), mlp_act_ref(h, act).cpu(), dtype, scale=4.0)
    kh.close(out.cpu(), kh.mlp_act_f64(h.cpu(), act), dtype, scale=4.0)
    kh.close(dh.cpu(), mlp_act_bwd_ref(g, h, act).cpu(), dtype, scale=4.0)
    h64 = h.cpu().double().requires_grad_()
    (dh_f64,) = torch.autograd.grad(kh.mlp_act_f64(h64, act), h64, g.cpu().double())
    kh.close(dh.cpu(), dh_f64, dtype, scale=8.0)
    if act == "relu2":   # exactly zero where h <= 0, value and gradient
        neg = h.cpu() <= 0
        assert (out.cpu()[neg] == 0).all() and (dh.cpu()[neg] == 0).all() and (out.cpu()[~neg] > 0).any()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("act", ACTS)
def test_clamped_glu_keeps_nan_and_inf_as_torch_clamp_does(dtype, act):
    """A NaN stays NaN through the clamps (not the limit), +-inf is clamped; gradients as torch's autograd gives
    them (a NaN input's clamp passes none)."""
    nan, inf = float("nan"), float("inf")
    h = torch.tensor([[nan, 0.5, 2.0, inf, 1.0, nan, 0.5, -inf],
                      [-inf, nan, 0.25, -3.0, nan, 1.5, inf, -0.5]], dtype=torch.float64)
    g = torch.tensor([[1.0, -2.0, 0.5, 3.0], [2.0, 1.0, -1.0, 0.5]], dtype=torch.float64)
    limit = 1.0
    h64 = h.clone().requires_grad_()
    gate, up = h64.chunk(2, dim=1)
    fn = {"silu": torch.nn.functional.silu, "swiglu_oai": lambda v: v * torch.sigmoid(ALPHA * v),
          "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh"),
          "gelu": torch.nn.functional.gelu}[act]
    want = fn(gate.clamp(max=limit)) * (up.clamp(-limit, limit) + (act == "swiglu_oai"))
    (want_dh,) = torch.autograd.grad(want, h64, g)
    hd, gd = h.to(dtype).to(DEVICE), g.to(dtype).to(DEVICE)
    for out, dh in ((glu_triton(hd, limit, act, ALPHA), glu_bwd_triton(gd, hd, limit, act, ALPHA)),
                    (glu_ref(hd, limit, act, ALPHA), glu_bwd_ref(gd, hd, limit, act, ALPHA))):
        torch.testing.assert_close(out.cpu().double(), want.detach(), equal_nan=True, rtol=2e-2, atol=1e-2)
        torch.testing.assert_close(dh.cpu().double(), want_dh, equal_nan=True, rtol=2e-2, atol=1e-2)


def _block_shapes(configs):
    """The distinct tile shapes of a config list (warps and stages change nothing under the interpreter)."""
    shapes = {tuple((k, v) for k, v in c.items() if k not in ("num_warps", "num_stages")) for c in configs}
    return [dict(s) for s in sorted(shapes)] if INTERPRET else configs


def _config_ids(configs):
    return ["-".join(f"{k.removeprefix('BLOCK_')}{v}" for k, v in c.items() if k.startswith("BLOCK")) for c in configs]


# Every config fits shared memory with 16-bit operands (the GPU lists are for them); the interpreter runs fp32.
CONFIG_DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
# The fallbacks are what fp64 (and any dtype whose operands overflow shared memory) runs on a GPU.
FWD_CONFIGS = _block_shapes(FWD_HOPPER_CONFIGS + FWD_FALLBACK_CONFIGS)
DW_CONFIGS = _block_shapes(DW_HOPPER_CONFIGS + DW_FALLBACK_CONFIGS)


@pytest.mark.parametrize("config", FWD_CONFIGS, ids=_config_ids(FWD_CONFIGS))
def test_grouped_mm_every_gpu_config(config, gen, kh):
    """Each autotune config the GPU may pick, run once (under the interpreter here): tiles of 64-256 against
    groups smaller than, equal to and larger than a tile, and a K that is not a multiple of BLOCK_K."""
    sizes, K, N = [0, 130, 3, 0, 64], 72, 136
    offsets = torch.tensor(sizes).cumsum(0).to(DEVICE)
    x = torch.randn(sum(sizes), K, generator=gen).to(CONFIG_DTYPE).to(DEVICE)
    w = (torch.randn(len(sizes), K, N, generator=gen) / K**0.5).to(CONFIG_DTYPE).to(DEVICE)
    with poison_outputs():
        y = grouped_mm_triton(x, w, offsets, config=config, variant="classic")
    kh.close(y.cpu(), kh.grouped_mm_f64(x.cpu(), w.cpu(), offsets.cpu()), CONFIG_DTYPE, scale=2.0)


@pytest.mark.parametrize("config", DW_CONFIGS, ids=_config_ids(DW_CONFIGS))
def test_grouped_mm_dw_every_gpu_config(config, gen, kh):
    sizes, K, N = [70, 0, 5, 100], 136, 72
    offsets = torch.tensor(sizes).cumsum(0).to(DEVICE)
    x = torch.randn(sum(sizes), K, generator=gen).to(CONFIG_DTYPE).to(DEVICE)
    dy = torch.randn(sum(sizes), N, generator=gen).to(CONFIG_DTYPE).to(DEVICE)
    with poison_outputs():
        dw = grouped_mm_dw_triton(x, dy, offsets, config=config)
    kh.close(dw.cpu(), kh.grouped_mm_dw_f64(x.cpu(), dy.cpu(), offsets.cpu()), CONFIG_DTYPE, scale=20.0)


def test_elementwise_kernels_every_gpu_config(gen, kh):
    T, K, E, D = 5, 2, 4, 2100  # D not a multiple of any BLOCK_D
    _, src, dst, w = _routing(T, K, E, gen, kh)
    src, dst, w = src.to(DEVICE), dst.to(DEVICE), w.to(DEVICE)
    x = torch.randn(T, D, generator=gen).to(DEVICE)
    y = torch.randn(T * K, D, generator=gen).to(DEVICE)
    with poison_outputs():
        for config in PERMUTE_HOPPER_CONFIGS:
            assert torch.equal(permute_triton(x, src, dst, config=config), permute_ref(x, src, dst))
        for config in UNPERMUTE_HOPPER_CONFIGS:
            assert torch.equal(unpermute_triton(y, src, dst, w, config=config), unpermute_ref(y, src, dst, w))
        for config in UNPERMUTE_BWD_HOPPER_CONFIGS:
            dy, dw = unpermute_bwd_triton(x, y, src, dst, w, True, config=config)
            dy_ref, dw_ref = unpermute_bwd_ref(x, y, src, dst, w, True)
            assert torch.equal(dy, dy_ref)
            torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-4)
        h = torch.randn(T, 2 * D, generator=gen).to(DEVICE)
        for config in GLU_HOPPER_CONFIGS:
            kh.close(glu_triton(h, config=config).cpu(), kh.glu_f64(h.cpu()), torch.float32, scale=4.0)
            kh.close(glu_bwd_triton(x, h, config=config).cpu(), glu_bwd_ref(x, h).cpu(), torch.float32)
