"""MoELayer inside ``torch.autocast`` on 4 gloo ranks (2 nodes x 2 GPUs), routing given from outside:

* a float32 layer under CPU autocast (bfloat16) computes what a bfloat16 layer computes on the rounded inputs,
  bit for bit after rounding (plain EP: each expert's rows in one GEMM on its owner), so its GEMMs really run in
  the autocast dtype; its output and gradients stay float32;
* with balancing on (feplb-split, and the peers' fastermoe and eplb; rows and weights move) it is as accurate as
  torch's own autocast: against a float64 dense reference, every tensor's error (norm-wise) is at most twice that
  of a dense torch implementation run under the same autocast; and balancing on equals balancing off within the
  same bound;
* inside autocast a float16 / bfloat16 / float32 input of another dtype is accepted (cast to the layer's dtype)
  and its output comes back in it; a bfloat16 input outside autocast, and a float64 or integer input inside it,
  are refused on every rank, and the layer works on afterwards.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from feplb.testing import error_of, run_dist

pytestmark = pytest.mark.dist

H, FF, E, K, W, G = 16, 32, 16, 2, 4, 2
TOKENS = (24, 40, 0, 32)   # rank 2 sends nothing (its experts still receive rows)
AC = torch.bfloat16


def _bf16_exact(t: torch.Tensor) -> torch.Tensor:
    return t.to(AC).float()


def make_inputs(seed: int = 7):
    """Global expert weights, and per rank: tokens, routing (skewed to rank 0's experts) and upstream gradients.
    Routing weights and upstream gradients are bf16-exact, so the float32 and bfloat16 layers see the same values."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, H, 2 * FF, generator=gen) / H ** 0.5
    w2 = torch.randn(E, FF, H, generator=gen) / FF ** 0.5
    xs, ids, gates, dys = [], [], [], []
    probs = torch.ones(E)
    probs[0] = 200.0                         # expert 0 (rank 0's) is very hot: FasterMoE shadows it
    probs[1:3] = 12.0                        # experts 1-2 are hot
    for t in TOKENS:
        xs.append(torch.randn(t, H, generator=gen))
        ids.append(torch.stack([torch.multinomial(probs, K, generator=gen) for _ in range(t)])
                   if t else torch.zeros(0, K, dtype=torch.int64))
        gates.append(_bf16_exact(torch.rand(t, K, generator=gen)))
        dys.append(_bf16_exact(torch.randn(t, H, generator=gen)))
    return w1, w2, xs, ids, gates, dys


def _layer(policy: str, dtype: torch.dtype, w1, w2, weights: str = "per-microbatch"):
    from feplb import FEPLBConfig, MoELayer

    layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, router="external", gpus_per_node=G,
                                 dyn=2, policy=policy, weights=weights, min_chunk=2, plan_wait_ms=60_000,
                                 min_straggler_rows=0, dtype=dtype))
    lo = layer.rank * layer.num_local
    with torch.no_grad():
        layer.w1.copy_(w1[lo:lo + layer.num_local])
        layer.w2.copy_(w2[lo:lo + layer.num_local])
    return layer


def _run(layer, x, ids, gates, dy, autocast: bool, in_dtype=None):
    x = x.to(in_dtype or layer.config.dtype, copy=True).requires_grad_(in_dtype is None or in_dtype.is_floating_point)
    g = gates.to(layer.config.dtype, copy=True).requires_grad_(True)
    if layer.config.weights == "per-step":
        with torch.no_grad(), torch.autocast("cpu", dtype=AC, enabled=autocast):
            layer(x, routing=(ids, g))   # tells the layer which experts are dynamic (EPLB: its replicas)
        layer.refresh_replicas()
    with torch.autocast("cpu", dtype=AC, enabled=autocast):
        out = layer(x, routing=(ids, g))
    (out.float() * dy).sum().backward()
    layer.reduce_replica_grads()
    # clones: a later backward of the same layer accumulates into .grad in place
    return {"out": out.detach(), "dx": x.grad, "dgate": g.grad, "dw1": layer.w1.grad.clone(),
            "dw2": layer.w2.grad.clone(), "moved": layer.last_stats.rows_moved}


