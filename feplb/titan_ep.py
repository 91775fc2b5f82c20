"""FEPLB behind torchtitan's own expert parallelism: torchtitan keeps its EP (its token dispatcher, all-to-all,
DeepEP or HybridEP; its DTensor expert shards, FSDP, checkpoints, trainer), and FEPLB balances the rows it delivers.

torchtitan (>= 0.3) computes every MoE's routed experts as ``RoutedExperts``: ``token_dispatcher.dispatch`` sends
each token to its experts' EP rank, ``inner_experts(rows, counts)`` (``GroupedExperts``) computes the rows of this
rank's ``L = E / W`` experts, grouped by local expert, and ``token_dispatcher.combine`` weighs and returns them.
:class:`FEPLBGroupedExperts` is a ``GroupedExperts`` (the same parameters ``w1_EFD``, ``w2_EDF``, ``w3_EFD``, the
same names, shapes, initialisation and sharding, so torchtitan parallelizes, shards, checkpoints and optimizes
them as ever) whose forward shares those rows among the GPUs of the node as
:meth:`feplb.MoELayer.forward_dispatched` does: the experts stay at their owners, per micro-batch the plan copies
rows (and the weights of the experts that help) to less loaded GPUs of the node and the outputs back, with the same
result as computing them at home.

Turn it on without changing model code, through torchtitan's override mechanism (``--override.imports``, or
``OverrideConfig(imports=[...])`` in a config registry), with :class:`feplb.FEPLBConfig` fields as its arguments::

    --override.imports 'feplb.titan_ep.feplb_experts={"policy": "feplb-split", "gpus_per_node": 8}'

or in Python on a model config before ``build()``: :func:`convert` (``feplb.titan_ep.convert(model_config,
policy="feplb-split", gpus_per_node=8)``). Both replace every ``GroupedExperts.Config`` (torchtitan's plain experts;
GPT-OSS's and low-precision experts are refused by name) by a :class:`FEPLBGroupedExperts.Config`.

The EP group is torchtitan's ``ep`` mesh, taken when torchtitan parallelizes the model
(``model.parallelize(parallel_dims)``); the forward raises without it (expert parallelism off: nothing to
balance). Weights travel with the rows every micro-batch and their gradients return in the backward pass
(``weights="per-microbatch"``, the only mode here): no per-step call for the training loop to make, and FSDP, which
unshards the expert weights only around the forward, sees ordinary gradients. The experts compute in bfloat16 like
``GroupedExperts`` (``dtype="float32"`` for an exact reference); the rows come back in the input's dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.config import override
from torchtitan.models.common.moe import GroupedExperts

from feplb.config import FEPLBConfig, dispatched_policy_problem
from feplb.dropin import DERIVED
from feplb.layer import MoELayer
from feplb.titan import _GateUp

__all__ = ["FEPLBGroupedExperts", "convert", "feplb_experts"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# what the experts module and torchtitan's routing give FEPLB, or this mode fixes (dtype is the user's to choose)
_DERIVED = tuple(f for f in DERIVED if f != "dtype") + ("weights",)


def _feplb_config(dim: int, hidden_dim: int, num_experts: int, settings: dict[str, Any]) -> FEPLBConfig:
    """The FEPLBConfig of a :class:`FEPLBGroupedExperts` from its shape and ``settings`` (FEPLBConfig fields; dtype
    by name), or TypeError / ValueError naming what is wrong."""
    known = {f.name for f in dataclasses.fields(FEPLBConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(f"FEPLBGroupedExperts: unknown FEPLBConfig field(s) {unknown}; expected some of "
                        f"{sorted(known - set(_DERIVED))}")
    given = sorted(set(settings) & set(_DERIVED))
    if given:
        raise TypeError(f"FEPLBGroupedExperts: {given} come from the experts module and torchtitan's routing, or "
                        "are fixed: weights travel per micro-batch (their gradients return in the backward pass; "
                        "FSDP unshards them only around the forward); do not pass them")
    fields_of = dict(settings)
    dtype = fields_of.pop("dtype", "bfloat16")
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"FEPLBGroupedExperts: dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    cfg = FEPLBConfig(hidden=dim, ffn=hidden_dim, num_experts=num_experts, top_k=1, router="external",
                      weights="per-microbatch", dtype=_DTYPES[dtype], **fields_of)
    why = dispatched_policy_problem(cfg.policy)
    if why is not None:
        raise ValueError(f"FEPLBGroupedExperts: {why.replace('use FEPLB', 'use feplb.titan.apply for FEPLB')}")
    return cfg


class _Engine(MoELayer):
    """The FEPLB layer behind one :class:`FEPLBGroupedExperts`: no parameters of its own; its experts are the
    module's local shards, joined per forward (``expert_weights``)."""

    def _init_experts(self, L: int, H: int, F: int, device: torch.device, dtype: torch.dtype) -> None:
        self._weights: tuple[torch.Tensor, ...] | None = None

    def expert_weights(self) -> tuple[torch.Tensor, ...]:
        if self._weights is None:
            raise RuntimeError("FEPLBGroupedExperts: the experts' weights are read only inside its forward")
        return self._weights


class FEPLBGroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` (same parameters, names, sharding), its rows balanced over the node by FEPLB.

    ``forward(x_RD [R, D], num_tokens_per_expert [L]) -> [R, D]`` in x's dtype: the rows torchtitan's token
    dispatcher delivered for this rank's experts, grouped by local expert, each through its expert's
    ``w2(silu(w1 x) * w3 x)``. Collective over torchtitan's EP group: every rank of it runs every forward, as
    torchtitan's dispatch already requires. :meth:`close` releases FEPLB's threads and copy path.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        # FEPLBConfig fields (policy, gpus_per_node, dyn, plan_wait_ms, ...; dtype by name: "bfloat16" by default)
        feplb: dict[str, Any] = field(default_factory=dict)

    def __init__(self, config: Config):
        super().__init__(config)
        why = self._gemm_problem()
        if why is not None:
            raise TypeError(why)
        # checked now, at build time on every rank alike, not at the first forward
        self.feplb_config = _feplb_config(config.dim, config.hidden_dim, config.num_experts, config.feplb)
        self._ep_mesh = None
        object.__setattr__(self, "_engine", None)   # not a submodule: no state of its own in state_dict()

    def parallelize(self, parallel_dims) -> None:
        super().parallelize(parallel_dims)
        self._ep_mesh = parallel_dims.get_optional_mesh("ep")

    def _gemm_problem(self) -> str | None:
        """Why the module's grouped GEMM is not torchtitan's (a low-precision converter swapped it), or None: FEPLB
        computes the experts with its own, so a swapped one would be ignored."""
        if type(self)._grouped_mm is not GroupedExperts._grouped_mm or "_grouped_mm" in vars(self):
            return (f"{type(self).__name__}: its grouped GEMM was replaced (a low-precision converter?); FEPLB "
                    "computes the experts with its own grouped GEMM in bfloat16 or float32, and would ignore it")
        return None

    @property
    def engine(self) -> MoELayer | None:
        """The FEPLB layer (made by the first forward; its ``last_stats``, ``state``, ``last_timeline``), or None."""
        return self._engine

    def _local(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))

    def _engine_for(self, x_RD: torch.Tensor) -> MoELayer:
        if self._engine is not None:
            return self._engine
        if self._ep_mesh is None:
            raise RuntimeError("FEPLBGroupedExperts needs torchtitan's expert parallelism: parallelize the model "
                               "with expert_parallel_degree > 1 (FEPLB balances the GPUs of an EP group; with "
                               "expert parallelism off there is nothing to balance)")
        if self._ep_mesh.ndim != 1:
            raise RuntimeError(f"FEPLBGroupedExperts: torchtitan's EP mesh has {self._ep_mesh.ndim} dimensions; "
                               "expected one")
        cfg = self.feplb_config
        if cfg.device == "auto":
            cfg = dataclasses.replace(cfg, device=x_RD.device.type)
        engine = _Engine(cfg, self._ep_mesh.get_group())
        object.__setattr__(self, "_engine", engine)
        return engine

    @torch.compiler.disable(reason="FEPLB's forward plans on the host and runs its own collectives and threads: "
                                   "it cannot be traced; compile torchtitan's blocks without fullgraph, or not at all")
    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        why = self._gemm_problem()
        if why is not None:   # (the same module on every rank of the group: all raise)
            raise TypeError(why)
        engine = self._engine_for(x_RD)
        w1, w2, w3 = self._local()
        dt = engine.config.dtype
        if w1.shape[0] != engine.num_local:
            raise RuntimeError(f"FEPLBGroupedExperts: {w1.shape[0]} local experts, expected E / W = "
                               f"{engine.num_local} (torchtitan's EP shards the experts over its EP group)")
        engine.train(self.training)
        engine._weights = (_GateUp.apply(w1, w3, dt).transpose(1, 2), w2.to(dt).transpose(1, 2))
        try:
            y = engine._forward_dispatched(x_RD.to(dt), num_tokens_per_expert_E)
        finally:
            engine._weights = None
        return y.to(x_RD.dtype)

    def close(self) -> None:
        """Release the FEPLB layer's threads, copy path and transport (idempotent; a later forward makes a new one,
        collectively)."""
        if self._engine is not None:
            self._engine.close()
            object.__setattr__(self, "_engine", None)

    def extra_repr(self) -> str:
        c = self.feplb_config
        return (f"num_experts={self.num_experts}, policy={c.policy!r}, gpus_per_node={c.gpus_per_node}, "
                f"dtype={str(c.dtype).removeprefix('torch.')}")


def _replacement(cfg: GroupedExperts.Config, settings: dict[str, Any]) -> FEPLBGroupedExperts.Config:
    if type(cfg) is not GroupedExperts.Config:
        raise ValueError(f"FEPLBGroupedExperts replaces torchtitan's plain GroupedExperts (SwiGLU in bfloat16); got "
                         f"{type(cfg).__qualname__}, whose experts FEPLB does not compute behind torchtitan's "
                         "dispatch (GPT-OSS's run with feplb.titan.apply, FEPLB's own dispatch; low-precision "
                         "grouped GEMMs do not run)")
    _feplb_config(cfg.dim, cfg.hidden_dim, cfg.num_experts, settings)   # refuse a bad setting at config time
    kept = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
    return FEPLBGroupedExperts.Config(**kept, feplb=dict(settings))


# every GroupedExperts.Config and subclass: one FEPLB cannot run raises instead of staying unbalanced unnoticed
@override(target=GroupedExperts.Config,
          description="FEPLB: the routed experts' rows balanced over the GPUs of each node")
def feplb_experts(cfg: GroupedExperts.Config, **settings: Any) -> FEPLBGroupedExperts.Config:
    """torchtitan override (``--override.imports 'feplb.titan_ep.feplb_experts={...}'``): every
    ``GroupedExperts.Config`` -> a :class:`FEPLBGroupedExperts.Config` with ``settings`` (FEPLBConfig fields)."""
    return _replacement(cfg, settings)


def convert(config: Any, **settings: Any) -> list[str]:
    """Replace, in place, every ``GroupedExperts.Config`` in the model config tree ``config`` by a
    :class:`FEPLBGroupedExperts.Config` with ``settings`` (FEPLBConfig fields); before ``build()``. Returns the
    qualified names replaced. Raises, before replacing any: TypeError or ValueError for settings FEPLB cannot run,
    ValueError for experts it does not compute (a subclass: GPT-OSS's, low-precision ones) or none found."""
    found = list(config.traverse(GroupedExperts.Config))
    if not found:
        raise ValueError(f"feplb.titan_ep.convert: found no GroupedExperts.Config in {type(config).__qualname__}")
    if any(parent is None for _, _, parent, _ in found):
        raise ValueError("feplb.titan_ep.convert: the config is a GroupedExperts.Config itself; pass the model's "
                         "config, or use feplb_experts(config, ...) for the replacement")
    new = [_replacement(node, settings) for _, node, _, _ in found]
    for (_, _, parent, attr), rep in zip(found, new, strict=True):
        if isinstance(parent, list):
            parent[attr] = rep
        else:
            setattr(parent, attr, rep)
    return [fqn for fqn, _, _, _ in found]


def engines(model: nn.Module) -> list[MoELayer]:
    """The FEPLB layers of ``model``'s :class:`FEPLBGroupedExperts` made so far (their stats, policy states)."""
    return [m.engine for m in model.modules() if isinstance(m, FEPLBGroupedExperts) and m.engine is not None]
