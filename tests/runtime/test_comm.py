"""Transports, copy path and differentiable exchanges on 4 gloo processes (2 nodes x 2 GPUs), against what each
rank can compute alone from the shared seed."""

from __future__ import annotations

import pytest
import torch

from feplb.testing import run_dist

pytestmark = pytest.mark.dist


def _comm_cases(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from feplb.copy_engine import GlooCopyEngine, make_node_groups
    from feplb.dispatch import PeerComm, all_to_all_rows, exchange
    from feplb.transport import TorchTransport

    g = 2
    tr = TorchTransport()
    node_group, node_ranks = make_node_groups(None, g)
    comm = PeerComm(tr, GlooCopyEngine(node_group, g), g)
    out = {}

    # Phase-1 all-to-all with uneven splits (one rank sends nothing at all) and its backward.
    gen = torch.Generator().manual_seed(0)
    splits_WW = torch.randint(0, 4, (world, world), generator=gen)
    splits_WW[2] = 0
    data = [torch.randn(int(splits_WW[s].sum()), 3, generator=gen) for s in range(world)]
    x = data[rank].clone().requires_grad_(True)
    recv = all_to_all_rows(x, tr, splits_WW[rank].tolist(), splits_WW[:, rank].tolist())
    expect = torch.cat([data[s][int(splits_WW[s, :rank].sum()):int(splits_WW[s, :rank + 1].sum())]
                        for s in range(world)])
    out["a2a"] = torch.equal(recv, expect)
    (recv * (rank + 1)).sum().backward()
    # Row of source s sent to rank d gets gradient (d + 1).
    want = torch.cat([torch.full((int(splits_WW[rank, d]), 3), float(d + 1)) for d in range(world)])
    out["a2a_grad"] = torch.equal(x.grad, want)

    # A known split matrix (as the layer derives it from the all-gathered counts): same result; a matrix that
    # disagrees with this rank's splits is refused locally, before any collective.
    recv_m = tr.all_to_all(data[rank], splits_WW[rank].tolist(), splits_WW[:, rank].tolist(), split_matrix=splits_WW)
    out["a2a_matrix"] = torch.equal(recv_m, expect)
    wrong = splits_WW.clone()
    wrong[rank, (rank + 1) % world] += 1
    try:
        tr.all_to_all(data[rank], splits_WW[rank].tolist(), splits_WW[:, rank].tolist(), split_matrix=wrong)
        out["a2a_matrix_refused"] = False
    except ValueError as exc:
        out["a2a_matrix_refused"] = "split_matrix" in str(exc)

    # Counts all-gather and the config-consistency check.
    counts = tr.all_gather_counts(torch.arange(5) + rank)
    out["counts"] = torch.equal(counts, torch.arange(5).repeat(world, 1) + torch.arange(world)[:, None])
    tr.check_same(b"same", "config")
    try:
        tr.check_same(b"rank0" if rank == 0 else b"other", "config")
        out["check_same_raised"] = False
    except ValueError as exc:
        out["check_same_raised"] = "differs across ranks" in str(exc)

    # Exchange: every rank sends (rank*10 + dst) repeated (dst+1) times to every other rank, intra + cross node.
    def block(src: int, dst: int) -> torch.Tensor:
        return torch.full((dst + 1 + src,), float(src * 10 + dst))

    peers = [p for p in range(world) if p != rank]
    w = torch.zeros(1, requires_grad=True)
    flat = torch.cat([block(rank, p) for p in peers]) + w
    got = exchange(flat, comm, [(p, block(rank, p).numel()) for p in peers],
                   [(q, block(q, rank).numel()) for q in peers], cross_node=True, op="test exchange")
    out["exchange"] = torch.equal(got, torch.cat([block(q, rank) for q in peers]))
    (got * 2).sum().backward()
    out["exchange_grad"] = float(w.grad) == 2.0 * flat.numel()

    # Intra-node only: the copy path alone.
    peer = node_ranks[1] if rank == node_ranks[0] else node_ranks[0]
    t = torch.arange(4.0) + 100 * rank
    got = exchange(t, comm, [(peer, 4)], [(peer, 4)], cross_node=False, op="intra")
    out["intra"] = torch.equal(got, torch.arange(4.0) + 100 * peer)
    dist.barrier()
    return out


def test_comm_paths():
    results = run_dist(_comm_cases, 4, timeout_s=120)
    for rank, res in enumerate(results):
        assert all(res.values()), (rank, res)
