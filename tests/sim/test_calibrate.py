"""``feplb calibrate``: the fitted cost table (knee, monotone curve), the timed expert forward, the table from a
bench_kernels results file, and the command end to end on the CPU (a CPU table: it says nothing about a GPU)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from feplb.calibrate import _expert_forward, expert_us_from_bench, fit_table, isotonic, measure_expert_us
from feplb.cli import main
from feplb.sched import CostModel

H200_BENCH = Path(__file__).resolve().parents[2] / "bench" / "results" / "2026-11-30-h200" / "bench_kernels.json"


def isotonic_ref(us):
    """The least-squares non-decreasing fit by its min-max formula: fit[i] = max over j <= i of min over k >= i of
    mean(us[j..k]) (another algorithm than the pooling the code uses)."""
    n = len(us)
    return [max(min(float(np.mean(us[j:k + 1])) for k in range(i, n)) for j in range(i + 1)) for i in range(n)]


def test_fit_table_knee_and_isotonic_fit():
    rows = [32, 64, 128, 256, 512, 1024, 2048]
    us = [20.0, 19.5, 21.0, 30.0, 60.0, 58.0, 120.0]
    t_rows, t_us, info = fit_table(rows, us)
    # 20 and 19.5 pool to 19.75, 60 and 58 to 59; 21 is within 10% of 19.75, 30 is not: the knee is 128 rows
    assert info["fitted_us"] == pytest.approx([19.75, 19.75, 21.0, 30.0, 59.0, 59.0, 120.0])
    assert info["knee_rows"] == 128 and info["moved_points"] == 4
    assert t_rows == [128, 256, 512, 1024, 2048] and t_us == pytest.approx([21.0, 30.0, 59.0, 59.0, 120.0])
    cm = CostModel(table_rows=tuple(t_rows), table_us=tuple(t_us), hidden=64, ffn=32, table_hidden=64, table_ffn=32)
    assert cm.knee_rows == 128
    assert cm.gemm_us(1) == cm.gemm_us(128) == pytest.approx(21.0)


def test_a_noisy_point_moves_its_neighbours_less_than_a_running_maximum():
    us = [20.0, 20.5, 30.0, 20.2, 20.4, 20.3, 40.0, 80.0]
    _, _, info = fit_table([16, 32, 64, 128, 256, 512, 1024, 2048], us, floor_tolerance=0.3)
    assert max(info["fitted_us"][:6]) < 24 < max(np.maximum.accumulate(us[:6]))
    assert info["knee_rows"] == 512


@pytest.mark.parametrize("seed", range(20))
def test_fit_table_on_random_curves(seed):
    """Floor then line plus noise: the table is the suffix of the closest non-decreasing fit from the knee, the knee
    the last point within the tolerance of the first, and the cost model reproduces the table at its points."""
    rng = np.random.default_rng(seed)
    rows = np.unique(rng.integers(1, 8192, size=int(rng.integers(3, 12))))
    if rows.size < 3:
        rows = np.array([1, 100, 8000])
    floor, slope, knee = rng.uniform(5, 50), rng.uniform(0.01, 1.0), rng.uniform(rows[0], rows[-2])
    us = np.maximum(floor, floor + slope * (rows - knee)) * rng.uniform(0.97, 1.03, size=rows.size)
    tol = float(rng.uniform(0.0, 0.3))
    fit = np.array(isotonic_ref(us.tolist()))
    assert np.allclose(isotonic(us.tolist()), fit, rtol=1e-12)
    inside = np.nonzero(fit <= fit[0] * (1 + tol))[0]
    # the first two points on one line through the origin (times grow as the rows): none on the floor
    linear = inside[-1] == 0 and 0.9 <= (fit[1] / fit[0]) / (rows[1] / rows[0]) <= 1.15
    if inside[-1] == rows.size - 1 or fit[-1] <= fit[-2] or linear:
        with pytest.raises(ValueError, match="never leaves the weight-read floor|ends flat|no point lies on the "
                                             "weight-read floor"):
            fit_table(rows.tolist(), us.tolist(), floor_tolerance=tol)
        return
    t_rows, t_us, info = fit_table(rows.tolist(), us.tolist(), floor_tolerance=tol)
    k = inside[-1]
    assert t_rows == rows[k:].tolist() and np.allclose(t_us, fit[k:], rtol=1e-12)
    assert info["knee_rows"] == rows[k]
    assert np.all(np.diff(t_us) >= 0)
    cm = CostModel(table_rows=tuple(t_rows), table_us=tuple(t_us))
    assert np.allclose(cm.gemm_us(np.array(t_rows)), t_us)
    assert np.all(np.diff(cm.gemm_us(np.arange(1, rows[-1] + 1))) >= 0)


@pytest.mark.parametrize("rows, us, match", [
    ([64, 128, 256], [10.0, 10.5, 10.9], "never leaves the weight-read floor"),
    ([128, 64], [10.0, 20.0], "strictly ascending"),
    ([0, 64], [10.0, 20.0], "strictly ascending"),
    ([64], [10.0], "at least 2"),
    ([64, 128], [10.0], "same length"),
    ([64, 128], [10.0, float("nan")], "finite and > 0"),
    ([64, 128], [0.0, 20.0], "finite and > 0"),
    ([64, 128, 256, 512], [10.0, 10.5, 40.0, 39.0], "ends flat"),
    # the two largest row counts of a sweep stopped early: both on the line, the floor never measured
    ([2048, 4096], [233.5, 460.1], r"grows about as the rows .* no point lies on the weight-read floor"),
    ([512, 1024, 4096], [70.0, 138.0, 540.0], r"no point lies on the weight-read floor"),
])
def test_fit_table_refusals(rows, us, match):
    with pytest.raises(ValueError, match=match):
        fit_table(rows, us)


def test_a_first_point_on_the_floor_is_kept():
    """A first segment that grows less than its rows (a floor point before the line) or more (a line that starts
    past the floor) starts on the floor: the table keeps it."""
    for us in ([23.3, 30.1, 52.0], [20.0, 80.0, 200.0], [20.0, 35.0, 70.0]):
        t_rows, _, info = fit_table([128, 256, 512], us)
        assert t_rows == [128, 256, 512] and info["knee_rows"] == 128


@pytest.mark.parametrize("impl", ["torch", "feplb"])
def test_timed_call_is_the_experts_forward(impl):
    """What calibrate times computes each expert's SwiGLU MLP on its own rows (fp64 reference per expert)."""
    torch.manual_seed(0)
    E, H, F, R = 3, 32, 16, 8
    x = torch.randn(E * R, H, dtype=torch.bfloat16)
    w1 = (torch.randn(E, H, 2 * F) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, F, H) / F ** 0.5).to(torch.bfloat16)
    offsets = torch.arange(1, E + 1, dtype=torch.int32) * R
    got = _expert_forward(x, w1, w2, offsets, impl)().double()
    for e in range(E):
        xe = x[e * R:(e + 1) * R].double()
        h = xe @ w1[e].double()
        want = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ w2[e].double()
        err = (got[e * R:(e + 1) * R] - want).abs().max() / want.abs().max()
        assert err < 3e-2, f"expert {e}: relative error {err:.2e}"
    with pytest.raises(ValueError, match="impl must be"):
        _expert_forward(x, w1, w2, offsets, "cublas")


