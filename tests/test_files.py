"""feplb.files: outputs written whole or not at all."""

import json
import os
import stat
from pathlib import Path

import pytest

from feplb.files import write_json, write_outputs


def test_write_json_makes_the_folder_and_writes_the_document(tmp_path):
    doc = {"a": [1, 2.5, None], "b": {"c": "d"}, "nan": float("nan")}
    out = write_json(tmp_path / "x" / "y" / "r.json", doc)
    assert out == tmp_path / "x" / "y" / "r.json"
    got = json.loads(out.read_text())
    assert got["a"] == doc["a"] and got["b"] == doc["b"] and got["nan"] != got["nan"]
    assert out.read_text().endswith("\n")
    assert os.listdir(out.parent) == ["r.json"]


def test_a_document_json_cannot_hold_leaves_the_old_file_and_no_other(tmp_path):
    out = tmp_path / "r.json"
    write_json(out, {"old": 1})
    before = out.read_bytes()
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json(out, {"new": object()})
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        write_json(out, {"new": float("inf")}, allow_nan=False)
    assert out.read_bytes() == before
    assert os.listdir(tmp_path) == ["r.json"]
    # nothing made for a document refused before the write: not even its folder
    with pytest.raises(TypeError):
        write_json(tmp_path / "new" / "r.json", {1j: 2})
    assert not (tmp_path / "new").exists()


def test_a_failing_writer_leaves_every_output_as_it_was(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("old a")
    os.chmod(a, 0o640)

    def fail(tmp):
        Path(tmp).write_text("partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_outputs([(a, lambda tmp: Path(tmp).write_text("new a")), (b, fail)])
    assert a.read_text() == "old a" and not b.exists()
    assert sorted(os.listdir(tmp_path)) == ["a.txt"]
    write_outputs([(a, lambda tmp: Path(tmp).write_text("new a")), (b, lambda tmp: Path(tmp).write_text("b"))])
    assert a.read_text() == "new a" and b.read_text() == "b"
    assert stat.S_IMODE(a.stat().st_mode) == 0o640     # a replaced file keeps its mode
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt"]
