"""The expert-parallel topology: ranks, nodes, experts and their default homes.

Legend: W EP ranks (= GPUs), G GPUs per node, E experts, D dynamic experts per GPU (``dyn``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

_INT64 = np.dtype(np.int64)
_MAX = np.maximum.reduce


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"Topology.{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"Topology.{name} must be >= {minimum}, got {value}")
    return int(value)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """W EP ranks in nodes of G GPUs, E experts, expert e at home on GPU ``e // (E // W)``.

    ``dyn`` experts of each GPU are dynamic: a balancing plan may compute their rows elsewhere in the node.
    """

    num_ranks: int
    gpus_per_node: int
    num_experts: int
    dyn: int = 4

    def __post_init__(self) -> None:
        w = _check_int("num_ranks", self.num_ranks, 1)
        g = _check_int("gpus_per_node", self.gpus_per_node, 1)
        e = _check_int("num_experts", self.num_experts, 1)
        d = _check_int("dyn", self.dyn, 0)
        if w % g != 0:
            raise ValueError(f"Topology: gpus_per_node (G={g}) must divide num_ranks (W={w})")
        if e % w != 0:
            raise ValueError(f"Topology: num_ranks (W={w}) must divide num_experts (E={e})")
        if d > e // w:
            raise ValueError(f"Topology: dyn must be <= experts per rank E // W = {e // w}, got dyn={d}")
        for name, v in (("num_ranks", w), ("gpus_per_node", g), ("num_experts", e), ("dyn", d)):
            object.__setattr__(self, name, v)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.gpus_per_node

    def home(self, expert: int) -> int:
        """Default home GPU of ``expert`` (plain EP placement)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert must be in [0, {self.num_experts}), got {expert}")
        return expert // self.experts_per_rank

    def node_of(self, rank: int) -> int:
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank}")
        return rank // self.gpus_per_node

    def node_ranks(self, node: int) -> range:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node must be in [0, {self.num_nodes}), got {node}")
        return range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node)

    def local_experts(self, rank: int) -> range:
        """Experts whose default home is ``rank``."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank}")
        return range(rank * self.experts_per_rank, (rank + 1) * self.experts_per_rank)

    def default_home_E(self) -> np.ndarray:
        """int64 [E]: the default home GPU of every expert."""
        return np.arange(self.num_experts, dtype=np.int64) // self.experts_per_rank

    def check_counts(self, counts_WE: object, name: str = "counts_WE") -> np.ndarray:
        """Validate a count matrix and return it as a C-contiguous int64 [W, E] array.

        counts_WE: integer [W, E], counts_WE[s, e] = rows source rank s sends to expert e; never negative.
        """
        # (np.matrix indexes otherwise, and a masked array's mask would be ignored; other subclasses, np.memmap
        # say, are taken as arrays)
        if not isinstance(counts_WE, np.ndarray) or isinstance(counts_WE, (np.matrix, np.ma.MaskedArray)):
            raise TypeError(f"{name} must be a numpy array (np.ndarray; not a matrix or masked array), got "
                            f"{type(counts_WE).__name__}")
        if type(counts_WE) is not np.ndarray:
            counts_WE = np.asarray(counts_WE)
        if counts_WE.dtype.kind not in "iu":
            raise TypeError(f"{name} must have an integer dtype, got {counts_WE.dtype}")
        expect = (self.num_ranks, self.num_experts)
        if counts_WE.shape != expect:
            raise ValueError(f"{name} must have shape [W, E] = {list(expect)}, got {list(counts_WE.shape)}")
        # the planner's hot path: an int64 C-contiguous array needs no conversion, one reduction checks the sign
        out = counts_WE if counts_WE.dtype == _INT64 and counts_WE.flags.c_contiguous else np.ascontiguousarray(
            counts_WE, dtype=np.int64)
        # as unsigned, a negative count is larger than any bound: one reduction checks both ends
        if out.size and _MAX(out.view(np.uint64), None) > self.max_count:
            s, e = np.argwhere((out < 0) | (out > self.max_count))[0]
            v = int(counts_WE[s, e])   # the caller's value (an unsigned one past int64 wrapped in the cast)
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v} at [source {s}, expert {e}]")
            raise ValueError(f"{name}: {v} rows at [source {s}, expert {e}] exceed the planner's bound of "
                             f"{self.max_count} per (source, expert) for W={self.num_ranks}, E={self.num_experts}")
        return out

    @cached_property
    def max_count(self) -> int:
        """The largest count ``check_counts`` accepts: an expert's rows over all W sources stay below
        2**(62 - max(16, B)), B the bits of an expert id, so the planner's integer keys (rows shifted left by B)
        and the history's fixed-point EMA (16 fraction bits) cannot overflow int64."""
        return (1 << (62 - max(16, (self.num_experts - 1).bit_length()))) // self.num_ranks