class _CastCount(TorchDispatchMode):
    """Counts dtype casts (``aten._to_copy``) of tensors of the given shapes: (shape, from, to) -> calls."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.n = shapes, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in self.shapes:
            key = (tuple(args[0].shape), str(args[0].dtype), str(out.dtype))
            self.n[key] = self.n.get(key, 0) + 1
        return out


def _worker(rank: int, world: int):
    w1, w2, xs, ids, gates, dys = make_inputs()
    args = (xs[rank], ids[rank], gates[rank], dys[rank])
    res = {}
    for name, policy, dtype, autocast, weights in [
            ("ac_none", "none", torch.float32, True, "per-microbatch"),
            ("ac_split", "feplb-split", torch.float32, True, "per-microbatch"),
            ("ac_fastermoe", "fastermoe", torch.float32, True, "per-microbatch"),
            ("ac_eplb", "eplb", torch.float32, True, "per-step"),
            ("bf16_none", "none", AC, False, "per-microbatch")]:
        src = (w1, w2) if dtype == torch.float32 else (w1.to(AC), w2.to(AC))
        with _layer(policy, dtype, *src, weights=weights) as layer:
            res[name] = _run(layer, *args, autocast=autocast)
    with _layer("feplb-split", torch.float32, w1, w2) as layer:
        res["ac_in"] = _run(layer, *args, autocast=True, in_dtype=AC)
        res["refused"] = {
            "bf16_outside": error_of(lambda: _run(layer, *args, autocast=False, in_dtype=AC)),
            "fp64_inside": error_of(lambda: _run(layer, *args, autocast=True, in_dtype=torch.float64)),
            "int_inside": error_of(lambda: _run(layer, args[0].long(), *args[1:], autocast=True,
                                                in_dtype=torch.int64)),
            # autocast on EP rank 1 only: the rows balancing moves there would compute in bf16
            "autocast_one_rank": error_of(lambda: _run(layer, *args, autocast=rank == 1)),
        }
        res["after_refusals"] = _run(layer, *args, autocast=True)   # the layer still works, on every rank
    with _layer("feplb-split", torch.float32, w1, w2) as layer:
        casts = _CastCount({tuple(layer.w1.shape), tuple(layer.w2.shape)})
        with casts:
            res["casts_moved"] = _run(layer, *args, autocast=True)["moved"]
        res["casts"] = casts.n
    with _layer("none", AC, w1.to(AC), w2.to(AC)) as layer:
        res["bf16_ac_fp32_in"] = _run(layer, *args, autocast=True, in_dtype=torch.float32)
    return res


def _dense(dtype: torch.dtype, autocast: bool):
    """Every rank's output, input and gate gradients and the global expert-weight gradients of a dense torch MoE
    (one matmul per expert over the tokens that chose it) in ``dtype``, under CPU autocast or not."""
    w1, w2, xs, ids, gates, dys = make_inputs()
    w1, w2 = (t.to(dtype).requires_grad_(True) for t in (w1, w2))
    outs, dxs, dgates = [], [], []
    for x, i_TK, g, dy in zip(xs, ids, gates, dys, strict=True):
        x, g = x.to(dtype, copy=True).requires_grad_(True), g.to(dtype, copy=True).requires_grad_(True)
        with torch.autocast("cpu", dtype=AC, enabled=autocast):
            out = torch.zeros_like(x)
            for e in range(E):
                t_idx, k_idx = torch.nonzero(i_TK == e, as_tuple=True)
                if t_idx.numel():
                    h = x[t_idx] @ w1[e]
                    y = (torch.nn.functional.silu(h[:, :FF]) * h[:, FF:]) @ w2[e]
                    out = out.index_add(0, t_idx, (g[t_idx, k_idx, None] * y).to(out.dtype))
        if out.requires_grad:
            (out.to(dy.dtype) * dy.to(out.dtype)).sum().backward()
        outs.append(out.detach())
        dxs.append(x.grad if x.grad is not None else torch.zeros_like(x))
        dgates.append(g.grad if g.grad is not None else torch.zeros_like(g))
    return {"out": outs, "dx": dxs, "dgate": dgates, "dw1": w1.grad, "dw2": w2.grad}


@pytest.fixture(scope="module")
def ranks():
    return run_dist(_worker, W, timeout_s=240)


def _per_rank(ref: dict, key: str, r: int) -> torch.Tensor:
    L = E // W
    return ref[key][r * L:(r + 1) * L] if key in ("dw1", "dw2") else ref[key][r]


KEYS = ("out", "dx", "dgate", "dw1", "dw2")


def test_autocast_layer_computes_the_bf16_layer_on_rounded_inputs(ranks):
    for r, res in enumerate(ranks):
        ac, bf = res["ac_none"], res["bf16_none"]
        for k in KEYS:
            assert ac[k].dtype == torch.float32, (r, k, ac[k].dtype)
            assert bf[k].dtype == AC, (r, k, bf[k].dtype)
            torch.testing.assert_close(ac[k].to(AC), bf[k], rtol=0, atol=0,
                                       msg=lambda m, r=r, k=k: f"rank {r} {k}: {m}")


def _norm_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius, in fp64)."""
    return float((got.double() - want.double()).norm() / want.double().norm())


