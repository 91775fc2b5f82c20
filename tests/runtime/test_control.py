"""The control plane (feplb.control.Control) on 4 gloo processes as 2 nodes x 2: every collective against what each
rank computes alone from a shared seed, per scope; errors raised on every rank together; timeouts naming the
operation; calls from a worker thread; EP groups that are subgroups of the job."""

from __future__ import annotations

import time

import pytest
import torch

from feplb.testing import error_of, run_dist

pytestmark = pytest.mark.dist

SEED = 20261201
STALL_TIMEOUT_S = 1.0


def _row(rank: int, n: int, key: int) -> torch.Tensor:
    return torch.randint(-(1 << 50), 1 << 50, (n,), generator=torch.Generator().manual_seed(SEED + 97 * key + rank))


def _control_cases(rank: int, world: int) -> dict:
    import concurrent.futures
    import datetime

    import torch.distributed as dist

    from feplb.control import Control

    g = 2
    out: dict = {}
    ctl = Control(None, g)
    node = rank // g
    peers = list(range(node * g, node * g + g))
    out["attrs"] = (ctl.rank == rank and ctl.world_size == world and ctl.gpus_per_node == g
                    and ctl.node_ranks == peers and ctl.node_rank == rank % g and ctl.ep_group is None
                    and ctl.group is None and dist.get_world_size(ctl.node_group) == g
                    and dist.get_process_group_ranks(ctl.node_group) == peers)

    # all_gather, per scope, on fresh random rows (N differs from call to call, equal across ranks).
    for key, n in enumerate((1, 5, 33)):
        got = ctl.all_gather(_row(rank, n, key), f"gather {key}")
        out[f"gather_{n}"] = torch.equal(got, torch.stack([_row(r, n, key) for r in range(world)]))
        got = ctl.all_gather(_row(rank, n, key + 10), f"node gather {key}", scope="node")
        out[f"gather_node_{n}"] = torch.equal(got, torch.stack([_row(r, n, key + 10) for r in peers]))

    # all_reduce_min per scope; the input is left alone.
    for scope, members in (("group", range(world)), ("node", peers)):
        flags = _row(rank, 7, 20) % 5
        before = flags.clone()
        got = ctl.all_reduce_min(flags, scope, f"min over {scope}")
        want = torch.stack([_row(r, 7, 20) % 5 for r in members]).min(0).values
        out[f"min_{scope}"] = torch.equal(got, want) and torch.equal(flags, before) and got.dtype == torch.int64

    out["objects"] = ctl.all_gather_object(("r", rank), "node", "objects") == [("r", r) for r in peers]
    ctl.barrier("group", "barrier")
    ctl.barrier("node", "node barrier")

    # check_same: silent when equal, a ValueError on every rank naming what, the versions and the hint otherwise.
    ctl.check_same(b"same bytes", "the config")
    err = error_of(lambda: ctl.check_same(b"v3" if rank == 3 else b"v0", "the config", "build it the same way"))
    mine, others = ([3], [[0, 1, 2]]) if rank == 3 else ([0, 1, 2], [[3]])
    out["check_same"] = err is not None and err.startswith("ValueError") and all(
        s in err for s in ("the config differs across ranks", f"version of ranks {mine}", f"ranks {others}",
                           "build it the same way"))

    # Bad arguments: raised before any collective (every rank errs alike here), naming the argument.
    out["bad_float_row"] = "row must be a 1-D int64 CPU tensor" in str(
        error_of(lambda: ctl.all_gather(torch.ones(3), "bad")))
    out["bad_2d_flags"] = "flags must be a 1-D int64 CPU tensor" in str(
        error_of(lambda: ctl.all_reduce_min(torch.ones(2, 2, dtype=torch.int64), "group", "bad")))
    out["bad_scope"] = "scope must be one of ('node', 'group'), got 'world'" in str(
        error_of(lambda: ctl.barrier("world", "bad")))
    out["bad_blob"] = "blob must be bytes" in str(error_of(lambda: ctl.check_same("text", "x")))

    # From a worker thread (the layer's copy thread), while the main thread computes.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(ctl.all_gather, _row(rank, 4, 30), "from a thread", scope="node")
        a = torch.randn(256, 256)
        for _ in range(5):
            a = torch.tanh(a @ a)
        out["thread"] = torch.equal(fut.result(timeout=20), torch.stack([_row(r, 4, 30) for r in peers]))

    # gpus_per_node that one rank gets wrong: ValueError on every rank, no rank left waiting in group creation.
    err = error_of(lambda: Control(None, 3 if rank == 1 else 2))
    out["bad_gpn_one_rank"] = err is not None and err.startswith("ValueError") and (
        "must be a positive int dividing the EP group size (4), got 3" in err if rank == 1
        else "gpus_per_node differs across the ranks" in err)
    # a node's GPU count larger than the EP group: the error says what to pass instead
    err = error_of(lambda: Control(None, 8))
    out["gpn_node_larger"] = err is not None and "got 8" in err and "is gpus_per_node=4)" in err
    err = error_of(lambda: Control(None, 4 if rank == 0 else 2))
    out["gpn_differs"] = err is not None and "gpus_per_node differs across the ranks" in err and "[4, 2, 2, 2]" in err

    # An EP group that is a subgroup of the job: ranks {0, 2} and {1, 3}; node ranks are global ranks.
    subs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    sub = Control(subs[rank % 2], 1)
    out["sub_attrs"] = sub.world_size == 2 and sub.node_ranks == [rank] and sub.rank == rank // 2
    out["sub_gather"] = torch.equal(sub.all_gather(_row(rank, 3, 40), "sub gather"),
                                    torch.stack([_row(r, 3, 40) for r in (rank % 2, rank % 2 + 2)]))
    sub2 = Control(subs[rank % 2], 2)
    out["sub_one_node"] = sub2.node_ranks == [rank % 2, rank % 2 + 2] and sub2.node_group is sub2.group

    ctl.close()
    ctl.close()
    out["closed"] = "closed" in str(error_of(lambda: ctl.barrier("group", "after close")))
    dist.barrier()

    # Timeouts, on groups with a short timeout (inherited by the node groups Control creates): rank 3 never joins
    # a group all-gather, then rank 1 never joins a node barrier. The others raise TimeoutError naming the step.
    short = datetime.timedelta(seconds=STALL_TIMEOUT_S)
    c1 = Control(dist.new_group(list(range(world)), timeout=short), g)
    c2 = Control(dist.new_group(list(range(world)), timeout=short), g)
    if rank == 3:
        time.sleep(2 * STALL_TIMEOUT_S)
    else:
        t0 = time.monotonic()
        err = error_of(lambda: c1.all_gather(torch.zeros(2, dtype=torch.int64), "the counts step"))
        # The ranks that wait out the timeout raise TimeoutError; a rank whose partner gave up first sees that
        # partner close the connection (gloo's ring) and raises RuntimeError. Both name the step.
        out["stall_group"] = (err or "").startswith(("TimeoutError", "RuntimeError")) and all(
            s in err for s in ("the counts step", "a peer died or stalled"))
        out["stall_group_timeout"] = (err or "").startswith("TimeoutError")
        out["stall_group_s"] = time.monotonic() - t0
    if rank == 1:
        time.sleep(2 * STALL_TIMEOUT_S)
    else:
        t0 = time.monotonic()
        err = error_of(lambda: c2.barrier("node", "end of writes"))
        if rank == 0:
            out["stall_node"] = (err or "").startswith("TimeoutError") and "end of writes" in err
            out["stall_node_s"] = time.monotonic() - t0
        else:
            out["node_1_fine"] = err is None
    return out


