"""Compile every Triton kernel for an H100/H200 (sm_90) without a GPU, and report what the compiler made of it.

Run without TRITON_INTERPRET (the interpreter replaces the kernels' JIT functions). Arguments are specialised
as a real launch would specialise them (unit strides become constants, pointers and large strides are known
to be 16-byte multiples). One JSON line per compiled kernel: shared memory, and for GEMMs whether Hopper's
warpgroup MMA (wgmma) and software-pipelined async copies were used. ``--all`` compiles every autotune config
of the GEMMs instead of the first. Exit status 1 when a kernel fails to compile.

    env -u TRITON_INTERPRET .venv/bin/python tests/kernels/hopper_compile.py [--all]
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

from feplb.kernels import activation, grouped_gemm, permutation, routing

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(name, jit_fn, *, types, ones=(), div16=(), consts=None, options=None) -> dict:
    """types: argument -> Triton type ("*bf16", "i32"); ``ones``: arguments a launch passes as 1 (specialised
    to constants); ``div16``: integer arguments known to be multiples of 16; consts: constexpr values."""
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
    row = {"kernel": name, "options": dict(options or {}),
           "config": {k: v for k, v in consts.items() if k.startswith(("BLOCK", "GROUP"))}}
    try:
        compiled = triton.compile(ASTSource(jit_fn, signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                                  options=options or {})
    except Exception as err:  # noqa: BLE001 - reported, and the exit status says it failed
        row.update(ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        return row
    ttgir = compiled.asm["ttgir"]
    row.update(ok=True, shared_bytes=compiled.metadata.shared, seconds=round(time.perf_counter() - start, 1),
               wgmma=len(re.findall(r"warp_group_dot", ttgir)) > 0,
               async_copies=len(re.findall(r"async_copy_global_to_local", ttgir)))
    return row


def split(config: dict) -> tuple[dict, dict]:
    options = {k: config[k] for k in ("num_warps", "num_stages") if k in config}
    return {k: v for k, v in config.items() if k not in options}, options


def gemm_jobs(all_configs: bool):
    bf16 = {"ACC": tl.float32, "DOT_PRECISION": None, "UPCAST": False}
    fwd_configs = grouped_gemm.FWD_HOPPER_CONFIGS if all_configs else grouped_gemm.FWD_HOPPER_CONFIGS[:1]
    dw_configs = grouped_gemm.DW_HOPPER_CONFIGS if all_configs else grouped_gemm.DW_HOPPER_CONFIGS[:1]
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "offsets_ptr": "*i32"}
    for config in fwd_configs:
        meta, options = split(config)
        consts = {**meta, **bf16, "BLOCK_E": 16}
        # Forward: x [M, K] and w [E, K, N] row-major.
        yield dict(name="grouped_mm forward", jit_fn=grouped_gemm._grouped_mm_kernel, types=ptrs,
                   ones=("stride_xk", "stride_wn", "stride_yn"),
                   div16=("N", "K", "stride_xm", "stride_we", "stride_wk", "stride_ym"), consts=consts,
                   options=options)
        # dX: the same kernel on the transposed weights (unit stride along the reduction dimension).
        yield dict(name="grouped_mm dX", jit_fn=grouped_gemm._grouped_mm_kernel, types=ptrs,
                   ones=("stride_xk", "stride_wk", "stride_yn"),
                   div16=("N", "K", "stride_xm", "stride_we", "stride_wn", "stride_ym"), consts=consts,
                   options=options)
    for config in dw_configs:
        meta, options = split(config)
        yield dict(name="grouped_mm dW", jit_fn=grouped_gemm._grouped_mm_dw_kernel,
                   types={"x_ptr": "*bf16", "dy_ptr": "*bf16", "dw_ptr": "*bf16", "offsets_ptr": "*i32"},
                   ones=("stride_xk", "stride_dyn", "stride_wn"),
                   div16=("K", "N", "stride_xm", "stride_dym", "stride_we", "stride_wk"), consts={**meta, **bf16},
                   options=options)


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
        ("swiglu", activation._swiglu_kernel, {"h_ptr": "*bf16", "out_ptr": "*bf16"}),
        ("swiglu backward", activation._swiglu_bwd_kernel, {"grad_ptr": "*bf16", "h_ptr": "*bf16", "dh_ptr": "*bf16"}),
    ):
        yield dict(name=name, jit_fn=fn, types=types, div16=("F",), consts={**meta, "ACC": tl.float32},
                   options=options)


def main(argv: list[str]) -> int:
    failed = 0
    for job in [*gemm_jobs("--all" in argv), *other_jobs()]:
        row = compile_kernel(job.pop("name"), job.pop("jit_fn"), **job)
        failed += not row["ok"]
        print(json.dumps(row), flush=True)
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
