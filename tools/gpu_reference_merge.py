"""File one GPU reference pack's ``filed/<slug>/`` folder into ``results/<slug>/``, adding to what is there.

Each device call files its figures onto a copy of the checkout's ``results/<slug>/``. When two calls run before
either is unpacked (a warm machine used for a second call at once), the second pack does not hold the first's
notebooks: copying it over would erase them. So the records are merged, notebook by notebook, the pack's entries
winning: ``results.json`` (a list of per-notebook entries), ``runtimes.json`` (per notebook), and
``reference_run.json`` (``runs[notebook][mode]``); figures and other files are copied over.

    python tools/gpu_reference_merge.py PACK/filed/<slug> results/<slug>
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def _load(path: Path, empty):
    return json.loads(path.read_text()) if path.exists() else empty


def merge_results(new: list[dict], old: list[dict]) -> list[dict]:
    """Per-notebook entries of both, the new one where both have a notebook, in notebook order."""
    by_notebook = {entry["notebook"]: entry for entry in old}
    by_notebook.update({entry["notebook"]: entry for entry in new})
    return [by_notebook[name] for name in sorted(by_notebook)]


def merge_runtimes(new: dict, old: dict) -> dict:
    """``{notebook: entry}`` (and any ``modes`` table) of both, the new entries winning."""
    merged = {**old, **new}
    if "modes" in old or "modes" in new:
        modes = {mode: dict(entries) for mode, entries in old.get("modes", {}).items()}
        for mode, entries in new.get("modes", {}).items():
            modes.setdefault(mode, {}).update(entries)
        merged["modes"] = modes
    return merged


def merge_reference_run(new: dict, old: dict) -> dict:
    """``runs[notebook][mode]`` of both, the new ones winning; the new environment."""
    runs = {notebook: dict(modes) for notebook, modes in old.get("runs", {}).items()}
    for notebook, modes in new.get("runs", {}).items():
        runs.setdefault(notebook, {}).update(modes)
    return {**old, **new, "runs": runs}


MERGERS = {"results.json": (merge_results, list), "runtimes.json": (merge_runtimes, dict),
           "reference_run.json": (merge_reference_run, dict)}


def file_pack(pack: Path, results: Path) -> list[str]:
    """Copy ``pack`` into ``results``, merging the three records; returns the names of the files written."""
    if not pack.is_dir():
        raise FileNotFoundError(f"{pack} is not a filed folder (expected PACK/filed/<slug>)")
    results.mkdir(parents=True, exist_ok=True)
    written = []
    for source in sorted(p for p in pack.rglob("*") if p.is_file()):
        target = results / source.relative_to(pack)
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.name in MERGERS and source.parent == pack:
            merge, empty = MERGERS[source.name]
            merged = merge(json.loads(source.read_text()), _load(target, empty()))
            target.write_text(json.dumps(merged, indent=2, sort_keys=source.name != "results.json") + "\n")
        else:
            shutil.copy2(source, target)
        written.append(str(target.relative_to(results)))
    return written


def main(argv: list[str] | None = None) -> int:
    """``PACK_FOLDER RESULTS_FOLDER``: file the pack, printing how many files were written."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: gpu_reference_merge.py PACK/filed/<slug> results/<slug>", file=sys.stderr)
        return 2
    try:
        written = file_pack(Path(args[0]), Path(args[1]))
    except (FileNotFoundError, json.JSONDecodeError, KeyError) as error:
        print(f"gpu_reference_merge: {error}", file=sys.stderr)
        return 1
    print(f"merged {len(written)} files into {args[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
