"""Which transformers MoE architectures ``feplb.hf`` runs exactly, checked on tiny random models of each.

transformers ships dozens of MoE architectures, and each release adds some. For every one whose modeling code holds an
experts module (3-D ``gate_up_proj`` / ``up_proj`` / ``down_proj`` parameters), :func:`check` builds a tiny random
model from the architecture's own config class (:func:`tiny_model`: two layers, two attention heads (hidden 64, or two
heads of the default head size where the config derives it; Kimi-style linear attention: 2 heads; Mamba mixers: 8
heads, a state of 16), 8 experts (LongCat-Flash: and 4 zero-computation experts), top-2, vocabulary 64, every other
field at its default; parameters the initialisation leaves constant, such as gpt-oss's expert biases and router
(zeros) or norm scales (ones), given random noise), runs it unmodified and with :func:`feplb.hf.apply` on the ranks
of a process group (balancing between two "GPUs" of a node, rows really moving), and compares the two on each rank's
own input: logits, every expert shard's gradient (against the slice of the unmodified model's gradient summed over the
ranks' inputs) and every other gradient (against the unmodified model's local one). Randomness inside the forward
(router jitter, sampling routers such as PhiMoE's in training mode) is drawn from the same seed in both runs, and the
fp64 reference (for tensors whose fp32 rounding alone nears ``TOL``) is given the fp32 run's draws (``_Draws``).

Each architecture ends in one of these outcomes (:class:`Outcome`):

* ``exact``: replaced, and everything agrees within ``TOL`` relative to the largest element;
* ``refused``: :func:`feplb.hf.apply` refused the experts modules (the reason is its error message's first line);
* ``no experts``: the tiny model holds no experts module ``feplb.hf`` recognises;
* ``not built``: the tiny model could not be built or run unmodified (a limit of this tiny-config recipe, not a
  statement about FEPLB);
* ``WRONG`` (replaced, and some output or gradient differs) and ``error`` (replaced, and the forward or backward
  raised): defects of ``feplb.hf``.

``feplb hf-check`` runs it on two gloo processes on the CPU and prints the table; the test suite asserts that no
architecture is ``WRONG`` or ``error`` and that the known ones stay ``exact``.
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import inspect
import os
import re
import warnings
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Outcome", "TOL", "check", "markdown", "moe_architectures", "summary", "table", "tiny_model"]

TOL = 1e-5
FP64_AGREES = 1e-4   # the fp64 model is a reference where its logits are within this of the fp32 model's
VOCAB = 64

# Set where the config has the field (as its constructor argument, so that fields derived from them follow); every
# other field keeps its default. Head sizes (head_dim, rotary and latent dims) keep theirs: rotary sections and
# latent projections are sized against them (see _tiny_kwargs).
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=64, intermediate_size=64, moe_intermediate_size=32, ffn_hidden_size=64,
            shared_expert_intermediate_size=32, num_local_experts=8, num_experts=8, n_routed_experts=8,
            moe_num_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_k=2, top_k=2, moe_topk=2,
            top_k_experts=2, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=32,
            # a clamped SwiGLU's limit (DeepSeek-V4, GLM-5, Hunyuan-V4) that the tiny models' activations exceed
            swiglu_limit=1.0,
            # the second layer is a MoE layer (architectures whose first layers are dense)
            first_k_dense_replace=1, num_dense_layers=1, first_k_dense=1, moe_layer_start_index=1,
            decoder_sparse_step=1, moe_layer_freq=1, mlp_only_layers=[],
            # Gemma 4: its MoE block on, per-layer input embeddings of the tiny vocabulary
            enable_moe_block=True, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
            # Step 3.7: its routed experts' clamp on every layer (the checkpoint's last two layers have one, 7)
            swiglu_limits=[1.0, 1.0],
            # LongCat-Flash: 4 zero-computation experts beside the 8 routed ones, so that its router picks both kinds
            # (with its default 256, nearly every slot goes to a zero expert and almost no rows reach the layer)
            zero_expert_num=4,
            # Kimi Linear's and GLM-5 Next's linear attention (and the latter's indexer) with 2 heads, Mamba mixers
            # (Granite-MoE-Hybrid, Nemotron-H) with 8 and a state of 16, chunked as long as the tiny input: at their
            # defaults (32-128 heads, a state of 128-256, chunks of 64-256) the pure-torch fallbacks took 16-21 s a
            # model on a 2-core CPU. (Qwen3-Next's keep theirs: with 2 heads the fp32 rounding of Qwen4-Exp's
            # per-head dt_bias and A_log gradients reached 6e-4 of their largest element, which is not this survey's
            # subject.)
            linear_num_heads=2, index_n_heads=2, mamba_n_heads=8, mamba_num_heads=8, mamba_d_state=16,
            ssm_state_size=16, mamba_chunk_size=16, chunk_size=16,
            # Kolibri 1.1's indexer scores keys with leading query heads of key head 0: at most the tiny 2 (default 12)
            index_num_heads=2,
            initializer_range=0.1, use_cache=False, tie_word_embeddings=False)
# Fields some models need set where their config leaves them None: given when a failed attempt's error names them
# (Step 3.7's decoder builds a sliding-window mask on every layer): a window as long as the tiny context.
NEEDED = dict(sliding_window=64)
TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")
# Per-layer lists some configs leave None by default (a checkpoint's config sets them): full attention, and the
# second layer a MoE layer (LFM2-MoE, DeepSeek-OCR2).
NONE_LISTS = dict(layer_types=["full_attention", "full_attention"], mlp_layer_types=["dense", "sparse"])

_EXPERTS_SOURCE = re.compile(r"\b(gate_up_proj|up_proj|down_proj)\s*=\s*nn\.Parameter\(")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What :func:`check` found for one architecture (on the worst rank)."""

    arch: str
    status: str                 # exact | refused | no experts | not built | WRONG | error
    detail: str = ""            # the reason, the error, or the model class and its experts class
    replaced: int = 0           # experts modules replaced
    rows_moved: int = 0         # rows balancing moved, summed over ranks and layers
    max_rel: float = 0.0        # worst relative difference over logits and gradients (exact / WRONG)
    idle: int = 0               # replaced experts modules that no token of the text input reached (on every rank)

    @property
    def defect(self) -> bool:
        return self.status in ("WRONG", "error")


