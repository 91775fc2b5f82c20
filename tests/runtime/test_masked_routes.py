"""Masked routes (``FEPLBConfig.masked_routes``): an id of -1 routes that slot of its token to no expert.

4 gloo ranks as 2 nodes x 2, an external router skewed to a few experts with about a third of the slots masked
(whole tokens, whole ranks' worth of slots too). Against an fp64 reference built from the same global weights
(each rank regenerates every rank's inputs, so the experts' gradients are checked whole): the output and the
gradients of the input, the routing weights (zero for masked slots) and every expert shard, with rows moving
(``feplb-split``; the peers' direct dispatch, ``eplb``, from its history) and without (``none``), per-step and
per-micro-batch weights, gates on the inputs; a recompute under activation checkpointing gives the same gradients
bit for bit; masked slots send no rows; -1 without ``masked_routes``, and -2 with it, are refused on every rank.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from feplb.testing import error_of, run_dist

pytestmark = pytest.mark.dist

H, FF, E, K, W, G = 16, 24, 16, 2, 4, 2
TOKENS = (40, 24, 32, 16)


def _weights():
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(E, H, 2 * FF, generator=gen, dtype=torch.float64) / H ** 0.5,
            torch.randn(E, FF, H, generator=gen, dtype=torch.float64) / FF ** 0.5)


def _inputs(rank: int):
    """This rank's tokens, routing skewed to three experts with about a third of the slots masked (-1): every
    third token entirely; rank 3 keeps one route in all."""
    gen = torch.Generator().manual_seed(500 + rank)
    T = TOKENS[rank]
    probs = torch.ones(E)
    probs[:3] = 12.0
    ids = torch.stack([torch.multinomial(probs, K, generator=gen) for _ in range(T)])
    mask = torch.rand(T, K, generator=gen) < 0.2
    mask[::3] = True
    if rank == 3:
        mask[:] = True
        mask[5, 1] = False
    ids[mask] = -1
    return (torch.randn(T, H, generator=gen, dtype=torch.float64), ids,
            torch.rand(T, K, generator=gen, dtype=torch.float64) + 0.1, torch.randn(T, H, generator=gen,
                                                                                    dtype=torch.float64))


def _reference(gate_on_input: bool):
    """fp64: every rank's output, input and weight gradients, and the experts' gradients over all ranks."""
    w1, w2 = (t.clone().requires_grad_() for t in _weights())
    outs = []
    for r in range(W):
        x, ids, w, dy = _inputs(r)
        x, w = x.requires_grad_(), w.requires_grad_()
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(K):
                e = int(ids[t, k])
                if e < 0:
                    continue
                xin = x[t] * w[t, k] if gate_on_input else x[t]
                h = xin @ w1[e]
                y = (torch.nn.functional.silu(h[:FF]) * h[FF:]) @ w2[e]
                out = out.index_add(0, torch.tensor([t]), (y if gate_on_input else w[t, k] * y)[None])
        (out * dy).sum().backward()
        outs.append((out.detach(), x.grad, w.grad))
    return outs, w1.grad, w2.grad


class _Shifted:
    """A MoELayer whose post_expert adds 1 to every row (built lazily: feplb imports in the workers)."""

    def __new__(cls, cfg):
        from feplb import MoELayer

        class Shifted(MoELayer):
            def post_expert(self, y_MD):   # written before post_expert took the ids: still called so
                return y_MD + 1.0

        return Shifted(cfg)


class _PerExpert:
    """A MoELayer whose post_expert adds e + 1 to each row of expert e (``post_expert_ids``)."""

    def __new__(cls, cfg):
        from feplb import MoELayer

        class PerExpert(MoELayer):
            post_expert_ids = True

            def post_expert(self, y_MD, expert_M):
                return y_MD + (expert_M + 1).to(y_MD.dtype)[:, None]

        return PerExpert(cfg)


def _rank(rank: int, world: int) -> dict:
    from feplb import FEPLBConfig, MoELayer

    res = {}
    w1, w2 = _weights()
    x, ids, w, dy = _inputs(rank)
    # (eplb: the peers' direct dispatch, rows straight to the GPU that computes them)
    for policy, weights, goi in (("feplb-split", "per-microbatch", False), ("feplb-split", "per-step", False),
                                 ("none", "per-step", False), ("feplb-split", "per-microbatch", True),
                                 ("eplb", "per-step", False)):
        layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=G, dyn=2,
                                     policy=policy, weights=weights, router="external", masked_routes=True,
                                     gate_on_input=goi, min_chunk=2, min_straggler_rows=0, plan_wait_ms=60_000,
                                     dtype=torch.float32))
        lo = rank * layer.num_local
        with torch.no_grad():
            layer.w1.copy_(w1[lo:lo + layer.num_local])
            layer.w2.copy_(w2[lo:lo + layer.num_local])
        layer.refresh_replicas()
        # the peers' policies plan from the history of earlier micro-batches: the last of three forwards counts
        for _ in range(3 if policy == "eplb" else 1):
            layer.zero_grad()
            xa, wa = x.float().requires_grad_(), w.float().requires_grad_()
            out = layer(xa, routing=(ids, wa))
            (out * dy.float()).sum().backward()
            layer.reduce_replica_grads()
            layer.refresh_replicas()
        s = layer.last_stats
        res[policy, weights, goi] = {"out": out.detach(), "dx": xa.grad, "dw": wa.grad, "dw1": layer.w1.grad.clone(),
                                     "dw2": layer.w2.grad.clone(), "moved": s.rows_moved,
                                     "sent": int(sum(s.counts_WE[rank]))}
        if (policy, weights, goi) == ("feplb-split", "per-microbatch", False):
            # a recompute under activation checkpointing: the same gradients, bit for bit
            layer.zero_grad()
            xc, wc = x.float().requires_grad_(), w.float().requires_grad_()
            y = torch.utils.checkpoint.checkpoint(lambda t, g, m=layer: m(t, routing=(ids, g)), xc, wc,
                                                  use_reentrant=False)
            (y * dy.float()).sum().backward()
            got = res[policy, weights, goi]
            res["ckpt_equal"] = (torch.equal(y.detach(), got["out"]) and torch.equal(xc.grad, got["dx"])
                                 and torch.equal(wc.grad, got["dw"]) and torch.equal(layer.w1.grad, got["dw1"])
                                 and torch.equal(layer.w2.grad, got["dw2"]))
            # refused on every rank: -2 (rank 1 only), and -1 without masked_routes
            bad = ids.clone()
            if rank == 1:
                bad[0, 0] = -2
            res["minus_two"] = error_of(lambda b=bad, m=layer: m(x.float(), routing=(b, w.float())))
            # ids of another integer dtype (uint8: -1 must not wrap around to 255 in the range check)
            full = ids.clamp(min=0)
            res["uint8_equal"] = torch.equal(layer(x.float(), routing=(full.to(torch.uint8), w.float())),
                                             layer(x.float(), routing=(full, w.float())))
        layer.close()
    # a row-wise post_expert (transformers' post-expert norm): the masked slots' rows weigh nothing, whatever it
    # makes of them
    cfg = FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=G, router="external",
                      masked_routes=True, policy="feplb-split", min_chunk=2, min_straggler_rows=0, dtype=torch.float32)
    outs = []
    for cls in (MoELayer, _Shifted, _PerExpert):
        torch.manual_seed(3)
        layer = cls(cfg)
        outs.append(layer(x.float(), routing=(ids, w.float())).detach())
        res.setdefault("post_moved", []).append(layer.last_stats.rows_moved)
        layer.close()
    res["post_shift"] = (outs[1] - outs[0], torch.where(ids >= 0, w, 0.0).sum(-1))
    # one per expert, by each row's expert id wherever the row was computed: each token gains sum_k w_k (e_k + 1)
    res["post_per_expert"] = (outs[2] - outs[0], torch.where(ids >= 0, w * (ids + 1), 0.0).sum(-1))
    # experts placed away from their owners (+place: rows grouped by slot, not by expert id), from the history of
    # two earlier steps: the ids are still the experts'
    placed = dataclasses.replace(cfg, policy="feplb-split+place")
    outs, moved_slots = [], []
    for cls in (MoELayer, _PerExpert):
        torch.manual_seed(3)
        layer = cls(placed)
        for _ in range(3):
            out = layer(x.float(), routing=(ids, w.float())).detach()
            layer.refresh_replicas()   # a step's end: the placement follows the history
        outs.append(out)
        moved_slots.append(int((layer._slot_of_E != torch.arange(E, device=layer._slot_of_E.device)).sum()))
        layer.close()
    res["placed_per_expert"] = (outs[1] - outs[0], torch.where(ids >= 0, w * (ids + 1), 0.0).sum(-1))
    res["placed_slots"] = moved_slots
    plain = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=G, router="external",
                                 policy="feplb-split", dtype=torch.float32))
    res["unmasked"] = error_of(lambda: plain(x.float(), routing=(ids, w.float())))
    plain.close()
    return res


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = float((got.double() - want).abs().max())
    scale = float(want.abs().max()) or 1.0
    assert err <= 1e-5 * scale, (what, err, scale)


def test_masked_routes_match_the_reference():
    results = run_dist(_rank, W, timeout_s=300)
    L = E // W
    for goi in (False, True):
        outs, dw1, dw2 = _reference(goi)
        for r, res in enumerate(results):
            _, ids, _, _ = _inputs(r)
            for key, got in res.items():
                if not isinstance(key, tuple) or key[2] != goi:
                    continue
                out, dx, dw = outs[r]
                _close(got["out"], out, (key, r, "out"))
                _close(got["dx"], dx, (key, r, "dx"))
                _close(got["dw"], dw, (key, r, "routing weights' grad"))
                assert (got["dw"][ids < 0] == 0).all(), (key, r)   # masked slots: no gradient
                _close(got["dw1"], dw1[r * L:(r + 1) * L], (key, r, "w1 grad"))
                _close(got["dw2"], dw2[r * L:(r + 1) * L], (key, r, "w2 grad"))
                # masked slots send no rows
                assert got["sent"] == int((ids >= 0).sum()), (key, r, got["sent"])
    # balancing really moved rows
    assert results[0]["feplb-split", "per-microbatch", False]["moved"] > 0
    assert results[0]["eplb", "per-step", False]["moved"] > 0
    assert results[0]["post_moved"][2] > 0   # the per-expert post_expert saw rows computed away from their owners
    assert results[0]["none", "per-step", False]["moved"] == 0
    for r, res in enumerate(results):
        assert res["ckpt_equal"] and res["uint8_equal"], r
        assert min(res["placed_slots"]) > 0, res["placed_slots"]   # +place really placed experts elsewhere
        for key in ("post_shift", "post_per_expert", "placed_per_expert"):   # + 1 (or e + 1) on every row, weighed
            delta, want = res[key]
            torch.testing.assert_close(delta.double(), want[:, None].expand_as(delta), rtol=1e-5, atol=1e-5)
        assert res["minus_two"] is not None and "EP rank(s) [1]" in res["minus_two"], (r, res["minus_two"])
        assert res["unmasked"] is not None and "outside [0, 16)" in res["unmasked"], (r, res["unmasked"])
