"""The feplb:: operators as torch sees them: opcheck (schema, fake impls, autograd registration, AOT dispatch),
gradcheck of the public ops (their autograd Functions) in float64, the operators' own autograd (called directly,
as an exported graph calls them) against the public ops, first derivatives only, and torch.compile(fullgraph=True)
of a SwiGLU expert block built from them. Each runs on the pure-torch twins (CPU dispatch), through
``triton_on_cpu`` under the interpreter on the Triton kernels, and, where a GPU is present, on CUDA tensors (the
Triton kernels as dispatched in training).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import feplb.kernels as fk

IMPLS = ["torch"]
if fk.HAVE_TRITON and fk.INTERPRET:
    IMPLS.append("triton")
if fk.HAVE_TRITON and torch.cuda.is_available():
    IMPLS.append("cuda")


def impl_context(impl: str):
    return fk.triton_on_cpu() if impl == "triton" else contextlib.nullcontext()


def _dev(impl: str) -> str:
    return "cuda" if impl == "cuda" else "cpu"


def _problem(gen, kh, *, T=9, K=2, E=4, H=8, F=6, dtype=torch.float64, device="cpu"):
    ids, w = kh.random_routing(T, K, E, gen=gen, used_experts=3)  # one expert left empty
    x = torch.randn(T, H, generator=gen).to(dtype)
    w1 = torch.randn(E, H, 2 * F, generator=gen) / H**0.5
    w2 = torch.randn(E, F, H, generator=gen) / F**0.5
    leaves = [t.to(dtype).to(device).requires_grad_() for t in (x, w, w1, w2)]
    return ids.to(device), E, *leaves


def expert_block(x_TH, weights_TK, w1_EH2F, w2_EFH, topk_ids_TK, num_experts: int):
    meta = fk.routing_metadata(topk_ids_TK, num_experts)
    h = fk.grouped_mm(fk.permute(x_TH, meta), w1_EH2F, meta.offsets_E)
    y = fk.grouped_mm(fk.swiglu(h), w2_EFH, meta.offsets_E)
    return fk.unpermute(y, meta, weights_TK)


@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck(impl, gen, kh):
    ids, E, x, w, w1, _ = _problem(gen, kh, device=_dev(impl))
    meta = fk.routing_metadata(ids, E)
    src, dst = meta.src_idx_M, meta.dst_idx_TK
    x_MD = fk.permute(x, meta).detach().requires_grad_()
    h = torch.randn(x_MD.shape[0], 12, dtype=torch.float64, generator=gen).to(x.device).requires_grad_()
    grad = torch.randn(x.shape, dtype=torch.float64, generator=gen).to(x.device)
    cases = [
        (torch.ops.feplb.routing_metadata.default, (ids, E, True)),
        (torch.ops.feplb.permute.default, (x, src, dst)),
        (torch.ops.feplb.unpermute.default, (x_MD, src, dst, w)),
        (torch.ops.feplb.unpermute.default, (x_MD, src, dst, None)),
        (torch.ops.feplb.unpermute_bwd.default, (grad, x_MD.detach(), src, dst, w.detach(), True)),
        (torch.ops.feplb.grouped_mm.default, (x_MD, w1, meta.offsets_E, True)),
        (torch.ops.feplb.grouped_mm.default, (x_MD, w1, meta.offsets_E.long(), False)),
        (torch.ops.feplb.grouped_mm_dw.default, (x_MD.detach(), h.detach(), meta.offsets_E)),
        (torch.ops.feplb.permute.default, (x, src, dst, False)),
        (torch.ops.feplb.unpermute.default, (x_MD, src, dst, w, False)),
        (torch.ops.feplb.unpermute_bwd.default, (grad, x_MD.detach(), src, dst, w.detach(), True, False)),
        (torch.ops.feplb.grouped_mm_dw.default, (x_MD.detach(), h.detach(), meta.offsets_E, False)),
        (torch.ops.feplb.glu.default, (h, None)),
        (torch.ops.feplb.glu.default, (h, 0.5)),
        (torch.ops.feplb.glu.default, (h, None, "gelu_tanh")),
        (torch.ops.feplb.glu.default, (h, 0.5, "gelu")),
        (torch.ops.feplb.glu.default, (h, 0.5, "swiglu_oai", 1.702)),
        (torch.ops.feplb.glu.default, (h, 0.5, "swiglu_oai", 1.702, True)),
        (torch.ops.feplb.glu.default, (h, None, "silu_softcap", 1.0, True, [0.7, 1.5])),
        (torch.ops.feplb.glu.default, (h, 0.3, "silu_postclamp")),
        (torch.ops.feplb.glu_bwd.default, (h.detach()[:, :6].contiguous(), h.detach(), None)),
        (torch.ops.feplb.glu_bwd.default, (h.detach()[:, :6].contiguous(), h.detach(), 0.5)),
        (torch.ops.feplb.glu_bwd.default, (h.detach()[:, :6].contiguous(), h.detach(), None, "gelu_tanh")),
        (torch.ops.feplb.glu_bwd.default, (h.detach()[:, :6].contiguous(), h.detach(), 0.5, "gelu")),
        (torch.ops.feplb.glu_bwd.default, (h.detach()[:, :6].contiguous(), h.detach(), 0.5, "swiglu_oai", 1.702)),
        (torch.ops.feplb.glu_bwd.default, (h.detach()[:, :6].contiguous(), h.detach(), None, "silu", 1.0, True)),
        (torch.ops.feplb.glu_bwd.default, (h.detach()[:, :6].contiguous(), h.detach(), None, "silu_softcap", 1.0,
                                           False, [0.7, 1.5])),
        (torch.ops.feplb.glu_bwd.default, (h.detach()[:, :6].contiguous(), h.detach(), 0.3, "silu_postclamp")),
        (torch.ops.feplb.mlp_act.default, (h, "relu2")),
        (torch.ops.feplb.mlp_act.default, (h, "gelu_tanh")),
        (torch.ops.feplb.mlp_act_bwd.default, (h.detach().clone(), h.detach(), "relu2")),
    ]
    with impl_context(impl):
        for op, args in cases:
            torch.library.opcheck(op, args)


@pytest.mark.parametrize("impl", IMPLS)
def test_operators_called_directly_check_their_index_values(impl, gen, kh):
    """The operators called directly (an exported graph, a caller of torch.ops.feplb) check the index values they
    read rows with, as the public ops check their metadata: an index out of range read out of bounds on the Triton
    path (garbage, or a crash) and wrapped around on the twin (a negative one); offsets short of M dropped rows from
    dW on the Triton path. Each is a ValueError naming the tensor, on every path."""
    ids, E, x, w, w1, _ = _problem(gen, kh, device=_dev(impl))
    meta = fk.routing_metadata(ids, E)
    M, T = meta.num_rows, x.shape[0]
    x_MD = fk.permute(x, meta).detach()
    grad = torch.randn(x.shape, dtype=torch.float64, generator=gen).to(x.device)
    h = torch.randn(M, 12, dtype=torch.float64, generator=gen).to(x.device)
    x, w = x.detach(), w.detach()
    pos = int(torch.randint(M, (1,), generator=gen))
    for name, bad_value, match in (("src", -2, r"src_idx_M: expected indices in \[0, %d\)" % M),
                                   ("src", 10**7, r"src_idx_M: expected indices in \[0, %d\)" % M),
                                   ("dst", -1, r"dst_idx_TK: expected indices in \[0, %d\)" % M),
                                   ("dst", M, r"dst_idx_TK: expected indices in \[0, %d\)" % M),
                                   # in range, but not the inverse of the other
                                   ("swap", None, "dst_idx_TK: expected the inverse permutation of src_idx_M")):
        src, dst = meta.src_idx_M.clone(), meta.dst_idx_TK.clone()
        if name == "src":
            src[pos] = bad_value
        elif name == "dst":
            dst.view(-1)[pos] = bad_value
        else:
            src[[0, M - 1]] = src[[M - 1, 0]]
        calls = {"permute": lambda s=src, d=dst: torch.ops.feplb.permute(x, s, d),
                 "unpermute": lambda s=src, d=dst: torch.ops.feplb.unpermute(x_MD, s, d, w),
                 "unpermute (no weights)": lambda s=src, d=dst: torch.ops.feplb.unpermute(x_MD, s, d, None),
                 "unpermute_bwd": lambda s=src, d=dst: torch.ops.feplb.unpermute_bwd(grad, x_MD, s, d, w, True)}
        with impl_context(impl):
            for what, call in calls.items():
                with pytest.raises(ValueError, match=match):
                    call()
                    pytest.fail(f"{what} {name}={bad_value}: no error")
    offsets = meta.offsets_E.clamp(max=M - 1)   # (the last row in no group)
    with impl_context(impl), pytest.raises(ValueError, match=f"last end offset to equal M = {M}, got {M - 1}"):
        torch.ops.feplb.grouped_mm_dw(x_MD, h, offsets)
    assert T * 2 == M


def test_gradcheck_expert_block(gen, kh):
    ids, E, x, w, w1, w2 = _problem(gen, kh, T=5, H=4, F=3)
    assert torch.autograd.gradcheck(lambda *a: expert_block(*a, ids, E), (x, w, w1, w2))


def _off_corners(h: torch.Tensor, limit: float) -> torch.Tensor:
    """h with every element at least 0.05 away from +-limit (gradcheck perturbs by 1e-6)."""
    near = (h.abs() - limit).abs() < 0.05
    return torch.where(near, h * 0.5, h)


@pytest.mark.parametrize("op", ["permute", "unpermute", "grouped_mm", "swiglu", "swiglu_clamped", "geglu_tanh",
                                "geglu_clamped", "swiglu_oai_clamped", "swiglu_oai_interleaved",
                                "swiglu_softcap"])
@pytest.mark.parametrize("impl", IMPLS)
def test_gradcheck_ops(impl, op, gen, kh):
    """Each op's backward in float64; fast mode, because every evaluation runs the interpreter."""
    ids, E, x, w, w1, _ = _problem(gen, kh, T=5, H=4, F=3, device=_dev(impl))
    meta = fk.routing_metadata(ids, E)
    M = meta.num_rows
    y = torch.randn(M, 4, dtype=torch.float64, generator=gen).to(x.device).requires_grad_()
    fns = {
        "permute": (lambda x: fk.permute(x, meta), (x,)),
        "unpermute": (lambda y, w: fk.unpermute(y, meta, w), (y, w)),
        "grouped_mm": (lambda y, w1: fk.grouped_mm(y, w1, meta.offsets_E), (y, w1)),
        "swiglu": (fk.swiglu, (torch.randn(M, 6, dtype=torch.float64, generator=gen).to(x.device).requires_grad_(),)),
        # inputs away from the clamps' corners (where the derivative jumps, which finite differences cannot take)
        "swiglu_clamped": (lambda h: fk.swiglu(h, 0.75),
                           (_off_corners(torch.randn(M, 6, dtype=torch.float64, generator=gen), 0.75)
                            .to(x.device).requires_grad_(),)),
        "geglu_tanh": (lambda h: fk.glu(h, None, "gelu_tanh"),
                       (torch.randn(M, 6, dtype=torch.float64, generator=gen).to(x.device).requires_grad_(),)),
        "geglu_clamped": (lambda h: fk.glu(h, 0.75, "gelu"),
                          (_off_corners(torch.randn(M, 6, dtype=torch.float64, generator=gen), 0.75)
                           .to(x.device).requires_grad_(),)),
        "swiglu_oai_clamped": (lambda h: fk.glu(h, 0.75, "swiglu_oai", 1.702),
                               (_off_corners(torch.randn(M, 6, dtype=torch.float64, generator=gen), 0.75)
                                .to(x.device).requires_grad_(),)),
        # _off_corners keeps every value off 0.75 whatever the layout
        "swiglu_oai_interleaved": (lambda h: fk.glu(h, 0.75, "swiglu_oai", 1.702, True),
                                   (_off_corners(torch.randn(M, 6, dtype=torch.float64, generator=gen), 0.75)
                                    .to(x.device).requires_grad_(),)),
        # caps that bend the values (Inkling 2's are 4 and 25 on far larger activations)
        "swiglu_softcap": (lambda h: fk.glu(h, None, "silu_softcap", 1.0, False, (0.8, 1.5)),
                           ((torch.randn(M, 6, dtype=torch.float64, generator=gen) * 2).to(x.device)
                            .requires_grad_(),)),
    }
    fn, args = fns[op]
    with impl_context(impl):
        assert torch.autograd.gradcheck(fn, args, fast_mode=impl == "triton")


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_match_twin(impl, gen, kh):
    """fp32 gradients of the whole block on the chosen impl equal float64 autograd within fp32 tolerance."""
    ids, E, x, w, w1, w2 = _problem(gen, kh, dtype=torch.float32, device=_dev(impl))
    with impl_context(impl):
        out = expert_block(x, w, w1, w2, ids, E)
        grads = torch.autograd.grad(out.square().sum(), (x, w, w1, w2))
    leaves64 = [t.detach().cpu().double().requires_grad_() for t in (x, w, w1, w2)]
    out64 = expert_block(*leaves64, ids.cpu(), E)
    expected = torch.autograd.grad(out64.square().sum(), leaves64)
    torch.testing.assert_close(out.cpu().double(), out64, rtol=1e-5, atol=1e-5)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g.cpu().double(), e, rtol=1e-4, atol=1e-5)


