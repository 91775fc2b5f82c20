"""Gated activation of the first expert projection: out = act(gate) * up, with gate = h[:, :F], up = h[:, F:].

``act`` (:data:`ACTS`): ``"silu"`` (SwiGLU: Mixtral, Qwen, DeepSeek, ...), ``"gelu_tanh"`` (GeGLU with the tanh
approximation, torch's ``gelu(approximate="tanh")``: Gemma 4's experts), ``"gelu"`` (GeGLU, exact erf form) or
``"swiglu_oai"`` (gpt-oss's and MiniMax-M3's: gate * sigmoid(alpha * gate) * (up + 1), ``alpha`` 1.702 there; the
only kind that reads ``alpha``).

Softcapped (``"silu_softcap"``, :data:`SOFTCAP_ACTS`: Inkling 2's experts): SwiGLU whose linear factors are bounded by
``softcap = (c_gate, c_up)``, out = cap(gate, c_gate) * sigmoid(gate) * cap(up, c_up) with cap(x, c) = c * tanh(x /
c) (the sigmoid sees the raw gate). It takes no ``limit``.

Clamped (``limit``, as DeepSeek-V4, GLM-5 and Hunyuan-V4 experts compute SwiGLU, and Megatron's
``activation_func_clamp_value``): out = act(min(gate, limit)) * clamp(up, -limit, limit); the gradient passes the
clamps where the input lies within them, by the installed torch's rule for an input on a bound
(:func:`clamp_grad_at_bounds`: passed up to torch 2.13, not from torch 2.14), so that the layer's gradients follow
the model's own torch.clamp.

Clamped after the activation (``"silu_postclamp"``, :data:`POSTCLAMP_ACTS`: Step 3.7's experts): out =
min(silu(gate), limit) * clamp(up, -limit, limit), ``limit`` required; the gate's gradient passes where silu(gate) <=
limit (< limit where torch's clamp passes none on a bound), times silu's derivative, as autograd orders it: a NaN or
infinite gate gets a NaN gradient.

``interleaved``: gate and up alternate column by column (gate = h[:, 0::2], up = h[:, 1::2]: gpt-oss's weights)
instead of side by side.

Non-gated experts (Nemotron-H's: down(act(up(x)))) take :func:`mlp_act_ref` / :func:`mlp_act_triton` instead: act(h)
elementwise, act one of :data:`PLAIN_ACTS` (``"relu2"``: relu(h)^2).

Legend: M rows, F ffn features (h holds gate and up side by side, 2F columns).
Computed in fp32 (fp64 for fp64 input), returned in the input dtype.
"""

from __future__ import annotations

import functools
import numbers

import torch
from torch import Tensor

from ._checks import FLOAT_DTYPES, check_finite, check_positive, check_tensor
from ._triton import alloc, autotune_configs, cdiv, check_launch_device, launch, tl, triton

__all__ = ["ACTS", "PLAIN_ACTS", "POSTCLAMP_ACTS", "SOFTCAP_ACTS", "check_glu_act", "check_glu_input",
           "check_glu_limit", "check_mlp_act", "clamp_grad_at_bounds", "glu_bwd_ref", "glu_bwd_triton", "glu_ref",
           "glu_triton", "mlp_act_bwd_ref", "mlp_act_bwd_triton", "mlp_act_ref", "mlp_act_triton"]

# the activations of the gate that take a clamp (limit), in the order of the kernels' ACT constexpr
ACTS = ("silu", "gelu_tanh", "gelu", "swiglu_oai")
# the gated activations that take softcaps (c_gate, c_up) instead: the kernels' ACT 5
SOFTCAP_ACTS = ("silu_softcap",)
# the gated activations clamped after the activation, limit required: the kernels' ACT 6
POSTCLAMP_ACTS = ("silu_postclamp",)
# the activations of a non-gated expert (act(h)); relu2 is the kernels' ACT 4
PLAIN_ACTS = ("silu", "gelu_tanh", "gelu", "relu2")
_ACT_ID = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "swiglu_oai": 3, "relu2": 4, "silu_softcap": 5, "silu_postclamp": 6}


