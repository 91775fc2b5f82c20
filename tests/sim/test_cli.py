"""``feplb simulate`` end to end on a small trace; on bad input, one line naming the file or option, exit status 2,
no partial output files."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import feplb.cli as cli
import feplb.simulate
from feplb.cli import main


def test_simulate_end_to_end(tmp_path, flame_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["simulate", str(flame_path), "synthetic:zipf:E=64:K=6:L=2", "--ep", "8", "--gpus-per-node", "4",
               "--tokens-per-rank", "128", "--dyn", "2", "--policies", "none,feplb,feplb-split,fastermoe,eplb,lp",
               "--microbatches", "2", "--warmup", "1", "--seed", "3", "--json", str(out_json), "--plot",
               str(out_png), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "flame_moe_290m_prefill" in printed and "all workloads" in printed and "feplb-split" in printed
    doc = json.loads(out_json.read_text())
    assert doc["config"]["num_ranks"] == 8 and doc["config"]["command"].startswith("feplb simulate")
    keys = {"token_straggler", "token_straggler_reduction", "max_over_mean", "gemm_straggler_ms", "pct_of_ideal",
            "planner_us_p50", "planner_us_p99", "ce_bytes_per_microbatch"}
    assert set(doc["policies"]) == {"none", "feplb", "feplb-split", "fastermoe", "eplb", "lp"}
    for s in doc["policies"].values():
        assert keys <= set(s)
    assert doc["policies"]["none"]["token_straggler_reduction"] == 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_topology_is_a_clear_error(flame_path, capsys):
    rc = main(["simulate", str(flame_path), "--ep", "6", "--gpus-per-node", "3", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"trace {flame_path}: Topology: --ep (W=6) must divide the experts (E=64) (E is the trace's largest " \
        "expert id + 1; --experts sets it)" in err, err


@pytest.mark.parametrize("args, words", [
    (["--ep", "4", "--gpus-per-node", "8"], "--gpus-per-node 8 must divide --ep 4"),
    (["--ep", "6"], "--gpus-per-node 4 must divide --ep 6"),
    (["--dyn", "9"], "--dyn must be <= experts per rank E // W = 8, got dyn=9"),
    (["--policies", "none,none"], "--policies repeats a policy"),
    (["--policies", "feplb,feplb@current"], "'feplb' and 'feplb@current' (the same policy)"),
    (["--policies", "feplb,feplb+"], "'+' names no modifier"),
    (["--policies", "eplb", "--eplb-groups", "3"], "--eplb-groups must divide E=64, got 3"),
])
def test_option_errors_name_the_options(args, words, flame_path, capsys, no_run):
    assert main(["simulate", str(flame_path), *FAST, *args]) == 2
    err = _one_line_error(capsys, words)
    assert "SimConfig" not in err and "PolicyState" not in err and "--experts sets it" not in err, err


@pytest.mark.parametrize("policies", ["feplb,", "feplb,,lp", ",none", "none, ,feplb", ""])
def test_an_empty_policy_name_is_refused(policies, flame_path, capsys, no_run):
    """A trailing or doubled comma named no policy, and the run compared one policy fewer, unsaid."""
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", str(flame_path), *FAST, "--policies", policies])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert f"argument --policies: expected comma-separated policy names, none empty, got {policies!r}" in err, err


def test_policy_names_are_stripped(flame_path, tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["simulate", str(flame_path), *FAST, "--policies", " none , feplb ", "--json", str(out)]) == 0
    assert list(json.loads(out.read_text())["policies"]) == ["none", "feplb"]


def test_a_value_argparse_cannot_convert_is_named_in_words(flame_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", str(flame_path), "--ep", "2.5"])
    assert exit_.value.code == 2 and "argument --ep: invalid positive integer value: '2.5'" in capsys.readouterr().err


def test_gpus_per_node_defaults_to_one_node_of_at_most_8(flame_path, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["simulate", str(flame_path), "--ep", "4", "--tokens-per-rank", "64", "--dyn", "1", "--policies",
                 "none,feplb", "--microbatches", "1", "--warmup", "0", "--no-progress", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["gpus_per_node"] == 4
    assert main(["simulate", str(flame_path), "--ep", "12", "--no-progress"]) == 2
    _one_line_error(capsys, "--gpus-per-node 8 must divide --ep 12 (the default, min(8, --ep); give --gpus-per-node)")


def test_console_script_help():
    proc = subprocess.run([sys.executable, "-m", "feplb.cli", "simulate", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "synthetic:zipf|dirichlet" in proc.stdout and "PATH.npz" in proc.stdout


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 2
    assert "simulate" in capsys.readouterr().out


FAST = ["--ep", "8", "--gpus-per-node", "4", "--tokens-per-rank", "64", "--dyn", "1", "--policies", "none,feplb",
        "--microbatches", "1", "--warmup", "0", "--no-progress"]


def _one_line_error(capsys, *fragments: str) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "Traceback" not in captured.err and len(err.splitlines()) == 1, captured.err
    assert err.startswith("feplb simulate: error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


@pytest.fixture
def no_run(monkeypatch):
    """Any simulation that starts fails the test: bad input must be refused before the work."""

    def ran(*args, **kwargs):
        raise AssertionError("the simulation ran although the input was bad")

    monkeypatch.setattr(feplb.simulate, "simulate", ran)


def _bad_trace(kind: str, tmp_path: pathlib.Path, flame_path: pathlib.Path, monkeypatch) -> tuple[pathlib.Path, str]:
    path = tmp_path / f"{kind}.npz"
    good = flame_path.read_bytes()
    if kind == "empty":
        path.write_bytes(b"")
        return path, "the file is empty"
    if kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
        return path, "not an .npz archive"
    if kind == "not-zip":
        path.write_bytes(b"topk_ids,0,1,2\n" * 20)
        return path, "not an .npz archive"
    if kind == "damaged-member":
        rng = np.random.default_rng()
        np.savez(path, topk_ids=rng.integers(0, 16, size=(256, 2, 2), dtype=np.int32))
        data = bytearray(path.read_bytes())
        at = data.index(b"\x93NUMPY") + 200  # inside the array's bytes, past its header
        data[at] ^= 0xFF
        path.write_bytes(bytes(data))
        return path, "damaged .npz archive"
    if kind == "directory":
        path.mkdir()
        return path, "is a directory"
    if kind.startswith("raw-"):   # a member that is no .npy file: numpy gives its bytes, not an array
        import zipfile

        member = kind.removeprefix("raw-")
        ids = np.random.default_rng().integers(0, 16, size=(8, 2, 2))
        arrays = {"topk_ids": ids, "expert_hidden": np.int64(64), "expert_ffn": np.int64(32),
                  "moe_layers": np.array(["a", "b"]), "seq_offsets": np.array([0, 8])}
        np.savez(path, **{k: v for k, v in arrays.items() if k != member})
        with zipfile.ZipFile(path, "a") as z:
            z.writestr(f"{member}.npy", b"not an array")
        return path, f"{member} is not an .npy array"
    if kind == "moe-layers-0d":
        np.savez(path, topk_ids=np.zeros((4, 1, 2), np.int64), moe_layers=np.array("L0"))
        return path, "moe_layers must be a 1-D array of the layers' names, got shape []"
    assert kind == "unreadable"
    shutil.copyfile(flame_path, path)
    if os.geteuid() != 0:
        path.chmod(0)
    else:  # root reads any file: make the read itself fail as it would for another user
        real_open = pathlib.Path.open

        def denied(self, *args, **kwargs):
            if self == path:
                raise PermissionError(13, "Permission denied", str(self))
            return real_open(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "open", denied)
    return path, "cannot read the file (Permission denied)"


@pytest.mark.parametrize("kind", ["empty", "truncated", "not-zip", "damaged-member", "directory", "unreadable",
                                  "raw-topk_ids", "raw-expert_hidden", "raw-moe_layers", "raw-seq_offsets",
                                  "moe-layers-0d"])
def test_unusable_trace_file(kind, tmp_path, flame_path, monkeypatch, capsys):
    path, why = _bad_trace(kind, tmp_path, flame_path, monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    rc = main(["simulate", str(path), *FAST, "--json", str(out / "r.json")])
    assert rc == 2
    _one_line_error(capsys, str(path), why)
    assert not list(out.iterdir()), "no output for a refused run"


def _bad_output(kind: str, tmp_path: pathlib.Path, monkeypatch) -> tuple[pathlib.Path, str]:
    if kind == "directory":
        (tmp_path / "d").mkdir()
        return tmp_path / "d", "is a directory"
    if kind == "missing-folder":
        return tmp_path / "nowhere" / "r.out", f"the folder {tmp_path / 'nowhere'} does not exist"
    if kind == "under-a-file":
        (tmp_path / "f").write_text("a file")
        return tmp_path / "f" / "r.out", f"{tmp_path / 'f'} is not a folder"
    assert kind == "read-only-folder"
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
    else:  # root writes anywhere: make creating a file in the folder fail as it would for another user
        real = cli.tempfile.mkstemp

        def denied(*args, dir=None, **kwargs):  # noqa: A002 (mkstemp's own keyword)
            if pathlib.Path(dir) == ro:
                raise PermissionError(13, "Permission denied", str(ro))
            return real(*args, dir=dir, **kwargs)

        monkeypatch.setattr(cli.tempfile, "mkstemp", denied)
    return ro / "r.out", f"cannot write in {ro} (Permission denied)"


@pytest.mark.parametrize("option", ["--json", "--plot"])
@pytest.mark.parametrize("kind", ["directory", "missing-folder", "under-a-file", "read-only-folder"])
def test_output_path_is_checked_before_the_run(option, kind, tmp_path, flame_path, monkeypatch, capsys, no_run):
    target, why = _bad_output(kind, tmp_path, monkeypatch)
    target = target.with_suffix(".png") if option == "--plot" and kind != "directory" else target
    before = sorted(tmp_path.rglob("*"))
    rc = main(["simulate", str(flame_path), *FAST, option, str(target)])
    assert rc == 2
    _one_line_error(capsys, f"{option} {target}", why)
    assert sorted(tmp_path.rglob("*")) == before, "nothing written"


def test_an_output_that_is_no_regular_file_is_refused(tmp_path, flame_path, capsys, no_run):
    # a device (as root, replacing /dev/null broke the machine's); the device itself is left as it was
    before = os.stat(os.devnull)
    assert main(["simulate", str(flame_path), *FAST, "--json", os.devnull]) == 2
    _one_line_error(capsys, f"--json {os.devnull}: exists and is not a regular file")
    after = os.stat(os.devnull)
    assert (after.st_mode, after.st_rdev) == (before.st_mode, before.st_rdev)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert main(["simulate", str(flame_path), *FAST, "--plot", str(fifo)]) == 2
    _one_line_error(capsys, f"--plot {fifo}: exists and is not a regular file")


def test_an_output_link_is_followed(tmp_path, flame_path, capsys):
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("{}")
    link.symlink_to(target.name)
    assert main(["simulate", str(flame_path), *FAST, "--json", str(link)]) == 0
    assert link.is_symlink() and json.loads(target.read_text())["config"]["num_ranks"] == 8


def test_a_replaced_output_keeps_its_mode_and_a_new_one_follows_the_umask(tmp_path, flame_path, capsys):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text("{}")
    old.chmod(0o640)
    mask = os.umask(0o027)
    try:
        for out in (old, new):
            assert main(["simulate", str(flame_path), *FAST, "--json", str(out)]) == 0
    finally:
        os.umask(mask)
    assert (old.stat().st_mode & 0o777, new.stat().st_mode & 0o777) == (0o640, 0o640)
    assert old.read_text().endswith("}\n")


def test_an_output_that_is_an_input_is_refused(tmp_path, flame_path, capsys, no_run):
    trace = tmp_path / "t.npz"
    shutil.copyfile(flame_path, trace)
    link = tmp_path / "same.npz"
    link.symlink_to(trace.name)
    data = trace.read_bytes()
    for out in (trace, link):
        assert main(["simulate", str(trace), *FAST, "--json", str(out)]) == 2
        _one_line_error(capsys, f"--json {out}: is the input trace {trace}, which the results would overwrite")
    table = tmp_path / "cost.json"
    table.write_text(json.dumps({"rows": [32, 128, 1024], "us": [20.0, 26.0, 130.0]}))
    assert main(["simulate", str(trace), *FAST, "--cost-table", str(table), "--plot", str(table)]) == 2
    _one_line_error(capsys, f"--plot {table}: is the input --cost-table {table}")
    counts = tmp_path / "counts.json"
    counts.write_text("{}")
    assert main(["simulate", f"{counts}:model=olmoe", *FAST, "--json", str(counts)]) == 2
    _one_line_error(capsys, f"is the input trace {counts}")
    assert trace.read_bytes() == data and counts.read_text() == "{}"


def test_plot_formats_matplotlib_cannot_write_here_are_refused_before_the_run(tmp_path, flame_path, capsys,
                                                                             monkeypatch, no_run):
    monkeypatch.setattr(shutil, "which", lambda name: None)    # no TeX installed
    assert main(["simulate", str(flame_path), *FAST, "--plot", str(tmp_path / "r.pgf")]) == 2
    _one_line_error(capsys, "matplotlib writes .pgf with", "which is not installed here")


def test_an_interrupt_is_one_line_and_writes_nothing(tmp_path, flame_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(feplb.simulate, "simulate", interrupted)
    assert main(["simulate", str(flame_path), *FAST, "--json", str(tmp_path / "r.json")]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "feplb simulate: interrupted; nothing written" and not list(tmp_path.iterdir())


@pytest.mark.parametrize("when", ["simulating", "writing"])
def test_a_sigterm_is_one_line_and_writes_nothing(when, tmp_path, flame_path, capsys, monkeypatch):
    """SIGTERM (a scheduler's time limit) ends the run as Ctrl-C does: one line, status 143, neither output written
    and no temporary file left beside them (the plot's writer is killed midway, after the JSON's was written);
    the previous SIGTERM handler is back after."""
    import signal

    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not end the run")

    if when == "simulating":
        monkeypatch.setattr(feplb.simulate, "simulate", killed)
    else:
        monkeypatch.setattr(cli, "plot_results", killed)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["simulate", str(flame_path), *FAST, "--json", str(tmp_path / "r.json"), "--plot",
                 str(tmp_path / "r.png")]) == 143
    err = capsys.readouterr().err
    assert err.strip() == "feplb simulate: terminated; nothing written" and not list(tmp_path.iterdir()), \
        (err, list(tmp_path.iterdir()))
    assert signal.getsignal(signal.SIGTERM) is before


def test_hidden_or_ffn_alone_keeps_the_other_dimension_of_each_workload(tmp_path, flame_path, capsys):
    out = tmp_path / "r.json"
    assert main(["simulate", str(flame_path), "synthetic:zipf:E=64:K=6:L=2", *FAST, "--ffn", "512",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "H=1024 F=512 (FLAME-MoE-290M-1.3B, --ffn from the options)" in printed
    assert "H=6144 F=512 (no model: --ffn from the options, the rest the cost table's)" in printed
    shapes = {k: (w["expert_shape"]["hidden"], w["expert_shape"]["ffn"])
              for k, w in json.loads(out.read_text())["workloads"].items()}
    # the traced model's hidden size; the synthetic workload's of the cost table (GLM-5's)
    assert shapes == {"flame_moe_290m_prefill": (1024, 512), "synthetic-zipf-E64-K6": (6144, 512)}, shapes
    # without --hidden / --ffn a synthetic workload's shape is the cost table's, and the header says so
    assert main(["simulate", "synthetic:zipf:E=64:K=6:L=2", *FAST]) == 0
    printed = capsys.readouterr().out
    assert "H=6144 F=2048 (no model: the cost table's)" in printed and "from the options" not in printed, printed


def test_what_limits_a_result_is_said_and_recorded(tmp_path, flame_path, capsys):
    """The test trace holds 2,048 tokens: 8 ranks of 256 tokens differ, of 2,048 every rank routes the whole trace;
    @ema's per-step costs over 3 micro-batches of a 2-micro-batch step count the window's refreshes only."""
    out = tmp_path / "r.json"
    base = ["--ep", "8", "--gpus-per-node", "4", "--dyn", "1", "--warmup", "0", "--no-progress", "--json", str(out)]
    assert main(["simulate", str(flame_path), *base, "--tokens-per-rank", "256", "--policies", "none,feplb",
                 "--microbatches", "2"]) == 0
    assert capsys.readouterr().err == "" and json.loads(out.read_text())["notes"] == []
    assert main(["simulate", str(flame_path), *base, "--tokens-per-rank", "2048", "--policies", "none,feplb@ema",
                 "--microbatches", "3", "--refresh-every", "2"]) == 0
    err = capsys.readouterr().err
    notes = json.loads(out.read_text())["notes"]
    assert len(notes) == 2 and all(f"feplb simulate: note: {n}" in err for n in notes), (notes, err)
    assert "every rank routes the same tokens in every micro-batch" in notes[0]
    assert "--microbatches 3 is not a multiple of --refresh-every 2: the per-step costs of feplb@ema" in notes[1]


@pytest.mark.parametrize("where, gpu", [({"device_type": "cpu", "device": "x86_64"}, False),
                                        ({"device_type": "cuda", "device": "NVIDIA H200"}, True),
                                        ({"bench_meta": {"device": "NVIDIA H200", "cuda": "13.0"}}, True),
                                        ({}, False)])
def test_a_cost_table_says_where_it_was_measured(where, gpu, tmp_path, flame_path, capsys):
    table, out = tmp_path / "cost.json", tmp_path / "r.json"
    table.write_text(json.dumps({"rows": [32, 128, 1024], "us": [20.0, 26.0, 130.0], "meta": where}))
    assert main(["simulate", str(flame_path), *FAST, "--tokens-per-rank", "64", "--cost-table", str(table),
                 "--json", str(out)]) == 0
    captured = capsys.readouterr()
    doc = json.loads(out.read_text())
    assert doc["config"]["cost_table"] == {"path": str(table), "meta": where}
    said = f"--cost-table {table} was not measured on a GPU"
    assert (said in captured.err) == (not gpu) and (any(said in n for n in doc["notes"])) == (not gpu)
    assert f"GEMM times from {table} (" in captured.out


@pytest.mark.parametrize("shape", [{}, {"hidden": 1024}, {"hidden": 1024, "ffn": 704}])
def test_a_cost_table_without_its_shape_is_said_to_be_the_default(shape, tmp_path, flame_path, capsys):
    """A table of the --cost-table help's form ({"rows", "us"}) is taken as measured on the default expert and
    scaled: said, since its times were scaled without a word."""
    table, out = tmp_path / "cost.json", tmp_path / "r.json"
    table.write_text(json.dumps({"rows": [32, 128, 1024], "us": [20.0, 26.0, 130.0], **shape}))
    assert main(["simulate", str(flame_path), *FAST, "--tokens-per-rank", "64", "--cost-table", str(table),
                 "--json", str(out)]) == 0
    err = capsys.readouterr().err
    missing = [k for k in ("hidden", "ffn") if k not in shape]
    said = f"--cost-table {table} gives no {' or '.join(missing)}: its times are taken as measured on an expert of " \
           f"H={shape.get('hidden', 6144)} F=2048"
    assert (said in err) == bool(missing), err
    assert any(said in n for n in json.loads(out.read_text())["notes"]) == bool(missing)


def test_unknown_plot_format_is_refused_before_the_run(tmp_path, flame_path, capsys, no_run):
    assert main(["simulate", str(flame_path), *FAST, "--plot", str(tmp_path / "r.xyz")]) == 2
    _one_line_error(capsys, f"--plot {tmp_path / 'r.xyz'}: unknown image format 'xyz'", "png")
    assert not list(tmp_path.iterdir())


def test_json_and_plot_on_one_file_is_refused(tmp_path, flame_path, capsys, no_run):
    target = str(tmp_path / "r.png")
    assert main(["simulate", str(flame_path), *FAST, "--json", target, "--plot", target]) == 2
    _one_line_error(capsys, "--json and --plot name the same file")


def test_huge_tokens_per_rank_is_bounded_with_the_reason(flame_path, capsys, no_run):
    rc = main(["simulate", str(flame_path), *FAST[:4], "--tokens-per-rank", "1000000000", *FAST[6:]])
    assert rc == 2
    err = _one_line_error(capsys, "--tokens-per-rank 1000000000: a micro-batch of flame_moe_290m_prefill gathers",
                          "expert ids", "GB; the limit is")
    # The largest S the message offers is accepted, one more is not.
    from feplb.traces import load_trace

    trace = load_trace(flame_path)
    largest = int(err.rsplit("--tokens-per-rank <= ", 1)[1].split(" ")[0])
    cli.bound_microbatch(trace, 8, largest)
    with pytest.raises(cli.UsageError, match=f"--tokens-per-rank {largest + 1}:"):
        cli.bound_microbatch(trace, 8, largest + 1)
    _, L, K = trace.topk_ids_TLK.shape
    assert largest * 8 * L * K * (trace.topk_ids_TLK.itemsize + 16) <= cli.MICROBATCH_BYTES_MAX


@pytest.mark.parametrize("args, words", [
    (["--tokens-per-rank", "300000000000000000"],
     ["--tokens-per-rank 300000000000000000:", "S x K = 2400000000000000000 rows from one rank could reach one "
      "expert, past the planner's bound of 17592186044416 per (source, expert) for W=4, E=32"]),
    (["--microbatches", "100000000000000000000"],
     ["--microbatches 100000000000000000000: the metrics of synthetic-zipf-E32-K8 (2 policies x",
      "the limit is 2.0 GB"]),
    (["--eplb-slots", "1000000", "--policies", "none,eplb"],
     ["--eplb-slots must be at most E = 32 (redundant slots per GPU", "got 1000000"]),
])
def test_options_past_what_a_run_can_hold_are_refused_before_it_naming_the_option(args, words, capsys, no_run):
    """Sizes no run could hold (they ran into the planner's bound mid-run, exhausted memory, or failed in numpy
    without naming the option) are refused before any work, as one line naming the option."""
    base = ["simulate", "synthetic:zipf:E=32:L=1:K=8", "--ep", "4", "--gpus-per-node", "4", "--dyn", "2",
            "--microbatches", "2", "--warmup", "0", "--policies", "none,feplb"]
    assert main(base + args) == 2
    _one_line_error(capsys, *words)
    # the largest --microbatches offered is taken
    from feplb.simulate import SimConfig
    from feplb.traces import SyntheticWorkload

    w = SyntheticWorkload(num_experts=32, top_k=8, num_layers=3)
    err = None
    try:
        cli.bound_metrics(w, SimConfig(num_ranks=4, gpus_per_node=4, microbatches=10**12))
    except cli.UsageError as e:
        err = str(e)
    largest = int(err.rsplit("--microbatches <= ", 1)[1].split(" ")[0])
    cli.bound_metrics(w, SimConfig(num_ranks=4, gpus_per_node=4, microbatches=largest))
    with pytest.raises(cli.UsageError, match=f"--microbatches {largest + 1}:"):
        cli.bound_metrics(w, SimConfig(num_ranks=4, gpus_per_node=4, microbatches=largest + 1))


@pytest.mark.parametrize("option, value", [("--hidden", "4611686018427387904"), ("--ffn", "1048577")])
def test_an_expert_size_no_model_comes_near_is_refused(option, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "synthetic:zipf:E=32:L=1:K=8", "--ep", "4", option, value])
    assert exit_.value.code == 2
    assert f"argument {option}: expected at most 1048576 (2**20" in capsys.readouterr().err
    assert main(["simulate", "synthetic:zipf:E=32:L=1:K=8", "--ep", "4", "--gpus-per-node", "4", "--dyn", "1",
                 "--microbatches", "1", "--warmup", "0", "--policies", "none", "--no-progress", option,
                 "1048576"]) == 0


def test_a_stray_expert_id_is_bounded_with_the_reason(tmp_path, capsys, no_run):
    """E is a trace's largest id + 1: one stray id past the counts' memory bound is refused before any work,
    naming E and the bound; an E within it passes the check."""
    rng = np.random.default_rng()
    ids = rng.integers(0, 16, size=(512, 2, 2), dtype=np.int64)
    ids[rng.integers(512), 1, 0] = 2**33 - 1
    path = tmp_path / "stray.npz"
    np.savez(path, topk_ids=ids)
    assert main(["simulate", str(path), *FAST]) == 2
    _one_line_error(capsys, str(path), "E=8589934592 (its largest expert id + 1)", "the limit is 2.0 GB",
                    "a stray expert id?")
    from feplb.traces import load_trace

    ids[ids > 15] = 15
    np.savez(path, topk_ids=ids)
    cli.bound_experts(load_trace(path), str(path), 8)


def test_traces_of_one_name_in_two_folders_are_both_kept(tmp_path, flame_path, capsys):
    a, b = tmp_path / "a" / flame_path.name, tmp_path / "b" / flame_path.name
    for p in (a, b):
        p.parent.mkdir()
        shutil.copyfile(flame_path, p)
    out = tmp_path / "r.json"
    assert main(["simulate", str(a), str(b), "synthetic:zipf:E=64:K=6:L=2", *FAST, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["workloads"]) == [str(a), str(b), "synthetic-zipf-E64-K6"], "a unique name stays as it was"
    assert [w["trace"] for w in doc["workloads"].values()] == [str(a), str(b), "synthetic:zipf:E=64:K=6:L=2"]
    printed = capsys.readouterr().out
    assert f"\n{a} (E=" in printed and f"\n{b} (E=" in printed


def test_workload_keys_are_distinct():
    assert cli.workload_keys(["x", "y"], ["a/x.npz", "y.npz"]) == ["x", "y"]
    assert cli.workload_keys(["x", "x", "y"], ["a/x.npz", "b/x.npz", "y.npz"]) == ["a/x.npz", "b/x.npz", "y"]
    keys = cli.workload_keys(["x", "x", "x"], ["a/x.npz", "a/x.npz", "b/x.npz"])
    assert keys == ["a/x.npz#1", "a/x.npz#2", "b/x.npz"] and len(set(keys)) == 3


def test_a_failing_output_leaves_no_file_behind(tmp_path, flame_path, monkeypatch):
    def broken_plot(*args, **kwargs):
        raise RuntimeError("the plot failed")

    monkeypatch.setattr(cli, "plot_results", broken_plot)
    with pytest.raises(RuntimeError, match="the plot failed"):
        main(["simulate", str(flame_path), *FAST, "--json", str(tmp_path / "r.json"), "--plot",
              str(tmp_path / "r.png")])
    assert not list(tmp_path.iterdir()), "neither the JSON nor a temporary file may stay"


def test_unsigned_ids_simulate_like_signed_ones(tmp_path, capsys):
    rng = np.random.default_rng()
    ids = rng.integers(0, 16, size=(128, 2, 2))
    runs = []
    for dtype in (np.int64, np.uint64, np.uint16):
        np.savez(tmp_path / f"t_{dtype.__name__}.npz", topk_ids=ids.astype(dtype))
        out = tmp_path / f"{dtype.__name__}.json"
        assert main(["simulate", str(tmp_path / f"t_{dtype.__name__}.npz"), "--ep", "4", "--gpus-per-node", "4",
                     "--tokens-per-rank", "16", "--dyn", "1", "--policies", "none,feplb", "--microbatches", "2",
                     "--warmup", "0", "--no-progress", "--json", str(out)]) == 0, capsys.readouterr().err
        runs.append(json.loads(out.read_text())["policies"])
    for pol in ("none", "feplb"):
        assert runs[0][pol]["token_straggler"] == runs[1][pol]["token_straggler"] == runs[2][pol]["token_straggler"]


def _strict_json(text: str):
    def refuse(name):
        raise AssertionError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_json_of_mixed_expert_shapes_is_standard_json(tmp_path, flame_path, capsys):
    # FLAME and a synthetic workload have different expert shapes: the pooled summary's shape is "mixed" (null)
    out = tmp_path / "r.json"
    assert main(["simulate", str(flame_path), "synthetic:zipf:E=64:K=6:L=2:seed=1", "--ep", "4", "--gpus-per-node",
                 "4", "--tokens-per-rank", "16", "--dyn", "1", "--policies", "none", "--microbatches", "1",
                 "--warmup", "0", "--no-progress", "--json", str(out)]) == 0
    doc = _strict_json(out.read_text())
    assert doc["policies"]["none"]["expert_hidden"] is None and doc["policies"]["none"]["expert_ffn"] is None


@pytest.mark.parametrize("kind, why", [
    ("directory", "cannot read the file"),
    ("truncated", "not a cost table of `feplb calibrate` (JSONDecodeError"),
    ("wrong-type", "not a cost table of `feplb calibrate` (TypeError"),
    ("unknown-key", "not a cost table of `feplb calibrate` (TypeError"),
    ("no-rows", "a cost table needs keys 'rows' and 'us'"),
])
def test_unusable_cost_table(kind, why, tmp_path, flame_path, capsys, no_run):
    path = tmp_path / "cost.json"
    good = {"rows": [32, 128, 1024], "us": [20.0, 26.0, 130.0], "hidden": 1024, "ffn": 704}
    if kind == "directory":
        path.mkdir()
    elif kind == "truncated":
        path.write_text(json.dumps(good)[:20])
    elif kind == "wrong-type":
        path.write_text(json.dumps({**good, "rows": 5}))
    elif kind == "unknown-key":
        path.write_text(json.dumps({**good, "bogus": 1}))
    else:
        path.write_text(json.dumps({"us": good["us"]}))
    assert main(["simulate", str(flame_path), *FAST, "--cost-table", str(path)]) == 2
    _one_line_error(capsys, f"--cost-table {path}", why)


@pytest.mark.parametrize("kind, why", [
    ("truncated", "Expecting"),
    ("ragged", "must be numbers in a [domain][layer][expert] array of equal lengths"),
    ("layer-names", "'layers' must be a list of the 3 counted layers' numbers, got [0, 7]"),
    ("layer-number", "'layers' must be a list of the 3 counted layers' numbers, got 5"),
    ("layer-strings", "'layers' must be a list of the 3 counted layers' numbers, got ['0', '7', '15']"),
    ("no-top-k", "models.olmoe has no 'top_k'"),
    ("a-list", "must be a JSON object with 'models' (the OLMoE repository's expert_counts_by_domain.json), got a "
               "list"),
    ("no-models", "must be a JSON object with 'models' (the OLMoE repository's expert_counts_by_domain.json), got "
                  "an object with keys ['layers', 'modles']"),
    ("fractional-top-k", "olmoe's top_k must be a whole number >= 1, got 2.7"),
    ("no-token", "olmoe/topk counts no token at all for domain 'b', layer 1"),
    ("infinite", "must be finite, non-negative [domain][layer][expert]"),
    ("overflowing", "olmoe/topk counts of domain 'b', layer 2 sum beyond a float64's range"),
    ("no-domain", "models.olmoe.topk lists no domain"),
    ("deep", "not an OLMoE counts file (its JSON is nested too deeply to read)"),
])
def test_unusable_counts_file_names_the_file(kind, why, tmp_path, capsys, no_run):
    path = tmp_path / "counts.json"
    counts = np.random.default_rng(0).integers(1, 100, size=(2, 3, 16)).tolist()
    doc = {"layers": [0, 7, 15], "models": {"olmoe": {"top_k": 2, "topk": {"a": counts[0], "b": counts[1]}}}}
    if kind == "truncated":
        text = json.dumps(doc)[:100]
    elif kind == "ragged":
        doc["models"]["olmoe"]["topk"]["a"][1] = doc["models"]["olmoe"]["topk"]["a"][1][:5]
        text = json.dumps(doc)
    elif kind == "fractional-top-k":
        doc["models"]["olmoe"]["top_k"] = 2.7
        text = json.dumps(doc)
    elif kind == "no-token":
        doc["models"]["olmoe"]["topk"]["b"][1] = [0] * 16
        text = json.dumps(doc)
    elif kind == "infinite":
        doc["models"]["olmoe"]["topk"]["b"][2][3] = float("inf")   # (json writes Infinity, and reads it back)
        text = json.dumps(doc)
    elif kind == "overflowing":    # (a RuntimeWarning, then probabilities "that do not sum to 1")
        doc["models"]["olmoe"]["topk"]["b"][2] = [1e308] * 16
        text = json.dumps(doc)
    elif kind == "no-domain":      # (was "unknown domains []; available: []")
        doc["models"]["olmoe"]["topk"] = {}
        text = json.dumps(doc)
    elif kind == "deep":           # (json's RecursionError)
        text = "[" * 100_000 + "]" * 100_000
    elif kind == "layer-number":   # ('int' object is not iterable)
        text = json.dumps({**doc, "layers": 5})
    elif kind == "layer-strings":
        text = json.dumps({**doc, "layers": ["0", "7", "15"]})
    elif kind == "no-top-k":       # (was simulated as top-1 without a word)
        del doc["models"]["olmoe"]["top_k"]
        text = json.dumps(doc)
    elif kind == "a-list":         # (was "unknown model 'olmoe'; available: []")
        text = json.dumps([doc])
    elif kind == "no-models":
        text = json.dumps({"layers": doc["layers"], "modles": doc["models"]})
    else:
        doc["layers"] = [0, 7]
        text = json.dumps(doc)
    path.write_text(text)
    assert main(["simulate", str(path), "--ep", "4", "--gpus-per-node", "4", "--tokens-per-rank", "16", "--dyn", "1",
                 "--policies", "none", "--microbatches", "1", "--warmup", "0", "--no-progress"]) == 2
    _one_line_error(capsys, str(path), why)


def test_place_min_gain_out_of_range_names_the_option(flame_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", str(flame_path), *FAST, "--place-min-gain", "1.5"])
    assert exit_.value.code == 2
    assert "--place-min-gain: expected a number in [0, 1), got 1.5" in capsys.readouterr().err


def test_plan_us_is_charged_recorded_and_checked(tmp_path, flame_path, capsys):
    out = tmp_path / "r.json"
    assert main(["simulate", str(flame_path), *FAST, "--policies", "none,feplb", "--plan-us", "25",
                 "--json", str(out)]) == 0
    assert "with 25 us of planning" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["config"]["plan_us"] == 25 and doc["config"]["cost"]["d2d_gbps"] == 2100
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", str(flame_path), *FAST, "--plan-us", "-3"])
    assert exit_.value.code == 2 and "--plan-us: expected a finite number >= 0, got -3" in capsys.readouterr().err


def test_no_reduce_in_fp32_halves_the_step_gradients_and_is_recorded(tmp_path, flame_path, capsys):
    """``--no-reduce-in-fp32`` (the layer's ``FEPLBConfig(reduce_in_fp32=False)``): the held copies' gradients go
    home in the weights' dtype, so a step's end costs a policy that holds copies less, and the JSON says so; the
    forward and backward are the same."""
    docs = {}
    for name, flag in (("fp32", []), ("bf16", ["--no-reduce-in-fp32"])):
        out = tmp_path / f"{name}.json"
        assert main(["simulate", str(flame_path), *FAST[:-7], "--policies", "none,feplb@ema", "--microbatches", "8",
                     "--warmup", "1", "--refresh-every", "4", "--plan-us", "25", "--no-progress", *flag,
                     "--json", str(out)]) == 0
        docs[name] = json.loads(out.read_text())
    capsys.readouterr()
    assert docs["fp32"]["config"]["cost"]["grad_dtype_bytes"] is None
    assert docs["bf16"]["config"]["cost"]["grad_dtype_bytes"] == docs["bf16"]["config"]["cost"]["dtype_bytes"] == 2
    a, b = docs["fp32"]["policies"]["feplb@ema"], docs["bf16"]["policies"]["feplb@ema"]
    assert a["fwd_bwd_ms"] == b["fwd_bwd_ms"]
    assert 0 < b["step_ms"] < a["step_ms"] and b["train_ms"] < a["train_ms"]


def test_options_without_effect_and_a_suspicious_expert_count_are_said_before_the_run(tmp_path, flame_path,
                                                                                       capsys):
    ids = np.random.default_rng(0).integers(0, 2, size=(1024, 1, 2))
    ids[0, 0, 0] = 63               # one stray id: E = 64, 3 experts routed
    sparse = tmp_path / "sparse.npz"
    np.savez(sparse, topk_ids=ids)
    out = tmp_path / "r.json"
    assert main(["simulate", str(flame_path), str(flame_path), str(sparse), *FAST, "--replicas", "lazy",
                 "--json", str(out)]) == 0
    err = capsys.readouterr().err
    want = [f"trace {flame_path} is given 2 times: 'all workloads' pools it as often",
            "--replicas lazy changes the @ema policies only, and none is simulated",
            f"trace {sparse}: E=64 (its largest expert id + 1), but it routes to 3 experts only: check the trace, "
            "or give --experts"]
    assert json.loads(out.read_text())["notes"][:3] == want
    assert all(f"feplb simulate: note: {n}" in err for n in want), err
    # none of them where they do not apply
    assert main(["simulate", str(flame_path), str(sparse), *FAST, "--experts", "64", "--policies", "none,feplb@ema",
                 "--replicas", "lazy", "--microbatches", "8", "--refresh-every", "4", "--warmup", "4", "--json",
                 str(out)]) == 0
    assert json.loads(out.read_text())["notes"] == [], capsys.readouterr().err


def test_options_of_policies_not_simulated_and_experts_of_counts_are_said(tmp_path, flame_path, capsys):
    """An option of one policy family (--min-chunk, --tau, --eplb-slots, --eplb-groups, --recopy-weights) given
    for a run without it, and --experts for OLMoE counts (whose E is their own), change nothing: said in a note."""
    counts = np.random.default_rng(0).integers(1, 50, size=(2, 3, 16)).tolist()
    olmoe = tmp_path / "counts.json"
    olmoe.write_text(json.dumps({"layers": [0, 7, 15],
                                 "models": {"olmoe": {"top_k": 2, "topk": {"a": counts[0], "b": counts[1]}}}}))
    out = tmp_path / "r.json"
    assert main(["simulate", str(olmoe), *FAST, "--policies", "none,lp", "--experts", "32", "--min-chunk", "7",
                 "--tau", "0.5", "--eplb-slots", "2", "--eplb-groups", "2", "--json", str(out)]) == 0
    notes = json.loads(out.read_text())["notes"]
    assert notes == ["--min-chunk changes the feplb-split policies only, and none is simulated",
                     "--tau changes the feplb, feplb-split policies only, and none is simulated",
                     "--eplb-slots changes the eplb policies only, and none is simulated",
                     "--eplb-groups changes the eplb policies only, and none is simulated",
                     f"trace {olmoe}: --experts 32 is not used: its counts give E=16"], notes
    capsys.readouterr()
    # a synthetic spec's own E wins over --experts (which only sets its default)
    spec = "synthetic:zipf:E=16:K=2:L=2"
    assert main(["simulate", spec, *FAST, "--policies", "none,feplb", "--experts", "32", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["notes"] == [f"trace {spec}: --experts 32 is not used: the spec's E=16 is"]
    assert main(["simulate", "synthetic:zipf:K=2:L=2", *FAST, "--policies", "none,feplb", "--experts", "32",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["notes"] == []
    capsys.readouterr()
    # where they apply, nothing is said
    assert main(["simulate", str(flame_path), *FAST, "--policies", "none,feplb-split,eplb", "--experts", "64",
                 "--min-chunk", "7", "--tau", "0.5", "--eplb-slots", "2", "--recopy-weights",
                 "--microbatches", "8", "--warmup", "8", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["notes"] == [], capsys.readouterr().err