def test_measure_expert_us_cpu():
    got = measure_expert_us([4, 8, 16], hidden=32, ffn=16, experts=2, dtype=torch.float32, repeats=3, warmup=1)
    assert [g["rows"] for g in got] == [4, 8, 16]
    for g in got:
        assert len(g["samples"]) == 3 and g["us"] == pytest.approx(float(np.median(g["samples"])))
        assert 0 < g["min_us"] <= g["us"]
        flops = 2 * g["rows"] * 32 * 32 + 2 * g["rows"] * 16 * 32
        assert g["tflops"] == pytest.approx(flops / (g["us"] * 1e-6) / 1e12)
    with pytest.raises(ValueError, match="rows must be positive and strictly ascending"):
        measure_expert_us([8, 4], hidden=32, ffn=16)
    with pytest.raises(ValueError, match="experts must be an int >= 1"):
        measure_expert_us([4, 8], hidden=32, ffn=16, experts=0)


def test_from_bench_on_the_h200_run():
    """The per-expert time is the two forward GEMMs of torch._grouped_mm summed over 16 experts, per row count."""
    doc = json.loads(H200_BENCH.read_text())
    got, shape = expert_us_from_bench(doc)
    assert shape == {"hidden": 6144, "ffn": 2048, "experts": 16}
    want: dict[int, float] = {}
    for r in doc["results"]:
        if r["bench"] == "grouped_mm" and r["op"] == "forward" and r["impl"] == "torch_grouped_mm" \
                and r["dist"] == "uniform":
            want[r["rows_per_expert"]] = want.get(r["rows_per_expert"], 0.0) + r["us"] / 16
    assert [g["rows"] for g in got] == sorted(want) == [128, 256, 512, 1024, 2048, 4096]
    assert [g["us"] for g in got] == pytest.approx([want[r] for r in sorted(want)])
    ours, _ = expert_us_from_bench(doc, impl="feplb", dist="zipf")
    assert len(ours) == 6 and all(g["us"] > 0 for g in ours)


