"""Routing workloads for the simulator: real per-token traces, per-domain expert popularity, synthetic skew.

Legend: T tokens in a trace, L MoE layers, K top-k, E experts, W EP ranks, S tokens per rank per micro-batch.

A workload yields micro-batches as ``counts_LWE`` (int64 [L, W, E]): rows each source rank sends to each expert,
per layer. Every source rank sends exactly S * K rows per layer.

Trace specs accepted by ``load_workload`` (and the ``feplb simulate`` command line):
* ``PATH.npz``: a per-token trace: ``topk_ids`` [T, L, K] (optional ``topk_weights`` / ``topk_weights_e4``,
  ``seq_offsets`` [n + 1]), or the FLAME layout ``prefill_topk_ids`` [T, L, K]. Each rank of a micro-batch reads
  S consecutive tokens from a seeded random sample start (wrapping around the end of the trace).
* ``PATH.json[:model=olmoe][:domains=arxiv,github,...][:variant=topk]``: the OLMoE repository's per-domain expert
  counts; rank s draws its S * K rows from domain ``domains[s % len(domains)]`` (multinomial).
* ``synthetic:zipf|dirichlet[:E=128][:K=8][:L=4][:alpha=1.2][:drift=0.1][:seed=0]``: seeded popularity (Zipf
  with exponent alpha over a random expert order, or Dirichlet(alpha)), drifting every micro-batch by an AR(1)
  walk of its log-probabilities (step std ``drift``); every rank draws its rows from the same popularity.
Every workload carries the expert shape of the model its routing comes from (``expert_shape``, an ``ExpertShape``
or None): an npz trace from its keys ``expert_hidden`` / ``expert_ffn`` (and ``model``) when present, else from
``KNOWN_MODELS`` by file name; the OLMoE counts from the model name; synthetic workloads have none. The
simulator's cost model uses it by default (``feplb.simulate.SimConfig.shape_from_trace``).
Multinomial workloads draw rows with replacement: an expert may receive more than S rows from one rank, which
real top-k routing cannot produce; the imbalance statistics are what matter here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["KNOWN_MODELS", "ExpertShape", "MultinomialWorkload", "RoutingTrace", "SyntheticWorkload", "load_trace",
           "load_workload", "shape_for", "trace_counts"]


# The largest expert hidden / ffn size taken (far above any model's): a larger one is a corrupt or mistaken trace,
# whose layer times would be absurd
MAX_EXPERT_DIM = 2 ** 20


@dataclass(frozen=True, kw_only=True)
class ExpertShape:
    """One routed expert of a model: hidden size H and expert ffn width F (SwiGLU: weights 3 * H * F), and where
    those numbers come from."""

    model: str
    hidden: int
    ffn: int
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"ExpertShape.{name} must be a positive int, got {v!r}")
            if v > MAX_EXPERT_DIM:
                raise ValueError(f"ExpertShape.{name} must be at most {MAX_EXPERT_DIM} (2**20: no model's hidden or "
                                 f"expert ffn size comes near), got {v!r}")
            object.__setattr__(self, name, int(v))

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model, "hidden": self.hidden, "ffn": self.ffn, "source": self.source}


# The models of the routing traces in shared/routing_traces, by trace file-name prefix (or OLMoE model name).
KNOWN_MODELS: dict[str, ExpertShape] = {
    "esft_vanilla_lite": ExpertShape(
        model="DeepSeek-V2-Lite", hidden=2048, ffn=1408,
        source="huggingface.co/deepseek-ai/DeepSeek-V2-Lite config.json: hidden_size, moe_intermediate_size"),
    "flame_moe_290m": ExpertShape(
        model="FLAME-MoE-290M-1.3B", hidden=1024, ffn=704,
        source="github.com/cmu-flame/FLAME-MoE scripts for FLAME-MoE-290M-1.3B: HIDDEN_SIZE, MOE_FFN_HIDDEN_SIZE"),
    "olmoe": ExpertShape(
        model="OLMoE-1B-7B", hidden=2048, ffn=1024,
        source="huggingface.co/allenai/OLMoE-1B-7B-0924 config.json: hidden_size, intermediate_size"),
    "mistral": ExpertShape(
        model="Mixtral-8x7B", hidden=4096, ffn=14336,
        source="huggingface.co/mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size, intermediate_size"),
}


def shape_for(name: str) -> ExpertShape | None:
    """The known expert shape for a trace name (file stem, or OLMoE model name such as ``olmoe-sft``), or None."""
    for prefix, shape in KNOWN_MODELS.items():
        if name == prefix or name.startswith((prefix + "_", prefix + "-")):
            return shape
    return None


def _check_ids(ids: np.ndarray, name: str, num_experts: int | None) -> int:
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{name}: expert ids must have an integer dtype, got {ids.dtype}")
    if ids.ndim != 3:
        raise ValueError(f"{name}: expert ids must have shape [T, L, K], got {list(ids.shape)}")
    if 0 in ids.shape:
        raise ValueError(f"{name}: expert ids must not be empty, got shape {list(ids.shape)}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        raise ValueError(f"{name}: expert ids must be >= 0, got {lo}")
    if num_experts is not None and hi >= num_experts:
        raise ValueError(f"{name}: expert id {hi} >= num_experts={num_experts}")
    return hi


@dataclass(frozen=True, kw_only=True, eq=False)
class RoutingTrace:
    """A per-token routing trace.

    topk_ids_TLK: integer [T, L, K] expert ids, all in [0, num_experts); an id repeated in a token's top-k counts
        a row per entry (as ``MoELayer`` computes routing given so).
    seq_offsets: int64 [n + 1] sample boundaries (0 = first, T = last), or None (every token may start).
    topk_weights_TLK: float32 [T, L, K] gate weights, or None.
    expert_shape: the expert shape of the model that produced the trace, or None (unknown).
    """

    name: str
    topk_ids_TLK: np.ndarray
    num_experts: int
    seq_offsets: np.ndarray | None = None
    topk_weights_TLK: np.ndarray | None = None
    layer_names: tuple[str, ...] = ()
    expert_shape: ExpertShape | None = None

    def __post_init__(self) -> None:
        if self.expert_shape is not None and not isinstance(self.expert_shape, ExpertShape):
            raise TypeError(f"{self.name}: expert_shape must be an ExpertShape or None, got "
                            f"{type(self.expert_shape).__name__}")
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"{self.name}: num_experts must be a positive int, got {self.num_experts!r}")
        _check_ids(self.topk_ids_TLK, self.name, self.num_experts)
        T, L, K = self.topk_ids_TLK.shape
        if self.num_experts < K:
            raise ValueError(f"{self.name}: top-k K={K} exceeds num_experts={self.num_experts}")
        if self.topk_weights_TLK is not None and self.topk_weights_TLK.shape != (T, L, K):
            raise ValueError(f"{self.name}: gate weights must have shape {[T, L, K]}, "
                             f"got {list(self.topk_weights_TLK.shape)}")
        if self.seq_offsets is not None:
            off = np.asarray(self.seq_offsets)
            if off.dtype.kind not in "iu" or off.ndim != 1 or off.size < 2:
                raise ValueError(f"{self.name}: seq_offsets must be a 1-D integer array [n + 1], got {off.dtype} "
                                 f"{list(off.shape)}")
            # compared as Python ints: np.diff of an unsigned array wraps (a fall reads as a huge rise), and an
            # unsigned offset past int64 would wrap in the cast
            vals = off.tolist()
            if vals[0] != 0 or vals[-1] != T or any(b <= a for a, b in zip(vals, vals[1:], strict=False)):
                raise ValueError(f"{self.name}: seq_offsets must rise strictly from 0 to T={T}, got "
                                 f"{vals[:3]}...{vals[-2:]}")
            object.__setattr__(self, "seq_offsets", off.astype(np.int64))
        if not self.layer_names:
            object.__setattr__(self, "layer_names", tuple(str(i) for i in range(L)))
        elif len(self.layer_names) != L:
            raise ValueError(f"{self.name}: {len(self.layer_names)} layer names for {L} layers")

    @property
    def num_tokens(self) -> int:
        return self.topk_ids_TLK.shape[0]

    @property
    def num_layers(self) -> int:
        return self.topk_ids_TLK.shape[1]

    @property
    def top_k(self) -> int:
        return self.topk_ids_TLK.shape[2]

    def sample_starts(self) -> np.ndarray:
        """int64 [n]: the token indices a micro-batch slice may start at (sample starts, or every token)."""
        if self.seq_offsets is None:
            return np.arange(self.num_tokens, dtype=np.int64)
        return self.seq_offsets[:-1]

    def microbatches(self, rng: np.random.Generator, num_ranks: int, tokens_per_rank: int) -> Iterator[np.ndarray]:
        """Endless micro-batches: each rank takes S consecutive tokens from a random sample start."""
        _check_mb(num_ranks, tokens_per_rank)
        starts = self.sample_starts()
        step = np.arange(tokens_per_rank, dtype=np.int64)
        while True:
            first = starts[rng.integers(0, starts.size, size=num_ranks)]
            idx_WS = (first[:, None] + step[None, :]) % self.num_tokens
            yield trace_counts(self.topk_ids_TLK[idx_WS], self.num_experts)


def trace_counts(ids_WSLK: np.ndarray, num_experts: int) -> np.ndarray:
    """Route W ranks' tokens to experts: ids_WSLK integer [W, S, L, K] -> counts_LWE int64 [L, W, E]."""
    W, S, L, K = ids_WSLK.shape
    # int64 ids (uint64 plus int64 would promote to float64, which bincount refuses)
    flat = (np.arange(L, dtype=np.int64)[None, None, :, None] * W
            + np.arange(W, dtype=np.int64)[:, None, None, None]) * num_experts
    flat = flat + ids_WSLK.astype(np.int64, copy=False)
    return np.bincount(flat.ravel(), minlength=L * W * num_experts).reshape(L, W, num_experts)