def check_glu_input(h_M2F: Tensor) -> None:
    """h float [M, 2F], contiguous, an even number of columns."""
    check_tensor("h_M2F", h_M2F, dtypes=FLOAT_DTYPES, ndim=2, contiguous=True)
    if h_M2F.shape[1] % 2:
        raise ValueError(f"h_M2F: expected an even number of columns [M, 2F], got shape {list(h_M2F.shape)}")


# a number: Python's, numpy's scalars (np.float32 say; numbers.Real), or torch.compile's symbolic float
_REAL = (int, float, numbers.Real)


def check_glu_limit(limit: float | None) -> None:
    """None (no clamp) or a finite number > 0."""
    if limit is None:
        return
    if isinstance(limit, bool) or not isinstance(limit, _REAL) or not check_finite(limit, "limit") \
            or not check_positive(limit, "limit"):
        raise ValueError(f"limit: expected None or a finite number > 0, got {limit!r}")


def check_glu_act(act: str, alpha: float = 1.0, softcap: tuple[float, float] | None = None,
                  limit: float | None = None) -> None:
    """One of :data:`ACTS`, :data:`SOFTCAP_ACTS` or :data:`POSTCLAMP_ACTS`; ``alpha`` a finite number; ``softcap``
    (c_gate, c_up), finite numbers > 0, given exactly with a softcapped activation, which takes no ``limit``; a
    ``limit`` given with a clamped-after activation."""
    if not isinstance(act, str) or act not in ACTS + SOFTCAP_ACTS + POSTCLAMP_ACTS:
        raise ValueError(f"act: expected one of {ACTS + SOFTCAP_ACTS + POSTCLAMP_ACTS}, got {act!r}")
    if act in POSTCLAMP_ACTS and limit is None:
        raise ValueError(f"limit: {act} clamps after the activation and needs a limit, got None")
    if isinstance(alpha, bool) or not isinstance(alpha, _REAL) or not check_finite(alpha, "alpha"):
        raise ValueError(f"alpha: expected a finite number, got {alpha!r}")
    if act in SOFTCAP_ACTS:
        if not isinstance(softcap, (tuple, list)) or len(softcap) != 2 or any(
                isinstance(c, bool) or not isinstance(c, _REAL) or not check_finite(c, "softcap")
                or not check_positive(c, "softcap", "numbers > 0")
                for c in softcap):
            raise ValueError(f"softcap: {act} expects (c_gate, c_up), two finite numbers > 0, got {softcap!r}")
        if limit is not None:
            raise ValueError(f"limit: {act} takes softcaps, not a clamp; got limit {limit!r}")
    elif softcap is not None:
        raise ValueError(f"softcap: only {SOFTCAP_ACTS} take softcaps, got softcap {softcap!r} with act {act!r}")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.cache
def clamp_grad_at_bounds() -> bool:
    """Whether the installed torch's ``torch.clamp`` passes the gradient of an input equal to a (number) bound:
    torch 2.13 and earlier do (bounds included), torch 2.14 does not (only inputs strictly inside pass). Read once
    off torch's own autograd, on the CPU, for ``clamp(max=)`` and ``clamp(min, max)`` at both bounds; the clamped
    activations' kernels and twins follow it."""
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64, requires_grad=True)
        y = torch.cat([x[:1].clamp(max=1.0), x[1:].clamp(-1.0, 1.0)])
        (g,) = torch.autograd.grad(y.sum(), x)
    got = g.tolist()
    if got not in ([1.0] * 3, [0.0] * 3):
        raise RuntimeError(f"torch {torch.__version__}: torch.clamp's gradient at its bounds is {got} (clamp(max=1) "
                           "at 1, clamp(-1, 1) at -1 and 1), neither all passed nor all stopped: the clamped "
                           "activations cannot follow it")
    return got[0] == 1.0


def _within(x: Tensor, limit: float, both: bool) -> Tensor:
    """Where torch.clamp(x, max=limit) (both: clamp(x, -limit, limit)) passes the gradient
    (:func:`clamp_grad_at_bounds`; NaN: nowhere)."""
    le = torch.le if clamp_grad_at_bounds() else torch.lt
    return le(x.abs() if both else x, limit)


def _halves(h: Tensor, interleaved: bool) -> tuple[Tensor, Tensor]:
    return (h[:, 0::2], h[:, 1::2]) if interleaved else h.chunk(2, dim=1)