def moe_architectures() -> list[str]:
    """The model types of the installed transformers whose modeling code defines an experts module (a 3-D
    ``gate_up_proj``, ``up_proj`` or ``down_proj`` parameter), one per architecture (not a multimodal model's parts
    apart from it), sorted."""
    import transformers
    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING,
        CONFIG_MAPPING_NAMES,
        model_type_to_module_name,
    )

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    folders = set()
    for path in glob.glob(os.path.join(root, "*", "modeling_*.py")):
        with open(path, encoding="utf-8") as f:
            if _EXPERTS_SOURCE.search(f.read()):
                folders.add(os.path.basename(os.path.dirname(path)))
    # One per architecture: the model type named like its folder, else each type of the folder that no other type
    # of it holds as a sub-config. A sub-config's model (a text, vision or audio part) is reached through the type
    # holding it: the text part is the one surveyed, and an encoder beside it holds no experts.
    by_folder: dict[str, list[str]] = {}
    for t in CONFIG_MAPPING_NAMES:
        folder = model_type_to_module_name(t)
        if folder in folders:
            by_folder.setdefault(folder, []).append(t)
    out = set()
    for folder, types in by_folder.items():
        if folder in types:
            out.add(folder)
            continue
        held = {cls for t in types for cls in getattr(CONFIG_MAPPING[t], "sub_configs", {}).values()}
        out.update(t for t in types if CONFIG_MAPPING[t] not in held)
    return sorted(out)