def _bench_doc(rows):
    return {"meta": {"shape": {"hidden": 64, "ffn": 32, "local_experts": 2}}, "results": rows}


def _rec(proj, r, **kw):
    return {"bench": "grouped_mm", "proj": proj, "op": "forward", "dist": "uniform", "rows_per_expert": r,
            "impl": "torch_grouped_mm", **kw}


@pytest.mark.parametrize("doc, impl, match", [
    ({"results": []}, "torch_grouped_mm", "not a bench_kernels results document"),
    ({"meta": {"shape": {"hidden": 1}}, "results": []}, "torch_grouped_mm", "must give hidden, ffn and local_experts"),
    (_bench_doc([_rec("gate_up", 128, us=10.0)]), "torch_grouped_mm", "no 'down' record"),
    (_bench_doc([_rec("gate_up", 128, us=10.0), _rec("down", 128, error="AssertionError")]), "torch_grouped_mm",
     "has no time"),
    (_bench_doc([_rec("gate_up", 128, us=10.0)]), "feplb", "no forward grouped_mm records of impl 'feplb'"),
    (_bench_doc([]), "dense", "impl must be one of"),
    ({"meta": {"shape": {"hidden": 64, "ffn": 32, "local_experts": 0}}, "results": []}, "torch_grouped_mm",
     "positive local_experts"),
    # a shape as written, never truncated or converted (hidden 64.5 read as 64, true as 1)
    ({"meta": {"shape": {"hidden": 64.5, "ffn": 32, "local_experts": 2}}, "results": []}, "torch_grouped_mm",
     "meta.shape must hold integers"),
    ({"meta": {"shape": {"hidden": 64, "ffn": 32, "local_experts": True}}, "results": []}, "torch_grouped_mm",
     "meta.shape must hold integers"),
    (_bench_doc([{k: v for k, v in _rec("gate_up", 128, us=1.0).items() if k != "rows_per_expert"}]),
     "torch_grouped_mm", "no positive integer rows_per_expert"),
    (_bench_doc([_rec("gate_up", 128, us=1.0), _rec("down", 128, us=None)]), "torch_grouped_mm", "us: None"),
    # a record naming no GEMM (it was called a second run's)
    (_bench_doc([_rec("gate_up", 128, us=1.0), {k: v for k, v in _rec("down", 128, us=1.0).items() if k != "proj"}]),
     "torch_grouped_mm", r"results\[1\] \(torch_grouped_mm forward at 128 rows per expert\) has no proj 'gate_up' "
     r"or 'down': None"),
    # two runs in one file: the last record was kept without a word
    (_bench_doc([_rec("gate_up", 128, us=1.0), _rec("down", 128, us=1.0), _rec("down", 128, us=9.0)]),
     "torch_grouped_mm", r"results\[2\]: a second torch_grouped_mm forward 'down' record at 128 rows per expert"),
    # records of another shape than the meta's (hidden 64, ffn 32, 2 experts)
    (_bench_doc([_rec("gate_up", 128, us=1.0, M=256, K=64, N=96), _rec("down", 128, us=1.0)]), "torch_grouped_mm",
     r"results\[0\] \(torch_grouped_mm forward gate_up at 128 rows per expert\) timed a GEMM of \{'N': 96\}, not "
     r"the meta.shape's \{'M': 256, 'K': 64, 'N': 64\}"),
    (_bench_doc([_rec("gate_up", 128, us=1.0), _rec("down", 128, us=1.0, M=128, K=32, N=64)]), "torch_grouped_mm",
     r"timed a GEMM of \{'M': 128\}"),
])
def test_from_bench_refusals(doc, impl, match):
    with pytest.raises(ValueError, match=match):
        expert_us_from_bench(doc, impl=impl)


def test_from_bench_takes_records_of_its_shape():
    got, _ = expert_us_from_bench(_bench_doc([_rec("gate_up", 128, us=2.0, M=256, K=64, N=64),
                                              _rec("down", 128, us=1.0, M=256, K=32, N=64)]))
    assert [(g["rows"], g["us"]) for g in got] == [(128, 1.5)]


