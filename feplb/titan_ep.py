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
and GPT-OSS's ``GptOssGroupedExperts.Config``) by a :class:`FEPLBGroupedExperts.Config` (a
:class:`FEPLBGptOssGroupedExperts.Config`); other experts (low-precision grouped GEMMs) are refused by name.

The EP group is torchtitan's ``ep`` mesh, taken when torchtitan parallelizes the model
(``model.parallelize(parallel_dims)``); the forward raises without it (expert parallelism off: nothing to
balance). Weights travel with the rows every micro-batch and their gradients return in the backward pass
(``weights="per-microbatch"``, the only mode here): no per-step call for the training loop to make, and FSDP, which
unshards the expert weights only around the forward, sees ordinary gradients. The experts compute in bfloat16 like
``GroupedExperts`` (``dtype="float32"`` for an exact reference); the rows come back in the input's dtype.

torchtitan checkpoints the experts' parameters as its own. The FEPLB layers' balancing histories join its
checkpoints with a second override, ``feplb.titan_ep.feplb_checkpoint`` (:class:`FEPLBCheckpointManager`), so that a
resumed run plans on as the uninterrupted one; without it a resumed run starts them afresh (the same math, other
rows moved).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

import spmd_types as spmd
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer.base import BaseCheckpointManager
from torchtitan.components.checkpointer.dcp import CheckpointManager
from torchtitan.config import override
from torchtitan.config.override import derive
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

from feplb.config import FEPLBConfig, dispatched_policy_problem, int_counts
from feplb.control import _smaller_group_hint
from feplb.dropin import (
    DERIVED,
    HoldsEngine,
    PolicyStates,
    _agree,
    derived_for_forward,
    load_policy_state_dict,
    policy_state_dict,
)
from feplb.experts import checked_at_backward
from feplb.layer import MoELayer
from feplb.recompute import hidden_from_selective_checkpoint
from feplb.titan import oss_fields, oss_weights, swiglu_weights

