"""What the first steps of a forward produce, read by the later ones (frozen, identical in meaning on every rank)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from feplb.layout import HomeLayout

__all__ = ["Counts", "Split", "read_counts"]


@dataclass(frozen=True, kw_only=True, eq=False)
class Counts:
    """The all-gathered counts of one forward, read identically on every rank."""

    counts_WS: np.ndarray       # int64 [W, E]: rows source s sends each flat slot
    counts_WE: np.ndarray       # int64 [W, E]: rows source s sends each expert
    loads_default_W: np.ndarray  # int64 [W]: rows per GPU with every expert at its owner (plain EP)
    loads_home_W: np.ndarray    # int64 [W]: rows per GPU with the current placement, before balancing
    want_plan: bool             # balancing is on and the straggler is worth it (identical everywhere)


@dataclass(frozen=True, kw_only=True, eq=False)
class Split:
    """Static and dynamic experts of this micro-batch and this rank's home layout."""

    dynamic_WD: np.ndarray      # int64 [W, D]: dynamic experts of every GPU (D = 0 without a plan)
    home: HomeLayout
    send_splits: list[int]      # [W] rows this rank sends each rank in phase 1
    split_WW: torch.Tensor      # int64 CPU [W, W]: rows rank s sends rank d in phase 1


def read_counts(gathered: np.ndarray, slots_WS: np.ndarray, *, balance: bool, min_straggler: float) -> Counts:
    """Read the all-gathered rows (int64 [W, E + 3]: counts per flat slot, this rank's routing flags (1: NaN or
    inf, 2: ids out of range), its replicas-stale flag, its bad-input flag), raising on every rank together when
    any rank reported a problem.

    slots_WS: int64 [W, L] the experts at home on each GPU. balance: the policy balances (and W > 1).
    min_straggler: rows of token straggler below which balancing is not worth it.
    """
    from feplb.sched.metrics import token_straggler

    W, L = slots_WS.shape
    E = W * L
    input_ranks = np.nonzero(gathered[:, E + 2])[0].tolist()
    if input_ranks:
        raise ValueError(f"MoELayer: the input of EP rank(s) {input_ranks} is malformed (see the error there); "
                         "every rank stops this step")
    id_ranks = np.nonzero(gathered[:, E] & 2)[0].tolist()
    if id_ranks:
        raise ValueError(f"MoELayer: routing passed to forward() holds expert ids outside [0, {E}) on EP rank(s) "
                         f"{id_ranks}")
    bad_ranks = np.nonzero(gathered[:, E])[0].tolist()
    if bad_ranks:
        raise ValueError(f"MoELayer: router logits (or routing weights) contain NaN or inf on EP rank(s) "
                         f"{bad_ranks}; check the input and the router weights")
    stale_ranks = np.nonzero(gathered[:, E + 1])[0].tolist()
    if stale_ranks:
        raise RuntimeError(f"MoELayer: expert weights changed since the last refresh_replicas() on EP rank(s) "
                           f"{stale_ranks}; call layer.refresh_replicas() after optimizer.step() "
                           "(weights='per-step'), or layer.attach_optimizer(optimizer) once")
    counts_WS = np.ascontiguousarray(gathered[:, :E])
    counts_WE = np.empty_like(counts_WS)
    counts_WE[:, slots_WS.reshape(-1)] = counts_WS
    loads_home = counts_WS.sum(axis=0).reshape(W, L).sum(axis=1)
    want = balance and token_straggler(loads_home) >= max(min_straggler, 1e-9)
    return Counts(counts_WS=counts_WS, counts_WE=counts_WE,
                  loads_default_W=counts_WE.sum(axis=0).reshape(W, L).sum(axis=1), loads_home_W=loads_home,
                  want_plan=bool(want))
