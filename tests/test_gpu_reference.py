"""tools/gpu_reference.sh on a CPU: what its dry run runs, files and packs, within what a device call returns.

The notebooks' execution is stubbed (``GPU_REFERENCE_RUNNER``) so that this takes seconds: a small script writes
what ``tools/run_notebooks.py`` leaves for a notebook in full mode (the executed copy, the recorded figures, a
saved figure, its line in ``runtimes.json`` as ``record_runtimes`` writes it, without importing torch) and then
passes, fails, hangs past its time limit with a "kernel" in a session of its own, or crashes, as its number says. The real
runner on a real notebook is ``tools/gpu_reference.sh --dry-run 00`` (check mode, about as long as the notebook).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests.processes import alive

# the script is written for the Linux GPU machines (GNU coreutils' timeout, stat and split; /proc)
pytestmark = pytest.mark.skipif(sys.platform != "linux" or shutil.which("timeout") is None,
                                reason="tools/gpu_reference.sh needs Linux with GNU coreutils")
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_reference.sh"
STUB = r'''
import json, os, subprocess, sys, time
from pathlib import Path

stem, build = sys.argv[1], Path(os.environ["PYTORCH_INTRO_BUILD_DIR"])
behaviour = {"00": "ok", "01": "fail", "02": "hang", "03": "crash"}[stem[:2]]
executed = build / "executed" / f"{stem}.ipynb"
executed.parent.mkdir(parents=True, exist_ok=True)
error = {"output_type": "error", "ename": "AssertionError", "evalue": "measured 3 != predicted 2", "traceback": []}
cells = [{"cell_type": "code", "execution_count": 1, "metadata": {}, "source": "x = 1",
          "outputs": [error] if behaviour == "fail" else []},
         {"cell_type": "code", "execution_count": None, "metadata": {}, "source": "y = 2", "outputs": []}]
payload = os.urandom(int(os.environ.get("STUB_EXECUTED_BYTES", "0"))).hex()
executed.write_text(json.dumps({"cells": cells, "metadata": {"payload": payload}, "nbformat": 4, "nbformat_minor": 5}))
if behaviour == "hang":
    runtime = os.environ["JUPYTER_RUNTIME_DIR"]
    kernel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", f"{runtime}/kernel-1.json"],
                              start_new_session=True)
    Path(os.environ["KERNEL_PID_FILE"]).write_text(str(kernel.pid))
    time.sleep(120)
if behaviour == "crash":
    sys.exit(7)
if behaviour == "ok":
    (build / "results").mkdir(parents=True, exist_ok=True)
    (build / "results" / f"{stem}.json").write_text(json.dumps(
        {"notebook": stem, "check_mode": False, "device": "stub", "figures": [{"name": "x", "value": 1.0, "unit": "B"}]}))
    (build / "figures").mkdir(parents=True, exist_ok=True)
    (build / "figures" / f"{stem[:2]}_stub.png").write_bytes(b"\x89PNG stub")
# what tools/run_notebooks.py's record_runtimes writes, for the device the script described (no torch import here)
device = json.loads(next(p / "environment.json" for p in build.parents if (p / "environment.json").exists()).read_text())
runtimes = json.loads((build / "runtimes.json").read_text()) if (build / "runtimes.json").exists() else {"modes": {}}
mode = "check" if os.environ.get("PYTORCH_INTRO_CHECK_MODE") == "1" else "full"
runtimes["modes"].setdefault(mode, {})[stem] = {"seconds": 0.5, "ok": behaviour == "ok", "cpu_seconds": None,
                                                  "load_average": None, "device": device["name"],
                                                  "device_slug": device["slug"], "finished": "2026-01-01T00:00:00+00:00"}
runtimes["device"] = device
(build / "runtimes.json").write_text(json.dumps(runtimes))
sys.exit(0 if behaviour == "ok" else 1)
'''
FILE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
# what the script's own description writes, for the runs that need no real one: describing the machine imports torch
# (about 2.5 s of CPU); the module's dry run below still describes it for real
STUB_ENVIRONMENT = {"name": "stub CPU, 1 threads", "slug": "stub-cpu-1-threads", "kind": "cpu", "torch": "stub",
                    "gpu": None, "dry_run": True, "torch_cuda": None, "cudnn": None, "nvidia_smi": None}


def _run(tmp_path: Path, *args: str, **variables: str) -> subprocess.CompletedProcess:
    stub = tmp_path / "stub_runner.py"
    stub.write_text(STUB)
    env = {**os.environ, "REPO_ROOT": str(ROOT), "PYTHON": sys.executable,
           "GPU_REFERENCE_RUNNER": f"{sys.executable} {stub}", "GPU_REFERENCE_BUILD": str(tmp_path / "build"),
           "GPU_REFERENCE_RESULTS": str(tmp_path / "results"), "GPU_REFERENCE_RUNS": str(tmp_path / "runs"),
           "OUT": str(tmp_path / "out"), "KERNEL_PID_FILE": str(tmp_path / "kernel.pid"),
           "GPU_REFERENCE_PYTEST_ARGS": "--version", "GPU_REFERENCE_CALCULATOR_ARGS": "--help", **variables}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)


def described(tmp_path: Path) -> dict[str, str]:
    """The variable that hands the script :data:`STUB_ENVIRONMENT` instead of its torch-importing description."""
    path = tmp_path / "stub_environment.json"
    path.write_text(json.dumps(STUB_ENVIRONMENT))
    return {"GPU_REFERENCE_ENVIRONMENT": str(path)}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of four stubbed notebooks: one passes, one fails, one hangs past its limit, one crashes.

    This run alone describes the machine for real and runs the calculator (``--help``): each imports torch."""
    tmp_path = tmp_path_factory.mktemp("gpu_reference")
    (tmp_path / "results" / "some-other-device").mkdir(parents=True)
    done = _run(tmp_path, "--dry-run", "unit-tests", "00:full", "01:full", "02:full", "03:full", "00",
                GPU_REFERENCE_NOTEBOOK_TIMEOUT_S="3", GPU_REFERENCE_BUDGET_S="1000",
                GPU_REFERENCE_PART_MIB="1", STUB_EXECUTED_BYTES=str(700_000))
    return tmp_path, done


