"""The instructor's round trip with nbgrader itself: generate the release, autograde two submissions, export grades.

Every notebook's check-mode run (tests/test_notebooks.py) already grades its own execution by nbgrader's rule
(a graded cell with an error or stderr output earns nothing) and requires full marks for the solutions. This file
runs the whole pipeline an instructor runs (``nbgrader generate_assignment``, ``autograde``, ``export``) on one
notebook, the cheapest to execute, in check mode: the instructor's solutions, handed in as a submission, earn full
marks; the untouched release copy earns zero.
"""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# one cheap notebook with two exercises; the mechanism is the same for all of them
ROUND_TRIP_NOTEBOOK = "02_gradient_accumulation"


def _nbgrader(course_root: Path, *args: str, build: Path) -> subprocess.CompletedProcess:
    env = {**os.environ,
           # nbgrader creates its gradebook by running the `alembic` program of the same environment
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           "PYTORCH_INTRO_CHECK_MODE": "1", "PYTORCH_INTRO_BUILD_DIR": str(build),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "nbgrader", *args, f"--CourseDirectory.root={course_root}",
         "--CourseDirectory.db_url=sqlite:///" + str(course_root / "gradebook.db")],
        cwd=course_root, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.notebook
def test_nbgrader_round_trip_gives_solutions_full_marks_and_the_release_zero(tmp_path):
    notebook = ROOT / "notebooks" / f"{ROUND_TRIP_NOTEBOOK}.ipynb"
    course = tmp_path / "course_root"
    (course / "source" / "ps").mkdir(parents=True)
    shutil.copy(notebook, course / "source" / "ps" / notebook.name)
    _nbgrader(course, "generate_assignment", "ps", "--force", build=tmp_path / "build")
    released = course / "release" / "ps" / notebook.name
    assert "BEGIN SOLUTION" not in released.read_text()

    for student, handed_in in (("instructor", notebook), ("untouched", released)):
        folder = course / "submitted" / student / "ps"
        folder.mkdir(parents=True)
        shutil.copy(handed_in, folder / notebook.name)
    _nbgrader(course, "autograde", "ps", "--force", "--Autograde.create_student=True", build=tmp_path / "build")
    _nbgrader(course, "export", "--to", str(tmp_path / "grades.csv"), build=tmp_path / "build")

    with open(tmp_path / "grades.csv") as handle:
        rows = {row["student_id"]: row for row in csv.DictReader(handle)}
    instructor, untouched = rows["instructor"], rows["untouched"]
    max_score = float(instructor["max_score"])
    assert max_score > 0
    assert float(instructor["score"]) == max_score, f"the solutions earned {instructor['score']} of {max_score}"
    assert float(untouched["score"]) == 0, f"the untouched release earned {untouched['score']} of {max_score}"
