"""The grouped GEMM's persistent (tensor-descriptor) variants (forward / dX and dW), the split-M weight
gradient, the shared-memory prune and the autotune keys: kernels through their launchers (on a GPU, or on the CPU
under TRITON_INTERPRET=1) against independent float64 computations, outputs poisoned with NaN first; the rules as
pure functions."""

from __future__ import annotations

import contextlib

import pytest
import torch

from feplb.kernels import HAVE_TRITON, INTERPRET, poison_outputs
from feplb.kernels import _triton as kt
from feplb.kernels import grouped_gemm as gg

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not HAVE_TRITON or (DEVICE == "cpu" and not INTERPRET),
                                   reason="needs Triton and a GPU, or TRITON_INTERPRET=1")
# The interpreter computes bf16 dots wrongly (the kernels upcast there); fp16 and fp32 are exact references.
DTYPES = [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "fp16"] if DEVICE == "cpu" else ["bf16", "fp16"]

# id: (group sizes, K, N). K and N keep 16-byte row strides (tensor descriptors need them); the interpreter's
# tiles are 32 x 32 x 32, so sizes straddle, equal and exceed a tile.
CASES = {
    "multi-tile": ([40, 33, 7], 40, 48),
    "empty-groups": ([0, 12, 0, 0, 21, 0], 24, 16),
    "group-larger-than-tiles": ([70], 32, 72),
    "single-rows": ([1, 1, 0, 1], 16, 16),
    "tile-multiples": ([32, 64, 0, 32], 64, 32),
    "all-but-one-empty": ([0, 0, 0, 9], 8, 40),
}


def _inputs(case, dtype, gen, offsets_dtype=torch.int64):
    sizes, K, N = CASES[case]
    offsets = torch.tensor(sizes).cumsum(0).to(offsets_dtype)
    x = torch.randn(sum(sizes), K, generator=gen).to(dtype)
    w = (torch.randn(len(sizes), K, N, generator=gen) / K**0.5).to(dtype)
    dy = torch.randn(sum(sizes), N, generator=gen).to(dtype)
    return x.to(DEVICE), w.to(DEVICE), dy.to(DEVICE), offsets.to(DEVICE)


# ---------------------------------------------------------------------------------------------------- persistent