@pytest.mark.timing   # the fit needs times that grow with the rows: a busy CPU beside it can flatten them
def test_cli_measures_writes_a_table_the_simulator_reads(tmp_path, capsys):
    out = tmp_path / "cost.json"
    rc = main(["calibrate", "--out", str(out), "--hidden", "128", "--ffn", "64", "--experts", "2", "--rows",
               "4,16,64,256,1024,4096", "--dtype", "float32", "--device", "cpu", "--repeats", "5", "--warmup", "1",
               "--ce-gbps", "100"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "knee" in printed and f"wrote {out}" in printed and "CPU times, no GPU's" in printed
    doc = json.loads(out.read_text())
    meta = doc["meta"]
    assert meta["source"] == "measured" and meta["device_type"] == "cpu" and meta["command"].startswith("feplb cal")
    assert doc["hidden"] == 128 and doc["ffn"] == 64 and doc["ce_gbps"] == 100
    measured = {m["rows"]: m["us"] for m in meta["measured"]}
    assert sorted(measured) == [4, 16, 64, 256, 1024, 4096]
    # the printed rate keeps its significant digits, however small (a CPU's at 4 rows is far below 0.01 TFLOP/s)
    lines = {int(line.split()[0]): line.split() for line in printed.splitlines() if line.split()[:1] and
             line.split()[0].isdigit()}
    for m in meta["measured"]:
        assert float(lines[m["rows"]][2]) == pytest.approx(m["tflops"], rel=1e-3) and float(lines[m["rows"]][2]) > 0
    # the table is the non-decreasing fit of the recorded measurements from the knee on
    fit = isotonic_ref([measured[r] for r in sorted(measured)])
    k = sorted(measured).index(doc["rows"][0])
    assert doc["rows"] == sorted(measured)[k:] and np.allclose(doc["us"], fit[k:], rtol=1e-12)
    cm = CostModel.from_json(out)
    # float32 times, float32 bytes (the model's default element size is bf16's)
    assert (cm.hidden, cm.ffn, cm.ce_gbps, cm.knee_rows, cm.dtype_bytes) == (128, 64, 100.0, doc["rows"][0], 4)
    assert cm.weight_bytes == 3 * 128 * 64 * 4
    sim_json = tmp_path / "sim.json"
    assert main(["simulate", "synthetic:zipf:E=16:K=2:L=1", "--ep", "4", "--gpus-per-node", "4", "--tokens-per-rank",
                 "64", "--dyn", "1", "--policies", "none,feplb-split", "--microbatches", "1", "--warmup", "0",
                 "--no-progress", "--cost-table", str(out), "--json", str(sim_json)]) == 0
    assert json.loads(sim_json.read_text())["policies"]["feplb-split"]["expert_hidden"] == 128


def test_cli_from_bench(tmp_path, capsys):
    out = tmp_path / "h200.json"
    assert main(["calibrate", "--from-bench", str(H200_BENCH), "--out", str(out), "--d2d-gbps", "1900",
                 "--copy-out-slowdown", "0.21"]) == 0
    doc = json.loads(out.read_text())
    assert (doc["d2d_gbps"], doc["copy_out_slowdown"]) == (1900, 0.21) and "ce_gbps" not in doc
    cm = CostModel.from_json(out)
    assert (cm.d2d_gbps, cm.copy_out_slowdown) == (1900, 0.21)
    assert doc["rows"][0] == 128 and (doc["hidden"], doc["ffn"]) == (6144, 2048)
    assert doc["meta"]["bench_meta"]["device"] == "NVIDIA H200" and "no SwiGLU" in doc["meta"]["what"]
    assert (doc["meta"]["device_type"], doc["meta"]["device"]) == ("cuda", "NVIDIA H200")
    # the results file given as the output too: refused, and left as it was
    bench = tmp_path / "bench.json"
    bench.write_bytes(H200_BENCH.read_bytes())
    assert main(["calibrate", "--from-bench", str(bench), "--out", str(bench)]) == 2
    assert "is the input --from-bench" in capsys.readouterr().err
    assert bench.read_bytes() == H200_BENCH.read_bytes()
    assert CostModel.from_json(out).knee_rows == 128
    # feplb's kernels' times of the same run make a table too (their first segment grows 0.77 of its rows' ratio:
    # a floor point, kept)
    assert main(["calibrate", "--from-bench", str(H200_BENCH), "--bench-impl", "feplb", "--out", str(out)]) == 0
    assert CostModel.from_json(out).knee_rows == 128


def test_cli_from_bench_takes_everything_from_the_file(tmp_path, capsys):
    """Measuring options beside --from-bench are refused (they were ignored: a table of the file's shape written
    after --hidden 2048); --bench-impl without it too; the bench's dtype reaches the table's meta; a file that
    does not say whether its torch had CUDA is not called a CPU's."""
    out = tmp_path / "t.json"
    for extra, words in ((["--hidden", "2048", "--ffn", "1408"], "--hidden, --ffn with --from-bench"),
                         (["--rows", "1,2", "--device", "cpu", "--impl", "feplb"], "--rows, --device, --impl with "
                                                                                  "--from-bench"),
                         (["--dtype", "float32"], "--dtype with --from-bench")):
        assert main(["calibrate", "--from-bench", str(H200_BENCH), "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert words in err and "leave them out" in err and len(err.strip().splitlines()) == 1, err
    assert main(["calibrate", "--bench-impl", "feplb", "--out", str(out), "--device", "cpu"]) == 2
    assert "--bench-impl is for --from-bench" in capsys.readouterr().err
    assert not out.exists()
    assert main(["calibrate", "--from-bench", str(H200_BENCH), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["dtype"] == "bfloat16" and CostModel.from_json(out).dtype_bytes == 2
    capsys.readouterr()
    # one row count left: the message names the file
    doc = _bench_doc([_rec("gate_up", 128, us=10.0), _rec("down", 128, us=5.0)])
    one = tmp_path / "one.json"
    one.write_text(json.dumps(doc))
    assert main(["calibrate", "--from-bench", str(one), "--out", str(out)]) == 2
    assert f"--from-bench {one}: a cost table needs at least 2 measured row counts, got 1" in capsys.readouterr().err
    # no 'cuda' key in the bench's meta: where it ran is unknown, not "a CPU"
    doc = _bench_doc([_rec(p, r, us=u) for r, u in ((64, 10.0), (128, 10.2), (256, 30.0))
                      for p in ("gate_up", "down")])
    for cuda, kind in (("absent", None), (None, "cpu"), ("13.0", "cuda")):
        meta = {**doc["meta"], "device": "somewhere"} | ({} if cuda == "absent" else {"cuda": cuda})
        path = tmp_path / "b.json"
        path.write_text(json.dumps({**doc, "meta": meta}))
        assert main(["calibrate", "--from-bench", str(path), "--out", str(out)]) == 0
        assert json.loads(out.read_text())["meta"]["device_type"] == kind
        printed = capsys.readouterr().out
        assert ("the bench file's times were measured on a CPU" in printed) == (kind == "cpu"), printed
        assert "this machine" not in printed


def test_cli_a_cpu_out_of_memory_is_said_so(tmp_path, capsys, monkeypatch):
    """The CPU allocator's failure is a RuntimeError: it was blamed on --impl torch (and --impl feplb advised)."""
    import feplb.calibrate

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 262144000000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(feplb.calibrate, "measure_expert_us", no_memory)
    out = tmp_path / "t.json"
    assert main(["calibrate", "--out", str(out), "--device", "cpu", "--rows", "32,1000000000"]) == 2
    err = capsys.readouterr().err
    assert "out of memory on cpu timing 16 experts of H=6144 F=2048 at up to 1000000000 rows per expert: use fewer " \
        "--experts or smaller --rows" in err and "--impl feplb" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("case", ["missing-folder", "bad-json", "not-utf8", "flat-curve", "no-such-gpu", "deep-json",
                                  "huge-rows", "huge-shape"])
def test_cli_refusals_write_nothing(tmp_path, capsys, case):
    out = tmp_path / "cost.json"
    if case == "missing-folder":
        out = tmp_path / "nowhere" / "cost.json"
        argv, match = ["--from-bench", str(H200_BENCH)], "does not exist"
    elif case == "bad-json":
        bad = tmp_path / "bench.json"
        bad.write_text("{ not json")
        argv, match = ["--from-bench", str(bad)], "not JSON"
    elif case == "not-utf8":
        bad = tmp_path / "bench.json"
        bad.write_bytes(b"\xff\xfe{")
        argv, match = ["--from-bench", str(bad)], "not JSON"
    elif case == "no-such-gpu":
        argv, match = ["--device", f"cuda:{torch.cuda.device_count() + 3}"], "no such CUDA device here"
    elif case == "deep-json":    # (json's RecursionError was a traceback)
        bad = tmp_path / "bench.json"
        bad.write_text("[" * 100_000 + "]" * 100_000)
        argv, match = ["--from-bench", str(bad)], "its JSON is nested too deeply to read"
    elif case in ("huge-rows", "huge-shape"):    # (a JSON integer beyond a float: an OverflowError traceback)
        doc = _bench_doc([_rec(p, r, us=10.0 * r) for p in ("gate_up", "down") for r in (64, 128)])
        if case == "huge-rows":
            doc["results"][0]["rows_per_expert"] = 10**400
            match = "has no positive integer rows_per_expert below 2**46"
        else:
            doc["meta"]["shape"]["hidden"] = 10**400
            match = "hidden and ffn must be at most 2**20"
        bad = tmp_path / "bench.json"
        bad.write_text(json.dumps(doc))
        argv = ["--from-bench", str(bad)]
    else:
        flat = tmp_path / "bench.json"
        flat.write_text(json.dumps(_bench_doc([_rec("gate_up", r, us=10.0) for r in (64, 128)]
                                              + [_rec("down", r, us=5.0) for r in (64, 128)])))
        argv, match = ["--from-bench", str(flat)], "never leaves the weight-read floor"
    assert main(["calibrate", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("feplb calibrate: error:") and match in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".cost.json.*"))


def test_cli_names_a_shape_the_kernel_refuses(tmp_path, capsys):
    """torch._grouped_mm needs 16-byte strides: H=7 in fp32 is refused with one line naming the shape, no file."""
    out = tmp_path / "cost.json"
    assert main(["calibrate", "--out", str(out), "--hidden", "7", "--ffn", "5", "--experts", "2", "--rows", "4,8",
                 "--dtype", "float32", "--device", "cpu", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert "--impl torch cannot run H=7 F=5 in float32 on cpu" in err and "--impl feplb" in err
    assert err.strip().splitlines()[-1].startswith("feplb calibrate: error:") and not out.exists()
    # the project's own kernels (here their CPU twins) take the shape
    got = measure_expert_us([4, 8], hidden=7, ffn=5, experts=2, dtype=torch.float32, impl="feplb", repeats=1)
    assert [g["rows"] for g in got] == [4, 8] and all(g["us"] > 0 for g in got)


@pytest.mark.parametrize("option, match", [(["--rows", "64,32"], "strictly ascending"),
                                           (["--device", "tpu9"], "--device"),
                                           (["--device", "mps"], "expected cpu, cuda or cuda:N"),
                                           (["--floor-tolerance", "nan"], "expected a number in [0, 10)"),
                                           (["--floor-tolerance", "-1"], "expected a number in [0, 10)"),
                                           (["--warmup", "0"], "expected an integer >= 1"),
                                           (["--copy-out-slowdown", "1.2"], "expected a number in [0, 1]"),
                                           (["--d2d-gbps", "0"], "expected a finite number > 0")])
def test_cli_options_are_checked_before_any_work(option, match, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--out", "x.json", *option])
    assert exc.value.code == 2 and match in capsys.readouterr().err


def test_gpu_timer_order_on_stand_ins(monkeypatch):
    """On a GPU each timed call sits behind a queued GPU sleep between its two events, with one sync per call after
    the warm-up calls; the times are the events' (ms -> us)."""
    import feplb.calibrate as cal

    order: list[str] = []
    elapsed = iter([1.5, 0.5, 2.0])

    class Event:
        made = 0

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.name = ("start", "end")[Event.made % 2]
            Event.made += 1

        def record(self):
            order.append(self.name)

        def elapsed_time(self, end):
            assert self.name == "start" and end.name == "end"
            return next(elapsed)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: order.append("sleep"), raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: order.append("sync"))
    got = cal._time_us(lambda: order.append("call"), torch.device("cuda"), repeats=3, warmup=2)
    assert got == pytest.approx([1500.0, 500.0, 2000.0])
    assert order == ["call", "call", "sync"] + ["sleep", "start", "call", "end", "sync"] * 3


def test_cli_refuses_a_shape_the_cost_model_cannot_take_before_measuring(tmp_path, capsys):
    """--hidden / --ffn above the cost model's 2**20 are refused as options (they were measured first, the whole
    sweep, then refused by the table)."""
    out = tmp_path / "t.json"
    for option in ("--hidden", "--ffn"):
        with pytest.raises(SystemExit) as exc:
            main(["calibrate", "--out", str(out), option, str(2**20 + 8), "--device", "cpu"])
        assert exc.value.code == 2
        assert f"{option}: expected at most 1048576" in capsys.readouterr().err
    assert not out.exists()