def _tiny_kwargs(default: Any, cut: str | None) -> dict:
    """Constructor arguments of a tiny version of the config ``default``; per-layer lists (``layer_types``, ...) of
    the default depth are left to the config to derive (``cut=None``) or cut to the tiny depth, keeping their
    ``"last"`` or ``"first"`` layers (dense layers, where an architecture has some, come first)."""
    if hasattr(type(default), "allow_global_per_layer_attribute_access"):
        # a config whose fields may vary per layer (Gemma 4): read their global values; the tiny config sets them
        default.allow_global_per_layer_attribute_access = True
    params = inspect.signature(type(default).__init__).parameters
    kwargs = {k: v for k, v in TINY.items() if k in params or hasattr(default, k)}
    # Per-layer values given as lists (one per layer) keep that form.
    for k, v in list(kwargs.items()):
        if isinstance(getattr(default, k, None), list) and not isinstance(v, list):
            kwargs[k] = [v] * len(getattr(default, k))
    heads, kv = getattr(default, "num_attention_heads", None), getattr(default, "num_key_value_heads", None)
    if isinstance(heads, int) and kv == heads:
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", heads)   # multi-head attention stays so
    if isinstance(heads, int) and getattr(default, "head_dim", None) is None and \
            isinstance(getattr(default, "hidden_size", None), int):
        kwargs["hidden_size"] = kwargs["num_attention_heads"] * (default.hidden_size // heads)  # the default head size
        if hasattr(default, "head_dim"):
            kwargs["head_dim"] = default.hidden_size // heads
    layers = getattr(default, "num_hidden_layers", None)
    depth = TINY["num_hidden_layers"]
    if cut is not None and isinstance(layers, int) and layers > depth:
        for k, v in vars(default).items():
            if k not in kwargs and isinstance(v, list) and len(v) == layers:
                kwargs[k] = v[-depth:] if cut == "last" else v[:depth]
    for k, v in NONE_LISTS.items():
        if k in params and getattr(default, k, 0) is None:
            kwargs[k] = list(v)
    for k in TOKEN_ID_FIELDS:
        v = getattr(default, k, None)
        if isinstance(v, int) and v >= VOCAB:
            kwargs[k] = VOCAB - 1 - TOKEN_ID_FIELDS.index(k)
        elif isinstance(v, list):
            kwargs[k] = [min(int(i), VOCAB - 1) for i in v]
    return kwargs


def _text_model_class(config: Any) -> type:
    """The class of the model that takes ``input_ids`` for ``config``: the causal LM where the auto classes map one,
    else the base model, else (text parts of multimodal models) the modeling module's class for that config."""
    import importlib

    from transformers import AutoModel, AutoModelForCausalLM

    for auto in (AutoModelForCausalLM, AutoModel):
        try:
            return auto._model_mapping[type(config)]
        except KeyError:
            pass
    module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    found = [c for c in vars(module).values()
             if isinstance(c, type) and getattr(c, "config_class", None) is type(config)
             and "PreTrainedModel" not in c.__name__ and hasattr(c, "forward")]
    found.sort(key=lambda c: (not c.__name__.endswith("ForCausalLM"), not c.__name__.endswith("Model"), c.__name__))
    if not found:
        raise LookupError(f"no model class for {type(config).__name__}")
    return found[0]


def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random fp32 model of the transformers architecture ``arch`` (a model type) holding at least one
    experts module, in training mode: the text model where ``arch`` is multimodal. Same ``seed``, same weights.

    The recipe (:data:`TINY`) is generic: it tries the per-layer lists derived by the config, then cut to their last
    and their first layers, each with the default head size and then with heads of 128 (hidden 128), dropping a field
    the config rejects; the first model that holds an experts module and runs a forward and backward is returned.
    Raises, when none does, the error of the first attempt whose model held an experts module (else the last
    attempt's): the one that says what stopped an architecture that has experts."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from feplb.hf import _candidates

    full = CONFIG_MAPPING[arch]()
    default = full.get_text_config() if hasattr(full, "get_text_config") else full
    config_cls = type(default)
    last: BaseException | None = None
    first_with_experts: BaseException | None = None
    # the default head size derived from the default config, else a common real one (128): rotary sections sized for
    # real heads (GLM-4.5V's, Qwen3-Omni's) need it
    shapes = [{}, {"hidden_size": 128, "head_dim": 128}]
    for cut, shape in ((c, sh) for c in (None, "last", "first") for sh in shapes):
        kwargs = {**_tiny_kwargs(default, cut), **shape}
        for _ in range(4):
            model = None
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    config = config_cls(**kwargs)
                    torch.manual_seed(seed)
                    model = _text_model_class(config)(config).float().train()
                    _vary_constants(model, seed)
                if not _candidates(model):
                    raise LookupError(f"{type(model).__name__} of {len(kwargs)} tiny fields holds no experts module")
                probe = copy.deepcopy(model)
                _run(probe, torch.zeros(1, 4, dtype=torch.long) + 1, seed=0)
                return model
            except Exception as e:
                last = e
                if first_with_experts is None and model is not None and _candidates(model):
                    first_with_experts = e
                # A field the config's validation names: let it keep its default; one the model needs set: set it.
                # Then try again.
                named = [k for k in kwargs if k in TINY and re.search(rf"\b{k}\b", str(e))]
                needed = [k for k in NEEDED if kwargs.get(k) is None and re.search(rf"\b{k}\b", str(e))]
                if not named and not needed:
                    break
                for k in named:
                    del kwargs[k]
                kwargs.update((k, NEEDED[k]) for k in needed)
    assert last is not None
    raise first_with_experts or last


def _vary_constants(model: torch.nn.Module, seed: int) -> None:
    """Random noise (std ``initializer_range``) added to every floating parameter its initialisation left constant:
    zeros (gpt-oss's expert biases and router, attention sinks, ...) and ones (norm scales: Ergo's one per expert).
    A zero bias or a scale of ones would check nothing of how FEPLB carries them, or which expert's it uses."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() and bool((p == p.reshape(-1)[0]).all()):
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * TINY["initializer_range"])


def _run(model: torch.nn.Module, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """The model's logits (or last hidden state) on ``ids``, with the forward's own randomness drawn from ``seed``,
    and their backward of a fixed loss."""
    torch.manual_seed(seed)
    out = model(input_ids=ids, use_cache=False)
    y = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    # A loss whose gradient reaches every logit with a different weight.
    w = torch.linspace(-1.0, 1.0, y.numel(), dtype=torch.float32).view_as(y)
    (y.float() * w).sum().backward()
    return y.detach()


# The random-number ops a forward may call (torch functions and Tensor methods, by name)
_RANDOM_OPS = frozenset({
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli", "multinomial",
    "normal", "poisson", "exponential_", "uniform_", "normal_", "bernoulli_", "random_", "geometric_", "log_normal_",
    "cauchy_"})


# Functions that draw inside (the mode sees them whole, not their draws): (name, argument index and default of
# the probability or None, of the training flag or None)
_OPAQUE_RANDOM = {"dropout": ((1, 0.5), (2, True)), "dropout1d": ((1, 0.5), (2, True)),
                  "dropout2d": ((1, 0.5), (2, True)), "dropout3d": ((1, 0.5), (2, True)),
                  "alpha_dropout": ((1, 0.5), (2, False)), "feature_alpha_dropout": ((1, 0.5), (2, False)),
                  "dropout_": ((1, 0.5), (2, True)), "gumbel_softmax": (None, None),
                  "rrelu": (None, (3, False)), "rrelu_": (None, (3, False))}


def _draws_inside(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the call ``name(*args, **kwargs)`` of an ``_OPAQUE_RANDOM`` function draws random numbers."""
    prob, flag = _OPAQUE_RANDOM[name]

    def arg(spec, names):
        i, default = spec
        for n in names:
            if n in kwargs:
                return kwargs[n]
        return args[i] if len(args) > i else default

    if flag is not None and not arg(flag, ("training", "train")):
        return False
    return prob is None or float(arg(prob, ("p",))) > 0


class _Draws(torch.overrides.TorchFunctionMode):
    """Record the random numbers a run draws (``replay=None``), or give a run in another dtype the ones another run
    recorded, cast, in the order they were drawn (``replay``, a list of (op, numbers)): the fp64 reference of a
    forward that samples (PhiMoE's router in training mode) then routes as the fp32 model did. ``matched`` turns
    False where the replayed run draws otherwise (another op, count or shape), and where either run calls a function
    whose noise it cannot see (dropout with p > 0 in training, ``gumbel_softmax``, ``rrelu`` in training: the
    numbers they draw inside are not theirs to replace): its result is then no reference."""

    def __init__(self, replay: list[tuple[str, torch.Tensor]] | None = None):
        super().__init__()
        self.drawn: list[tuple[str, torch.Tensor]] = []
        self.replay = None if replay is None else list(replay)
        self.matched = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", None)
        if name in _OPAQUE_RANDOM and _draws_inside(name, args, kwargs):
            self.matched = False
            return out
        if name not in _RANDOM_OPS or not isinstance(out, torch.Tensor):
            return out
        if self.replay is None:
            self.drawn.append((name, out.detach().clone()))
        elif not self.replay or self.replay[0][0] != name or self.replay[0][1].shape != out.shape:
            self.matched = False
        else:
            with torch.no_grad():
                out.copy_(self.replay.pop(0)[1])
        return out

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        if self.replay:    # draws the replayed run never made
            self.matched = False


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max())
    diff = float((a.float() - b.float()).abs().max())
    return diff / scale if scale else diff


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    head = text[0] if text else type(e).__name__
    # apply's refusal: "cannot run these experts modules exactly ...:" then one line per module
    if len(text) > 1 and head.endswith(":"):
        head = text[1].strip()
    return head if len(head) <= 300 else head[:297] + "..."


def _agree(group, status: str) -> list[str]:
    got: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, status, group=group)
    return got


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in model.named_parameters()}