def test_dry_run_reports_each_notebook_and_exits_for_the_crash_only(dry_run):
    tmp_path, done = dry_run
    assert done.returncode == 4, done.stdout + done.stderr      # the runner crashed on 03: infrastructure
    status = json.loads((tmp_path / "build" / "status.json").read_text())
    got = [(row["notebook"][:2], row["mode"], row["status"]) for row in status["notebooks"]]
    assert got == [("00", "full", "ok"), ("01", "full", "FAILED"), ("02", "full", "TIMEOUT"),
                   ("03", "full", "CRASHED"), ("00", "check", "ok")], "the arguments' order and modes, honoured"
    details = {row["notebook"][:2]: row["detail"] for row in status["notebooks"] if row["mode"] == "full"}
    assert details["01"] == "cell 0: AssertionError: measured 3 != predicted 2"
    assert details["02"] == "last cell run: 0" and details["03"] == "last cell run: 0"
    assert status["unit_tests"]["status"] == "passed" and status["mode"] == "check (dry run)"
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert summary in done.stdout and len(summary.splitlines()) <= 30
    assert "FAILED" in summary and "TIMEOUT" in summary and "measured 3 != predicted 2" in summary


def test_a_notebook_past_its_limit_leaves_no_kernel_behind(dry_run):
    tmp_path, _ = dry_run
    pid = int((tmp_path / "kernel.pid").read_text())
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the hung notebook's kernel survived its time limit"