# Inductor compiles the graph around the opaque ops; on the CPU it is checked with the twins (the interpreter
# inside it would only repeat the aot_eager case, slower).
COMPILE_CASES = [("torch", "aot_eager"), ("torch", "inductor")] + [("triton", "aot_eager")] * ("triton" in IMPLS)
COMPILE_CASES += [("cuda", "aot_eager"), ("cuda", "inductor")] * ("cuda" in IMPLS)


@pytest.mark.parametrize(("impl", "backend"), COMPILE_CASES, ids=["-".join(c) for c in COMPILE_CASES])
def test_torch_compile_fullgraph(impl, backend, gen, kh):
    ids, E, x, w, w1, w2 = _problem(gen, kh, dtype=torch.float32, device=_dev(impl))
    torch._dynamo.reset()
    compiled = torch.compile(expert_block, backend=backend, fullgraph=True)
    with impl_context(impl):
        out = compiled(x, w, w1, w2, ids, E)
        grads = torch.autograd.grad(out.sum(), (x, w, w1, w2))
        out_eager = expert_block(x, w, w1, w2, ids, E)
        grads_eager = torch.autograd.grad(out_eager.sum(), (x, w, w1, w2))
    torch.testing.assert_close(out, out_eager)
    for g, e in zip(grads, grads_eager, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("impl", IMPLS)
def test_expert_block_with_no_tokens(impl, gen, kh):
    ids, E, x, w, w1, w2 = _problem(gen, kh, T=0, dtype=torch.float32, device=_dev(impl))
    with impl_context(impl), fk.poison_outputs():
        out = expert_block(x, w, w1, w2, ids, E)
        grads = torch.autograd.grad(out.sum(), (x, w, w1, w2), allow_unused=True)
    assert out.shape == (0, x.shape[1])
    assert grads[0].shape == x.shape and grads[1].shape == w.shape
    # No rows: the expert weights get an exact zero gradient, not uninitialised memory.
    assert torch.equal(grads[2], torch.zeros_like(w1)) and torch.equal(grads[3], torch.zeros_like(w2))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("draw", range(4))
def test_random_shapes(impl, draw, gen, kh):
    """Random (T, K, E, D, N, dtype, ids/offsets dtype) through routing -> permute -> grouped_mm -> unpermute,
    against float64 loops; outputs poisoned."""
    T = int(torch.randint(0, 40, (1,), generator=gen))
    E = int(torch.randint(1, 9, (1,), generator=gen))
    K = int(torch.randint(1, E + 1, (1,), generator=gen))
    used = int(torch.randint(K, E + 1, (1,), generator=gen))
    D, N = (int(v) for v in torch.randint(1, 48, (2,), generator=gen))
    dtype = [torch.float32, torch.bfloat16, torch.float16][int(torch.randint(0, 3, (1,), generator=gen))]
    ids_dtype = [torch.int32, torch.int64][draw % 2]
    ids, w = kh.random_routing(T, K, E, gen=gen, used_experts=used, ids_dtype=ids_dtype)
    x = torch.randn(T, D, generator=gen).to(dtype)
    w1 = (torch.randn(E, D, N, generator=gen) / D**0.5).to(dtype)
    dev = _dev(impl)
    with impl_context(impl), fk.poison_outputs():
        meta = fk.routing_metadata(ids.to(dev), E)
        offsets = meta.offsets_E.to(ids_dtype)
        out = fk.unpermute(fk.grouped_mm(fk.permute(x.to(dev), meta), w1.to(dev), offsets), meta, w.to(dev))
    expected = torch.zeros(T, N, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            expected[t] += float(w[t, k]) * (x[t].double() @ w1[int(ids[t, k])].double())
    kh.close(out.cpu(), expected, dtype, scale=4.0)


def raw_expert_block(x_TH, weights_TK, w1_EH2F, w2_EFH, topk_ids_TK, num_experts: int):
    """expert_block through the torch.ops.feplb operators themselves (their registered autograd)."""
    ops = torch.ops.feplb
    _, offsets, src, dst = ops.routing_metadata(topk_ids_TK, num_experts, True)
    h = ops.grouped_mm(ops.permute(x_TH, src, dst), w1_EH2F, offsets, True)
    y = ops.grouped_mm(ops.glu(h), w2_EFH, offsets, True)
    return ops.unpermute(y, src, dst, weights_TK)


@pytest.mark.parametrize("impl", IMPLS)
def test_operators_differentiate_like_the_public_ops(impl, gen, kh):
    """Called directly, the operators record the same gradients as the public ops (their autograd Functions): on
    the Triton path too, where nothing else would record a graph."""
    ids, E, x, w, w1, w2 = _problem(gen, kh, dtype=torch.float32, device=_dev(impl))
    with impl_context(impl):
        out = expert_block(x, w, w1, w2, ids, E)
        grads = torch.autograd.grad(out.square().sum(), (x, w, w1, w2))
        raw = raw_expert_block(x, w, w1, w2, ids, E)
        raw_grads = torch.autograd.grad(raw.square().sum(), (x, w, w1, w2))
    assert raw.grad_fn is not None
    torch.testing.assert_close(raw, out, rtol=0, atol=0)
    for g, e in zip(raw_grads, grads, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("call", ["public", "operators"])
def test_second_derivatives_are_refused(call, gen, kh):
    ids, E, x, w, w1, w2 = _problem(gen, kh, dtype=torch.float64)
    block = expert_block if call == "public" else raw_expert_block
    out = block(x, w, w1, w2, ids, E)
    with pytest.raises(RuntimeError, match="first derivatives only"):
        torch.autograd.grad(out.square().sum(), (x, w1), create_graph=True)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
@pytest.mark.parametrize("impl", IMPLS)
def test_exported_block_trains_like_eager(impl, strict, gen, kh):
    """torch.export keeps the operators in its graph; the exported module's gradients are the eager block's (on the
    Triton path, where only the operators' own autograd can record them)."""
    ids, E, x, w, w1, w2 = _problem(gen, kh, dtype=torch.float32, device=_dev(impl))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = torch.nn.Parameter(w1.detach().clone()), torch.nn.Parameter(w2.detach().clone())

        def forward(self, x_TH, weights_TK, topk_ids_TK):
            return expert_block(x_TH, weights_TK, self.w1, self.w2, topk_ids_TK, E)

    block = Block()
    with impl_context(impl):
        exported = torch.export.export(block, (x.detach(), w.detach(), ids), strict=strict).module()
        want = torch.autograd.grad(block(x, w, ids).square().sum(), (x, w, block.w1, block.w2))
        got_out = exported(x, w, ids)
        got = torch.autograd.grad(got_out.square().sum(), (x, w, *exported.parameters()), allow_unused=True)
    assert len(got) == 4
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("dynamic", [None, True])
def test_compiled_block_serves_every_token_count(dynamic, gen, kh):
    """One graph for every token count T (torch.compile's static one for the first T where dynamic=None, then one
    dynamic graph): no check may turn T into text, which would fix the graph to it (a compile per T, and with
    fullgraph=True a hard failure past the recompile limit)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(expert_block, backend=counter, fullgraph=True, dynamic=dynamic)
    for T in (13, 17, 5, 31, 40, 41, 42, 43, 44, 9):   # (none equal to a weight dim: duck sizing would tie them)
        ids, E, x, w, w1, w2 = _problem(gen, kh, T=T, dtype=torch.float32)
        out = compiled(x, w, w1, w2, ids, E)
        torch.testing.assert_close(out, expert_block(x, w, w1, w2, ids, E))
    assert counter.frame_count == (2 if dynamic is None else 1), counter.frame_count


def test_glu_compiles_with_symbolic_floats(gen):
    """Under dynamic=True a float argument is symbolic: glu's finiteness checks become runtime checks instead of
    refusing to trace, and still refuse a non-finite value."""
    h = torch.randn(7, 12, generator=gen)
    torch._dynamo.reset()
    compiled = torch.compile(fk.glu, backend="aot_eager", fullgraph=True, dynamic=True)
    for args in ((), (1.5,), (None, "swiglu_oai", 1.702), (7.0, "swiglu_oai", 1.3)):
        torch.testing.assert_close(compiled(h, *args), fk.glu(h, *args), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="alpha: expected a finite number"):
        compiled(h, None, "swiglu_oai", float("inf"))
    with pytest.raises(ValueError, match="alpha: expected a finite number, got inf"):
        fk.glu(h, None, "swiglu_oai", float("inf"))


@pytest.mark.parametrize(("args", "message"), [
    ((-0.5,), "limit: expected a number > 0"),
    ((0.0, "swiglu_oai", 1.702), "limit: expected a number > 0"),
    ((None, "silu_softcap", 1.0, False, (-1.0, 3.0)), "softcap: expected numbers > 0"),
    ((None, "silu_softcap", 1.0, False, (2.0, 0.0)), "softcap: expected numbers > 0"),
], ids=["limit-negative", "limit-zero", "softcap-negative", "softcap-zero"])
def test_glu_compiled_refuses_a_non_positive_limit_or_softcap(args, message, gen):
    """Under dynamic=True, a limit or softcap <= 0 is refused with a message naming it, as a non-finite one is: the
    eager check's message, which formats the value, failed to trace for a symbolic float (Dynamo's "BUILD_STRING
    type error" or "repr_impl not implemented" instead)."""
    h = torch.randn(7, 12, generator=gen)
    torch._dynamo.reset()
    compiled = torch.compile(fk.glu, backend="aot_eager", fullgraph=True, dynamic=True)
    compiled(h, 1.5)
    compiled(h, None, "silu_softcap", 1.0, False, (2.0, 3.0))
    with pytest.raises(RuntimeError) as err:
        compiled(h, *args)
    assert message in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="limit|softcap"):
        fk.glu(h, *args)


def _glu_forms(h, limit, alpha, c_gate, c_up):
    """glu's clamped, gpt-oss, softcapped and clamped-after forms side by side, with the caller's numbers."""
    return torch.cat([fk.glu(h, limit), fk.glu(h, limit, "swiglu_oai", alpha, True),
                      fk.glu(h, None, "silu_softcap", 1.0, False, (c_gate, c_up)), fk.glu(h, limit, "silu_postclamp")],
                     dim=1)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_glu_compiled_takes_numpy_scalars(backend, dynamic, gen):
    """Numpy scalars as limit, alpha and softcaps, which eager takes, under torch.compile(fullgraph=True) too (Dynamo
    traces them as arrays whose values it knows only at run time): the outputs and input gradients are eager's with
    the same numbers as Python floats, for new values too, and a value out of range is refused at run time with a
    message naming it."""
    import numpy as np

    torch._dynamo.reset()
    compiled = torch.compile(_glu_forms, backend=backend, fullgraph=True, dynamic=dynamic)
    for _ in range(2):
        h = (3 * torch.randn(9, 12, generator=gen)).requires_grad_()
        weight = torch.randn(9, 24, generator=gen)
        limit, alpha, c_gate, c_up = (0.5 + 2 * torch.rand(4, generator=gen)).tolist()
        numbers = (np.float32(limit), np.float64(alpha), np.float16(c_gate), np.int64(round(c_up) + 1))
        out = compiled(h, *numbers)
        (grad,) = torch.autograd.grad((out * weight).sum(), h)
        want = _glu_forms(h, *(float(v) for v in numbers))
        (want_grad,) = torch.autograd.grad((want * weight).sum(), h)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(grad, want_grad)
        torch.testing.assert_close(_glu_forms(h, *numbers), want, rtol=0, atol=0)   # eager takes them alike
    if backend != "aot_eager":   # (the checks are the traced graph's, whichever backend compiles it)
        return
    h = torch.randn(9, 12, generator=gen)
    good = (np.float32(1.0), np.float64(1.5), np.float32(2.0), np.float32(3.0))
    for at, bad, message in ((0, -1.0, "limit: expected a finite number > 0"), (0, float("nan"), "limit: expected"),
                             (1, float("inf"), "alpha: expected a finite number"),
                             (2, 0.0, "softcap: expected finite numbers > 0"),
                             (3, float("inf"), "softcap: expected finite numbers > 0")):
        numbers = list(good)
        numbers[at] = type(good[at])(bad)
        with pytest.raises(RuntimeError, match=message):
            compiled(h, *numbers)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="limit: expected a finite real number, got a numpy bool"):
        torch.compile(fk.glu, backend=backend, fullgraph=True, dynamic=dynamic)(h, np.bool_(True))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("act, limit, alpha", [("silu", None, 1.0), ("swiglu_oai", 7.0, 1.702)])
def test_interleaved_glu_with_no_rows(impl, act, limit, alpha):
    """An empty [0, 2F] block (an expert group with no rows) through interleaved gate/up columns, both ways."""
    h = torch.zeros(0, 16, device=_dev(impl), requires_grad=True)
    with impl_context(impl):
        out = fk.glu(h, limit, act, alpha, interleaved=True)
        (grad,) = torch.autograd.grad(out.sum(), h)
    assert out.shape == (0, 8) and grad.shape == (0, 16)
