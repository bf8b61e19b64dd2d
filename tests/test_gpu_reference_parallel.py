"""tools/gpu_reference.sh runs check-mode notebooks several at a time, each into its own build folder, and brings
their executed copies and wall times together (the stub runner of test_gpu_reference.py stands in for the
notebooks: 00 passes, 01 fails, 03 crashes)."""
from __future__ import annotations

import json
import tarfile

from tests.test_gpu_reference import _run, described, pytestmark  # noqa: F401  (the same Linux-only mark)


def test_check_mode_runs_several_at_a_time_and_gathers_their_copies(tmp_path):
    # the machine's description and the calculator's run (torch imports both) are test_gpu_reference.py's dry run's
    done = _run(tmp_path, "--dry-run", "00:check", "01:check", "03:check", GPU_REFERENCE_CHECK_JOBS="3",
                GPU_REFERENCE_CALCULATOR_ARGS="", **described(tmp_path))
    assert done.returncode == 4, done.stdout + done.stderr          # 03 crashed: the runner's own failure
    status = json.loads((tmp_path / "build" / "status.json").read_text())
    by_notebook = {row["notebook"][:2]: row["status"] for row in status["notebooks"]}
    assert by_notebook == {"00": "ok", "01": "FAILED", "03": "CRASHED"}
    failed = next(row for row in status["notebooks"] if row["notebook"].startswith("01"))
    assert "measured 3 != predicted 2" in failed["detail"], "the error is read from the gathered executed copy"
    with tarfile.open(tmp_path / "out" / "executed.tar.gz") as pack:
        names = pack.getnames()
    assert sum(name.startswith("run/check/executed/") and name.endswith(".ipynb") for name in names) == 3
    with tarfile.open(tmp_path / "out" / "reference.tar.gz") as pack:
        runtimes = [n for n in pack.getnames() if n.startswith("run/check/runtimes-")]
    assert len(runtimes) == 2, "00's and 01's wall times (the crashed runner wrote none)"


def test_a_check_jobs_value_that_is_not_a_positive_whole_number_is_refused(tmp_path):
    done = _run(tmp_path, "--dry-run", "00:check", GPU_REFERENCE_CHECK_JOBS="0")
    assert done.returncode == 2 and "GPU_REFERENCE_CHECK_JOBS" in done.stderr