BALANCED = ("ac_split", "ac_fastermoe", "ac_eplb")


def test_autocast_layer_with_balancing_is_as_accurate_as_torch_autocast(ranks):
    """Norm-wise: a largest-element bound would let one bf16 rounding of a large gradient entry (the layer rounds
    an expert's whole weight gradient once, the dense loop smaller per-rank sums) decide."""
    ref, torch_ac = _dense(torch.float64, False), _dense(torch.float32, True)
    for run in BALANCED:
        assert sum(res[run]["moved"] for res in ranks) > 0, (run, [res[run]["moved"] for res in ranks])
    for r, res in enumerate(ranks):
        for k in KEYS:
            want = _per_rank(ref, k, r)
            if not want.numel() or not want.abs().max():
                continue
            theirs = _norm_rel(_per_rank(torch_ac, k, r), want)
            assert theirs > 1e-4, (r, k, "torch's autocast made no error: not bf16?")
            for run in ("ac_none", "ac_in", *BALANCED):
                err = _norm_rel(res[run][k], want)
                assert err <= 2 * theirs, f"{run} rank {r} {k}: error {err:.3g} > 2x torch autocast's {theirs:.3g}"
            for run in BALANCED:
                on_off = _norm_rel(res[run][k], res["ac_none"][k])
                assert on_off <= 2 * theirs, f"rank {r} {k}: {run} vs none differ by {on_off:.3g}"


def test_inputs_of_another_dtype_inside_autocast(ranks):
    """A bf16 input to a float32 layer (and a float32 input to a bf16 layer) inside autocast travels in the layer's
    dtype and returns in its own; outside autocast it is refused, on every rank; so is autocast on some ranks only."""
    for r, res in enumerate(ranks):
        run = res["ac_in"]
        assert run["out"].dtype == run["dx"].dtype == AC, (r, run["out"].dtype, run["dx"].dtype)
        assert run["dw1"].dtype == torch.float32
        torch.testing.assert_close(run["out"], res["ac_split"]["out"].to(AC), rtol=0, atol=0)
        refused = res["refused"]
        for case, dtype in (("bf16_outside", "bfloat16"), ("fp64_inside", "float64"), ("int_inside", "int64")):
            assert refused[case] is not None and refused[case].startswith("TypeError"), (r, case, refused[case])
            assert f"input dtype must be torch.float32 (FEPLBConfig.dtype), got torch.{dtype}" in refused[case]
        one = refused["autocast_one_rank"]
        assert one is not None and one.startswith("RuntimeError") and "different torch.autocast settings" in one, \
            (r, one)
        assert "1: 'bfloat16'" in one and "0: 'off'" in one, (r, one)
        torch.testing.assert_close(res["after_refusals"]["out"], res["ac_split"]["out"], rtol=0, atol=0)
        # the bf16 layer casts a float32 input as the bf16 layer's own caller would: the same numbers
        wide, bf = res["bf16_ac_fp32_in"], res["bf16_none"]
        assert wide["out"].dtype == wide["dx"].dtype == torch.float32
        for k in KEYS:
            torch.testing.assert_close(wide[k].to(AC), bf[k], rtol=0, atol=0,
                                       msg=lambda m, r=r, k=k: f"rank {r} {k}: {m}")
            if k in ("out", "dx"):
                torch.testing.assert_close(wide[k], bf[k].float(), rtol=0, atol=0)


def test_expert_weights_are_cast_once_per_forward(ranks):
    """With balancing on, the static GEMM and the dynamic experts' GEMM at home share one cast of the local weight
    bank (and their weight gradients one cast back), where a cast per launch would double the pass over the
    weights that plain EP makes."""
    assert any(res["casts_moved"] for res in ranks)
    for r, res in enumerate(ranks):
        L = E // W
        want = {(shape, a, b): 1 for shape in ((L, H, 2 * FF), (L, FF, H))
                for a, b in (("torch.float32", "torch.bfloat16"), ("torch.bfloat16", "torch.float32"))}
        assert res["casts"] == want, (r, res["casts"])