def _close(got: torch.Tensor, want: torch.Tensor, want64: torch.Tensor | None) -> tuple[float, bool]:
    """(max |got - want| / max |want|, whether that is within tolerance): within ``TOL`` of the unmodified fp32
    model's result ``want``, or of the fp64 result ``want64`` beyond four times the unmodified fp32 model's own
    distance from it. The second form is for tensors whose fp32 rounding alone is near ``TOL`` or beyond: after a
    cancellation, or a gradient that is zero in exact arithmetic (DeepSeek-V4's hash-routed gate, whose two equal
    expert ids make its weights constant), where both fp32 results are rounding noise. A defect (a row computed
    with the wrong weights, a dropped token) is off by the size of the values, far beyond either bound."""
    rel = _rel(got, want)
    if rel <= TOL:
        return rel, True
    if want64 is None:
        return rel, False
    return rel, _rel(got, want64) <= 4 * _rel(want, want64) + TOL


def _summed_expert_grads(model: torch.nn.Module, ref: torch.nn.Module, group) -> dict[str, torch.Tensor]:
    """The unmodified model ``ref``'s expert gradients summed over every rank's input, by the names of ``model``'s
    expert parameters (collective): one all-reduce per expert parameter, in the model's order and of its full shape
    on every rank, zeros where a rank has none."""
    import feplb.hf as fh

    grads, params = _grads(ref), dict(ref.named_parameters())
    expert_ids = {id(p) for p in fh.expert_parameters(model)}
    summed = {}
    for n, p in model.named_parameters():
        if id(p) in expert_ids:
            summed[n] = grads[n].clone() if grads[n] is not None else torch.zeros_like(params[n])
            dist.all_reduce(summed[n], group=group)
    return summed


