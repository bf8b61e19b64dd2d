"""`make results`: file what a full `make run` measured under results/<device-slug>/, for the README.

Usage: python tools/save_results.py [--build DIR] [--check-build DIR] [--results DIR]

Reads build/results/*.json (the figures each notebook recorded), build/figures/*.png and
build/runtimes.json (wall times, the device) from a full-mode `make run`, and the check-mode wall
times from a check-mode run (--check-build, default build/check/, which `make results` fills by
running every notebook in check mode). Writes, in results/<device-slug>/:

- results.json      the recorded figures of every notebook that passed, as build/results.json has them
- figures/*.png     the figures those notebooks saved
- runtimes.json     seconds per notebook in full and check mode, with the machine's load average
- environment.json  the device, torch's version, the CPU model and threads, Python, the date

Notebooks that failed or were not run keep what an earlier run filed for them, so a run of one
notebook refreshes only that notebook. Files in the folder that this script does not make are left
alone. The slug is computed from the device (tools/devices.py), never typed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.devices import SLUG_PATTERN  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS_ROOT = ROOT / "results"


class ResultsError(ValueError):
    """The build folder does not hold what a full run leaves (said in words a reader can act on)."""


def _read_json(path: Path, what: str) -> object:
    if not path.exists():
        raise ResultsError(f"{path} does not exist: {what}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path} is not valid JSON ({exc})") from exc


def read_run(build: Path) -> tuple[dict, dict[str, dict]]:
    """The device and the passed notebooks' recorded results of a full-mode run in ``build``.

    Returns:
        (runtimes.json's contents, {notebook stem: its results file}) for the notebooks whose
        latest full run passed and recorded figures in full mode.

    Raises:
        ResultsError: no full-mode run there, or its files are missing or unreadable.
    """
    if not build.is_dir():
        raise ResultsError(f"{build} does not exist: run the notebooks first (make run)")
    runtimes = _read_json(build / "runtimes.json", "run the notebooks first (make run)")
    full = runtimes.get("modes", {}).get("full", {})
    if not full:
        raise ResultsError(f"{build / 'runtimes.json'} has no full-mode run: results/ holds full-mode "
                           "measurements only (make run, without PYTORCH_INTRO_CHECK_MODE=1)")
    passed: dict[str, dict] = {}
    for stem, entry in sorted(full.items()):
        path = build / "results" / f"{stem}.json"
        if not entry.get("ok") or not path.exists():
            continue
        recorded = _read_json(path, f"{stem} recorded no figures")
        if recorded.get("check_mode"):
            print(f"skipping {stem}: its results file is from a check-mode run", file=sys.stderr)
            continue
        passed[stem] = recorded
    if not passed:
        raise ResultsError(f"no notebook passed a full run in {build}: nothing to file (make run, then look "
                           "at its closing summary)")
    return runtimes, passed


def _check_seconds(check_build: Path | None) -> dict[str, dict]:
    if check_build is None or not (check_build / "runtimes.json").exists():
        return {}
    runtimes = _read_json(check_build / "runtimes.json", "")
    return {stem: entry for stem, entry in runtimes.get("modes", {}).get("check", {}).items() if entry.get("ok")}


def save(build: Path, results_root: Path = RESULTS_ROOT, check_build: Path | None = None) -> Path:
    """File a full run from ``build`` under ``results_root/<device-slug>/`` (see the module's docstring).

    Args:
        build: the build folder of a full-mode `make run`.
        results_root: the folder of device folders (default: the repository's results/).
        check_build: a build folder whose runtimes.json holds check-mode times (optional).

    Returns:
        The device folder written.

    Raises:
        ResultsError: no usable full run in ``build``, or a device slug that is not a plain folder name.
    """
    runtimes, passed = read_run(build)
    device = runtimes["device"]
    slug = device.get("slug", "")
    if not SLUG_PATTERN.match(slug):
        raise ResultsError(f"device slug {slug!r} from {build / 'runtimes.json'} is not a plain folder name")
    folder = results_root / slug
    (folder / "figures").mkdir(parents=True, exist_ok=True)

    results_path = folder / "results.json"
    filed = {r["notebook"]: r for r in (json.loads(results_path.read_text()) if results_path.exists() else [])}
    for stem, result in passed.items():      # the code that measured each figure: the README marks it once it changes
        code = runtimes["modes"]["full"][stem].get("code_hash")
        filed[stem] = {**result, **({"code_hash": code} if code else {})}
    results_path.write_text(json.dumps([filed[k] for k in sorted(filed)], indent=2) + "\n")

    for stem in passed:
        for old in (folder / "figures").glob(f"{stem[:2]}_*.png"):
            old.unlink()
        for figure in sorted((build / "figures").glob(f"{stem[:2]}_*.png")):
            shutil.copyfile(figure, folder / "figures" / figure.name)

    times_path = folder / "runtimes.json"
    times = json.loads(times_path.read_text()) if times_path.exists() else {}
    full = runtimes["modes"]["full"]
    for stem in passed:
        times.setdefault(stem, {})["full"] = _timing(full[stem])
    for stem, entry in _check_seconds(check_build).items():
        if entry.get("device_slug") == slug and stem in filed:
            times.setdefault(stem, {})["check"] = _timing(entry)
    times_path.write_text(json.dumps(dict(sorted(times.items())), indent=2) + "\n")

    environment = {**device, "python": platform.python_version(), "platform": platform.platform(),
                   "filed": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    (folder / "environment.json").write_text(json.dumps(environment, indent=2) + "\n")
    return folder


def _timing(entry: dict) -> dict:
    return {key: entry.get(key) for key in ("seconds", "cpu_seconds", "load_average", "finished")}


def main(argv: list[str] | None = None) -> int:
    import utils

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", type=Path, default=None, help="the full run's build folder (default build/)")
    parser.add_argument("--check-build", type=Path, default=None,
                        help="a check-mode run's build folder, for the check-mode times (default build/check/)")
    parser.add_argument("--results", type=Path, default=RESULTS_ROOT, help="the folder of device folders")
    args = parser.parse_args(argv)
    build = args.build or utils.build_dir()
    check_build = args.check_build or build / "check"
    try:
        folder = save(build, args.results, check_build)
    except ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"filed under {folder}:")
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            print(f"  {path.relative_to(folder)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
