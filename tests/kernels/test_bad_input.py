"""Bad input raises ValueError/TypeError naming the argument, the expected and the given value."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import feplb.kernels as fk

E = 4


@pytest.fixture
def meta():
    return fk.routing_metadata(torch.tensor([[0, 1], [2, 3], [1, 0]]), E)


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
def test_routing_rejects(ids, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fk.routing_metadata(ids, E)


def test_routing_rejects_bad_num_experts():
    with pytest.raises(ValueError, match="num_experts.*>= 1.*0"):
        fk.routing_metadata(torch.zeros(2, 1, dtype=torch.long), 0)


def test_permute_rejects(meta):
    with pytest.raises(ValueError, match=r"x_TD.*3 rows.*\[4, 8\]"):
        fk.permute(torch.randn(4, 8), meta)
    with pytest.raises(ValueError, match="x_TD.*contiguous"):
        fk.permute(torch.randn(8, 3).T, meta)
    with pytest.raises(TypeError, match="x_TD.*int64"):
        fk.permute(torch.zeros(3, 8, dtype=torch.long), meta)
    with pytest.raises(TypeError, match="meta.*RoutingMetadata.*dict"):
        fk.permute(torch.randn(3, 8), {})


def test_unpermute_rejects(meta):
    y = torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"topk_weights_TK.*\[3, 2\].*\[3, 3\]"):
        fk.unpermute(y, meta, torch.rand(3, 3))
    with pytest.raises(TypeError, match="topk_weights_TK.*int64"):
        fk.unpermute(y, meta, torch.ones(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"y_MD.*6 rows.*\[5, 8\]"):
        fk.unpermute(torch.randn(5, 8), meta, torch.rand(3, 2))
    with pytest.raises(ValueError, match="topk_weights_TK.*contiguous"):
        fk.unpermute(y, meta, torch.rand(2, 3).T)


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
def test_grouped_mm_rejects(w_shape, w_dtype, offsets, exc, match):
    x = torch.randn(6, 4)
    with pytest.raises(exc, match=match):
        fk.grouped_mm(x, torch.randn(w_shape, dtype=w_dtype), torch.tensor(offsets))


def test_swiglu_rejects():
    with pytest.raises(ValueError, match=r"h_M2F.*even.*\[3, 5\]"):
        fk.swiglu(torch.randn(3, 5))
    with pytest.raises(ValueError, match="h_M2F.*contiguous"):
        fk.swiglu(torch.randn(6, 4).T)


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