def _against_fp64(model: torch.nn.Module, src64: torch.nn.Module | None, ids: torch.Tensor, seed: int,
                  draws: _Draws, want: torch.Tensor, over: list[tuple], group) -> tuple[list[str], list[str]]:
    """The tensors of ``over`` (this rank's (name, FEPLB's, the fp32 model's) beyond ``TOL`` of the unmodified fp32
    model) judged against the same model in fp64 (``src64``, a copy of the unmodified
    model, converted here; see :func:`_close`): (the names of those wrong, of those within the fp64 bound).
    Collective: every rank calls it, with its own ``over``, possibly empty. The fp64 model is a reference only where
    it runs on every rank and its logits agree with the fp32 model's to fp32 rounding (``FP64_AGREES``); a forward
    that draws random numbers (PhiMoE's router in training mode) is given the fp32 run's draws. Elsewhere every
    tensor of ``over`` is wrong."""
    try:
        ref64 = src64.double()
        if hasattr(ref64, "set_experts_implementation"):
            ref64.set_experts_implementation("eager")   # the default, torch._grouped_mm, has no fp64
        with _Draws(draws.drawn) as replayed:
            want64 = _run(ref64, ids, seed)
        if not replayed.matched or not _rel(want, want64) <= FP64_AGREES:
            want64 = None
    except Exception:   # (src64 None: the copy failed) no reference
        want64 = None
    if not all(_agree(group, want64 is not None)):
        return [n for n, *_ in over], []
    grads64, summed64 = _grads(ref64), _summed_expert_grads(model, ref64, group)
    bad, by64 = [], []
    for n, got_t, want_t in over:
        if n == "logits":
            w64 = want64
        elif n in summed64 and grads64[n] is not None:   # an expert parameter: its slice of the sum
            owner, _, pname = n.rpartition(".")
            w64 = model.get_submodule(owner).local_shard(pname, summed64[n])
        else:
            w64 = grads64[n]
        (by64 if _close(got_t, want_t, w64)[1] else bad).append(n)
    return bad, by64


