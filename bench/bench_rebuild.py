"""What deriving the joined expert weights again in the backward costs and saves, next to keeping them, in one run.

The adapters (``feplb.titan``, ``feplb.titan_ep``, Megatron's ``SequentialMLP`` / ``TEGroupedMLP``) join their
experts' parameters into the layer's layout every forward. Kept (the baseline): the experts' GEMMs save the joined
``w1 | w3`` for the backward. Rebuilt (``feplb.experts.rebuilt_in_backward``): autograd keeps a recipe and the
backward joins again. Both run the same experts (``feplb.experts.expert_mlp``: grouped GEMM, SwiGLU, grouped GEMM)
on the same rows, torchtitan's layout (``w1``, ``w3`` [L, F, H], ``w2`` [L, H, F]) in bf16 as FSDP's mixed
precision gives them; rounds alternate the variants. Reported per variant: the bytes of joined weights still
alive between the forward and its backward, on CUDA also the memory allocated then above what was allocated
before the forward, and the fastest round's forward and backward times. Both variants' gradients are checked
bit-equal first (also with ``--benchmark-disable``, as in CI, at a small shape).

On a CPU the times are this CPU's and the shape is small; on a GPU one layer of DeepSeek-V3's experts at EP 8
(32 local experts, H 7168, F 2048). With ``--benchmark-enable`` the results go to
``runs/bench_rebuild_<cpu|cuda>.json``.

    .venv/bin/pytest bench/bench_rebuild.py -s -p no:randomly --benchmark-enable
"""

from __future__ import annotations

import contextlib
import platform
import time
import weakref

import pytest
import torch

from feplb.experts import expert_mlp, rebuilt_in_backward
from feplb.files import write_json

ROUNDS = 5


def _shape(device: torch.device, full: bool) -> tuple[int, int, int, int]:
    """(L local experts, H, F, rows)."""
    if device.type == "cuda" and full:
        return 32, 7168, 2048, 32 * 512
    return (8, 256, 128, 8 * 64) if full else (4, 32, 16, 64)


def _join(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchtitan's weights as the layer's: ``[w1 | w3]`` [L, H, 2F] (a new tensor), ``w2`` [L, F, H] (a view)."""
    return torch.cat([w1, w3], dim=1).transpose(1, 2), w2.transpose(1, 2)


def _step(variant: str, params, x, offsets, g, sync, alive_bytes: list | None = None):
    """One forward and backward; (forward s, backward s, gradients)."""
    before = torch.cuda.memory_allocated(x.device) if x.is_cuda else 0
    sync()
    t0 = time.perf_counter()
    ctx = rebuilt_in_backward(_join, params, "bench") if variant == "rebuilt" else contextlib.nullcontext(
        _join(*params))
    with ctx as weights:
        y = expert_mlp(x, weights, offsets)
        refs = [weakref.ref(w) for w in weights[:1]]   # the join (w2 is its parameter's view)
    del weights, ctx   # (only autograd may hold the join now)
    sync()
    t1 = time.perf_counter()
    if alive_bytes is not None:
        held = sum(r().untyped_storage().nbytes() for r in refs if r() is not None)
        extra = torch.cuda.memory_allocated(x.device) - before if x.is_cuda else None
        alive_bytes.append((held, extra))
    grads = torch.autograd.grad(y, [x, *params], g)
    sync()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, grads


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rebuild_cost(benchmark, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    L, H, F, M = _shape(dev, not benchmark.disabled)
    gen = torch.Generator().manual_seed(0)
    params = [(torch.randn(*s, generator=gen) / s[-1] ** 0.5).to(dev, torch.bfloat16).requires_grad_()
              for s in ((L, F, H), (L, H, F), (L, F, H))]
    x = torch.randn(M, H, generator=gen).to(dev, torch.bfloat16).requires_grad_()
    g = torch.randn(M, H, generator=gen).to(dev, torch.bfloat16)
    offsets = torch.linspace(0, M, L + 1)[1:].round().to(dev, torch.int64)
    variants = ("kept", "rebuilt")
    first = {v: _step(v, params, x, offsets, g, sync)[2] for v in variants}
    for a, b in zip(first["kept"], first["rebuilt"], strict=True):
        assert torch.equal(a, b), "the rebuilt weights' gradients differ from the kept weights'"
    rounds = ROUNDS if not benchmark.disabled else 1
    best = {v: [float("inf"), float("inf")] for v in variants}
    held = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            fwd, bwd, _ = _step(v, params, x, offsets, g, sync, held[v])
            best[v] = [min(best[v][0], fwd), min(best[v][1], bwd)]
    join_bytes = L * H * 2 * F * 2
    results = {v: {"forward_ms": round(best[v][0] * 1e3, 3), "backward_ms": round(best[v][1] * 1e3, 3),
                   "join_bytes_held": held[v][-1][0], "allocated_after_forward_bytes": held[v][-1][1]}
               for v in variants}
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else
            (platform.processor() or platform.machine()), "device_type": dev.type, "torch": torch.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(),
            "shape": {"local_experts": L, "hidden": H, "ffn": F, "rows": M, "dtype": "bfloat16"},
            "join_bytes": join_bytes, "rounds": rounds, "results": results}
    benchmark.extra_info.update(info)
    if not benchmark.disabled:
        write_json(f"runs/bench_rebuild_{dev.type}.json", info)
    label = "GPU" if dev.type == "cuda" else "CPU"
    print(f"\n[{label}] experts L={L} H={H} F={F}, {M} rows, bf16; fastest of {rounds} rounds; w1|w3 "
          f"{join_bytes / 2 ** 20:.1f} MiB:")
    for v, r in results.items():
        print(f"  {v:8s} forward {r['forward_ms']:9.3f} ms  backward {r['backward_ms']:9.3f} ms  "
              f"join held {r['join_bytes_held'] / 2 ** 20:8.1f} MiB"
              + ("" if r["allocated_after_forward_bytes"] is None else
                 f"  allocated after forward {r['allocated_after_forward_bytes'] / 2 ** 20:8.1f} MiB"))
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    # the baseline keeps the join until the backward; the rebuilt variant keeps none of it
    assert results["kept"]["join_bytes_held"] == join_bytes and results["rebuilt"]["join_bytes_held"] == 0