def _join(d_gate: Tensor, d_up: Tensor, interleaved: bool) -> Tensor:
    if interleaved:
        return torch.stack([d_gate, d_up], dim=2).reshape(d_gate.shape[0], 2 * d_gate.shape[1])
    return torch.cat([d_gate, d_up], dim=1)


def _split(h_M2F: Tensor, limit: float | None, interleaved: bool = False, act: str = "silu") -> tuple[Tensor, Tensor]:
    gate, up = _halves(h_M2F.to(_acc_dtype(h_M2F.dtype)), interleaved)
    if limit is not None:   # a clamped-after activation leaves the gate's input as it is
        gate, up = gate if act in POSTCLAMP_ACTS else gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate, up


def _act_ref(gate: Tensor, act: str, alpha: float) -> Tensor:
    if act == "silu_softcap":   # alpha: the gate's softcap
        return alpha * torch.tanh(gate / alpha) * torch.sigmoid(gate)
    if act in ("silu", "silu_postclamp"):   # the latter's clamp is the caller's
        return torch.nn.functional.silu(gate)
    if act == "swiglu_oai":
        return gate * torch.sigmoid(gate * alpha)
    return torch.nn.functional.gelu(gate, approximate="tanh" if act == "gelu_tanh" else "none")


def glu_ref(h_M2F: Tensor, limit: float | None = None, act: str = "silu", alpha: float = 1.0,
            interleaved: bool = False, softcap: tuple[float, float] | None = None) -> Tensor:
    """Pure-torch twin: act(h[:, :F]) * h[:, F:] (clamped by ``limit``, see the module docstring), with torch's own
    activation (``swiglu_oai``: gate * sigmoid(alpha * gate) * (up + 1); ``silu_softcap``: its ``softcap``s).
    Returns [M, F] in h's dtype."""
    check_glu_input(h_M2F)
    check_glu_limit(limit)
    check_glu_act(act, alpha, softcap, limit)
    gate, up = _split(h_M2F, limit, interleaved, act)
    if act == "swiglu_oai":
        up = up + 1
    if softcap is not None:
        alpha, up = softcap[0], softcap[1] * torch.tanh(up / softcap[1])
    a = _act_ref(gate, act, alpha)
    if act in POSTCLAMP_ACTS:
        a = a.clamp(max=limit)
    return (a * up).to(h_M2F.dtype)