_OURS = "[feplb] "


def _raised_in_feplb(e: BaseException) -> bool:
    """Whether feplb's own code (other than this module's tiny-model recipe) was on the stack where ``e`` was
    raised."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    tb = e.__traceback__
    while tb is not None:
        name = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if name.startswith(here) and name != os.path.abspath(__file__):
            return True
        tb = tb.tb_next
    return False


def _check_one(arch: str, rank: int, world: int, group, overrides: dict) -> Outcome:
    import feplb.hf as fh

    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    seed = 7 + rank
    try:
        model = tiny_model(arch)
        ref = copy.deepcopy(model)
        with _Draws() as draws:
            want = _run(ref, ids, seed)
        built = f"{type(model).__name__}"
        err = ""
    except Exception as e:  # the tiny-config recipe's limit: reported, never a FEPLB outcome, unless FEPLB's own
        # code raised it (finding the experts modules: feplb.hf._candidates): a defect, not a limit of the recipe
        err = (_OURS if _raised_in_feplb(e) else "") + f"{type(e).__name__}: {_first_line(e)}"
    # Every rank goes on to the collective apply only if every rank built and ran its model.
    errs = [e for e in _agree(group, err) if e]
    ours = [e for e in errs if e.startswith(_OURS)]
    if ours:
        return Outcome(arch, "error", ours[0].removeprefix(_OURS))
    if errs:
        # an architecture whose tiny models all built but none held experts (a dense model named on the command line)
        return Outcome(arch, "no experts" if errs[0].startswith("LookupError") and "holds no experts module"
                       in errs[0] else "not built", errs[0])
    # A copy of the unmodified model for the fp64 reference (_against_fp64), run only where the fp32 comparison
    # needs it.
    try:
        src64 = copy.deepcopy(model)
    except Exception:
        src64 = None
    kinds = sorted({type(m).__name__ for _, m in fh._candidates(model)})
    try:
        names = fh.apply(model, group=group, **overrides)
        status = ("", "")
    except Exception as e:
        text = str(e)
        if isinstance(e, ValueError) and "found no experts module" in text:
            status = ("no experts", ", ".join(kinds) or built)
        elif isinstance(e, ValueError) and "cannot run these experts modules exactly" in text:
            status = ("refused", _first_line(e))
        else:
            status = ("error", f"{type(e).__name__}: {_first_line(e)}")
    # apply's refusals are agreed on every rank; anything else may have struck one rank only: the ranks go on to
    # the forward's collectives together, or not at all.
    failed = [st for st in _agree(group, status) if st[0]]
    if failed:
        order = ("error", "refused", "no experts")
        return Outcome(arch, *min(failed, key=lambda st: order.index(st[0])))
    try:
        got = _run(model, ids, seed)
        fh.reduce_replica_grads(model)
        # (name, FEPLB's tensor, the fp32 reference's) of every tensor compared
        compared = [("logits", got, want)]
        ref_grads, summed = _grads(ref), _summed_expert_grads(model, ref, group)
        missing = []
        for n, p in model.named_parameters():
            g_ref = ref_grads[n]
            if (p.grad is None) != (g_ref is None):
                missing.append(n)
                continue
            if g_ref is None:
                continue
            if n in summed:   # an expert parameter: this rank's slice of the sum, as its layer cuts it
                owner, _, pname = n.rpartition(".")
                g_ref = model.get_submodule(owner).local_shard(pname, summed[n])
            compared.append((n, p.grad, g_ref))
        rels = [_rel(got_t, want_t) for _, got_t, want_t in compared]
        worst = max(rels)
        # beyond TOL of the fp32 model: checked against the fp64 reference below, or wrong
        over = [c for c, rel in zip(compared, rels, strict=True) if rel > TOL]
        # An experts module no token of this input reached (e.g. a multimodal model's vision experts) has no stats.
        moved = sum(m.last_stats.rows_moved for m in fh.experts_modules(model) if m.last_stats is not None)
        idle = sum(m.last_stats is None for m in fh.experts_modules(model))
        # the model's own parameters marked as replaced ones (feplb.dropin.mark_replaced): an optimizer made after
        # apply would be refused at its first step
        marked = [n for n, p in model.named_parameters() if getattr(p, "_feplb_replaced", None)]
        lost = f"gradient of {', '.join(missing[:3])} missing on one side" if missing else \
            f"{', '.join(marked[:3])} marked as replaced (an optimizer made after apply would refuse it)" if marked \
            else ""
        mine = ("", worst, moved, lost, idle, len(over))
    except Exception as e:
        mine = (f"{type(e).__name__}: {_first_line(e)}", 0.0, 0, "", 0, 0)
    ranks = _agree(group, mine)
    rows = sum(r[2] for r in ranks)
    failed = [r[0] for r in ranks if r[0]]
    if failed:
        return Outcome(arch, "error", failed[0], len(names), rows)
    worst = max(r[1] for r in ranks)
    lost = [r[3] for r in ranks if r[3]]
    if lost:
        return Outcome(arch, "WRONG", lost[0], len(names), rows, worst)
    # every rank runs the fp64 reference (and agrees on its verdicts), or none
    verdicts = _agree(group, _against_fp64(model, src64, ids, seed, draws, want, over, group)) \
        if any(r[5] for r in ranks) else []
    wrong = [b for b, _ in verdicts if b]
    if wrong:
        return Outcome(arch, "WRONG", f"{', '.join(wrong[0][:3])} differ by up to {worst:.2e}", len(names), rows,
                       worst)
    idle = min(r[4] for r in ranks)
    detail = f"{built} ({', '.join(kinds)})"
    by64 = sorted({n for _, b64 in verdicts for n in b64})
    if by64:
        detail += (f"; {len(by64)} tensor(s) beyond {TOL:g} of the fp32 model, within 4x its fp32 rounding error "
                   f"of fp64: {', '.join(by64[:2])}{', ...' if len(by64) > 2 else ''}")
    if idle:
        detail += (f"; {idle} of {len(names)} experts modules took no token of the text input (modality experts: "
                   "every EP rank must run them in every forward)")
    return Outcome(arch, "exact", detail, len(names), rows, worst, idle)


def check(archs: list[str] | None = None, group=None, **overrides: Any) -> list[Outcome]:
    """Run every architecture of ``archs`` (default :func:`moe_architectures`) unmodified and with FEPLB on the
    ranks of ``group`` (collective: every rank calls it with the same list), and return their outcomes.

    overrides: :func:`feplb.hf.apply`'s config overrides (default: ``feplb-split`` balancing between 2 GPUs per
    node, any imbalance moved, 1-row chunks)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = dict(policy="feplb-split", gpus_per_node=min(2, world), min_chunk=1, plan_wait_ms=60_000,
               min_straggler_rows=0)
    cfg.update(overrides)
    out = []
    for arch in archs if archs is not None else moe_architectures():
        out.append(_check_one(arch, rank, world, group, cfg))
    return out


