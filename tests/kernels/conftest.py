"""Helpers for the kernel tests: random routings and independent float64 computations of every op.

Test modules get them through the ``kh`` fixture (pytest's importlib mode keeps test modules from importing
each other).
"""

from __future__ import annotations

import math
import zlib
from types import SimpleNamespace

import pytest
import torch

TOL = {  # (rtol, atol) of a kernel or a twin against the float64 computation
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


def random_routing(T: int, K: int, E: int, *, gen: torch.Generator, skew: float = 0.0, used_experts: int | None = None,
                   ids_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-K expert ids per token, as a router picks them, plus softmax-like gate weights.

    ``skew`` > 0 tilts the choice towards low expert ids (Zipf-like); ``used_experts`` < E leaves the other
    experts with zero rows. Returns (topk_ids_TK [T, K] of ids_dtype, topk_weights_TK float32 [T, K]).
    """
    used = E if used_experts is None else used_experts
    if not 1 <= K <= used <= E:
        raise ValueError(f"need 1 <= K <= used_experts <= E, got K={K}, used={used}, E={E}")
    scores = torch.rand(T, used, generator=gen)
    if skew > 0:
        scores = scores * torch.arange(1, used + 1, dtype=torch.float32).pow(-skew)
    # Spread the used experts over the whole id range so empty experts sit in the middle, not only at the end.
    id_map = torch.randperm(E, generator=gen)[:used].sort().values
    ids = id_map[scores.topk(K, dim=1).indices]
    weights = torch.rand(T, K, generator=gen) + 0.1
    return ids.to(ids_dtype), weights / weights.sum(1, keepdim=True)


def group_ids(offsets_E: torch.Tensor, M: int) -> torch.Tensor:
    """int64 [M]: the group of every row, from END offsets."""
    counts = torch.diff(offsets_E.long(), prepend=offsets_E.new_zeros(1).long())
    return torch.repeat_interleave(torch.arange(offsets_E.shape[0]), counts, output_size=M)


def grouped_mm_f64(x_MK, w_EKN, offsets_E):
    g = group_ids(offsets_E, x_MK.shape[0])
    return torch.einsum("mk,mkn->mn", x_MK.double(), w_EKN.double()[g])


def grouped_mm_dw_f64(x_MK, dy_MN, offsets_E):
    g = group_ids(offsets_E, x_MK.shape[0])
    dw = torch.zeros(offsets_E.shape[0], x_MK.shape[1], dy_MN.shape[1], dtype=torch.float64)
    dw.index_add_(0, g, x_MK.double()[:, :, None] * dy_MN.double()[:, None, :])
    return dw


def routing_f64(topk_ids_TK, E):
    """(counts, end offsets, src, dst) by explicit Python loops over experts, tokens and k."""
    T, K = topk_ids_TK.shape
    ids = topk_ids_TK.tolist()
    src = [t * K + k for e in range(E) for t in range(T) for k in range(K) if ids[t][k] == e]
    counts = [sum(row.count(e) for row in ids) for e in range(E)]
    dst = [0] * (T * K)
    for m, flat in enumerate(src):
        dst[flat] = m
    ends = torch.tensor(counts).cumsum(0) if E else torch.zeros(0)
    return torch.tensor(counts), ends, torch.tensor(src, dtype=torch.long), torch.tensor(dst).reshape(T, K)


def unpermute_f64(y_MD, dst_idx_TK, w_TK):
    return (w_TK.double()[:, :, None] * y_MD.double()[dst_idx_TK.long()]).sum(1)


def glu_f64(h_M2F, limit=None, act="silu", alpha=1.0, interleaved=False, softcap=None):
    """The gated activation in float64 from its formulas (not torch's activation functions)."""
    h = h_M2F.double()
    gate, up = (h[:, 0::2], h[:, 1::2]) if interleaved else h.chunk(2, dim=1)
    if limit is not None:   # torch.clamp (its gradient on a bound: the installed torch's rule)
        gate, up = gate if act == "silu_postclamp" else gate.clamp(max=limit), up.clamp(-limit, limit)
    if act == "silu_postclamp":   # the clamp after the activation
        return (gate / (1 + torch.exp(-gate))).clamp(max=limit) * up
    if act == "silu_softcap":   # c tanh(x / c) = c (1 - e^(-2x/c)) / (1 + e^(-2x/c))
        def cap(x, c):
            e = torch.exp(-2 * x / c)
            return c * (1 - e) / (1 + e)
        a, up = cap(gate, softcap[0]) / (1 + torch.exp(-gate)), cap(up, softcap[1])
    elif act == "silu":
        a = gate / (1 + torch.exp(-gate))
    elif act == "swiglu_oai":
        a, up = gate / (1 + torch.exp(-alpha * gate)), up + 1
    elif act == "gelu_tanh":
        a = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
    else:
        a = 0.5 * gate * (1 + torch.erf(gate / math.sqrt(2)))
    return a * up


def mlp_act_f64(h_MF, act):
    """A non-gated expert's activation in float64 from its formula."""
    h = h_MF.double()
    if act == "relu2":
        return torch.where(h > 0, h, torch.zeros_like(h)) ** 2
    return glu_f64(torch.cat([h, torch.ones_like(h)], dim=1), None, act)


def poisoned(t: torch.Tensor) -> torch.Tensor:
    """A tensor of t's shape and dtype filled with NaN (or -1 for integers)."""
    return torch.full_like(t, -1) if not t.is_floating_point() else torch.full_like(t, float("nan"))


def close(actual, expected, dtype, scale: float = 1.0) -> None:
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol * scale, atol=atol * scale)


@pytest.fixture
def kh() -> SimpleNamespace:
    return SimpleNamespace(random_routing=random_routing, group_ids=group_ids, grouped_mm_f64=grouped_mm_f64,
                           grouped_mm_dw_f64=grouped_mm_dw_f64, routing_f64=routing_f64, unpermute_f64=unpermute_f64,
                           glu_f64=glu_f64, mlp_act_f64=mlp_act_f64, poisoned=poisoned, close=close, TOL=TOL)


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test id, so every parametrized case draws fresh but reproducible inputs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