def glu_bwd_ref(grad_MF: Tensor, h_M2F: Tensor, limit: float | None = None, act: str = "silu",
                alpha: float = 1.0, interleaved: bool = False, softcap: tuple[float, float] | None = None) -> Tensor:
    """Gradient of :func:`glu_ref`: grad_MF [M, F] (h's dtype) -> dh [M, 2F] in h's dtype (torch's own activation
    derivatives)."""
    check_glu_input(h_M2F)
    check_glu_limit(limit)
    check_glu_act(act, alpha, softcap, limit)
    check_tensor("grad_MF", grad_MF, dtypes=(h_M2F.dtype,), shape=(h_M2F.shape[0], h_M2F.shape[1] // 2))
    acc = _acc_dtype(h_M2F.dtype)
    raw_gate, raw_up = _halves(h_M2F.to(acc), interleaved)
    gate, up = _split(h_M2F, limit, interleaved, act)
    g = grad_MF.to(acc)
    if act == "silu_softcap":
        (cg, cu), s = softcap, torch.sigmoid(gate)
        tg, tu = torch.tanh(gate / cg), torch.tanh(up / cu)
        a = cg * tg * s
        d_gate = g * cu * tu * ((1 - tg * tg) * s + a * (1 - s))
        return _join(d_gate, g * a * (1 - tu * tu), interleaved).to(h_M2F.dtype)
    a = _act_ref(gate, act, alpha)
    if act == "swiglu_oai":
        up = up + 1
        s = torch.sigmoid(gate * alpha)
        d_gate = g * up * (s + gate * alpha * s * (1 - s))
    elif act == "silu":
        d_gate = torch.ops.aten.silu_backward(g * up, gate)
    elif act == "silu_postclamp":   # torch.clamp's rule on the activation's output, before silu's derivative
        d_gate = torch.ops.aten.silu_backward(torch.where(_within(a, limit, False), g * up, 0.0), gate)
        a = a.clamp(max=limit)
    else:
        d_gate = torch.ops.aten.gelu_backward(g * up, gate, approximate="tanh" if act == "gelu_tanh" else "none")
    d_up = g * a
    if limit is not None:   # torch.clamp's rule: the gradient passes where the input lies within the bounds
        if act not in POSTCLAMP_ACTS:
            d_gate = torch.where(_within(raw_gate, limit, False), d_gate, 0.0)
        d_up = torch.where(_within(raw_up, limit, True), d_up, 0.0)
    return _join(d_gate, d_up, interleaved).to(h_M2F.dtype)


HOPPER_CONFIGS = [dict(BLOCK_R=2, BLOCK_F=2048, num_warps=8), dict(BLOCK_R=4, BLOCK_F=1024, num_warps=8),
                  dict(BLOCK_R=8, BLOCK_F=512, num_warps=4)]
_CONFIGS = autotune_configs(HOPPER_CONFIGS, dict(BLOCK_R=64, BLOCK_F=128))


@triton.jit
def _tanh(x, ACC: tl.constexpr):
    """tanh(x) in ACC to a few ulps: Lambert's continued fraction x / (1 + x^2 / (3 + x^2 / (5 + ...))) to 17 where
    |x| < 1/2 (2 sigmoid(2x) - 1 would lose the small values to cancellation), (1 - e^-2|x|) / (1 + e^-2|x|)
    with x's sign elsewhere; NaN stays NaN, +-inf gives +-1. (libdevice's tanh has no interpreter twin.)"""
    x2 = x * x
    cf = tl.full(x.shape, 17.0, ACC)
    for k in tl.static_range(8):   # 15 + x^2 / 17, ..., 1 + x^2 / (3 + ...)
        cf = tl.cast(15.0 - 2 * k, ACC) + x2 / cf
    ax = tl.abs(x)
    t = tl.exp(-2 * ax)
    big = (1 - t) / (1 + t)
    return tl.where(ax < 0.5, x / cf, tl.where(x < 0, -big, big))


@triton.jit
def _act_and_grad(gate, alpha, ACT: tl.constexpr, ACC: tl.constexpr):
    """(act(gate), d act / d gate) in ACC: silu (ACT 0), gelu_tanh (1), gelu (2), gate * sigmoid(alpha * gate) (3,
    swiglu_oai's; its up + 1 is the caller's), relu(gate)^2 (4), alpha tanh(gate / alpha) sigmoid(gate) (5,
    silu_softcap's; alpha its gate's softcap; its up's softcap is the caller's), silu (6, silu_postclamp's; its clamp
    is the caller's). Constants and scalar arguments are made in ACC with ``tl.full``: ``tl.cast`` of a Python float
    goes through an fp32 constant (fp64 rounded to fp32; the interpreter passes float arguments so too)."""
    if ACT == 5:
        c = tl.full([], alpha, ACC)
        s = tl.sigmoid(gate)
        t = _tanh(gate / c, ACC)
        a = c * t * s
        return a, (1 - t * t) * s + a * (1 - s)
    elif ACT == 0 or ACT == 6:
        s = tl.sigmoid(gate)
        return gate * s, s * (1 + gate * (1 - s))
    elif ACT == 4:
        r = tl.where(gate < 0, 0.0, gate)   # NaN stays NaN, as torch.relu keeps it
        return r * r, 2 * r
    elif ACT == 3:
        a = tl.full([], alpha, ACC)
        s = tl.sigmoid(a * gate)
        return gate * s, s + a * gate * s * (1 - s)
    elif ACT == 1:
        # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) = x * sigmoid(k (x + 0.044715 x^3)), k = 2 sqrt(2/pi)
        k = tl.full([], 1.5957691216057308, ACC)
        c = tl.full([], 0.044715, ACC)
        s = tl.sigmoid(k * (gate + c * gate * gate * gate))
        return gate * s, s + gate * s * (1 - s) * k * (1 + 3 * c * gate * gate)
    else:
        # x * Phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2; derivative Phi(x) + x * phi(x)
        cdf = 0.5 * (1 + tl.math.erf(gate * tl.full([], 0.7071067811865476, ACC)))
        pdf = tl.exp(-0.5 * gate * gate) * tl.full([], 0.3989422804014327, ACC)
        return gate * cdf, cdf + gate * pdf


@triton.jit
def _tile(M, F, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    """This program's rows (int64), columns and their in-bounds mask over [M, F]."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    return rows, cols, (rows < M)[:, None] & (cols < F)[None, :]


@triton.jit
def _load_gate_up(h_ptr, rows, cols, mask, F, ACC: tl.constexpr, INTERLEAVED: tl.constexpr):
    """(gate, up, their offsets) of rows x cols in h [M, 2F]: side by side (gate in column j, up in F + j) or
    interleaved (gate in 2j, up in 2j + 1)."""
    if INTERLEAVED:
        g_offs = rows[:, None] * (2 * F) + 2 * cols[None, :]
        u_offs = g_offs + 1
    else:
        g_offs = rows[:, None] * (2 * F) + cols[None, :]
        u_offs = g_offs + F
    gate = tl.load(h_ptr + g_offs, mask=mask, other=0.0).to(ACC)
    up = tl.load(h_ptr + u_offs, mask=mask, other=0.0).to(ACC)
    return gate, up, g_offs, u_offs


@triton.autotune(configs=_CONFIGS, key=["F"])
@triton.jit
def _glu_kernel(h_ptr, out_ptr, M, F, limit: tl.float64, alpha: tl.float64, cap_up: tl.float64, ACC: tl.constexpr,
                CLAMP: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_F: tl.constexpr):
    rows, cols, mask = _tile(M, F, BLOCK_R, BLOCK_F)
    gate, up, _, _ = _load_gate_up(h_ptr, rows, cols, mask, F, ACC, INTERLEAVED)
    if CLAMP:   # torch.clamp's: NaN stays NaN (tl.minimum would return the limit)
        lim = tl.full([], limit, ACC)
        if ACT != 6:   # ACT 6 clamps the activation's output instead of the gate
            gate = tl.where(gate > lim, lim, gate)
        up = tl.where(up > lim, lim, tl.where(up < -lim, -lim, up))
    if ACT == 3:
        up = up + 1
    elif ACT == 5:
        cu = tl.full([], cap_up, ACC)
        up = cu * _tanh(up / cu, ACC)
    a, _ = _act_and_grad(gate, alpha, ACT, ACC)
    if CLAMP and ACT == 6:
        a = tl.where(a > lim, lim, a)
    out = a * up
    tl.store(out_ptr + rows[:, None] * F + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_CONFIGS, key=["F"])
@triton.jit
def _glu_bwd_kernel(grad_ptr, h_ptr, dh_ptr, M, F, limit: tl.float64, alpha: tl.float64, cap_up: tl.float64,
                    ACC: tl.constexpr, CLAMP: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr,
                    ON_BOUND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    rows, cols, mask = _tile(M, F, BLOCK_R, BLOCK_F)
    gate, up, g_offs, u_offs = _load_gate_up(h_ptr, rows, cols, mask, F, ACC, INTERLEAVED)
    g = tl.load(grad_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(ACC)
    if CLAMP:   # a NaN input is inside no bound: its clamp passes no gradient (torch.clamp's where); ON_BOUND: an
        # input on a bound passes it (clamp_grad_at_bounds)
        lim = tl.full([], limit, ACC)
        if ACT != 6:
            gate_in = (gate <= lim) if ON_BOUND else (gate < lim)
            gate = tl.where(gate > lim, lim, gate)
        up_in = ((up >= -lim) & (up <= lim)) if ON_BOUND else ((up > -lim) & (up < lim))
        up = tl.where(up > lim, lim, tl.where(up < -lim, -lim, up))
    if ACT == 3:
        up = up + 1
    elif ACT == 5:
        cu = tl.full([], cap_up, ACC)
        tu = _tanh(up / cu, ACC)
        up = cu * tu
    a, da = _act_and_grad(gate, alpha, ACT, ACC)
    if CLAMP and ACT == 6:   # the clamp of the activation's output, applied before silu's derivative (as autograd
        # does: a NaN or infinite gate gets NaN)
        d_gate = tl.where((a <= lim) if ON_BOUND else (a < lim), g * up, 0.0) * da
        a = tl.where(a > lim, lim, a)
    else:
        d_gate = g * up * da
    d_up = g * a
    if ACT == 5:
        d_up = d_up * (1 - tu * tu)
    if CLAMP:
        if ACT != 6:
            d_gate = tl.where(gate_in, d_gate, 0.0)
        d_up = tl.where(up_in, d_up, 0.0)
    tl.store(dh_ptr + g_offs, d_gate.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + u_offs, d_up.to(dh_ptr.dtype.element_ty), mask=mask)


def _launch_grid(M: int, F: int):
    def grid(meta):
        return cdiv(M, meta["BLOCK_R"]), cdiv(F, meta["BLOCK_F"])

    return grid


def _act_args(act: str, alpha: float, softcap: tuple[float, float] | None) -> tuple[float, float]:
    """The kernels' (alpha, cap_up) arguments: a softcapped activation's gate cap travels as alpha."""
    return (float(alpha), 1.0) if softcap is None else (float(softcap[0]), float(softcap[1]))


def glu_triton(h_M2F: Tensor, limit: float | None = None, act: str = "silu", alpha: float = 1.0,
               interleaved: bool = False, softcap: tuple[float, float] | None = None, *,
               config: dict | None = None) -> Tensor:
    """Launcher of the gated activation kernel. h float [M, 2F] contiguous -> [M, F] in h's dtype (fp32 math), act
    one of :data:`ACTS` (``alpha``: swiglu_oai's), clamped by ``limit``, of :data:`SOFTCAP_ACTS` with its
    ``softcap``, or of :data:`POSTCLAMP_ACTS` with its ``limit``; gate and up ``interleaved`` or side by side (see
    the module docstring).

    ``config``: explicit block sizes instead of the autotuner (see ``_triton.launch``)."""
    check_glu_input(h_M2F)
    check_glu_limit(limit)
    check_glu_act(act, alpha, softcap, limit)
    check_launch_device("glu_triton", h_M2F)
    M, F = h_M2F.shape[0], h_M2F.shape[1] // 2
    out_MF = alloc((M, F), h_M2F.dtype, h_M2F.device)
    if M > 0 and F > 0:
        acc = tl.float64 if h_M2F.dtype == torch.float64 else tl.float32
        launch(_glu_kernel, _launch_grid(M, F), h_M2F, out_MF, M, F, float(limit or 0.0),
               *_act_args(act, alpha, softcap), ACC=acc, CLAMP=limit is not None, ACT=_ACT_ID[act],
               INTERLEAVED=bool(interleaved), config=config)
    return out_MF


def glu_bwd_triton(grad_MF: Tensor, h_M2F: Tensor, limit: float | None = None, act: str = "silu",
                   alpha: float = 1.0, interleaved: bool = False, softcap: tuple[float, float] | None = None, *,
                   config: dict | None = None) -> Tensor:
    """Launcher of the gated activation's backward: grad [M, F] (h's dtype, contiguous), h [M, 2F] -> dh [M, 2F]."""
    check_glu_input(h_M2F)
    check_glu_limit(limit)
    check_glu_act(act, alpha, softcap, limit)
    check_tensor("grad_MF", grad_MF, dtypes=(h_M2F.dtype,), shape=(h_M2F.shape[0], h_M2F.shape[1] // 2),
                 contiguous=True)
    check_launch_device("glu_bwd_triton", h_M2F)
    M, F = grad_MF.shape
    dh_M2F = alloc(tuple(h_M2F.shape), h_M2F.dtype, h_M2F.device)
    if M > 0 and F > 0:
        acc = tl.float64 if h_M2F.dtype == torch.float64 else tl.float32
        launch(_glu_bwd_kernel, _launch_grid(M, F), grad_MF, h_M2F, dh_M2F, M, F, float(limit or 0.0),
               *_act_args(act, alpha, softcap), ACC=acc, CLAMP=limit is not None, ACT=_ACT_ID[act],
               INTERLEAVED=bool(interleaved), ON_BOUND=limit is None or clamp_grad_at_bounds(), config=config)
    return dh_M2F


# ---------------------------------------------------------------------------------------------------- non-gated

def check_mlp_act(h_MF: Tensor, act: str) -> None:
    """h float [M, F], contiguous; act one of :data:`PLAIN_ACTS`."""
    check_tensor("h_MF", h_MF, dtypes=FLOAT_DTYPES, ndim=2, contiguous=True)
    if not isinstance(act, str) or act not in PLAIN_ACTS:
        raise ValueError(f"act: expected one of {PLAIN_ACTS}, got {act!r}")


def _plain_ref(h: Tensor, act: str) -> Tensor:
    if act == "relu2":
        return torch.relu(h).square()
    return _act_ref(h, act, 1.0)


def mlp_act_ref(h_MF: Tensor, act: str) -> Tensor:
    """Pure-torch twin of a non-gated expert's activation: act(h) elementwise, computed in fp32 (fp64 for fp64), in
    h's dtype."""
    check_mlp_act(h_MF, act)
    return _plain_ref(h_MF.to(_acc_dtype(h_MF.dtype)), act).to(h_MF.dtype)


def mlp_act_bwd_ref(grad_MF: Tensor, h_MF: Tensor, act: str) -> Tensor:
    """Gradient of :func:`mlp_act_ref` (torch's own derivatives): grad [M, F] (h's dtype) -> dh [M, F]."""
    check_mlp_act(h_MF, act)
    check_tensor("grad_MF", grad_MF, dtypes=(h_MF.dtype,), shape=tuple(h_MF.shape))
    acc = _acc_dtype(h_MF.dtype)
    h, g = h_MF.to(acc), grad_MF.to(acc)
    if act == "relu2":
        d = g * 2 * torch.relu(h)
    elif act == "silu":
        d = torch.ops.aten.silu_backward(g, h)
    else:
        d = torch.ops.aten.gelu_backward(g, h, approximate="tanh" if act == "gelu_tanh" else "none")
    return d.to(h_MF.dtype)


@triton.autotune(configs=_CONFIGS, key=["F"])
@triton.jit
def _mlp_act_kernel(h_ptr, out_ptr, M, F, ACC: tl.constexpr, ACT: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_F: tl.constexpr):
    rows, cols, mask = _tile(M, F, BLOCK_R, BLOCK_F)
    offs = rows[:, None] * F + cols[None, :]
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(ACC)
    a, _ = _act_and_grad(h, 1.0, ACT, ACC)
    tl.store(out_ptr + offs, a.to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_CONFIGS, key=["F"])
@triton.jit
def _mlp_act_bwd_kernel(grad_ptr, h_ptr, dh_ptr, M, F, ACC: tl.constexpr, ACT: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_F: tl.constexpr):
    rows, cols, mask = _tile(M, F, BLOCK_R, BLOCK_F)
    offs = rows[:, None] * F + cols[None, :]
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(ACC)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(ACC)
    _, da = _act_and_grad(h, 1.0, ACT, ACC)
    tl.store(dh_ptr + offs, (g * da).to(dh_ptr.dtype.element_ty), mask=mask)


def mlp_act_triton(h_MF: Tensor, act: str, *, config: dict | None = None) -> Tensor:
    """Launcher of a non-gated expert's activation: h float [M, F] contiguous -> act(h) [M, F] in h's dtype (fp32
    math)."""
    check_mlp_act(h_MF, act)
    check_launch_device("mlp_act_triton", h_MF)
    M, F = h_MF.shape
    out = alloc((M, F), h_MF.dtype, h_MF.device)
    if M > 0 and F > 0:
        acc = tl.float64 if h_MF.dtype == torch.float64 else tl.float32
        launch(_mlp_act_kernel, _launch_grid(M, F), h_MF, out, M, F, ACC=acc, ACT=_ACT_ID[act], config=config)
    return out


def mlp_act_bwd_triton(grad_MF: Tensor, h_MF: Tensor, act: str, *, config: dict | None = None) -> Tensor:
    """Launcher of its backward: grad [M, F] (h's dtype, contiguous), h [M, F] -> dh [M, F]."""
    check_mlp_act(h_MF, act)
    check_tensor("grad_MF", grad_MF, dtypes=(h_MF.dtype,), shape=tuple(h_MF.shape), contiguous=True)
    check_launch_device("mlp_act_bwd_triton", h_MF)
    M, F = h_MF.shape
    dh = alloc((M, F), h_MF.dtype, h_MF.device)
    if M > 0 and F > 0:
        acc = tl.float64 if h_MF.dtype == torch.float64 else tl.float32
        launch(_mlp_act_bwd_kernel, _launch_grid(M, F), grad_MF, h_MF, dh, M, F, ACC=acc, ACT=_ACT_ID[act],
               config=config)
    return dh
