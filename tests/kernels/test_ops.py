"""The public ops on CPU tensors (pure-torch twins behind the custom ops), against float64 computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import feplb.kernels as fk

ROUTING_CASES = {  # id: (T, K, E, skew, used_experts)
    "uniform": (37, 4, 8, 0.0, None),
    "skewed": (50, 2, 6, 1.5, None),
    "empty-experts": (23, 3, 10, 0.0, 4),
    "single-expert": (9, 1, 1, 0.0, None),
    "T0": (0, 2, 5, 0.0, None),
}


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["ids32", "ids64"])
@pytest.mark.parametrize("case", list(ROUTING_CASES), ids=list(ROUTING_CASES))
def test_routing_metadata(case, ids_dtype, gen, kh):
    T, K, E, skew, used = ROUTING_CASES[case]
    ids, _ = kh.random_routing(T, K, E, gen=gen, skew=skew, used_experts=used, ids_dtype=ids_dtype)
    meta = fk.routing_metadata(ids, E)
    counts, ends, src, dst = kh.routing_f64(ids, E)
    assert (meta.num_experts, meta.top_k, meta.num_tokens, meta.num_rows) == (E, K, T, T * K)
    assert all(t.dtype == torch.int32 for t in (meta.counts_E, meta.offsets_E, meta.src_idx_M, meta.dst_idx_TK))
    assert torch.equal(meta.counts_E.long(), counts)
    assert torch.equal(meta.offsets_E.long(), ends.long())
    assert torch.equal(meta.src_idx_M.long(), src)
    assert torch.equal(meta.dst_idx_TK.long(), dst)
    # Invariants: every (t, k) row lands exactly once, in its expert's range.
    assert int(meta.counts_E.sum()) == T * K
    assert torch.equal(meta.src_idx_M.long()[meta.dst_idx_TK.long().reshape(-1)], torch.arange(T * K))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_permute_unpermute(dtype, gen, kh):
    T, K, E, D = 29, 3, 7, 24
    ids, w = kh.random_routing(T, K, E, gen=gen, used_experts=5)
    meta = fk.routing_metadata(ids, E)
    x = torch.randn(T, D, generator=gen).to(dtype)
    x_MD = fk.permute(x, meta)
    flat_tok = torch.arange(T).repeat_interleave(K)
    assert torch.equal(x_MD, x[flat_tok[meta.src_idx_M.long()]])
    # Rows of one expert are contiguous in grouped order.
    assert torch.equal(ids.reshape(-1)[meta.src_idx_M.long()], kh.group_ids(meta.offsets_E, T * K))
    y = torch.randn(T * K, D, generator=gen).to(dtype)
    out = fk.unpermute(y, meta, w)
    assert out.dtype == dtype
    kh.close(out, kh.unpermute_f64(y, meta.dst_idx_TK, w), dtype)


def test_permute_then_unpermute_restores_tokens(gen, kh):
    T, K, E, D = 17, 4, 6, 8
    ids, w = kh.random_routing(T, K, E, gen=gen)
    meta = fk.routing_metadata(ids, E)
    x = torch.randn(T, D, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(fk.unpermute(fk.permute(x, meta), meta, w), x * w.double().sum(1, keepdim=True))


GMM_CASES = {  # id: (group sizes, K, N)
    "uniform": ([8, 8, 8], 16, 12),
    "empty-groups": ([0, 5, 0, 11, 0], 9, 7),
    "all-empty": ([0, 0], 5, 3),
    "one-big-group": ([70], 33, 40),
    "K0": ([3, 4], 0, 5),
}


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64], ids=["off32", "off64"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=["fp32", "bf16", "fp16", "fp64"]
)
@pytest.mark.parametrize("case", list(GMM_CASES), ids=list(GMM_CASES))
def test_grouped_mm_forward(case, dtype, offsets_dtype, gen, kh):
    sizes, K, N = GMM_CASES[case]
    offsets = torch.tensor(sizes).cumsum(0).to(offsets_dtype)
    x = torch.randn(sum(sizes), K, generator=gen).to(dtype)
    w = torch.randn(len(sizes), K, N, generator=gen).to(dtype)
    with fk.poison_outputs():
        y = fk.grouped_mm(x, w, offsets)
    assert y.dtype == dtype and y.shape == (sum(sizes), N)
    kh.close(y, kh.grouped_mm_f64(x, w, offsets), dtype, scale=max(1.0, K**0.5))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("limit", [None, 1.5], ids=["plain", "clamped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_glu(dtype, limit, act, gen, kh):
    h = (torch.randn(13, 2 * 10, generator=gen) * 3).to(dtype)
    out = fk.glu(h, limit, act, 1.702)
    assert out.shape == (13, 10) and out.dtype == dtype
    kh.close(out, kh.glu_f64(h, limit, act, 1.702), dtype, scale=4.0)
    if limit is not None:   # the clamp changed something
        assert not torch.allclose(out.double(), kh.glu_f64(h, None, act, 1.702), rtol=0.05)
    if act != "silu":   # not SwiGLU under another name
        assert not torch.allclose(out.double(), kh.glu_f64(h, limit, "silu"), rtol=0.05)
    if act == "swiglu_oai":   # alpha reaches it
        assert not torch.allclose(out.double(), kh.glu_f64(h, limit, act, 1.0), rtol=0.05)
    if act == "silu":
        assert torch.equal(fk.swiglu(h, limit), out)


@pytest.mark.parametrize("limit", [0, -1.0, float("inf"), float("nan"), True, "2", np.float32(np.inf)])
def test_glu_rejects_a_bad_limit(limit):
    with pytest.raises(ValueError, match="limit: expected None or a finite number > 0"):
        fk.swiglu(torch.randn(3, 4), limit)


def test_glu_takes_numpy_scalars():
    """A numpy scalar (a config read from a numpy array, say) is a number: the same result as the Python float."""
    h = torch.randn(5, 8)
    assert torch.equal(fk.glu(h, np.float32(2.5), "swiglu_oai", np.float64(1.702)), fk.glu(h, 2.5, "swiglu_oai", 1.702))
    assert torch.equal(fk.glu(h, None, "silu_softcap", 1.0, False, (np.float32(4.0), np.int64(3))),
                       fk.glu(h, None, "silu_softcap", 1.0, False, (4.0, 3)))


@pytest.mark.parametrize("act", ["relu", "gelu_new", "", None, "SILU"])
def test_glu_rejects_an_unknown_activation(act):
    with pytest.raises(ValueError, match=r"act: expected one of \('silu', 'gelu_tanh', 'gelu', 'swiglu_oai', "
                                         r"'silu_softcap', 'silu_postclamp'\)"):
        fk.glu(torch.randn(3, 4), None, act)


def test_softcapped_glu(gen, kh):
    """Inkling 2's SwiGLU with softcapped linear factors: against its formula in fp64, gradients by gradcheck; the
    caps reach it; bad softcaps and a clamp with it refused."""
    h = torch.randn(13, 10, generator=gen) * 6
    out = fk.glu(h, None, "silu_softcap", 1.0, False, (4.0, 2.5))
    kh.close(out, kh.glu_f64(h, None, "silu_softcap", softcap=(4.0, 2.5)), torch.float32, scale=4.0)
    assert not torch.allclose(out.double(), kh.glu_f64(h, None, "silu_softcap", softcap=(4.0, 25.0)), rtol=0.05)
    assert not torch.allclose(out.double(), kh.glu_f64(h, None, "silu_softcap", softcap=(40.0, 2.5)), rtol=0.05)
    h64 = h.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: fk.glu(t, None, "silu_softcap", 1.0, True, (4.0, 2.5)), (h64,))
    for bad in (None, (4.0,), (4.0, -1.0), (float("nan"), 1.0), (4.0, True)):
        with pytest.raises(ValueError, match=r"softcap: silu_softcap expects \(c_gate, c_up\)"):
            fk.glu(h, None, "silu_softcap", 1.0, False, bad)
    with pytest.raises(ValueError, match="takes softcaps, not a clamp"):
        fk.glu(h, 2.0, "silu_softcap", 1.0, False, (4.0, 2.5))
    with pytest.raises(ValueError, match="only .*silu_softcap.* take softcaps"):
        fk.glu(h, None, "silu", 1.0, False, (4.0, 2.5))


def test_postclamped_glu(gen, kh):
    """Step 3.7's SwiGLU clamped after the activation: against its formula in fp64 (and not the clamp before it),
    gradients by gradcheck; a limit is required."""
    h = torch.randn(13, 10, generator=gen) * 3
    out = fk.glu(h, 0.6, "silu_postclamp")
    kh.close(out, kh.glu_f64(h, 0.6, "silu_postclamp"), torch.float32, scale=4.0)
    assert not torch.allclose(out.double(), kh.glu_f64(h, 0.6, "silu"), rtol=0.05)
    assert not torch.allclose(out.double(), kh.glu_f64(h, None, "silu"), rtol=0.05)
    h64 = h.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: fk.glu(t, 0.6, "silu_postclamp", 1.0, True), (h64,))
    with pytest.raises(ValueError, match="silu_postclamp clamps after the activation and needs a limit"):
        fk.glu(h, None, "silu_postclamp")
    with pytest.raises(ValueError, match="only .*silu_softcap.* take softcaps"):
        fk.glu(h, 0.6, "silu_postclamp", 1.0, False, (4.0, 2.5))


@pytest.mark.parametrize("act", ["relu2", "silu", "gelu_tanh", "gelu"])
def test_mlp_act(act, gen, kh):
    h = (torch.randn(13, 10, generator=gen) * 3)
    out = fk.mlp_act(h, act)
    kh.close(out, kh.mlp_act_f64(h, act), torch.float32, scale=4.0)
    h64 = h.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: fk.mlp_act(t, act), (h64,))


@pytest.mark.parametrize("act", ["swiglu_oai", "relu", None])
def test_mlp_act_rejects_an_unknown_activation(act):
    with pytest.raises(ValueError, match=r"act: expected one of \('silu', 'gelu_tanh', 'gelu', 'relu2'\)"):
        fk.mlp_act(torch.randn(3, 4), act)


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), True, "1.7"])
def test_glu_rejects_a_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha: expected a finite number"):
        fk.glu(torch.randn(3, 4), None, "swiglu_oai", alpha)


def _expert_block_f64(x, w, w1, w2, ids, E):
    """The SwiGLU MoE block by per-(token, k) loops in float64: sum_k w_k * (silu(x W1g) * (x W1u)) W2."""
    T, K = ids.shape
    F = w2.shape[1]
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            h = x[t].double() @ w1[e].double()
            a = torch.nn.functional.silu(h[:F]) * h[F:]
            out[t] += w[t, k].double() * (a @ w2[e].double())
    return out


def test_expert_block_forward_and_gradients(gen, kh):
    T, K, E, H, F = 11, 2, 5, 6, 4
    ids, w = kh.random_routing(T, K, E, gen=gen, used_experts=4)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64, requires_grad=True)
    w = w.double().requires_grad_()
    w1 = (torch.randn(E, H, 2 * F, generator=gen, dtype=torch.float64) / H**0.5).requires_grad_()
    w2 = (torch.randn(E, F, H, generator=gen, dtype=torch.float64) / F**0.5).requires_grad_()

    def block(x, w, w1, w2):
        meta = fk.routing_metadata(ids, E)
        h = fk.grouped_mm(fk.permute(x, meta), w1, meta.offsets_E)
        return fk.unpermute(fk.grouped_mm(fk.swiglu(h), w2, meta.offsets_E), meta, w)

    out = block(x, w, w1, w2)
    torch.testing.assert_close(out, _expert_block_f64(x.detach(), w.detach(), w1.detach(), w2.detach(), ids, E))
    grads = torch.autograd.grad(out.square().sum(), (x, w, w1, w2))
    expected = torch.autograd.grad(_expert_block_f64(x, w, w1, w2, ids, E).square().sum(), (x, w, w1, w2))
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e)
    assert torch.autograd.gradcheck(block, (x, w, w1, w2))


def test_unpermute_gradient_without_weight_grad(gen, kh):
    T, K, E, D = 7, 2, 3, 5
    ids, w = kh.random_routing(T, K, E, gen=gen)
    meta = fk.routing_metadata(ids, E)
    y = torch.randn(T * K, D, generator=gen, requires_grad=True)
    fk.unpermute(y, meta, w).sum().backward()
    assert torch.equal(y.grad, w.reshape(-1)[meta.src_idx_M.long()][:, None].expand(-1, D))


@pytest.mark.skipif(not (fk.HAVE_TRITON and fk.INTERPRET), reason="needs Triton's interpreter")
@pytest.mark.parametrize(("T", "K", "E"), [(300, 4, 200), (257, 2, 3), (1, 1, 1)], ids=["many-experts", "E3", "T1"])
def test_routing_op_runs_the_kernels_like_the_twin(T, K, E, gen, kh):
    """The custom op through the Triton kernels (histogram, one cumsum, scatter) equals the loop reference; the
    first case spans two row blocks of the interpreter's default block size."""
    ids, _ = kh.random_routing(T, K, E, gen=gen, skew=1.0)
    with fk.triton_on_cpu():
        meta = fk.routing_metadata(ids, E)
    counts, ends, src, dst = kh.routing_f64(ids, E)
    assert meta.checked
    assert torch.equal(meta.counts_E.long(), counts)
    assert torch.equal(meta.offsets_E.long(), ends.long())
    assert torch.equal(meta.src_idx_M.long(), src)
    assert torch.equal(meta.dst_idx_TK.long(), dst)
