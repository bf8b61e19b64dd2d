"""The instructor's round trip with nbgrader itself: generate the release, autograde two submissions, export grades.

Every notebook's check-mode run (tests/test_notebooks.py) already grades its own execution by nbgrader's rule
(a graded cell with an error or stderr output earns nothing) and requires full marks for the solutions. This file
runs the whole pipeline an instructor runs (``nbgrader generate_assignment``, ``autograde``, ``export``) on one
notebook, the cheapest to execute, in check mode: the instructor's solutions, handed in as a submission, earn full
marks; the untouched release copy earns zero.

The three steps run through ``nbgrader.apps.NbGraderAPI`` (the API behind nbgrader's formgrader, which runs the
same converter applications as the ``nbgrader`` command) in this process: three ``nbgrader`` commands would each
start a Python and import nbgrader's stack again (about 3 s of CPU each on 2 cores), for nothing the test checks.
For the same reason the gradebook's schema version, which nbgrader reads by running the ``alembic heads`` program
(a Python that imports nbgrader again: about 3 s of CPU), is read in this process from the same migration scripts
with alembic's own ``ScriptDirectory``. The notebooks still execute in kernels of their own, started by nbgrader's
own ``Execute`` preprocessor in the course folder's submission; on a CPU machine those kernels are forked from the
test process's kernel server, as the check-mode runs' are (tools/kernel_zygote.py: about 3 CPU-s of imports saved
per kernel), and ``PYTORCH_INTRO_FRESH_KERNELS=1`` starts fresh ones.
"""
from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from tools.kernel_zygote import use_zygote
from tools.nbtools import CHECK_KERNELS, nbgrader_api, nbgrader_succeeded

ROOT = Path(__file__).resolve().parent.parent
# one cheap notebook with two exercises; the mechanism is the same for all of them
ROUND_TRIP_NOTEBOOK = "02_gradient_accumulation"


@pytest.mark.notebook
# nbgrader's own gradebook code, on every autograde (the command prints it to its stderr, which nobody reads)
@pytest.mark.filterwarnings("ignore:Object of type <Submitted[A-Za-z]*> not in session:Warning")
def test_nbgrader_round_trip_gives_solutions_full_marks_and_the_release_zero(tmp_path, monkeypatch):
    from alembic.script import ScriptDirectory
    from nbgrader.api import Gradebook
    from nbgrader.dbutil import ALEMBIC_DIR
    from nbgrader.plugins import CsvExportPlugin

    # the kernels nbgrader starts inherit these: check mode, one thread, no GPU
    for name, value in {"PYTORCH_INTRO_CHECK_MODE": "1", "PYTORCH_INTRO_BUILD_DIR": str(tmp_path / "build"),
                        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}.items():
        monkeypatch.setenv(name, value)
    # what `alembic heads` prints first, which a new gradebook records (nbgrader.api.get_alembic_version): no program
    monkeypatch.setattr("nbgrader.api.get_alembic_version", ScriptDirectory(ALEMBIC_DIR).get_current_head)
    if use_zygote():
        # nbgrader's Execute passes its kernel manager class to nbclient as an argument (so config cannot set it),
        # naming jupyter_client's AsyncKernelManager: the forked kernels' manager takes its place
        monkeypatch.setattr("nbgrader.preprocessors.execute.AsyncKernelManager",
                            CHECK_KERNELS.kernel_manager_class())
    notebook = ROOT / "notebooks" / f"{ROUND_TRIP_NOTEBOOK}.ipynb"
    course = tmp_path / "course_root"
    (course / "source" / "ps").mkdir(parents=True)
    shutil.copy(notebook, course / "source" / "ps" / notebook.name)
    api = nbgrader_api(course)
    nbgrader_succeeded("generate_assignment", api.generate_assignment("ps", force=True, create=True))
    released = course / "release" / "ps" / notebook.name
    assert "BEGIN SOLUTION" not in released.read_text()

    for student, handed_in in (("instructor", notebook), ("untouched", released)):
        folder = course / "submitted" / student / "ps"
        folder.mkdir(parents=True)
        shutil.copy(handed_in, folder / notebook.name)
        nbgrader_succeeded(f"autograde ({student})", api.autograde("ps", student, force=True, create=True))
    grades = tmp_path / "grades.csv"
    with Gradebook(api.coursedir.db_url, api.course_id) as gradebook:     # what `nbgrader export --to` runs
        CsvExportPlugin(to=str(grades)).export(gradebook)

    with open(grades) as handle:
        rows = {row["student_id"]: row for row in csv.DictReader(handle)}
    instructor, untouched = rows["instructor"], rows["untouched"]
    max_score = float(instructor["max_score"])
    assert max_score > 0
    assert float(instructor["score"]) == max_score, f"the solutions earned {instructor['score']} of {max_score}"
    assert float(untouched["score"]) == 0, f"the untouched release earned {untouched['score']} of {max_score}"