def test_the_pack_fits_a_device_call_and_holds_the_filed_run(dry_run):
    tmp_path, _ = dry_run
    out = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert 2 <= len(out) <= 8 and all(FILE_NAME.match(name) for name in out), out
    assert all((tmp_path / "out" / name).stat().st_size <= 16 * 2**20 for name in out)
    assert any(name.startswith("executed.tar.gz.part-") for name in out), "700 kB of hex in 1 MiB parts: split"
    slug = json.loads((tmp_path / "build" / "environment.json").read_text())["slug"]
    with tarfile.open(tmp_path / "out" / "reference.tar.gz") as pack:
        members = set(pack.getnames())
    assert {"summary.txt", "status.json", "environment.json", f"filed/{slug}/results.json",
            f"filed/{slug}/figures/00_stub.png", f"filed/{slug}/reference_run.json", f"logs/{_stem('01')}-full.log",
            "calculator_validation.txt"} <= members
    assert not any("some-other-device" in name for name in members), "only this device's folder is packed"
    filed = json.loads((tmp_path / "build" / "filed" / slug / "results.json").read_text())
    assert [entry["notebook"][:2] for entry in filed] == ["00"], "only the notebook that passed is filed"


def test_what_comes_back_drops_check_modes_copies_first_to_fit_the_call(tmp_path):
    """A device call returns 8 files and 64 MiB in all: here 3 MiB, with 1 MiB of executed notebooks per run."""
    done = _run(tmp_path, "--dry-run", "--no-tests", "00:full", "00:check", GPU_REFERENCE_BUDGET_S="1000",
                GPU_REFERENCE_RETURN_MIB="3", GPU_REFERENCE_PART_MIB="1", STUB_EXECUTED_BYTES=str(1_000_000),
                **described(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    assert sum(p.stat().st_size for p in out.iterdir()) <= 3 * 2**20 and len(list(out.iterdir())) <= 8
    assert "left out of the pack: run/check/executed" in (out / "summary.txt").read_text()
    parts = sorted(out.glob("executed.tar.gz*"))
    with tarfile.open(fileobj=__import__("io").BytesIO(b"".join(p.read_bytes() for p in parts))) as pack:
        names = pack.getnames()
    assert any(name.startswith("run/executed/") for name in names), "full mode's copies stay"
    assert not any(name.startswith("run/check/") for name in names)


def test_unpack_files_the_run_under_results(dry_run):
    tmp_path, _ = dry_run
    done = _run(tmp_path, "--unpack", str(tmp_path / "out"))
    assert done.returncode == 0, done.stdout + done.stderr
    slug = json.loads((tmp_path / "build" / "environment.json").read_text())["slug"]
    assert (tmp_path / "results" / slug / "figures" / "00_stub.png").exists()
    assert (tmp_path / "results" / slug / "reference_run.json").exists()
    assert (tmp_path / "runs" / slug / "run" / "executed" / f"{_stem('00')}.ipynb").exists()   # parts rejoined
    assert (tmp_path / "results" / "some-other-device").is_dir()


def test_out_of_time_notebooks_are_listed_not_run(tmp_path):
    done = _run(tmp_path, "--dry-run", "--no-tests", "00", "01", GPU_REFERENCE_BUDGET_S="10", **described(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    status = json.loads((tmp_path / "build" / "status.json").read_text())
    assert [row["status"] for row in status["notebooks"]] == ["not run", "not run"]
    assert status["unit_tests"] is None and "nothing" in status["filed"]["note"]


def test_bad_arguments_are_infrastructure_failures_and_foreign_files_stay(tmp_path):
    assert _run(tmp_path, "--dry-run", "99").returncode == 2
    assert _run(tmp_path, "--frobnicate").returncode == 2
    assert _run(tmp_path, "--unpack", str(tmp_path)).returncode == 2
    (tmp_path / "build").mkdir(exist_ok=True)
    (tmp_path / "build" / "mine.txt").write_text("a reader's file")
    refused = _run(tmp_path, "--dry-run", "00")
    assert refused.returncode == 2 and (tmp_path / "build" / "mine.txt").exists()


def _stem(number: str) -> str:
    return next(p.stem for p in (ROOT / "notebooks").glob(f"{number}_*.ipynb"))