def _check_mb(num_ranks: int, tokens_per_rank: int) -> None:
    for name, v in (("num_ranks", num_ranks), ("tokens_per_rank", tokens_per_rank)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def _member(z, path: Path, key: str) -> np.ndarray:
    """The npz archive's array ``key``; numpy gives a member that is no .npy file as its raw bytes."""
    v = z[key]
    if not isinstance(v, np.ndarray):
        raise ValueError(f"{path}: {key} is not an .npy array (the archive holds another kind of file under that "
                         "name)")
    return v


def load_trace(path: str | Path, num_experts: int | None = None) -> RoutingTrace:
    """Load a per-token trace from an npz file (layouts in the module docstring).

    num_experts: E; by default the largest id + 1. Ids >= num_experts are an error, never clipped.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    with np.load(path, allow_pickle=False) as z:
        keys = set(z.files)
        if "topk_ids" in keys:
            ids_key, w_keys = "topk_ids", ("topk_weights", "topk_weights_e4")
        elif "prefill_topk_ids" in keys:
            ids_key, w_keys = "prefill_topk_ids", ("prefill_topk_scores",)
        else:
            raise ValueError(f"{path}: no 'topk_ids' or 'prefill_topk_ids' array; found {sorted(keys)}")
        ids = _member(z, path, ids_key)
        hi = _check_ids(ids, f"{path}:{ids_key}", num_experts)
        weights = None
        for k in w_keys:
            if k in keys:
                w = _member(z, path, k)
                # (complex weights lost their imaginary part with a warning, text failed naming no key)
                if w.dtype.kind not in "iuf":
                    raise ValueError(f"{path}: {k} must hold real numbers, got {w.dtype}")
                weights = (w.astype(np.float32) / 1e4) if k.endswith("_e4") else w.astype(np.float32)
                break
        offsets = _member(z, path, "seq_offsets") if "seq_offsets" in keys else None
        layer_names = ()
        if "moe_layers" in keys:
            names = _member(z, path, "moe_layers")
            if names.ndim != 1:
                raise ValueError(f"{path}: moe_layers must be a 1-D array of the layers' names, got shape "
                                 f"{list(names.shape)}")
            layer_names = tuple(str(v) for v in names)
        shape = shape_for(path.stem)
        if "expert_hidden" in keys or "expert_ffn" in keys:
            if not ("expert_hidden" in keys and "expert_ffn" in keys):
                raise ValueError(f"{path}: an expert shape needs both 'expert_hidden' and 'expert_ffn'")
            model = path.stem
            if "model" in keys:
                v = _member(z, path, "model")
                if v.shape != () or v.dtype.kind != "U":
                    raise ValueError(f"{path}: model must be one string (the model's name), got {v.dtype} "
                                     f"{list(v.shape)}")
                model = str(v)
            dims = {}
            for k in ("expert_hidden", "expert_ffn"):
                v = _member(z, path, k)
                if v.shape != () or v.dtype.kind not in "iuf" or not np.isfinite(v) or v != np.floor(v):
                    raise ValueError(f"{path}: {k} must be one whole number, got {v.dtype} {v.tolist()!r}")
                if not 1 <= v <= MAX_EXPERT_DIM:
                    raise ValueError(f"{path}: {k} must be between 1 and {MAX_EXPERT_DIM} (2**20), got {v.tolist()!r}")
                dims[k] = int(v)
            shape = ExpertShape(model=model, hidden=dims["expert_hidden"], ffn=dims["expert_ffn"],
                                source=f"{path.name}: expert_hidden, expert_ffn")
    if num_experts is None:
        num_experts = hi + 1
    return RoutingTrace(name=path.stem, topk_ids_TLK=ids, num_experts=int(num_experts), seq_offsets=offsets,
                        topk_weights_TLK=weights, layer_names=layer_names, expert_shape=shape)


@dataclass(frozen=True, kw_only=True, eq=False)
class MultinomialWorkload:
    """Rows drawn per rank from a per-domain expert popularity: probs_DLE float64 [n_domains, L, E], each row
    summing to 1; rank s draws from domain ``s % n_domains``. expert_shape: the model's, or None."""

    name: str
    probs_DLE: np.ndarray
    top_k: int
    domains: tuple[str, ...]
    layer_names: tuple[str, ...] = ()
    expert_shape: ExpertShape | None = None

    def __post_init__(self) -> None:
        p = np.asarray(self.probs_DLE, dtype=np.float64)
        if p.ndim != 3 or p.shape[0] != len(self.domains):
            raise ValueError(f"{self.name}: probs_DLE must be [n_domains={len(self.domains)}, L, E], got "
                             f"{list(p.shape)}")
        if np.any(p < 0) or not np.allclose(p.sum(axis=2), 1.0):
            raise ValueError(f"{self.name}: every probs_DLE[d, l] must be non-negative and sum to 1")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= p.shape[2]:
            raise ValueError(f"{self.name}: top_k must be an int in [1, E={p.shape[2]}], got {self.top_k!r}")
        object.__setattr__(self, "probs_DLE", p)
        if not self.layer_names:
            object.__setattr__(self, "layer_names", tuple(str(i) for i in range(p.shape[1])))
        elif len(self.layer_names) != p.shape[1]:
            raise ValueError(f"{self.name}: {len(self.layer_names)} layer names for {p.shape[1]} layers of counts")

    @property
    def num_experts(self) -> int:
        return self.probs_DLE.shape[2]

    @property
    def num_layers(self) -> int:
        return self.probs_DLE.shape[1]

    def microbatches(self, rng: np.random.Generator, num_ranks: int, tokens_per_rank: int) -> Iterator[np.ndarray]:
        _check_mb(num_ranks, tokens_per_rank)
        dom = np.arange(num_ranks) % len(self.domains)
        p_WLE = self.probs_DLE[dom]
        while True:
            yield rng.multinomial(tokens_per_rank * self.top_k, p_WLE).transpose(1, 0, 2).astype(np.int64)


_NONE = object()


def _leaves(x: object) -> Iterator[object]:
    """The values of nested JSON lists, depth first (anything that is not a list is a value)."""
    if isinstance(x, list):
        for v in x:
            yield from _leaves(v)
    else:
        yield x


def load_olmoe(path: str | Path, model: str = "olmoe", domains: tuple[str, ...] | None = None,
               variant: str = "topk") -> MultinomialWorkload:
    """The OLMoE repository's per-domain expert counts (``expert_counts_by_domain.json``) as a workload."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"OLMoE counts file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except RecursionError:
        raise ValueError(f"{path}: not an OLMoE counts file (its JSON is nested too deeply to read)") from None
    if not isinstance(data, dict) or "models" not in data:
        raise ValueError(f"{path}: must be a JSON object with 'models' (the OLMoE repository's "
                         f"expert_counts_by_domain.json), got "
                         + (f"an object with keys {sorted(data)}" if isinstance(data, dict) else
                            f"a {type(data).__name__}"))
    models = data["models"]
    if not isinstance(models, dict):
        raise ValueError(f"{path}: 'models' must be an object mapping model names to their counts, got a "
                         f"{type(models).__name__}")
    if model not in models:
        raise ValueError(f"{path}: unknown model {model!r}; available: {sorted(models)}")
    m = models[model]
    if not isinstance(m, dict):
        raise ValueError(f"{path}: models.{model} must be an object with 'top_k' and the variants 'topk' / 'top1', "
                         f"got a {type(m).__name__}")
    if variant not in m:
        raise ValueError(f"{path}: unknown variant {variant!r} for {model}; available: "
                         f"{sorted(v for v in m if v in ('topk', 'top1'))}")
    by_dom = m[variant]
    if not isinstance(by_dom, dict):
        raise ValueError(f"{path}: models.{model}.{variant} must map each domain to its [layer][expert] counts, got a "
                         f"{type(by_dom).__name__}")
    domains = tuple(sorted(by_dom)) if domains is None else tuple(domains)
    if not by_dom:
        raise ValueError(f"{path}: models.{model}.{variant} lists no domain")
    missing = [d for d in domains if d not in by_dom]
    if missing or not domains:
        raise ValueError(f"{path}: unknown domains {missing}; available: {sorted(by_dom)}")
    what = (f"{path}: counts of {model}/{variant} must be numbers in a [domain][layer][expert] array of equal "
            f"lengths")
    # (each value as JSON gave it: a float64 conversion would take the string "1" for a count, true for 1)
    bad = next((v for d in domains for v in _leaves(by_dom[d]) if type(v) not in (int, float)), _NONE)
    if bad is not _NONE:
        raise ValueError(f"{what}, got {bad!r}")
    try:
        counts = np.asarray([by_dom[d] for d in domains], dtype=np.float64)  # [D, L, E]
    except (ValueError, TypeError) as err:   # ragged lists
        raise ValueError(f"{what} ({err})") from err
    if counts.ndim != 3 or not np.all(counts >= 0) or not np.isfinite(counts).all():
        raise ValueError(f"{path}: counts of {model}/{variant} must be finite, non-negative "
                         "[domain][layer][expert]")
    with np.errstate(over="ignore"):
        sums = counts.sum(2)
    if not np.isfinite(sums).all():    # (finite counts near 1e308 whose sum overflows)
        d, layer = np.argwhere(~np.isfinite(sums))[0]
        raise ValueError(f"{path}: {model}/{variant} counts of domain {domains[d]!r}, layer {layer} sum beyond a "
                         "float64's range")
    empty = np.argwhere(sums == 0)
    if empty.size:
        d, layer = empty[0]
        raise ValueError(f"{path}: {model}/{variant} counts no token at all for domain {domains[d]!r}, layer "
                         f"{layer}: nothing to draw its routing from")
    if variant == "topk" and "top_k" not in m:
        raise ValueError(f"{path}: models.{model} has no 'top_k': the experts each token of its 'topk' counts went to")
    top_k = m["top_k"] if variant == "topk" else 1
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"{path}: {model}'s top_k must be a whole number >= 1, got {top_k!r}")
    numbers = data.get("layers", list(range(counts.shape[1])))
    if not isinstance(numbers, list) or len(numbers) != counts.shape[1] or \
            any(isinstance(v, bool) or not isinstance(v, int) for v in numbers):
        raise ValueError(f"{path}: 'layers' must be a list of the {counts.shape[1]} counted layers' numbers, got "
                         f"{numbers!r}")
    layers = tuple(f"L{v}" for v in numbers)
    return MultinomialWorkload(name=f"{model}-{'+'.join(domains)}", probs_DLE=counts / counts.sum(2, keepdims=True),
                               top_k=top_k, domains=domains, layer_names=layers, expert_shape=shape_for(model))


@dataclass(frozen=True, kw_only=True, eq=False)
class SyntheticWorkload:
    """Seeded synthetic popularity with drift (see the module docstring)."""

    kind: str = "zipf"
    num_experts: int = 128
    top_k: int = 8
    num_layers: int = 4
    alpha: float = 1.2
    drift: float = 0.1
    seed: int = 0
    base_logp_LE: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in ("zipf", "dirichlet"):
            raise ValueError(f"synthetic kind must be 'zipf' or 'dirichlet', got {self.kind!r}")
        for name in ("num_experts", "top_k", "num_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"synthetic {name} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"synthetic top_k={self.top_k} exceeds num_experts={self.num_experts}")
        # (bounded: a drift of 1e308 overflowed the walk's log-popularities into NaN probabilities mid-run, far past
        # any popularity that differs from one-hot)
        if not (0 < self.alpha <= 1e6):
            raise ValueError(f"synthetic alpha must be in (0, 1e6], got {self.alpha}")
        if not (0 <= self.drift <= 1e6):
            raise ValueError(f"synthetic drift must be in [0, 1e6], got {self.drift}")
        rng = np.random.default_rng(self.seed)
        E, L = self.num_experts, self.num_layers
        if self.kind == "zipf":
            ranks = np.stack([rng.permutation(E) for _ in range(L)]) + 1.0
            logp = -self.alpha * np.log(ranks)
        else:
            logp = np.log(rng.dirichlet(np.full(E, self.alpha), size=L) + 1e-300)
        object.__setattr__(self, "base_logp_LE", logp)

    @property
    def name(self) -> str:
        return f"synthetic-{self.kind}-E{self.num_experts}-K{self.top_k}"

    @property
    def expert_shape(self) -> None:
        """A synthetic popularity belongs to no model."""
        return None

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(str(i) for i in range(self.num_layers))

    def microbatches(self, rng: np.random.Generator, num_ranks: int, tokens_per_rank: int) -> Iterator[np.ndarray]:
        _check_mb(num_ranks, tokens_per_rank)
        xi = np.zeros_like(self.base_logp_LE)
        while True:
            logp = self.base_logp_LE + xi
            p = np.exp(logp - logp.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            p_WLE = np.broadcast_to(p, (num_ranks, *p.shape))
            yield rng.multinomial(tokens_per_rank * self.top_k, p_WLE).transpose(1, 0, 2).astype(np.int64)
            xi = 0.9 * xi + self.drift * rng.standard_normal(xi.shape)


def _options(parts: list[str], spec: str, allowed: dict[str, type]) -> dict[str, object]:
    out: dict[str, object] = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or key not in allowed:
            raise ValueError(f"trace spec {spec!r}: bad option {part!r}; expected KEY=VALUE with KEY in "
                             f"{sorted(allowed)}")
        if key in out:   # (two values of one option contradict: neither is taken silently)
            raise ValueError(f"trace spec {spec!r}: option {key} is given twice")
        try:
            out[key] = allowed[key](value)
        except ValueError as err:
            raise ValueError(f"trace spec {spec!r}: option {key}={value!r} is not a valid "
                             f"{allowed[key].__name__}") from err
    return out


def load_workload(spec: str, num_experts: int | None = None):
    """A workload from a trace spec (forms in the module docstring)."""
    if spec.startswith("synthetic:"):
        parts = spec.split(":")[1:]
        kind, opts = parts[0], _options(parts[1:], spec, {"E": int, "K": int, "L": int, "alpha": float,
                                                          "drift": float, "seed": int})
        kw = {"num_experts": opts.pop("E", num_experts or 128), "top_k": opts.pop("K", 8),
              "num_layers": opts.pop("L", 4)}
        return SyntheticWorkload(kind=kind, **kw, **opts)
    path, _, rest = spec.partition(":") if spec.split(":")[0].endswith(".json") else (spec, "", "")
    if path.endswith(".json"):
        opts = _options(rest.split(":") if rest else [], spec, {"model": str, "domains": str, "variant": str})
        doms = tuple(str(opts["domains"]).split(",")) if "domains" in opts else None
        return load_olmoe(path, model=str(opts.get("model", "olmoe")), domains=doms,
                          variant=str(opts.get("variant", "topk")))
    if path.endswith(".npz"):
        return load_trace(path, num_experts)
    raise ValueError(f"unknown trace spec {spec!r}: expected PATH.npz, PATH.json[:model=..][:domains=..] or "
                     "synthetic:zipf|dirichlet[:E=..][:K=..][:L=..][:alpha=..][:drift=..][:seed=..]")
