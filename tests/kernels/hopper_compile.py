"""Compile every Triton kernel for an H100/H200 (sm_90) without a GPU, and report what the compiler made of it.

Run without TRITON_INTERPRET (the interpreter replaces the kernels' JIT functions). Arguments are specialised
as a real launch would specialise them (unit strides become constants, pointers and large strides are known
to be 16-byte multiples). The GEMMs compile for every dtype they can be launched with on a GPU (bf16, fp16,
fp32 with TF32 or IEEE dots, fp64), each with the configs that the autotuner's shared-memory prune keeps for it:
by default the first and the largest, with ``--all`` every one (fp16 too). One JSON line per compiled kernel:
shared memory next to the prune's estimate, and for GEMMs whether Hopper's warpgroup MMA (wgmma),
software-pipelined async copies or TMA loads were used, and the registers per thread and the bytes spilled to
local memory (by the ptxas Triton ships). Exit status 1 when a kernel fails to compile or needs
more shared memory than a block has (232,448 bytes). ``--only TEXT`` keeps the jobs whose name or dtype holds it.

    env -u TRITON_INTERPRET .venv/bin/python tests/kernels/hopper_compile.py [--all] [--only TEXT]
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("hopper_compile.py: unset TRITON_INTERPRET (the interpreter replaces the JIT functions)")

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from feplb.kernels import _triton, activation, grouped_gemm, permutation, routing

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(name, jit_fn, *, types, ones=(), div16=(), consts=None, options=None, dtype=None,
                   estimate=None) -> dict:
    """types: argument -> Triton type ("*bf16", "i32"); ``ones``: arguments a launch passes as 1 (specialised
    to constants); ``div16``: integer arguments known to be multiples of 16; consts: constexpr values; dtype and
    estimate (the autotune prune's shared-memory estimate) are reported. ok is False when the compile fails or
    the kernel needs more shared memory than one block has."""
    while not isinstance(jit_fn, JITFunction):  # an autotuned kernel wraps its JIT function
        jit_fn = jit_fn.fn
    names = list(jit_fn.arg_names)
    consts = dict(consts or {})
    signature, constexprs, attrs = {}, {}, {}
    for i, arg in enumerate(names):
        if arg in ones:
            signature[arg], constexprs[(i,)] = "constexpr", 1
        elif arg in consts:
            signature[arg], constexprs[(i,)] = "constexpr", consts[arg]
        else:
            signature[arg] = types.get(arg, "i32")
        if signature[arg].startswith("*") or arg in div16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    start = time.perf_counter()
    row = {"kernel": name, "dtype": dtype, "options": dict(options or {}),
           "config": {k: v for k, v in consts.items() if k.startswith(("BLOCK", "GROUP", "PROGRAMS"))}}
    try:
        compiled = triton.compile(ASTSource(jit_fn, signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                                  options=options or {})
    except Exception as err:  # noqa: BLE001 - reported, and the exit status says it failed
        row.update(ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        return row
    ttgir = compiled.asm["ttgir"]
    shared = compiled.metadata.shared
    row["registers"], row["spill_bytes"] = registers(compiled.asm["ptx"])
    row.update(ok=shared <= _triton.SHARED_MEMORY_BYTES, shared_bytes=shared, shared_estimate=estimate,
               seconds=round(time.perf_counter() - start, 1), wgmma=len(re.findall(r"warp_group_dot", ttgir)) > 0,
               async_copies=len(re.findall(r"async_copy_global_to_local", ttgir)),
               tma_loads=len(re.findall(r"async_tma_copy_global_to_local", ttgir)))
    if not row["ok"]:
        row["error"] = f"needs {shared} bytes of shared memory, over the {_triton.SHARED_MEMORY_BYTES} of a block"
    return row


def registers(ptx: str) -> tuple[int | None, int | None]:
    """Registers per thread of a kernel's sm_90 code and the bytes it spills to local memory (stores plus loads),
    by the ptxas Triton ships (None, None when it has none)."""
    import subprocess
    import tempfile
    from pathlib import Path

    bin_dir = Path(triton.backends.nvidia.__file__).parent / "bin"
    # ptxas-blackwell is the newer of the two Triton ships (the PTX version it emits may be too new for the other)
    ptxas = next((p for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists()), None)
    if ptxas is None:
        return None, None
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
                             capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    # (the kernel's own lines: ptxas reports each function of the PTX, the kernel's entry by its name)
    entry = re.search(r"Compiling entry function '([^']+)'", text)
    if entry is not None:
        text = text[entry.start():]
        nxt = re.search(r"Compiling entry function", text[1:])
        text = text if nxt is None else text[:nxt.start() + 1]
    found = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if out.returncode != 0 or not found:
        return None, None
    return int(found[0]), sum(int(s) + int(ld) for s, ld in spills)


def split(config: dict) -> tuple[dict, dict]:
    options = {k: config[k] for k in ("num_warps", "num_stages") if k in config}
    return {k: v for k, v in config.items() if k not in options}, options


# Each dtype a GEMM can be launched with on a GPU: (name, Triton pointer type, itemsize, compile-time arguments).
# fp32 runs TF32 or IEEE dots, following torch.backends.cuda.matmul.fp32_precision (allow_tf32).
DTYPES = {
    "bf16": ("*bf16", 2, {"ACC": tl.float32, "DOT_PRECISION": None, "UPCAST": False}),
    "fp16": ("*fp16", 2, {"ACC": tl.float32, "DOT_PRECISION": None, "UPCAST": False}),
    "fp32-tf32": ("*fp32", 4, {"ACC": tl.float32, "DOT_PRECISION": "tf32", "UPCAST": False}),
    "fp32-ieee": ("*fp32", 4, {"ACC": tl.float32, "DOT_PRECISION": "ieee", "UPCAST": False}),
    "fp64": ("*fp64", 8, {"ACC": tl.float64, "DOT_PRECISION": None, "UPCAST": False}),
}
# The persistent variant runs 16-bit operands only (grouped_gemm.persistent_unsupported).
PERSISTENT_DTYPES = ("bf16", "fp16")


def launchable(configs, fallback, shared_bytes, itemsize, all_configs: bool):
    """The configs the shared-memory prune keeps for this itemsize: all of them with ``--all``, else the first and
    the one needing the most shared memory (the one that would break the limit first)."""
    kept = _triton.fitting_configs(configs, fallback, shared_bytes, itemsize)
    if all_configs or len(kept) <= 2:
        return kept
    biggest = max(kept, key=lambda c: shared_bytes(c, itemsize))
    return [kept[0]] if biggest is kept[0] else [kept[0], biggest]


def gemm_jobs(all_configs: bool):
    gg = grouped_gemm
    dtypes = list(DTYPES) if all_configs else ["bf16", "fp32-tf32", "fp32-ieee", "fp64"]
    for dname in dtypes:
        ptr, itemsize, dot = DTYPES[dname]
        ptrs = {"x_ptr": ptr, "w_ptr": ptr, "y_ptr": ptr, "offsets_ptr": "*i32"}
        for config in launchable(gg.FWD_HOPPER_CONFIGS, gg.FWD_FALLBACK_CONFIGS, gg.fwd_shared_bytes, itemsize,
                                 all_configs):
            meta, options = split(config)
            consts = {**meta, **dot, "BLOCK_E": 16}
            estimate = gg.fwd_shared_bytes(config, itemsize)
            # Forward: x [M, K] and w [E, K, N] row-major.
            yield dict(name="grouped_mm forward", dtype=dname, estimate=estimate, jit_fn=gg._grouped_mm_kernel,
                       types=ptrs, ones=("stride_xk", "stride_wn", "stride_yn"),
                       div16=("N", "K", "M_BUCKET", "stride_xm", "stride_we", "stride_wk", "stride_ym"),
                       consts=consts, options=options)
            # dX: the same kernel on the transposed weights (unit stride along the reduction dimension).
            yield dict(name="grouped_mm dX", dtype=dname, estimate=estimate, jit_fn=gg._grouped_mm_kernel,
                       types=ptrs, ones=("stride_xk", "stride_wk", "stride_yn"),
                       div16=("N", "K", "M_BUCKET", "stride_xm", "stride_we", "stride_wn", "stride_ym"),
                       consts=consts, options=options)
        if dname in PERSISTENT_DTYPES:
            for config in launchable(gg.PERSISTENT_HOPPER_CONFIGS, gg.PERSISTENT_FALLBACK_CONFIGS,
                                     gg.persistent_shared_bytes, itemsize, all_configs):
                meta, options = split(config)
                estimate = gg.persistent_shared_bytes(config, itemsize)
                for name, w_k_contiguous, one in (("forward", False, "stride_wn"), ("dX", True, "stride_wk")):
                    others = [s for s in ("stride_wk", "stride_wn") if s != one]
                    yield dict(name=f"grouped_mm persistent {name}", dtype=dname, estimate=estimate,
                               jit_fn=gg._grouped_mm_persistent_kernel, types=ptrs, ones=(one, "stride_yn"),
                               div16=("N", "K", "M_BUCKET", "stride_xm", "stride_we", "stride_ym", *others),
                               consts={**meta, **dot, "BLOCK_E": 16, "W_K_CONTIGUOUS": w_k_contiguous},
                               options=options)
        dw_ptrs = {"x_ptr": ptr, "dy_ptr": ptr, "dw_ptr": ptr, "offsets_ptr": "*i32",
                   "part_ptr": "*fp64" if dname == "fp64" else "*fp32"}
        for config in launchable(gg.DW_HOPPER_CONFIGS, gg.DW_FALLBACK_CONFIGS, gg.dw_shared_bytes, itemsize,
                                 all_configs):
            meta, options = split(config)
            yield dict(name="grouped_mm dW", dtype=dname, jit_fn=gg._grouped_mm_dw_kernel, types=dw_ptrs,
                       estimate=gg.dw_shared_bytes(config, itemsize),
                       ones=("stride_xk", "stride_dyn", "stride_wn"),
                       div16=("K", "N", "CHUNK", "M_BUCKET", "stride_xm", "stride_dym", "stride_we", "stride_wk"),
                       consts={**meta, **dot, "BLOCK_E": 16}, options=options)
        if dname in PERSISTENT_DTYPES:
            # x [M, K] and dy [M, N] through tensor descriptors (unit strides along K and N); every config, so that
            # each one's PROGRAMS_PER_SM is checked against its registers and shared memory
            for config in launchable(gg.DW_PERSISTENT_HOPPER_CONFIGS, gg.DW_PERSISTENT_FALLBACK_CONFIGS,
                                     gg.dw_shared_bytes, itemsize, True):
                meta, options = split(config)
                yield dict(name="grouped_mm persistent dW", dtype=dname, jit_fn=gg._grouped_mm_dw_persistent_kernel,
                           types=dw_ptrs, estimate=gg.dw_shared_bytes(config, itemsize), ones=("stride_wn",),
                           div16=("K", "N", "CHUNK", "M_BUCKET", "stride_xm", "stride_dym", "stride_we",
                                  "stride_wk"),
                           consts={**meta, **dot, "BLOCK_E": 16}, options=options)
        if dname in ("bf16", "fp64"):
            yield dict(name="grouped_mm dW reduce", dtype=dname, jit_fn=gg._dw_reduce_kernel,
                       types={"part_ptr": dw_ptrs["part_ptr"], "dw_ptr": ptr, "offsets_ptr": "*i32"},
                       div16=("KN", "CHUNK", "stride_we"),
                       consts={"BLOCK_E": 16, "ACC": dot["ACC"], "BLOCK": 1024}, options={"num_warps": 4})


def other_jobs():
    yield dict(name="routing histogram", jit_fn=routing._block_histogram_kernel,
               types={"ids_ptr": "*i64", "counts_EB_ptr": "*i32"}, consts={"BLOCK_M": 256, "BLOCK_E": 64})
    yield dict(name="routing scatter", jit_fn=routing._scatter_kernel,
               types={"ids_ptr": "*i32", "base_EB_ptr": "*i32", "src_ptr": "*i32", "dst_ptr": "*i32"},
               consts={"BLOCK_M": 256, "BLOCK_E": 64})
    meta, options = split(permutation.PERMUTE_HOPPER_CONFIGS[0])
    yield dict(name="permute", jit_fn=permutation._permute_kernel,
               types={"x_ptr": "*bf16", "src_ptr": "*i32", "out_ptr": "*bf16"}, div16=("D",), consts=meta,
               options=options)
    meta, options = split(permutation.UNPERMUTE_HOPPER_CONFIGS[0])
    yield dict(name="unpermute", jit_fn=permutation._unpermute_kernel,
               types={"y_ptr": "*bf16", "dst_ptr": "*i32", "w_ptr": "*fp32", "out_ptr": "*bf16"}, div16=("D",),
               consts={**meta, "K": 8, "HAS_WEIGHTS": True, "ACC": tl.float32},
               options={**options, "enable_fp_fusion": False})
    meta, options = split(permutation.UNPERMUTE_BWD_HOPPER_CONFIGS[0])
    yield dict(name="unpermute backward", jit_fn=permutation._unpermute_bwd_kernel,
               types={"grad_ptr": "*bf16", "y_ptr": "*bf16", "dst_ptr": "*i32", "w_ptr": "*fp32", "dy_ptr": "*bf16",
                      "dw_ptr": "*fp32"}, div16=("D",),
               consts={**meta, "K": 8, "BLOCK_K": 16, "NEED_DW": True, "ACC": tl.float32}, options=options)
    meta, options = split(activation.HOPPER_CONFIGS[0])
    for name, fn, types in (
        ("glu", activation._glu_kernel, {"h_ptr": "*bf16", "out_ptr": "*bf16", "limit": "fp64", "alpha": "fp64",
                                         "cap_up": "fp64"}),
        ("glu backward", activation._glu_bwd_kernel,
         {"grad_ptr": "*bf16", "h_ptr": "*bf16", "dh_ptr": "*bf16", "limit": "fp64", "alpha": "fp64",
          "cap_up": "fp64"}),
    ):
        # the backward's rule for an input on a clamp's bound: the installed torch's
        bound = {"ON_BOUND": activation.clamp_grad_at_bounds()} if fn is activation._glu_bwd_kernel else {}
        for act_id, act in enumerate(activation.ACTS):   # SwiGLU, GeGLU (tanh, erf), gpt-oss's; plain and clamped
            for clamp in (False, True):
                # gate and up side by side; gpt-oss's own (clamped, interleaved) too
                for inter in (False, True) if act == "swiglu_oai" and clamp else (False,):
                    yield dict(name=f"{name} {act}" + (" clamped" if clamp else "") + (" interleaved" if inter else ""),
                               jit_fn=fn, types=types, div16=("F",), options=options,
                               consts={**meta, "ACC": tl.float32, "CLAMP": clamp, "ACT": act_id, "INTERLEAVED": inter,
                                       **bound})
        for act in activation.POSTCLAMP_ACTS:   # Step 3.7's SwiGLU clamped after the activation (always clamped)
            yield dict(name=f"{name} {act}", jit_fn=fn, types=types, div16=("F",), options=options,
                       consts={**meta, "ACC": tl.float32, "CLAMP": True, "ACT": activation._ACT_ID[act],
                               "INTERLEAVED": False, **bound})
        for act in activation.SOFTCAP_ACTS:   # Inkling 2's softcapped SwiGLU (no clamp), both layouts
            for inter in (False, True):
                yield dict(name=f"{name} {act}" + (" interleaved" if inter else ""), jit_fn=fn, types=types,
                           div16=("F",), options=options,
                           consts={**meta, "ACC": tl.float32, "CLAMP": False, "ACT": activation._ACT_ID[act],
                                   "INTERLEAVED": inter, **bound})


    for name, fn, types in (
        ("mlp_act", activation._mlp_act_kernel, {"h_ptr": "*bf16", "out_ptr": "*bf16"}),
        ("mlp_act backward", activation._mlp_act_bwd_kernel, {"grad_ptr": "*bf16", "h_ptr": "*bf16",
                                                              "dh_ptr": "*bf16"}),
    ):
        for act in activation.PLAIN_ACTS:   # non-gated experts (relu2: Nemotron-H's)
            yield dict(name=f"{name} {act}", jit_fn=fn, types=types, div16=("F",), options=options,
                       consts={**meta, "ACC": tl.float32, "ACT": activation._ACT_ID[act]})


def main(argv: list[str]) -> int:
    failed = 0
    only = argv[argv.index("--only") + 1] if "--only" in argv else ""
    for job in [*gemm_jobs("--all" in argv), *other_jobs()]:
        if only not in f"{job['name']} {job.get('dtype')}":
            continue
        row = compile_kernel(job.pop("name"), job.pop("jit_fn"), **job)
        failed += not row["ok"]
        print(json.dumps(row), flush=True)
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