__all__ = ["FEPLBCheckpointManager", "FEPLBGptOssGroupedExperts", "FEPLBGroupedExperts", "POLICY_STATES",
           "PolicyStates", "convert", "engines", "feplb_checkpoint", "feplb_experts", "load_policy_state_dict",
           "policy_state_dict"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# what the experts module and torchtitan's routing give FEPLB, or this mode fixes (dtype is the user's to choose)
_DERIVED = tuple(f for f in DERIVED if f != "dtype") + ("weights",)


def _feplb_config(dim: int, hidden_dim: int, num_experts: int, settings: dict[str, Any], **fixed: Any) -> FEPLBConfig:
    """The FEPLBConfig of FEPLB's experts from their shape, ``fixed`` (the activation the module computes) and
    ``settings`` (FEPLBConfig fields; dtype by name), or TypeError / ValueError naming what is wrong."""
    known = {f.name for f in dataclasses.fields(FEPLBConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(f"feplb.titan_ep: unknown FEPLBConfig field(s) {unknown}; expected some of "
                        f"{sorted(known - set(_DERIVED))}")
    given = sorted(set(settings) & set(_DERIVED))
    if given:
        raise TypeError(f"feplb.titan_ep: {given} come from the experts module and torchtitan's routing, or "
                        "are fixed: weights travel per micro-batch (their gradients return in the backward pass; "
                        "FSDP unshards them only around the forward); do not pass them")
    if "gpus_per_node" not in settings:
        raise TypeError("feplb.titan_ep: gpus_per_node is required: the GPUs of a node, over which FEPLB balances "
                        "(8 on an 8-GPU node; with 1 it would plan every micro-batch and move nothing)")
    fields_of = dict(settings)
    dtype = fields_of.pop("dtype", "bfloat16")
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"feplb.titan_ep: dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    cfg = FEPLBConfig(hidden=dim, ffn=hidden_dim, num_experts=num_experts, top_k=1, router="external",
                      weights="per-microbatch", dtype=_DTYPES[dtype], **fixed, **fields_of)
    why = dispatched_policy_problem(cfg.policy)
    if why is not None:
        raise ValueError(f"feplb.titan_ep: {why.replace('use FEPLB', 'use feplb.titan.apply for FEPLB')}")
    return cfg


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _Engine(MoELayer):
    """The FEPLB layer behind one of FEPLB's experts modules here: no parameters of its own; its experts are the
    module's local shards, joined per forward (``expert_weights``)."""

    def _init_experts(self, L: int, H: int, F: int, device: torch.device, dtype: torch.dtype) -> None:
        self._weights: tuple[torch.Tensor, ...] | None = None

    def expert_weights(self) -> tuple[torch.Tensor, ...]:
        if self._weights is None:
            raise RuntimeError("feplb.titan_ep: the experts' weights are read only inside its forward")
        return self._weights


class _Balanced(HoldsEngine):
    """What FEPLB's experts behind torchtitan's dispatch share, mixed into a torchtitan experts class (``_base``)
    whose parameters, names and forward signature they keep; ``_join(dtype, *shards)`` gives the engine its experts."""

    _base: type
    _params: tuple[str, ...]

    def _setup(self, config, **fixed: Any) -> None:
        why = self._gemm_problem()
        if why is not None:
            raise TypeError(why)
        # checked now, at build time on every rank alike, not at the first forward
        self.feplb_config = _feplb_config(config.dim, config.hidden_dim, config.num_experts, config.feplb, **fixed)
        self._ep_mesh = None
        object.__setattr__(self, "_engine", None)   # not a submodule: no state of its own in state_dict()

    def parallelize(self, parallel_dims) -> None:
        # (checked first, the same mesh and config on every rank: all raise, before torchtitan's sharding, whose
        # dispatch otherwise fails at the first forward naming no option: "shape '[3, -1]' is invalid")
        mesh = parallel_dims.get_optional_mesh("ep")
        G, E = self.feplb_config.gpus_per_node, self.feplb_config.num_experts
        if mesh is not None and E % mesh.size():
            raise ValueError(f"{type(self).__name__}: torchtitan's expert_parallel_degree {mesh.size()} does not "
                             f"divide the {E} experts; expert parallelism gives every rank of the EP group the same "
                             "number of experts")
        if mesh is not None and mesh.size() % G:
            raise ValueError(f"{type(self).__name__}: gpus_per_node={G} does not divide torchtitan's EP group "
                             f"({mesh.size()} ranks); FEPLB balances over whole nodes of the EP group"
                             + _smaller_group_hint(G, mesh.size()))
        super().parallelize(parallel_dims)
        self._ep_mesh = mesh

    def __getstate__(self) -> dict:
        # a copy (copy.deepcopy, pickling) makes its own FEPLB layer at its first forward: threads, copy paths and
        # process groups are not copied
        state = self.__dict__.copy()
        state["_engine"] = None
        return state

    def _gemm_problem(self) -> str | None:
        """Why the module's grouped GEMM is not torchtitan's (a low-precision converter swapped it), or None: FEPLB
        computes the experts with its own, so a swapped one would be ignored."""
        if type(self)._grouped_mm is not self._base._grouped_mm or "_grouped_mm" in vars(self):
            return (f"{type(self).__name__}: its grouped GEMM was replaced (a low-precision converter?); FEPLB "
                    "computes the experts with its own grouped GEMM in bfloat16 or float32, and would ignore it")
        return None

    @property
    def engine(self) -> MoELayer | None:
        """The FEPLB layer (made by the first forward; its ``last_stats``, ``state``, ``last_timeline``), or None."""
        return self._engine

    def _local(self) -> list[torch.Tensor]:
        """This rank's shards of the parameters (``_params`` order): DTensors' local parts, or the local tensors."""
        return [w.to_local() if isinstance(w, DTensor) else w for w in (getattr(self, n) for n in self._params)]

    def _join(self, dt: torch.dtype, *local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The engine's experts in ``dt`` from this rank's shards ``local`` (``_local()``, in ``_params`` order)."""
        raise NotImplementedError

    def make_engine(self) -> MoELayer:
        """The FEPLB layer, made now if no forward has made it yet (collective over torchtitan's EP group, as the
        first forward is): a restore of the balancing histories before the first step (:class:`PolicyStates`)
        makes it. Its device (``device="auto"``) is then the EP group's, as ``MoELayer`` finds it (CUDA over NCCL,
        else the CPU), not the shards' (which CPU offload keeps on the host while the rows are on the GPU); a
        forward whose rows are elsewhere raises on every rank, naming both."""
        if self._local()[0].device.type == "meta":
            raise RuntimeError(f"{type(self).__name__}: its experts are on the meta device; materialize the model "
                               "(to_empty, init_weights) before restoring the balancing histories")
        return self._engine_on(None)

    def _engine_on(self, device: torch.device | None) -> MoELayer:
        """The layer, made on its first call; ``device``: the rows' (``device="auto"`` becomes its type), or None
        for the group's (``MoELayer``'s own rule)."""
        if self._engine is not None:
            return self._engine
        name = type(self).__name__
        if self._ep_mesh is None:
            raise RuntimeError(f"{name} needs torchtitan's expert parallelism: parallelize the model with "
                               "expert_parallel_degree > 1 (FEPLB balances the GPUs of an EP group; with expert "
                               "parallelism off there is nothing to balance)")
        if self._ep_mesh.ndim != 1:
            raise RuntimeError(f"{name}: torchtitan's EP mesh has {self._ep_mesh.ndim} dimensions; expected one")
        cfg = self.feplb_config
        if cfg.device == "auto" and device is not None:
            cfg = dataclasses.replace(cfg, device=device.type)
        # (hidden from selective checkpointing: made by the first forward, inside a selective activation
        # checkpointing region where torchtitan's op-level mode wraps the block, its agreement's collectives, max,
        # .item() and (CUDA) device-to-host copies would be recorded as that forward's ops, and handed to its
        # recompute's first calls of the same ops, which made none of them)
        engine = hidden_from_selective_checkpoint(_Engine)(cfg, self._ep_mesh.get_group())
        object.__setattr__(self, "_engine", engine)
        return engine

    @torch.compiler.disable(reason="FEPLB's forward plans on the host and runs its own collectives and threads: "
                                   "it cannot be traced; compile torchtitan's blocks without fullgraph, or not at all")
    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """torchtitan's experts call: x_RD [R, D] the rows its dispatcher delivered for this rank's experts, grouped
        by local expert, their counts [L] -> [R, D] in x's dtype. Rows past the counts (a dispatcher's padding at
        the tail, which torchtitan's GPT-OSS experts allow for) come back as zeros."""
        why = self._gemm_problem()
        if why is not None:   # (the same module on every rank of the group: all raise)
            raise TypeError(why)
        if _capturing():
            # (every rank captures at the same point: all raise)
            raise RuntimeError(f"{type(self).__name__}: FEPLB cannot run inside a CUDA graph capture (it plans on the "
                               "host every micro-batch, with host collectives and threads); run torchtitan with "
                               "--training.disable_cuda_graphs")
        if spmd.has_local_type(x_RD):
            # torchtitan's SPMD type checking (--debug.spmd_typechecking): FEPLB's collectives are its own, over
            # its own groups, and its output has the type of its input, as the experts' output has
            with spmd.no_typecheck():
                y = self._forward(x_RD, num_tokens_per_expert_E)
            spmd.assert_type_like(y, x_RD)
            return y
        return self._forward(x_RD, num_tokens_per_expert_E)

    def _forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        engine = self._engine_on(x_RD.device)
        dt = engine.config.dtype
        local = self._local()
        if local[0].shape[0] != engine.num_local:
            raise RuntimeError(f"{type(self).__name__}: {local[0].shape[0]} local experts, expected E / W = "
                               f"{engine.num_local} (torchtitan's EP shards the experts over its EP group)")
        counts, rows = int_counts(num_tokens_per_expert_E), x_RD   # (the one read of the counts on the host)
        if counts is None:   # the engine refuses them, on every rank together
            counts = num_tokens_per_expert_E
        elif 0 <= sum(counts) < x_RD.shape[0]:
            rows = x_RD[:sum(counts)]
        engine.train(self.training)
        # (the DTensors' own versions: an in-place step of one leaves its local tensor's version as it was)
        params = {f"{n} (the DTensor)": getattr(self, n) for n in self._params}
        with derived_for_forward(engine, "_weights", functools.partial(self._join, dt),
                                 dict(zip(self._params, local, strict=True)), type(self).__name__, params):
            y = checked_at_backward(engine._forward_dispatched(rows.to(dt), counts)).to(x_RD.dtype)
        if rows.shape[0] < x_RD.shape[0]:
            y = torch.cat([y, y.new_zeros(x_RD.shape[0] - rows.shape[0], y.shape[1])])
        return y

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


class FEPLBGroupedExperts(_Balanced, GroupedExperts):
    """torchtitan's ``GroupedExperts`` (same parameters, names, sharding), its rows balanced over the node by FEPLB.

    ``forward(x_RD [R, D], num_tokens_per_expert [L]) -> [R, D]`` in x's dtype: the rows torchtitan's token
    dispatcher delivered for this rank's experts, grouped by local expert, each through its expert's
    ``w2(silu(w1 x) * w3 x)``. Collective over torchtitan's EP group: every rank of it runs every forward, as
    torchtitan's dispatch already requires. :meth:`close` releases FEPLB's threads and copy path.
    """

    _base = GroupedExperts
    _params = ("w1_EFD", "w2_EDF", "w3_EFD")

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        # FEPLBConfig fields (policy, gpus_per_node, dyn, plan_wait_ms, ...; dtype by name: "bfloat16" by default)
        feplb: dict[str, Any] = field(default_factory=dict)

    def __init__(self, config: Config):
        super().__init__(config)
        self._setup(config)

    def _join(self, dt: torch.dtype, *local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return swiglu_weights(*local, dt)


class FEPLBGptOssGroupedExperts(_Balanced, GptOssGroupedExperts):
    """torchtitan's GPT-OSS experts (``GptOssGroupedExperts``: ``mlp1_weight_EGD`` [E, 2F, D] with gate and up rows
    interleaved, ``mlp1_bias_EG``, ``mlp2_weight_EDF``, ``mlp2_bias_ED``, the gate clamped at ``swiglu_limit``),
    balanced like :class:`FEPLBGroupedExperts`; the weights and biases cast to the layer's dtype as torchtitan casts
    them."""

    _base = GptOssGroupedExperts
    _params = ("mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED")

    @dataclass(kw_only=True, slots=True)
    class Config(GptOssGroupedExperts.Config):
        feplb: dict[str, Any] = field(default_factory=dict)

    def __init__(self, config: Config):
        super().__init__(config)
        limit = config.swiglu_limit   # (None, which torchtitan's clamp refuses, too)
        fields = oss_fields(limit) if limit is not None else "swiglu_limit None; expected a number > 0 (inf: no clamp)"
        if isinstance(fields, str):
            raise ValueError(f"FEPLBGptOssGroupedExperts: {fields}")
        self._setup(config, **fields)

    def _join(self, dt: torch.dtype, *local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return oss_weights(*local, dt)


def _replacement(cfg: GroupedExperts.Config, settings: dict[str, Any]) -> GroupedExperts.Config:
    if type(cfg) in (FEPLBGroupedExperts.Config, FEPLBGptOssGroupedExperts.Config):
        # converted already (convert() and the feplb_experts override both applied, or either twice): the same
        # settings leave it as it is
        if cfg.feplb == dict(settings):
            return cfg
        raise ValueError(f"feplb.titan_ep: this {type(cfg).__qualname__} was converted to FEPLB's already, with "
                         f"settings {cfg.feplb}, and is given {dict(settings)} now (convert() and the "
                         "feplb_experts override both applied?): apply one of them")
    cls = {GroupedExperts.Config: FEPLBGroupedExperts, GptOssGroupedExperts.Config: FEPLBGptOssGroupedExperts}.get(
        type(cfg))
    if cls is None:
        raise ValueError(f"feplb.titan_ep replaces torchtitan's GroupedExperts and GptOssGroupedExperts; got "
                         f"{type(cfg).__qualname__}, whose experts FEPLB does not compute (low-precision grouped "
                         "GEMMs, other activations)")
    _feplb_config(cfg.dim, cfg.hidden_dim, cfg.num_experts, settings)   # refuse a bad setting at config time
    kept = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
    return cls.Config(**kept, feplb=dict(settings))


# every GroupedExperts.Config and subclass: one FEPLB cannot run raises instead of staying unbalanced unnoticed
@override(target=GroupedExperts.Config,
          description="FEPLB: the routed experts' rows balanced over the GPUs of each node")
def feplb_experts(cfg: GroupedExperts.Config, **settings: Any) -> FEPLBGroupedExperts.Config:
    """torchtitan override (``--override.imports 'feplb.titan_ep.feplb_experts={...}'``): every
    ``GroupedExperts.Config`` -> a :class:`FEPLBGroupedExperts.Config` (GPT-OSS's: a
    :class:`FEPLBGptOssGroupedExperts.Config`) with ``settings`` (FEPLBConfig fields); other subclasses raise."""
    return _replacement(cfg, settings)


def convert(config: Any, **settings: Any) -> list[str]:
    """Replace, in place, every ``GroupedExperts.Config`` in the model config tree ``config`` by a
    :class:`FEPLBGroupedExperts.Config` (GPT-OSS's by a :class:`FEPLBGptOssGroupedExperts.Config`) with
    ``settings`` (FEPLBConfig fields); before ``build()``. Returns the qualified names replaced. Raises, before
    replacing any: TypeError or ValueError for settings FEPLB cannot run, ValueError for experts it does not compute
    (other subclasses: low-precision ones) or none found."""
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
    """The FEPLB layers of ``model``'s experts made so far (their stats, policy states), in module order."""
    return [m.engine for m in model.modules() if isinstance(m, _Balanced) and m.engine is not None]


# ---------------------------------------------------------------------------------------------------- checkpoints

POLICY_STATES = "feplb_policy"   # the balancing histories' entry in torchtitan's checkpoints


class FEPLBCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` whose checkpoints also hold the FEPLB layers' balancing histories
    (:class:`PolicyStates`, under :data:`POLICY_STATES`), so that a resumed run plans its next steps as the
    uninterrupted one would (bit for bit the same steps where the run is otherwise deterministic). Everything else
    is torchtitan's: torchtitan without FEPLB loads these checkpoints (the extra entry is not read), and a
    checkpoint without the histories (torchtitan's own, or one saved before this was on) loads with a warning, the
    histories starting afresh. Turned on by the override :func:`feplb_checkpoint`."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def __init__(self, config: Config, *, model_parts: list[nn.Module], states: dict[str, Any], **kwargs: Any):
        super().__init__(config, model_parts=model_parts, states=states, **kwargs)
        if self.enable:
            self.states[POLICY_STATES] = PolicyStates(model_parts)

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if POLICY_STATES in state_dict and not from_hf and not _histories_saved(checkpoint_id):
            warnings.warn(f"feplb.titan_ep: the checkpoint {checkpoint_id} holds no FEPLB balancing histories (saved "
                          "without FEPLBCheckpointManager); the layers start theirs afresh: the same math, other "
                          "rows moved at first", RuntimeWarning, stacklevel=2)
            state_dict = {k: v for k, v in state_dict.items() if k != POLICY_STATES}
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)


def _histories_saved(checkpoint_id: str) -> bool:
    """Whether the checkpoint holds the histories (:data:`POLICY_STATES`), agreed over the job (collective): every
    rank reads the metadata, and a read that fails on some ranks, or ranks that find different answers (node-local
    checkpoints that differ), raise a RuntimeError on every rank, naming them, instead of leaving the others in the
    load's first collective."""
    try:
        found, why = _saved_with(checkpoint_id, POLICY_STATES), None
    except Exception as e:   # noqa: BLE001 - agreed below, then raised on every rank
        found, why = None, f"{type(e).__name__}: {e}"
    views = _agree((found, why), None)
    failed = [r for r, (_, w) in enumerate(views) if w is not None]
    if failed:
        raise RuntimeError(f"feplb.titan_ep: reading the metadata of the checkpoint {checkpoint_id} failed on rank(s) "
                           f"{failed}: {views[failed[0]][1]}")
    if len({f for f, _ in views}) > 1:
        raise RuntimeError(f"feplb.titan_ep: the checkpoint {checkpoint_id} holds the balancing histories on rank(s) "
                           f"{[r for r, (f, _) in enumerate(views) if f]} and not on the others: the ranks read "
                           "different checkpoints under that name")
    return bool(views[0][0])


def _saved_with(checkpoint_id: str, key: str) -> bool:
    """Whether the DCP checkpoint ``checkpoint_id`` (a local path, or a remote fsspec URI, as ``dcp.load`` and
    torchtitan tell them apart) holds entries under ``key``."""
    if "://" in str(checkpoint_id):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as Reader
    else:
        from torch.distributed.checkpoint import FileSystemReader as Reader
    names = Reader(checkpoint_id).read_metadata().state_dict_metadata
    return any(n == key or n.startswith(key + ".") for n in names)


@override(target=BaseCheckpointManager.Config,
          description="FEPLB: the balancing histories in torchtitan's checkpoints")
def feplb_checkpoint(cfg: BaseCheckpointManager.Config) -> FEPLBCheckpointManager.Config:
    """torchtitan override (``--override.imports feplb.titan_ep.feplb_checkpoint``, beside
    :func:`feplb_experts`): torchtitan's ``CheckpointManager.Config`` -> :class:`FEPLBCheckpointManager.Config`,
    the same settings (one already FEPLB's stays as it is); other checkpoint managers raise."""
    if type(cfg) is FEPLBCheckpointManager.Config:
        return cfg
    if type(cfg) is not CheckpointManager.Config:
        raise ValueError(f"feplb.titan_ep.feplb_checkpoint replaces torchtitan's CheckpointManager (DCP); got "
                         f"{type(cfg).__qualname__}")
    return derive(cfg, FEPLBCheckpointManager.Config)