def _worker(rank: int, world: int, archs: list[str] | None, overrides: dict) -> list[dict]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()   # tiny configs draw warnings (rope scaling, kernels falling back) by the dozen
    # Plain dicts: run_dist's children load this module under another name, whose classes the parent cannot unpickle.
    return [dataclasses.asdict(o) for o in check(archs, **overrides)]


_ORDER = ("WRONG", "error", "exact", "refused", "no experts", "not built")


def _sorted(outcomes: list[Outcome]) -> list[Outcome]:
    return sorted(outcomes, key=lambda o: (_ORDER.index(o.status), o.arch))


def summary(outcomes: list[Outcome]) -> str:
    """One line: how many architectures ended in each outcome."""
    counts = {s: sum(o.status == s for o in outcomes) for s in _ORDER}
    return f"{len(outcomes)} architectures: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)


def table(outcomes: list[Outcome]) -> str:
    """A plain-text table, defects first."""
    rows = [(o.arch, o.status, str(o.replaced), str(o.rows_moved), f"{o.max_rel:.1e}" if o.replaced else "-",
             o.detail) for o in _sorted(outcomes)]
    head = ("architecture", "outcome", "replaced", "rows moved", "max rel diff", "detail")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + "  " + r[5] for r in [head, *rows]]
    return "\n".join(lines)


