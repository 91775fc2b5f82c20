"""``feplb simulate`` end to end on a small trace."""

import json
import subprocess
import sys

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
    assert "num_ranks (W=6) must divide num_experts (E=64)" in capsys.readouterr().err


def test_console_script_help():
    proc = subprocess.run([sys.executable, "-m", "feplb.cli", "simulate", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "synthetic:zipf|dirichlet" in proc.stdout and "PATH.npz" in proc.stdout


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 2
    assert "simulate" in capsys.readouterr().out
