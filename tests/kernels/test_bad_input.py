"""Bad input raises ValueError/TypeError naming the argument, the expected and the given value, on the CPU and
(when one is present) on a CUDA GPU, where the same calls reach the Triton kernels."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import feplb.kernels as fk
from feplb.kernels import _triton
from feplb.kernels._checks import MAX_EXPERTS, MAX_ROWS
from feplb.kernels.permutation import check_permute_inputs

if fk.HAVE_TRITON:
    import triton

E = 4
CUDA = torch.cuda.is_available()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="needs a CUDA GPU")])])
def dev(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture
def meta(dev):
    return fk.routing_metadata(torch.tensor([[0, 1], [2, 3], [1, 0]], device=dev), E)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (torch.tensor([[0, 4]]), r"topk_ids_TK.*\[0, 4\).*\[0, 4\]"),
        (torch.tensor([[-1, 2]]), r"topk_ids_TK.*\[0, 4\).*\[-1, 2\]"),
        (torch.tensor([[0.0, 1.0]]), r"topk_ids_TK.*int32, int64.*float32"),
        (torch.tensor([0, 1]), r"topk_ids_TK.*2-D.*\(2,\)"),
        (torch.zeros(3, 0, dtype=torch.long), r"topk_ids_TK.*K >= 1"),
    ],
    ids=["id-too-large", "id-negative", "float-ids", "1d-ids", "K0"],
)
def test_routing_rejects(ids, match, dev):
    with pytest.raises((ValueError, TypeError), match=match):
        fk.routing_metadata(ids.to(dev), E)


@pytest.mark.parametrize(("num_experts", "match"), [
    (0, r"num_experts.*>= 1.*0"),
    (MAX_EXPERTS + 1, rf"num_experts.*at most {MAX_EXPERTS}.*{MAX_EXPERTS + 1}"),
    (2**31, rf"num_experts.*at most {MAX_EXPERTS}.*{2**31}"),
], ids=["zero", "above-bound", "2**31"])
def test_routing_rejects_bad_num_experts(num_experts, match, dev):
    # 2**31 experts once allocated two 16 GB count tensors before anything looked at the number.
    with pytest.raises(ValueError, match=match):
        fk.routing_metadata(torch.zeros(2, 1, dtype=torch.long, device=dev), num_experts)


def test_routing_rejects_rows_past_32_bits(dev):
    # A stride-0 view: 2**31 rows of ids without allocating them.
    ids = torch.zeros(1, 1, dtype=torch.int32, device=dev).expand(2**30, 2)
    with pytest.raises(ValueError, match=rf"topk_ids_TK.*at most {MAX_ROWS} rows.*2\*\*31|topk_ids_TK.*{2**31}"):
        fk.routing_metadata(ids, E, check=False)


def test_permute_rejects_rows_past_32_bits():
    # Meta tensors: shapes without storage.
    big = torch.empty(2**30, 2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=rf"dst_idx_TK.*at most {MAX_ROWS} rows.*{2**31}"):
        check_permute_inputs(torch.empty(2**30, 8, device="meta"), big.reshape(-1), big)
    with pytest.raises(ValueError, match=rf"dst_idx_TK.*at most {MAX_ROWS} rows.*{2**31}"):
        fk.RoutingMetadata(num_experts=E, top_k=2, counts_E=torch.empty(E, dtype=torch.int32, device="meta"),
                           offsets_E=torch.empty(E, dtype=torch.int32, device="meta"), src_idx_M=big.reshape(-1),
                           dst_idx_TK=big)


def test_grouped_mm_and_swiglu_reject_sizes_past_the_bounds():
    def on_meta(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    with pytest.raises(ValueError, match=rf"x_MK.*at most {MAX_ROWS} rows.*M = {2**31}"):
        fk.grouped_mm(on_meta(2**31, 4), on_meta(2, 4, 3), on_meta(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=rf"w_EKN.*at most {MAX_EXPERTS} groups.*\[{MAX_EXPERTS + 1}, 4, 3\]"):
        fk.grouped_mm(on_meta(6, 4), on_meta(MAX_EXPERTS + 1, 4, 3), on_meta(MAX_EXPERTS + 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=rf"h_M2F.*at most {MAX_ROWS} rows.*M = {2**31}"):
        fk.swiglu(on_meta(2**31, 8))
    # the operators themselves too (torch.ops.feplb.*: no wrapper's checks before them)
    ops = torch.ops.feplb
    with pytest.raises(ValueError, match=rf"x_MK.*at most {MAX_ROWS} rows.*M = {2**31}"):
        ops.grouped_mm(on_meta(2**31, 4), on_meta(2, 4, 3), on_meta(2, dtype=torch.int32), True)
    with pytest.raises(ValueError, match=rf"w_EKN.*at most {MAX_EXPERTS} groups.*\[{MAX_EXPERTS + 1}, 4, 3\]"):
        ops.grouped_mm(on_meta(6, 4), on_meta(MAX_EXPERTS + 1, 4, 3), on_meta(MAX_EXPERTS + 1, dtype=torch.int32), True)
    with pytest.raises(ValueError, match=rf"x_MK.*at most {MAX_ROWS} rows.*M = {2**31}"):
        ops.grouped_mm_dw(on_meta(2**31, 4), on_meta(2**31, 3), on_meta(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=rf"offsets_E.*at most {MAX_EXPERTS} groups.*\[{MAX_EXPERTS + 1}\]"):
        ops.grouped_mm_dw(on_meta(6, 4), on_meta(6, 3), on_meta(MAX_EXPERTS + 1, dtype=torch.int32))
    # (and the CPU operators' own implementations, not only their meta ones)
    many = torch.full((MAX_EXPERTS + 1,), 6, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"offsets_E.*at most {MAX_EXPERTS} groups"):
        ops.grouped_mm_dw(torch.zeros(6, 4), torch.zeros(6, 3), many)
    with pytest.raises(ValueError, match=rf"w_EKN.*at most {MAX_EXPERTS} groups"):
        ops.grouped_mm(torch.zeros(6, 4), torch.zeros(1, 4, 3).expand(MAX_EXPERTS + 1, 4, 3), many, True)


def test_permute_rejects(meta, dev):
    with pytest.raises(ValueError, match=r"x_TD.*3 rows.*\[4, 8\]"):
        fk.permute(torch.randn(4, 8, device=dev), meta)
    with pytest.raises(ValueError, match="x_TD.*contiguous"):
        fk.permute(torch.randn(8, 3, device=dev).T, meta)
    with pytest.raises(TypeError, match="x_TD.*int64"):
        fk.permute(torch.zeros(3, 8, dtype=torch.long, device=dev), meta)
    with pytest.raises(TypeError, match="meta.*RoutingMetadata.*dict"):
        fk.permute(torch.randn(3, 8, device=dev), {})


def test_unpermute_rejects(meta, dev):
    y = torch.randn(6, 8, device=dev)
    with pytest.raises(ValueError, match=r"topk_weights_TK.*\[3, 2\].*\[3, 3\]"):
        fk.unpermute(y, meta, torch.rand(3, 3, device=dev))
    with pytest.raises(TypeError, match="topk_weights_TK.*int64"):
        fk.unpermute(y, meta, torch.ones(3, 2, dtype=torch.long, device=dev))
    with pytest.raises(ValueError, match=r"y_MD.*6 rows.*\[5, 8\]"):
        fk.unpermute(torch.randn(5, 8, device=dev), meta, torch.rand(3, 2, device=dev))
    with pytest.raises(ValueError, match="topk_weights_TK.*contiguous"):
        fk.unpermute(y, meta, torch.rand(2, 3, device=dev).T)


def _tampered(meta, field: str, edit):
    """A hand-built copy of ``meta`` (checked=False) with ``edit`` applied to a clone of one field."""
    fields = {name: getattr(meta, name) for name in ("counts_E", "offsets_E", "src_idx_M", "dst_idx_TK")}
    fields[field] = fields[field].clone()
    edit(fields[field])
    return fk.RoutingMetadata(num_experts=meta.num_experts, top_k=meta.top_k, **fields)


def _swap_first_two(t):
    t.view(-1)[:2] = t.view(-1)[:2].flip(0).clone()


TAMPERED = {  # id: (field, edit, message)
    "src-negative": ("src_idx_M", lambda t: t.__setitem__(0, -1), r"src_idx_M.*\[0, 6\).*\[-1, "),
    "src-too-large": ("src_idx_M", lambda t: t.__setitem__(2, 6), r"src_idx_M.*\[0, 6\).*, 6\]"),
    "dst-negative": ("dst_idx_TK", lambda t: t.__setitem__((1, 0), -7), r"dst_idx_TK.*\[0, 6\).*\[-7, "),
    "dst-too-large": ("dst_idx_TK", lambda t: t.__setitem__((2, 1), 2**30), r"dst_idx_TK.*\[0, 6\).*1073741824\]"),
    "not-inverse": ("src_idx_M", _swap_first_two, r"dst_idx_TK.*inverse.*src_idx_M.*2 of 6"),
    "counts-sum": ("counts_E", lambda t: t.__setitem__(0, t[0] + 1), r"counts_E.*summing to M = 6.*sum 7"),
    "counts-negative": ("counts_E", lambda t: t.__setitem__(0, -1), r"counts_E.*non-negative.*min -1"),
    "offsets": ("offsets_E", lambda t: t.__setitem__(1, t[1] - 1), r"offsets_E.*cumsum\(counts_E\).*1 of 4"),
}


@pytest.mark.parametrize("case", list(TAMPERED), ids=list(TAMPERED))
def test_hand_built_metadata_is_validated_before_any_kernel(case, meta, dev):
    field, edit, match = TAMPERED[case]
    bad = _tampered(meta, field, edit)
    assert not bad.checked
    x, y, w = torch.randn(3, 8, device=dev), torch.randn(6, 8, device=dev), torch.rand(3, 2, device=dev)
    with pytest.raises(ValueError, match=match):
        fk.permute(x, bad)
    with pytest.raises(ValueError, match=match):
        fk.unpermute(y, bad, w)


def test_edited_metadata_is_validated_again(meta, dev):
    """dataclasses.replace of routing_metadata's output is unchecked: its new indices are validated before any
    kernel reads them; checked cannot be claimed by hand."""
    import dataclasses

    dst = meta.dst_idx_TK.clone()
    dst[2, 1] = 9
    bad = dataclasses.replace(meta, dst_idx_TK=dst)
    assert meta.checked and not bad.checked
    with pytest.raises(ValueError, match=r"dst_idx_TK.*\[0, 6\).*, 9\]"):
        fk.unpermute(torch.randn(6, 8, device=dev), bad, torch.rand(3, 2, device=dev))
    with pytest.raises(TypeError, match="checked"):
        fk.RoutingMetadata(num_experts=meta.num_experts, top_k=meta.top_k, counts_E=meta.counts_E,
                           offsets_E=meta.offsets_E, src_idx_M=meta.src_idx_M, dst_idx_TK=meta.dst_idx_TK,
                           checked=True)


def test_metadata_changed_in_place_is_validated_again(meta, dev, monkeypatch):
    """An index tensor of routing_metadata's output changed in place (its version counter moved) is validated before
    a kernel reads it, as a hand-built one is; once found consistent, it is not validated again."""
    x, w = torch.randn(3, 8, device=dev), torch.rand(3, 2, device=dev)
    want = fk.permute(x, meta)
    saved, saved_dst = meta.src_idx_M.clone(), meta.dst_idx_TK.clone()
    meta.src_idx_M[0] = 7
    assert meta.checked and meta.changed_in_place()
    with pytest.raises(ValueError, match=r"src_idx_M.*\[0, 6\).*, 7\]"):
        fk.permute(x, meta)
    meta.dst_idx_TK[0, 0] = -1
    with pytest.raises(ValueError, match="src_idx_M|dst_idx_TK"):
        fk.unpermute(torch.randn(6, 8, device=dev), meta, w)
    meta.src_idx_M.copy_(saved)
    meta.dst_idx_TK.copy_(saved_dst)
    calls = []
    real = fk.RoutingMetadata.validate
    monkeypatch.setattr(fk.RoutingMetadata, "validate", lambda self: calls.append(1) or real(self))
    assert torch.equal(fk.permute(x, meta), want)   # consistent again: validated once, then trusted
    assert torch.equal(fk.permute(x, meta), want) and len(calls) == 1 and not meta.changed_in_place()
    with torch.inference_mode():   # inference tensors have no version counter: nothing to track
        inf = fk.routing_metadata(torch.tensor([[0, 1], [2, 1], [0, 2]], device=dev), 3)
        assert inf.checked and not inf.changed_in_place()
        fk.permute(x, inf)


def test_metadata_compares_and_hashes_by_identity(meta):
    """Two metadata objects compare as objects (a field-wise == would ask a tensor for its truth value and raise)."""
    import dataclasses

    twin = dataclasses.replace(meta, **{f: getattr(meta, f).clone() for f in ("counts_E", "offsets_E", "src_idx_M",
                                                                              "dst_idx_TK")})
    assert meta == meta and (meta == twin) is False and (meta != twin) is True
    assert len({meta, twin, meta}) == 2


def test_hand_built_valid_metadata_is_accepted(meta, dev):
    same = _tampered(meta, "src_idx_M", lambda t: None)
    x = torch.randn(3, 8, device=dev)
    assert torch.equal(fk.permute(x, same), fk.permute(x, meta))


def test_routing_metadata_output_skips_the_value_check(meta, dev, monkeypatch):
    # Metadata from routing_metadata() is consistent by construction: validating it again would cost a host sync
    # per call on a GPU (the layer's forward must have none).
    assert meta.checked

    def fail(self):
        raise AssertionError("validate() called on checked metadata")

    monkeypatch.setattr(fk.RoutingMetadata, "validate", fail)
    fk.unpermute(fk.permute(torch.randn(3, 8, device=dev), meta), meta, torch.rand(3, 2, device=dev))


def test_metadata_rejects_inconsistent_fields(meta):
    with pytest.raises(TypeError, match="counts_E.*int32.*int64"):
        fk.RoutingMetadata(num_experts=E, top_k=2, counts_E=meta.counts_E.long(), offsets_E=meta.offsets_E,
                           src_idx_M=meta.src_idx_M, dst_idx_TK=meta.dst_idx_TK)
    with pytest.raises(ValueError, match=r"src_idx_M.*\[6\].*\[5\]"):
        fk.RoutingMetadata(num_experts=E, top_k=2, counts_E=meta.counts_E, offsets_E=meta.offsets_E,
                           src_idx_M=meta.src_idx_M[:5], dst_idx_TK=meta.dst_idx_TK)


@pytest.mark.parametrize(
    ("w_shape", "w_dtype", "offsets", "exc", "match"),
    [
        ((2, 4, 3), torch.float32, [4, 2], ValueError, r"offsets_E.*non-decreasing.*\[4, 2\]"),
        ((2, 4, 3), torch.float32, [2, 5], ValueError, r"offsets_E.*M = 6.*5"),
        ((2, 4, 3), torch.float32, [-1, 6], ValueError, r"offsets_E.*non-negative"),
        ((2, 4, 3), torch.float32, [2.0, 6.0], TypeError, r"offsets_E.*int32, int64.*float32"),
        ((2, 4, 3), torch.float32, [6], ValueError, r"offsets_E.*\[2\].*\[1\]"),
        ((2, 5, 3), torch.float32, [2, 6], ValueError, r"w_EKN.*K = 4.*\[2, 5, 3\]"),
        ((2, 4, 3), torch.float64, [2, 6], TypeError, r"w_EKN.*float32.*float64"),
        ((4, 3), torch.float32, [2, 6], ValueError, r"w_EKN.*3-D.*\(4, 3\)"),
    ],
    ids=["decreasing", "wrong-end", "negative", "float-offsets", "offsets-length", "K-mismatch", "dtype-mismatch",
         "2d-w"],
)
def test_grouped_mm_rejects(w_shape, w_dtype, offsets, exc, match, dev):
    x = torch.randn(6, 4, device=dev)
    with pytest.raises(exc, match=match):
        fk.grouped_mm(x, torch.randn(w_shape, dtype=w_dtype, device=dev), torch.tensor(offsets, device=dev))


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
@pytest.mark.parametrize("which", ["x_MK", "w_EKN"])
def test_grouped_mm_rejects_a_non_tensor(which, autocast, dev):
    # The autocast cast ran before any check: a list for x (and, inside torch.autocast, for w) failed with
    # "AttributeError: 'list' object has no attribute 'device'", naming no argument.
    args = {"x_MK": torch.randn(6, 4, device=dev), "w_EKN": torch.randn(2, 4, 3, device=dev)}
    args[which] = args[which].tolist()
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast), \
            pytest.raises(TypeError, match=rf"{which}: expected a torch.Tensor, got list"):
        fk.grouped_mm(args["x_MK"], args["w_EKN"], torch.tensor([2, 6], device=dev))


@pytest.mark.parametrize("value", [None, 0, "no"], ids=["None", "int", "str"])
def test_check_flags_must_be_bools(value, dev):
    # torch's schema turned check=None (or 0) into False: on a GPU the id range or the offsets went unchecked,
    # while the CPU twins check regardless; an id out of range then gave metadata that permute reads out of bounds.
    with pytest.raises(TypeError, match=rf"check: expected a bool, got {value!r}"):
        fk.routing_metadata(torch.tensor([[0, 5]], device=dev), E, check=value)
    with pytest.raises(TypeError, match=rf"check: expected a bool, got {value!r}"):
        fk.grouped_mm(torch.randn(6, 4, device=dev), torch.randn(2, 4, 3, device=dev),
                      torch.tensor([2, 6], device=dev), check=value)


def test_swiglu_rejects(dev):
    with pytest.raises(ValueError, match=r"h_M2F.*even.*\[3, 5\]"):
        fk.swiglu(torch.randn(3, 5, device=dev))
    with pytest.raises(ValueError, match="h_M2F.*contiguous"):
        fk.swiglu(torch.randn(6, 4, device=dev).T)
    with pytest.raises(ValueError, match="act: expected one of"):
        fk.glu(torch.randn(6, 4, device=dev), None, "relu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's messages")
def test_kernels_refuse_cpu_tensors_without_interpreter():
    """Without TRITON_INTERPRET, a launcher given CPU tensors and triton_on_cpu() both fail with a clear message."""
    code = (
        "import torch, feplb.kernels as fk\n"
        "from feplb.kernels.permutation import permute_triton\n"
        "try:\n"
        "    idx = torch.zeros(2, 1, dtype=torch.int32)\n"
        "    permute_triton(torch.zeros(2, 4), idx.reshape(2), idx)\n"
        "except ValueError as e:\n"
        "    print('launcher:', e)\n"
        "try:\n"
        "    fk.triton_on_cpu().__enter__()\n"
        "except RuntimeError as e:\n"
        "    print('context:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300).stdout
    assert "launcher: permute_triton: Triton kernels need CUDA tensors" in out
    assert "context: triton_on_cpu() needs Triton and TRITON_INTERPRET=1" in out


@pytest.mark.skipif(not (fk.HAVE_TRITON and _triton.INTERPRET), reason="checks the interpreter's probe")
def test_interpreter_probe():
    """The probe that guards interpreted launches passes where the kernel tests run; a probe that fails (as Triton
    3.6's interpreter does with numpy >= 2.4) or miscounts becomes one clear error at every launcher."""
    assert _triton.interpreter_problem() is None
    probe = _triton.interpreter_problem.__wrapped__

    class Failing:
        def __getitem__(self, grid):
            def run(*_args):
                raise RuntimeError("interpreter failed") from TypeError(
                    "only 0-dimensional arrays can be converted to Python scalars")
            return run

    class Miscounting:
        def __getitem__(self, grid):
            return lambda out, n: out.fill_(n)

    real = _triton._interpreter_probe_kernel
    try:
        _triton._interpreter_probe_kernel = Failing()
        failed = probe()
        _triton._interpreter_probe_kernel = Miscounting()
        miscounted = probe()
    finally:
        _triton._interpreter_probe_kernel = real
    assert "TypeError: only 0-dimensional arrays" in failed and "numpy<2.4" in failed
    assert f"Triton {triton.__version__} with numpy {np.__version__}" in failed
    assert "ran 5 times, not 3" in miscounted

    from feplb.kernels.permutation import permute_triton
    idx = torch.zeros(2, 1, dtype=torch.int32)
    original = _triton.interpreter_problem
    _triton.interpreter_problem = lambda: failed
    try:
        with pytest.raises(RuntimeError, match=r"permute_triton: Triton's interpreter .* cannot run the kernels"):
            permute_triton(torch.zeros(2, 4), idx.reshape(2), idx)
    finally:
        _triton.interpreter_problem = original