def markdown(outcomes: list[Outcome], meta: dict) -> str:
    """The outcomes as a Markdown document: how they were obtained, a summary line, and the table."""
    esc = lambda text: text.replace("|", "\\|")   # noqa: E731
    lines = [
        "# transformers MoE architectures under feplb.hf",
        "",
        f"Produced by `{meta['command']}` on {meta['date']} ({meta['machine']}; transformers {meta['transformers']}, "
        f"torch {meta['torch']}, Python {meta['python']}; {meta['wall_s']} s). Each architecture is a tiny random "
        "model (2 layers, 2 attention heads (Kimi-style linear attention: 2 heads; Mamba mixers: 8 heads, a state "
        "of 16), 8 experts (LongCat-Flash: and 4 zero-computation experts), top-2, "
        "vocabulary 64, every other field at its default; "
        "parameters its initialisation leaves constant (zeros: gpt-oss's expert biases; ones: norm scales, "
        "Ergo's per expert) given random noise) "
        f"built from its own config class, run unmodified and with "
        f"`feplb.hf.apply` on {meta['ranks']} gloo processes ({meta['gpus_per_node']} per modelled node, policy "
        f"`{meta['policy']}`). **exact**: logits and every gradient within {meta['tolerance']:g} of the unmodified "
        "model's (relative to each tensor's largest element), or within that of the fp64 result beyond four times "
        "the unmodified fp32 model's own error. **refused**: what `feplb.hf.apply` refuses, and why. **not built**: "
        "this tiny recipe could not build or run the architecture unmodified (nothing is said about FEPLB).",
        "",
        summary(outcomes) + ".",
        "",
        "| architecture | outcome | experts modules replaced | rows moved | max rel. diff | detail |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for o in _sorted(outcomes):
        rel = f"{o.max_rel:.1e}" if o.replaced else "-"
        lines.append(f"| `{o.arch}` | {o.status} | {o.replaced} | {o.rows_moved} | {rel} | {esc(o.detail)} |")
    return "\n".join(lines) + "\n"
