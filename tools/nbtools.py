"""Shared by `make run`, `make student` and the tests: find, execute and convert the notebooks."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def list_notebooks() -> list[Path]:
    """The course notebooks in order (``NN_topic.ipynb``)."""
    return sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def execute(notebook: Path, output: Path, *, check_mode: bool, build: Path | None = None,
            timeout_s: int = 600, parameters: dict | None = None) -> nbformat.NotebookNode:
    """Run a notebook with papermill in the notebooks folder and save the executed copy.

    ``check_mode`` sets PYTORCH_INTRO_CHECK_MODE for the kernel; ``build`` sets where the notebook
    writes figures and results (PYTORCH_INTRO_BUILD_DIR). The kernel inherits this environment.
    """
    import papermill

    env_backup = {key: os.environ.get(key) for key in ("PYTORCH_INTRO_CHECK_MODE", "PYTORCH_INTRO_BUILD_DIR")}
    os.environ["PYTORCH_INTRO_CHECK_MODE"] = "1" if check_mode else "0"
    if build is not None:
        os.environ["PYTORCH_INTRO_BUILD_DIR"] = str(build)
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        return papermill.execute_notebook(
            str(notebook), str(output), parameters=parameters or {}, cwd=str(notebook.parent),
            kernel_name="python3", execution_timeout=timeout_s, progress_bar=False, log_output=False,
        )
    finally:
        for key, value in env_backup.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


STUDENT_PREPROCESSORS = (
    # nbgrader's GenerateAssignment pipeline, less the parts that need a course database or headers.
    "LockCells", "ClearSolutions", "ClearOutput", "CheckCellMetadata", "ComputeChecksums",
    "ClearHiddenTests", "ClearMarkScheme", "ComputeChecksums", "CheckCellMetadata",
)


def student_version(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The student version of a source notebook, made by nbgrader's own preprocessors."""
    from nbgrader import preprocessors

    student = copy.deepcopy(notebook)
    resources: dict = {}
    for name in STUDENT_PREPROCESSORS:
        student, resources = getattr(preprocessors, name)().preprocess(student, resources)
    return student
