"""Copy path exchange time: shared-memory peer tensors (``ShmCopyEngine``) vs gloo (``GlooCopyEngine``), side by side.

``test_copy_cpu``: 4 CPU processes as one node; every rank sends S bytes (fp32, as two pieces of S/2, the way the
layer hands the engines its rows) to each of the 3 others and receives 3 x S, for S = 4 KiB, 64 KiB, 1, 16 and
64 MiB. Four variants alternate inside one job on the same inputs (gloo, gloo+matrix, shm, shm+matrix, gloo, ...):
without ``+matrix`` an engine agrees on the split matrix first (one more control collective per exchange); with
it, it is given the matrix, as the MoE layer does. Each exchange is timed from a barrier to its return and reduced
as the max over ranks; the table gives the median and the receive bandwidth per rank (3 x S / time). CPU NUMBERS:
they compare CPU transports on this machine (one torch thread per process) and say nothing about GPU copy
engines.

With ``--benchmark-disable`` (the default in pyproject) it runs one 64 KiB round as a smoke test. Full run:
``.venv/bin/pytest bench/bench_copy.py -s -p no:randomly --benchmark-enable``; results go to
``runs/bench_copy_cpu.json`` and ``benchmark.extra_info``. Both engines return freshly allocated tensors, whose
first-touch page faults weigh on large blocks; ``THP_MEM_ALLOC_ENABLE=1`` (torch's CPU allocator then asks for
transparent huge pages) cuts that cost for both, and is recorded in the JSON.
"""

from __future__ import annotations

import os
import platform
import time

import pytest
import torch

from feplb.files import write_json
from feplb.testing import run_dist

WORLD = 4
FULL = dict(sizes_kib=(4, 64, 1 << 10, 16 << 10, 64 << 10), iters=7)
SMOKE = dict(sizes_kib=(64,), iters=1)
ENGINES = ("gloo", "gloo+matrix", "shm", "shm+matrix")


def _label(kib: int) -> str:
    return f"{kib >> 10} MiB" if kib >= 1024 else f"{kib} KiB"


def _bench_worker(rank: int, world: int, sizes_kib: tuple, iters: int) -> dict:
    import numpy as np
    import torch.distributed as dist

    from feplb.control import Control
    from feplb.copy import make_copy_engine

    cpu = torch.device("cpu")
    ctl = Control(None, world)
    engines = {k: make_copy_engine(k.split("+")[0], cpu, ctl) for k in ENGINES}
    res = {}
    for kib in sizes_kib:
        n = kib * 1024 // 4
        gen = torch.Generator().manual_seed(rank)
        send = {p: list(torch.randn(n, generator=gen).chunk(2)) for p in range(world) if p != rank}
        recv = {q: n for q in send}
        matrix = tuple(tuple(0 if i == j else n for j in range(world)) for i in range(world))
        args = {k: {"matrix": matrix} if k.endswith("+matrix") else {} for k in engines}
        # Warm-up (the shm inboxes grow here; twice, so both halves are touched), and the engines must agree
        # before they are timed.
        for _ in range(2):
            got = {k: e.exchange(send, recv, dtype=torch.float32, device=cpu, op="warm-up", **args[k])
                   for k, e in engines.items()}
            if any(not torch.equal(got["gloo"][q], got[k][q]) for q in recv for k in engines):
                raise AssertionError(f"the copy engines disagree at {_label(kib)}")
        times = {k: [] for k in engines}
        for _ in range(iters):
            for k, e in engines.items():
                ctl.barrier("group", "bench")
                t0 = time.perf_counter()
                e.exchange(send, recv, dtype=torch.float32, device=cpu, op=f"bench {k}", **args[k])
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[k].append(float(t))
        recv_bytes = (world - 1) * n * 4
        res[_label(kib)] = {k: {"median_ms": float(np.median(v)) * 1e3, "min_ms": float(np.min(v)) * 1e3,
                                   "recv_GBps": recv_bytes / float(np.median(v)) / 1e9}
                               for k, v in times.items()}
    for e in engines.values():
        e.close()
    ctl.close()
    return res


@pytest.mark.dist
@pytest.mark.slow
def test_copy_cpu(benchmark):
    cfg = SMOKE if benchmark.disabled else FULL
    res = run_dist(_bench_worker, WORLD, cfg["sizes_kib"], cfg["iters"], timeout_s=600)[0]
    info = {"device": "cpu", "world": WORLD, "threads_per_rank": 1, "iters": cfg["iters"], "results": res,
            "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "")}
    if not benchmark.disabled:
        write_json("runs/bench_copy_cpu.json", info)
    benchmark.extra_info.update(info)
    print(f"\n[CPU] copy path exchange, {WORLD} processes as one node, per-peer block S, median over "
          f"{cfg['iters']} (max over ranks):")
    for size, r in res.items():
        line = "  ".join(f"{k} {r[k]['median_ms']:8.2f} ms ({r[k]['recv_GBps']:6.2f} GB/s)" for k in ENGINES)
        print(f"  S = {size:>9s}  {line}  gloo/shm {r['gloo']['median_ms'] / r['shm']['median_ms']:5.2f}x  "
              f"(+matrix) {r['gloo+matrix']['median_ms'] / r['shm+matrix']['median_ms']:5.2f}x")
    # The timing itself is in extra_info; the fixture records the (cheap) report call so the JSON has an entry.
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    assert all(r[k]["median_ms"] > 0 for r in res.values() for k in ENGINES)