@pytest.mark.timing   # a stalled peer is reported within bounds of the timeout
def test_control():
    results = run_dist(_control_cases, 4, timeout_s=120)
    timed_out: list[bool] = []
    for rank, res in enumerate(results):
        waits = {k: res.pop(k) for k in [k for k in res if k.endswith("_s")]}
        timed_out.append(res.pop("stall_group_timeout", False))
        failed = {k: v for k, v in res.items() if not v}
        assert not failed, (rank, failed)
        assert ("stall_group" in res) == (rank != 3) and ("stall_node" in res) == (rank == 0)
        for k, waited in waits.items():
            assert 0.5 * STALL_TIMEOUT_S < waited < 5 * STALL_TIMEOUT_S, (rank, k, waited)
    assert any(timed_out), "no rank reported the stalled all-gather as a TimeoutError"


def _nccl_cases(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from feplb.control import Control

    ctl = Control(None, world)
    got = ctl.all_gather(_row(rank, 3, 50), "counts")
    flags = ctl.all_reduce_min(torch.tensor([rank + 1, 5 - rank], dtype=torch.int64), "group", "agreement")
    return {"gloo": "gloo" in str(dist.get_backend(ctl.group)) and ctl.ep_group is None,
            "gather": torch.equal(got, torch.stack([_row(r, 3, 50) for r in range(world)])),
            "min": flags.tolist() == [1, 5 - (world - 1)] and flags.device.type == "cpu"}


@pytest.mark.gpu
def test_control_over_nccl_group():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (NCCL refuses two ranks on one GPU)")
    for rank, res in enumerate(run_dist(_nccl_cases, 2, backend="nccl", timeout_s=120)):
        assert all(res.values()), (rank, res)


def _groups_released(rank: int, world: int) -> dict:
    """Layers over fresh subgroups, each closed and its group destroyed: nothing of feplb keeps a group alive (a
    module-level lock table held every group ever used, with its gloo sockets)."""
    import datetime
    import gc
    import os
    import weakref

    import torch.distributed as dist

    from feplb import FEPLBConfig, MoELayer

    refs, fds = [], []
    for _ in range(6):
        group = dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(seconds=60))
        layer = MoELayer(FEPLBConfig(hidden=16, ffn=16, num_experts=8, top_k=2, gpus_per_node=2, dyn=1,
                                     policy="feplb-split", weights="per-microbatch"), group=group)
        layer(torch.randn(24, 16)).square().sum().backward()
        layer.close()
        del layer
        dist.destroy_process_group(group)
        refs.append(weakref.ref(group))
        del group
        gc.collect()
        fds.append(len(os.listdir("/proc/self/fd")))
    return {"alive": sum(r() is not None for r in refs), "fds": fds}


def test_closed_layers_release_their_groups():
    for rank, res in enumerate(run_dist(_groups_released, 4, timeout_s=180, collective_timeout_s=60)):
        assert res["alive"] == 0, (rank, res)
        assert res["fds"][-1] <= res["fds"][1], (rank, res["fds"])   # (no sockets piling up per group)
