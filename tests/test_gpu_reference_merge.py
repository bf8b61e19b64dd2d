"""Unpacking a GPU reference pack adds to results/<gpu>/: two calls unpacked one after the other keep both."""
from __future__ import annotations

import json

from tools.gpu_reference_merge import file_pack


def _pack(folder, notebook, mode, status, figure):
    folder.mkdir(parents=True)
    (folder / "figures").mkdir()
    (folder / "figures" / figure).write_bytes(b"png")
    (folder / "results.json").write_text(json.dumps([{"notebook": notebook, "figures": {}}]))
    (folder / "runtimes.json").write_text(json.dumps({notebook: {"seconds": 1.0}}))
    (folder / "reference_run.json").write_text(json.dumps(
        {"environment": {"slug": "gpu"}, "runs": {notebook: {mode: {"status": status}}}}))


def test_a_second_pack_adds_to_the_first_and_wins_where_both_ran(tmp_path):
    results = tmp_path / "results" / "gpu"
    _pack(tmp_path / "one", "04_x", "full", "ok", "04_a.png")
    _pack(tmp_path / "two", "10_x", "full", "ok", "10_a.png")
    _pack(tmp_path / "three", "04_x", "check", "FAILED", "04_b.png")
    for name in ("one", "two", "three"):
        file_pack(tmp_path / name, results)
    assert [e["notebook"] for e in json.loads((results / "results.json").read_text())] == ["04_x", "10_x"]
    assert set(json.loads((results / "runtimes.json").read_text())) == {"04_x", "10_x"}
    runs = json.loads((results / "reference_run.json").read_text())["runs"]
    assert runs == {"04_x": {"full": {"status": "ok"}, "check": {"status": "FAILED"}}, "10_x": {"full": {"status": "ok"}}}
    assert sorted(p.name for p in (results / "figures").iterdir()) == ["04_a.png", "04_b.png", "10_a.png"]