@needs_kernels
@pytest.mark.parametrize("programs", [1, None], ids=["1-program", "default-programs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_persistent_forward_and_dx(case, dtype, programs, gen, kh):
    """Forward (w [E, K, N], unit stride along N) and dX (the transposed view, unit stride along K), with fewer
    programs than tiles (1, or 3 under the interpreter) so that every program walks several tiles and groups;
    int32 offsets with the default programs, int64 with one."""
    x, w, dy, offsets = _inputs(case, dtype, gen, torch.int32 if programs is None else torch.int64)
    with poison_outputs():
        y = gg.grouped_mm_triton(x, w, offsets, variant="persistent", programs=programs)
        dx = gg.grouped_mm_triton(dy, w.transpose(1, 2), offsets, variant="persistent", programs=programs)
    kh.close(y.cpu(), kh.grouped_mm_f64(x.cpu(), w.cpu(), offsets.cpu()), dtype, scale=2.0)
    kh.close(dx.cpu(), kh.grouped_mm_f64(dy.cpu(), w.cpu().transpose(1, 2), offsets.cpu()), dtype, scale=2.0)
    # Same tiles, same fp32 accumulation order as the classic variant.
    classic = gg.grouped_mm_triton(x, w, offsets, variant="classic")
    kh.close(y.cpu(), classic.cpu(), dtype)


def _block_shapes(configs):
    """The distinct tile shapes of a config list (warps and stages change nothing under the interpreter)."""
    shapes = {tuple((k, v) for k, v in c.items() if k not in ("num_warps", "num_stages")) for c in configs}
    return [dict(s) for s in sorted(shapes)] if INTERPRET else configs


def _config_ids(configs):
    return ["-".join(f"{k.removeprefix('BLOCK_')}{v}" for k, v in c.items() if k.startswith("BLOCK")) for c in configs]


PERSISTENT = _block_shapes(gg.PERSISTENT_HOPPER_CONFIGS + gg.PERSISTENT_FALLBACK_CONFIGS)


@needs_kernels
@pytest.mark.parametrize("config", PERSISTENT, ids=_config_ids(PERSISTENT))
def test_persistent_every_gpu_config(config, gen, kh):
    """Each tile shape the GPU may pick: groups smaller than, equal to and larger than a tile, a K that is not a
    multiple of BLOCK_K (descriptor loads past K read zeros) and an N that is not a multiple of BLOCK_N."""
    sizes, K, N = [0, 130, 3, 0, 64], 72, 136
    offsets = torch.tensor(sizes).cumsum(0).to(DEVICE)
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    x = torch.randn(sum(sizes), K, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(len(sizes), K, N, generator=gen) / K**0.5).to(dtype).to(DEVICE)
    with poison_outputs():
        y = gg.grouped_mm_triton(x, w, offsets, config=config, variant="persistent", programs=2)
        dx = gg.grouped_mm_triton(y, w.transpose(1, 2), offsets, config=config, variant="persistent", programs=2)
    kh.close(y.cpu(), kh.grouped_mm_f64(x.cpu(), w.cpu(), offsets.cpu()), dtype, scale=2.0)
    kh.close(dx.cpu(), kh.grouped_mm_f64(y.cpu(), w.cpu().transpose(1, 2), offsets.cpu()), dtype, scale=4.0)


@needs_kernels
@pytest.mark.parametrize("variant", gg.VARIANTS)
def test_unchecked_bad_offsets_are_clamped(variant, gen, kh):
    """With check_values=False, a decreasing offset and one past M are clamped in-kernel: group 1 ([30, 10)) is
    empty and group 2 covers [10, M) (not [10, M + 50)), so rows [0, 10) hold group 0's product and rows [30, M)
    group 2's; rows [10, 30) belong to both clamped groups and are left unchecked."""
    x, w, _, _ = _inputs("multi-tile", torch.float32 if DEVICE == "cpu" else torch.bfloat16, gen)
    M = x.shape[0]
    offsets = torch.tensor([30, 10, M + 50], device=DEVICE)
    y = gg.grouped_mm_triton(x, w, offsets, variant=variant, check_values=False).cpu().double()
    xd, wd = x.cpu().double(), w.cpu().double()
    kh.close(y[:10], xd[:10] @ wd[0], x.dtype, scale=2.0)
    kh.close(y[30:], xd[30:] @ wd[2], x.dtype, scale=2.0)



@needs_kernels
def test_classic_forward_offsets_along_k_are_64_bit():
    """A column-major x (stride M along K, a transposed view of a [K, M] activation) of 70 million rows: the
    classic kernel's offsets along K pass 2**31 inside one tile (column 31 at 2.17e9 elements). They are 64-bit:
    with 32-bit ones it read column 31 at the wrapped offset (where this storage holds 1000s) and gave 1031, not
    32. The storage is 8.7 GB of address space, of which only the columns read and the wrapped place are touched."""
    M, K, N, S = 4, 32, 16, 70_000_000
    wrapped = (31 * S + 2**31) % 2**32 - 2**31             # column 31's offset in 32-bit arithmetic
    at = -wrapped + 2**20                                   # x's storage offset: the wrapped read stays inside
    try:
        base = torch.empty(at + 31 * S + M + 16, dtype=torch.float16, device=DEVICE)
    except (RuntimeError, MemoryError) as e:   # (an environment's limit on address space, not the kernel's)
        pytest.skip(f"cannot reserve {2 * (at + 31 * S) / 1e9:.1f} GB of address space here: {e}")
    x = torch.as_strided(base, (M, K), (1, S), at)
    x.fill_(1.0)                                            # (writes the K columns only)
    base[at + wrapped:at + wrapped + M] = 1000.0
    w = torch.ones(1, K, N, dtype=torch.float16, device=DEVICE)
    y = gg.grouped_mm_triton(x, w, torch.tensor([M], device=DEVICE), variant="classic")
    assert torch.equal(y.cpu(), torch.full((M, N), float(K), dtype=torch.float16)), y[0, :4].tolist()
    del base, x

def test_persistent_rejects_operands_it_cannot_take():
    x = torch.randn(8, 6)  # rows of 24 bytes: not a multiple of 16
    w = torch.randn(2, 6, 8)
    offsets = torch.tensor([3, 8])
    assert "16 bytes" in gg.persistent_unsupported(x, w)
    assert "unit stride" in gg.persistent_unsupported(torch.randn(6, 8).T, torch.randn(2, 6, 8))
    # a broadcast gradient (the backward of y.sum(0) reaches dX with a zero row stride)
    assert "zero" in gg.persistent_unsupported(torch.ones(1, 8).expand(16, 8), torch.randn(2, 8, 8))
    assert gg.persistent_unsupported(torch.randn(8, 8), torch.randn(2, 8, 8)) is None or not HAVE_TRITON
    if HAVE_TRITON and INTERPRET:
        with pytest.raises(ValueError, match=r"variant: 'persistent' cannot run these operands.*16 bytes"):
            gg.grouped_mm_triton(x, w, offsets, variant="persistent")
        with pytest.raises(ValueError, match=r"variant: expected one of \('classic', 'persistent'\).*'tma'"):
            gg.grouped_mm_triton(x, w, offsets, variant="tma")


def test_choose_variant(monkeypatch):
    x, w = torch.randn(8, 8), torch.randn(2, 8, 8)
    monkeypatch.delenv("FEPLB_GROUPED_MM_VARIANT", raising=False)
    assert gg.choose_variant(x, w) == "classic"  # CPU tensors: the persistent variant only when asked
    monkeypatch.setenv("FEPLB_GROUPED_MM_VARIANT", "persistent")
    assert gg.choose_variant(x, w) == ("persistent" if gg.persistent_unsupported(x, w) is None else "classic")
    assert gg.choose_variant(torch.randn(8, 6), torch.randn(2, 6, 8)) == "classic"  # misaligned: classic
    monkeypatch.setenv("FEPLB_GROUPED_MM_VARIANT", "classic")
    assert gg.choose_variant(x, w) == "classic"
    monkeypatch.setenv("FEPLB_GROUPED_MM_VARIANT", "fast")
    with pytest.raises(ValueError, match="FEPLB_GROUPED_MM_VARIANT: expected one of auto, classic, persistent, "
                                         "got 'fast'"):
        gg.choose_variant(x, w)


# ---------------------------------------------------------------------------------------------------- split-M dW

@needs_kernels
@pytest.mark.parametrize("split_rows", [16, 40, None], ids=["split16", "split40-not-tile-multiple", "rule"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_dw_split_rows(case, dtype, split_rows, gen, kh):
    """Groups larger than split_rows are cut into chunks whose partial sums are reduced; the result matches the
    float64 reference, empty groups get zeros, and a second run is bit-identical (fixed reduction order)."""
    x, _, dy, offsets = _inputs(case, dtype, gen)
    with poison_outputs():
        dw = gg.grouped_mm_dw_triton(x, dy, offsets, split_rows=split_rows)
        again = gg.grouped_mm_dw_triton(x, dy, offsets, split_rows=split_rows)
    expected = kh.grouped_mm_dw_f64(x.cpu(), dy.cpu(), offsets.cpu())
    kh.close(dw.cpu(), expected, dtype, scale=2.0 * max(x.shape[0], 1) ** 0.5)
    assert torch.equal(dw, again)
    empty = torch.diff(offsets.cpu(), prepend=offsets.new_zeros(1).cpu()) == 0
    assert torch.all(dw.cpu()[empty] == 0)


DW_ALL = _block_shapes(gg.DW_HOPPER_CONFIGS + gg.DW_FALLBACK_CONFIGS)


@needs_kernels
@pytest.mark.parametrize("config", DW_ALL, ids=_config_ids(DW_ALL))
def test_dw_split_every_gpu_config(config, gen, kh):
    """Each dW tile shape with split groups: 150 rows in chunks of 64 (two full, one partial), beside an unsplit
    group and an empty one; K and N not multiples of the tiles."""
    sizes, K, N = [150, 0, 5, 64], 136, 72
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16  # every GPU config fits with 16-bit operands
    offsets = torch.tensor(sizes).cumsum(0).to(DEVICE)
    x = torch.randn(sum(sizes), K, generator=gen).to(dtype).to(DEVICE)
    dy = torch.randn(sum(sizes), N, generator=gen).to(dtype).to(DEVICE)
    with poison_outputs():
        dw = gg.grouped_mm_dw_triton(x, dy, offsets, config=config, split_rows=64)
    kh.close(dw.cpu(), kh.grouped_mm_dw_f64(x.cpu(), dy.cpu(), offsets.cpu()), dtype, scale=20.0)


# ---------------------------------------------------------------------------------------------------- persistent dW

@needs_kernels
@pytest.mark.parametrize(("split_rows", "programs"), [(16, 1), (40, None), (None, None)],
                         ids=["split16-1-program", "split40-not-tile-multiple", "rule"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_dw_persistent(case, dtype, split_rows, programs, gen, kh):
    """The persistent dW variant against the float64 reference: groups in one chunk and split into chunks that
    are not tile multiples (a partial last block, zeroed past the chunk's end), empty groups (zeros), one program
    walking every work item; int32 offsets with the default programs, int64 with one. Two runs are
    bit-identical, and under the interpreter (same tiles, same accumulation order) equal to the classic variant."""
    x, _, dy, offsets = _inputs(case, dtype, gen, torch.int32 if programs is None else torch.int64)
    with poison_outputs():
        dw = gg.grouped_mm_dw_triton(x, dy, offsets, split_rows=split_rows, variant="persistent", programs=programs)
        again = gg.grouped_mm_dw_triton(x, dy, offsets, split_rows=split_rows, variant="persistent",
                                        programs=programs)
        classic = gg.grouped_mm_dw_triton(x, dy, offsets, split_rows=split_rows, variant="classic")
    expected = kh.grouped_mm_dw_f64(x.cpu(), dy.cpu(), offsets.cpu())
    kh.close(dw.cpu(), expected, dtype, scale=2.0 * max(x.shape[0], 1) ** 0.5)
    assert torch.equal(dw, again)
    if INTERPRET:
        assert torch.equal(dw, classic)
    empty = torch.diff(offsets.cpu(), prepend=offsets.new_zeros(1).cpu()) == 0
    assert torch.all(dw.cpu()[empty] == 0)


@needs_kernels
@pytest.mark.parametrize("config", DW_ALL, ids=_config_ids(DW_ALL))
def test_dw_persistent_every_gpu_config(config, gen, kh):
    """Each dW tile shape through the persistent variant, with split groups (150 rows in chunks of 64), an unsplit
    group, an empty one, and K and N that are not tile multiples (descriptor loads past them read zeros)."""
    sizes, K, N = [150, 0, 5, 64], 136, 72
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    offsets = torch.tensor(sizes).cumsum(0).to(DEVICE)
    x = torch.randn(sum(sizes), K, generator=gen).to(dtype).to(DEVICE)
    dy = torch.randn(sum(sizes), N, generator=gen).to(dtype).to(DEVICE)
    with poison_outputs():
        dw = gg.grouped_mm_dw_triton(x, dy, offsets, config=config, split_rows=64, variant="persistent", programs=2)
    kh.close(dw.cpu(), kh.grouped_mm_dw_f64(x.cpu(), dy.cpu(), offsets.cpu()), dtype, scale=20.0)


@needs_kernels
@pytest.mark.parametrize("variant", gg.DW_VARIANTS)
def test_dw_other_groups_rows_never_enter_a_group(variant, gen, kh):
    """A group's rows are the reduction: the tile-sized loads that run past a group's (or a chunk's) end must not
    add the next group's rows. Groups 1 and 3 hold inf in x and NaN in dy; groups 0 and 2 (5 and 37 rows, chunks
    of 16: partial blocks beside the poisoned rows on both sides) must equal their float64 reference exactly
    as if those rows did not exist, and group 4 (rows up to M) too."""
    sizes, K, N = [5, 20, 37, 3, 11], 16, 24
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    offsets = torch.tensor(sizes).cumsum(0)
    x = torch.randn(sum(sizes), K, generator=gen).to(dtype)
    dy = torch.randn(sum(sizes), N, generator=gen).to(dtype)
    for g in (1, 3):
        rows = slice(int(offsets[g - 1]), int(offsets[g]))
        x[rows] = float("inf")
        dy[rows] = float("nan")
    dw = gg.grouped_mm_dw_triton(x.to(DEVICE), dy.to(DEVICE), offsets.to(DEVICE), split_rows=16,
                                 variant=variant).cpu()
    expected = kh.grouped_mm_dw_f64(x, dy, offsets)
    for g in (0, 2, 4):
        assert torch.isfinite(dw[g]).all(), f"group {g} took in rows of a neighbouring group"
        kh.close(dw[g], expected[g], dtype, scale=4.0)


def test_dw_persistent_rejects_operands_it_cannot_take():
    x, dy = torch.randn(8, 8), torch.randn(8, 8)
    assert "unit stride" in gg.dw_persistent_unsupported(torch.randn(8, 8).T, dy)
    assert "unit stride" in gg.dw_persistent_unsupported(x, torch.randn(8, 8).T)
    assert "16 bytes" in gg.dw_persistent_unsupported(torch.randn(8, 6), dy)   # rows of 24 bytes
    assert "16 bytes" in gg.dw_persistent_unsupported(x, torch.randn(8, 6))
    # a broadcast gradient (the backward of y.sum(0) reaches dW with a zero row stride)
    assert "zero" in gg.dw_persistent_unsupported(x, torch.ones(1, 8).expand(8, 8))
    assert gg.dw_persistent_unsupported(x, dy) is None or not HAVE_TRITON
    if HAVE_TRITON and INTERPRET:
        offsets = torch.tensor([3, 8])
        with pytest.raises(ValueError, match=r"variant: 'persistent' cannot run these operands.*unit stride"):
            gg.grouped_mm_dw_triton(x, torch.randn(8, 8).T, offsets, variant="persistent")
        with pytest.raises(ValueError, match=r"variant: expected one of \('classic', 'persistent'\).*'tma'"):
            gg.grouped_mm_dw_triton(x, dy, offsets, variant="tma")
        w = torch.randn(2, 8, 8)
        for bad in (0, -1, 2.0, True):
            with pytest.raises(ValueError, match=f"programs: expected an int >= 1 or None, got {bad!r}"):
                gg.grouped_mm_dw_triton(x, dy, offsets, variant="persistent", programs=bad)
            with pytest.raises(ValueError, match=f"programs: expected an int >= 1 or None, got {bad!r}"):
                gg.grouped_mm_triton(x, w, offsets, variant="persistent", programs=bad)
        # the classic variants launch their own grids: a programs count would be ignored
        with pytest.raises(ValueError, match="programs: only the persistent variant takes it"):
            gg.grouped_mm_dw_triton(x, dy, offsets, variant="classic", programs=2)
        with pytest.raises(ValueError, match="programs: only the persistent variant takes it"):
            gg.grouped_mm_triton(x, w, offsets, variant="classic", programs=2)


def test_choose_dw_variant(monkeypatch):
    x, dy = torch.randn(8, 8), torch.randn(8, 16)
    monkeypatch.delenv("FEPLB_GROUPED_MM_DW_VARIANT", raising=False)
    assert gg.choose_dw_variant(x, dy) == "classic"  # untimed on a GPU: never by default
    monkeypatch.setenv("FEPLB_GROUPED_MM_DW_VARIANT", "auto")
    assert gg.choose_dw_variant(x, dy) == "classic"
    monkeypatch.setenv("FEPLB_GROUPED_MM_DW_VARIANT", "persistent")
    assert gg.choose_dw_variant(x, dy) == ("persistent" if gg.dw_persistent_unsupported(x, dy) is None
                                           else "classic")
    assert gg.choose_dw_variant(x, torch.randn(8, 6)) == "classic"  # misaligned: classic
    monkeypatch.setenv("FEPLB_GROUPED_MM_DW_VARIANT", "fast")
    with pytest.raises(ValueError, match="FEPLB_GROUPED_MM_DW_VARIANT: expected one of auto, classic, persistent, "
                                         "got 'fast'"):
        gg.choose_dw_variant(x, dy)


@needs_kernels
@pytest.mark.parametrize("per_sm", [1, 2])
def test_dw_persistent_grid_takes_the_configs_programs_per_sm(per_sm, monkeypatch, gen, kh):
    """The grid Triton evaluates for the persistent dW launch has PROGRAMS_PER_SM x SMs programs (3 "SMs" under the
    interpreter), capped by the work items: the config's constant reaches the grid, as num_stages would not."""
    grids = []
    real_launch = gg.launch

    def spy(kernel, grid, *args, **kwargs):
        def recorded(meta):
            grids.append(grid(meta))
            return grids[-1]
        return real_launch(kernel, recorded, *args, **kwargs)

    monkeypatch.setattr(gg, "launch", spy)
    x, _, dy, offsets = _inputs("multi-tile", torch.float32 if DEVICE == "cpu" else torch.bfloat16, gen)
    config = dict(BLOCK_K=32, BLOCK_N=32, BLOCK_M=32, PROGRAMS_PER_SM=per_sm, num_warps=4, num_stages=3)
    dw = gg.grouped_mm_dw_triton(x, dy, offsets, variant="persistent", config=config)
    sms = kt.num_programs(x)
    upper = (1 + 3) * 2 * 2   # work items: one chunk per group (at most 1 + E), 2 x 2 tiles of 32 (K = 40, N = 48)
    assert grids == [(min(per_sm * sms, upper),)]
    assert x.is_cuda or per_sm * sms < upper
    kh.close(dw.cpu(), kh.grouped_mm_dw_f64(x.cpu(), dy.cpu(), offsets.cpu()), x.dtype, scale=20.0)


def test_dw_programs_per_sm():
    assert gg.dw_programs(132, {"BLOCK_M": 64, "PROGRAMS_PER_SM": 2}) == 264
    assert gg.dw_programs(132, {"BLOCK_M": 64}) == 132
    assert {c["PROGRAMS_PER_SM"] for c in gg.DW_PERSISTENT_HOPPER_CONFIGS} == {1, 2}
    # the persistent dW configs are the classic's tiles, but for the one for fp32 IEEE dots (16-bit operands only)
    strip = [{k: v for k, v in c.items() if k != "PROGRAMS_PER_SM"} for c in gg.DW_PERSISTENT_HOPPER_CONFIGS]
    assert strip == gg.DW_HOPPER_CONFIGS[:-1]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True], ids=["zero", "negative", "float", "bool"])
def test_dw_rejects_bad_split_rows(bad):
    if not (HAVE_TRITON and INTERPRET):
        pytest.skip("the launcher runs only with Triton (CPU tensors under the interpreter)")
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=f"split_rows: expected an int >= 1 or None, got {bad!r}"):
        gg.grouped_mm_dw_triton(x, torch.randn(4, 8), torch.tensor([4]), split_rows=bad)


GLM5 = dict(K=6144, N=2 * 2048, E=16)  # gate/up projection of a GLM-5 expert, 16 experts per GPU


@pytest.mark.parametrize("rows_per_group", [128, 256, 512, 4096])
def test_dw_split_rule_leaves_balanced_large_shapes_whole(rows_per_group):
    """With thousands of (group, tile) programs and balanced groups, no group is split (splitting would only add
    partial-sum traffic); a group 4x over the mean is."""
    M = rows_per_group * GLM5["E"]
    chunk = gg.dw_split_rows(M, GLM5["E"], GLM5["K"], GLM5["N"], programs=132, itemsize=2)
    assert chunk % 256 == 0
    assert chunk >= rows_per_group
    assert chunk < 4 * rows_per_group + 256


@pytest.mark.parametrize(("M", "E", "K", "N"), [(4096, 2, 256, 256), (8192, 1, 512, 128), (300, 3, 64, 64)],
                         ids=["2-groups-small-tiles", "1-group", "tiny"])
def test_dw_split_rule_fills_the_gpu_when_tiles_are_few(M, E, K, N):
    programs = 132
    chunk = gg.dw_split_rows(M, E, K, N, programs=programs, itemsize=2)
    tiles = E * -(-K // 128) * -(-N // 128)
    items = -(-M // chunk) if chunk < M else E
    assert chunk % 256 == 0 and chunk >= 256
    # Either the chunks give at least 2 programs per SM, or chunks are already at their 256-row floor.
    assert items * tiles >= 2 * programs or chunk == 256 or chunk >= M


def test_dw_split_rule_bounds_the_partial_sums():
    """The partial-sum buffer (at most 2 M / CHUNK slots of K x N accumulators) stays within max(64 MiB, 2 x dW)."""
    for M, E, K, N in [(1 << 20, 4, 4096, 4096), (65536, 1, 8192, 8192), (5000, 2, 128, 128)]:
        chunk = gg.dw_split_rows(M, E, K, N, programs=132, itemsize=2)
        slots = 2 * M // chunk if chunk < M else 0
        assert slots * K * N * 8 <= max(64 << 20, 2 * E * K * N * 2) or chunk >= M


# ---------------------------------------------------------------------------------------------------- prune, keys

KERNELS = {  # name: (configs, fallback, shared-memory estimate, dtypes it can launch with on a GPU)
    "forward": (gg.FWD_HOPPER_CONFIGS, gg.FWD_FALLBACK_CONFIGS, gg.fwd_shared_bytes,
                [torch.bfloat16, torch.float16, torch.float32, torch.float64]),
    "persistent": (gg.PERSISTENT_HOPPER_CONFIGS, gg.PERSISTENT_FALLBACK_CONFIGS, gg.persistent_shared_bytes,
                   [torch.bfloat16, torch.float16]),
    "dw": (gg.DW_HOPPER_CONFIGS, gg.DW_FALLBACK_CONFIGS, gg.dw_shared_bytes,
           [torch.bfloat16, torch.float16, torch.float32, torch.float64]),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_every_launchable_config_fits_shared_memory(kernel):
    configs, fallback, estimate, dtypes = KERNELS[kernel]
    for dtype in dtypes:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        kept = kt.fitting_configs(configs, fallback, estimate, itemsize)
        assert kept, (kernel, dtype)
        assert all(estimate(c, itemsize) <= kt.SHARED_MEMORY_BYTES for c in kept), (kernel, dtype)
        # Only configs over the limit are dropped.
        dropped = [c for c in configs if c not in kept]
        assert all(estimate(c, itemsize) > kt.SHARED_MEMORY_BYTES for c in dropped if kept[0] in configs)
    # 16-bit operands keep every config: the list was chosen for them.
    assert kt.fitting_configs(configs, fallback, estimate, 2) == configs


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=["bf16", "fp32", "fp64"])
def test_prune_drops_configs_over_the_limit(dtype):
    """The autotuner's prune, on Config objects as the autotuner passes them (the GPU config list)."""
    import triton

    configs = [triton.Config({k: v for k, v in c.items() if k not in ("num_warps", "num_stages")},
                             num_warps=c["num_warps"], num_stages=c["num_stages"]) for c in gg.FWD_HOPPER_CONFIGS]
    kept = gg._fwd_prune(configs, {"x_ptr": torch.empty(0, dtype=dtype)})
    itemsize = torch.empty(0, dtype=dtype).element_size()
    expected = kt.fitting_configs(gg.FWD_HOPPER_CONFIGS, gg.FWD_FALLBACK_CONFIGS, gg.fwd_shared_bytes, itemsize)
    assert [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in kept] == expected
    if dtype == torch.float64:
        assert expected == gg.FWD_FALLBACK_CONFIGS


def test_rows_bucket():
    assert kt.rows_bucket(128 * 16, 16) == 128
    assert kt.rows_bucket(4096 * 16, 16) == 4096
    assert kt.rows_bucket(129 * 16, 16) == 256
    assert kt.rows_bucket(0, 4) == 16 and kt.rows_bucket(3, 4) == 16
    assert kt.rows_bucket(10**7, 2) == 4096
    buckets = [kt.rows_bucket(m, 8) for m in range(0, 50000, 97)]
    assert buckets == sorted(buckets) and all(b % 16 == 0 and b & (b - 1) == 0 for b in buckets)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton (its cdiv and next_power_of_2 are the reference)")
def test_host_cdiv_and_next_power_of_2_equal_tritons():
    import random

    import triton

    rng = random.Random(0)
    values = list(range(1, 300)) + [rng.randrange(1, 2**40) for _ in range(300)] + [2**k for k in range(1, 41)]
    for n in values:
        assert kt.next_power_of_2(n) == triton.next_power_of_2(n), n
        d = rng.randrange(1, 5000)
        assert kt.cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert kt.cdiv(0, 7) == 0 and kt.next_power_of_2(1) == 1


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
def test_autotune_keys_see_rows_per_group():
    for kernel in (gg._grouped_mm_kernel, gg._grouped_mm_persistent_kernel, gg._grouped_mm_dw_kernel,
                   gg._grouped_mm_dw_persistent_kernel):
        assert "M_BUCKET" in kernel.keys, kernel


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
@pytest.mark.parametrize(("K", "N", "groups"), [(8, 6, 1), (7168, 2 * 18432, 64), (6144, 4096, 128)],
                         ids=["tiny", "over-65535-blocks", "glm5"])
def test_dw_reduce_grid_within_cuda_limits(K, N, groups):
    """The reduce kernel's element blocks (cdiv(K * N, 1024): 258,048 for a 7168 x 36864 expert) sit on grid axis
    0, whose limit is 2**31 - 1; the split groups (<= experts) on axis 1, limited to 65,535. Every element of every
    group is covered exactly: blocks * block >= K * N > (blocks - 1) * block."""
    blocks, split = gg.dw_reduce_grid(groups, K * N, 1024)
    assert split == groups and blocks * 1024 >= K * N > (blocks - 1) * 1024
    assert blocks <= 2**31 - 1 and split <= 65_535
    with pytest.raises(ValueError, match="dW reduce grid .* exceeds CUDA's limits"):
        gg.dw_reduce_grid(70_000, K * N, 1024)


@needs_kernels
@pytest.mark.parametrize("wanted", ["persistent", "classic"])
def test_grouped_mm_backward_takes_the_dw_variant_asked_for(wanted, monkeypatch, gen, kh):
    """FEPLB_GROUPED_MM_DW_VARIANT reaches the operator's backward: grouped_mm's weight gradient comes from the
    kernel asked for (the launches are recorded), equal to the float64 reference."""
    from feplb import kernels as fk

    launched = []
    real_launch = gg.launch

    def spy(kernel, *args, **kwargs):
        launched.append(kernel)
        return real_launch(kernel, *args, **kwargs)

    monkeypatch.setattr(gg, "launch", spy)
    monkeypatch.setenv("FEPLB_GROUPED_MM_DW_VARIANT", wanted)
    x, w, dy, offsets = _inputs("multi-tile", torch.float32 if DEVICE == "cpu" else torch.bfloat16, gen)
    w.requires_grad_(True)
    with fk.triton_on_cpu() if DEVICE == "cpu" else contextlib.nullcontext():
        fk.grouped_mm(x, w, offsets).backward(dy)
    expected = {"persistent": gg._grouped_mm_dw_persistent_kernel, "classic": gg._grouped_mm_dw_kernel}[wanted]
    assert expected in launched
    other = ({gg._grouped_mm_dw_persistent_kernel, gg._grouped_mm_dw_kernel} - {expected}).pop()
    assert other not in launched
    kh.close(w.grad.cpu(), kh.grouped_mm_dw_f64(x.cpu(), dy.cpu(), offsets.cpu()), x.dtype,
             scale=2.0 * x.shape[0] ** 0.5)


# ------------------------------------------------------------------------------------- deterministic algorithms

class _SpyLaunch:
    """Stands for an autotuner's JIT function: records the block sizes each launch passes, then launches."""

    def __init__(self, fn):
        self.fn, self.seen = fn, []

    def __getitem__(self, grid):
        run = self.fn[grid]

        def launch(*args, **kwargs):
            self.seen.append({k: kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")})
            return run(*args, **kwargs)

        return launch


@contextlib.contextmanager
def _deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kernel", ["forward", "dw"])
def test_deterministic_algorithms_fix_the_config(kernel, dtype, gen, kh, monkeypatch):
    """Under torch.use_deterministic_algorithms(True) the launcher does not let the autotuner time the configs (its
    pick, the fastest per process, differs from run to run, and so do the bits of a reduction split otherwise): it
    launches the first config the shared-memory rule keeps for the operands' dtype (the pure rule
    ``fitting_configs`` says which), and the autotuner's choice stays empty. The kernel is given every GPU config,
    so under the interpreter (which cannot time a kernel) an autotuner left to choose fails."""
    configs, fallback, estimate, _ = KERNELS[kernel]
    jit = gg._grouped_mm_kernel if kernel == "forward" else gg._grouped_mm_dw_kernel
    monkeypatch.setattr(jit, "configs", kt._to_configs(configs))
    monkeypatch.setattr(jit, "cache", {})
    spy = _SpyLaunch(jit.fn)
    monkeypatch.setattr(jit, "fn", spy)
    x, w, dy, offsets = _inputs("multi-tile", dtype, gen)
    with _deterministic(), poison_outputs():
        if kernel == "forward":
            got = gg.grouped_mm_triton(x, w, offsets, variant="classic")
        else:
            got = gg.grouped_mm_dw_triton(x, dy, offsets, variant="classic")
    want = kh.grouped_mm_f64(x.cpu(), w.cpu(), offsets.cpu()) if kernel == "forward" else \
        kh.grouped_mm_dw_f64(x.cpu(), dy.cpu(), offsets.cpu())
    kh.close(got.cpu(), want, dtype, scale=2.0)
    first = kt.fitting_configs(configs, fallback, estimate, x.element_size())[0]
    assert spy.seen and all(s == {k: first[k] for k in s} for s in spy.seen), (spy.seen, first)
    assert jit.cache == {}


def test_deterministic_config_only_under_the_flag():
    """No fixed config with the flag off, for a single config (Triton never times one) or for a plain function."""
    class Tuned:
        arg_names = ["x_ptr"]
        configs = ["a", "b"]

        @staticmethod
        def early_config_prune(configs, named, **_):
            assert named == {"x_ptr": 1}
            return configs[1:]

    assert kt.deterministic_config(Tuned, (1,), {}) is None
    with _deterministic():
        assert kt.deterministic_config(Tuned, (1,), {}) == "b"
        Tuned.configs = ["a"]
        assert kt.deterministic_config(Tuned, (1,), {}) is None
        assert kt.deterministic_config(object(), (1,), {}) is None
