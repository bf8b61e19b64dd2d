"""Shared by `make run`, `make student` and the tests: find, execute and convert the notebooks."""

from __future__ import annotations

import contextlib
import copy
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
NBVAL_MARKER = "# NBVAL_CHECK_OUTPUT"


def list_notebooks() -> list[Path]:
    """The course notebooks in order (``NN_topic.ipynb``)."""
    return sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


@contextlib.contextmanager
def notebook_environment(*, check_mode: bool, build: Path | None = None,
                         torch_threads: int | None = None) -> Iterator[None]:
    """Set the variables a notebook kernel inherits, and restore them afterwards.

    ``check_mode`` sets PYTORCH_INTRO_CHECK_MODE; ``build`` sets where the notebook writes figures and
    results (PYTORCH_INTRO_BUILD_DIR); ``torch_threads`` caps the kernel's intra-op threads (the tests
    run two kernels side by side on two cores, and two kernels of two threads each would fight).
    """
    updates = {"PYTORCH_INTRO_CHECK_MODE": "1" if check_mode else "0"}
    if build is not None:
        updates["PYTORCH_INTRO_BUILD_DIR"] = str(build)
    if torch_threads is not None:
        if isinstance(torch_threads, bool) or not isinstance(torch_threads, int) or torch_threads < 1:
            raise ValueError(f"torch_threads must be a positive int or None, got {torch_threads!r}")
        updates.update(OMP_NUM_THREADS=str(torch_threads), MKL_NUM_THREADS=str(torch_threads))
    backup = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in backup.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def execute(notebook: Path, output: Path, *, check_mode: bool, build: Path | None = None,
            timeout_s: int = 600, parameters: dict | None = None) -> nbformat.NotebookNode:
    """Run a notebook with papermill in the notebooks folder and save the executed copy.

    ``check_mode`` sets PYTORCH_INTRO_CHECK_MODE for the kernel; ``build`` sets where the notebook
    writes figures and results (PYTORCH_INTRO_BUILD_DIR). The kernel inherits this environment.
    """
    import papermill

    output.parent.mkdir(parents=True, exist_ok=True)
    with notebook_environment(check_mode=check_mode, build=build):
        return papermill.execute_notebook(
            str(notebook), str(output), parameters=parameters or {}, cwd=str(notebook.parent),
            kernel_name="python3", execution_timeout=timeout_s, progress_bar=False, log_output=False,
        )


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


def first_exercise_index(notebook: nbformat.NotebookNode) -> int:
    """Index of the first nbgrader solution cell (the first exercise)."""
    for index, cell in enumerate(notebook.cells):
        if cell.metadata.get("nbgrader", {}).get("solution"):
            return index
    raise ValueError("the notebook has no nbgrader solution cell (no exercise)")


def stream_text(cell: nbformat.NotebookNode) -> str:
    """Everything a code cell printed to stdout, joined the way nbval compares it."""
    from nbval.plugin import coalesce_streams

    outputs = coalesce_streams(copy.deepcopy(cell.get("outputs", [])))
    return "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stdout")


@dataclass
class CheckRun:
    """What ``run_check_mode`` saw: the executed source notebook and the student probe's outcome.

    Attributes:
        notebook: the executed source notebook (outputs filled in).
        seconds: wall time of the whole run, kernel start included.
        student_error: the exception name the student's first exercise raised (``NotImplementedError``
            when the student version behaves), or None when it raised nothing.
        student_failed_cell: ``grade_id`` of the student cell that raised.
        marked_outputs: stdout of each ``# NBVAL_CHECK_OUTPUT`` cell, by cell id.
    """

    notebook: nbformat.NotebookNode
    seconds: float
    student_error: str | None = None
    student_failed_cell: str | None = None
    marked_outputs: dict[str, str] = field(default_factory=dict)


def run_check_mode(notebook_path: Path, output: Path, *, build: Path, timeout_s: int = 300,
                   torch_threads: int = 1) -> CheckRun:
    """Execute a notebook once in check mode, probing its student version on the way.

    The student version (nbgrader's, solutions replaced by ``raise NotImplementedError()``) is identical
    to the source up to its first exercise (the caller asserts it), so running it separately would
    repeat the whole lesson. Instead, when the run reaches the first exercise, the student's exercise
    cell and, if that only defines a stub, the test cell after it are executed in the same kernel, in
    exactly the state a student would have there, and must raise. The source's own cells then run
    from that exercise on, so every assertion of the notebook still runs.

    Raises:
        nbclient.exceptions.CellExecutionError: a source cell failed (the message names the cell).
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    source = nbformat.read(notebook_path, as_version=4)
    student = student_version(source)
    first = first_exercise_index(source)
    client = NotebookClient(source, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": str(notebook_path.parent)}})
    run = CheckRun(notebook=source, seconds=0.0)
    started = time.perf_counter()
    with notebook_environment(check_mode=True, build=build, torch_threads=torch_threads):
        with client.setup_kernel():
            for index, cell in enumerate(source.cells):
                if index == first:
                    run.student_error, run.student_failed_cell = _probe_student(client, student, first,
                                                                                CellExecutionError)
                if cell.cell_type == "code":
                    try:
                        client.execute_cell(cell, index)
                    finally:
                        output.parent.mkdir(parents=True, exist_ok=True)
                        nbformat.write(source, output)
    run.seconds = time.perf_counter() - started
    run.marked_outputs = {c.id: stream_text(c) for c in source.cells
                          if c.cell_type == "code" and NBVAL_MARKER in c.source}
    return run


def _probe_student(client, student: nbformat.NotebookNode, first: int,
                   error_type: type[Exception]) -> tuple[str | None, str | None]:
    """Run the student's first exercise cell (and its test cell when needed); return what raised."""
    for index in (first, first + 1):
        cell = copy.deepcopy(student.cells[index])
        try:
            client.execute_cell(cell, index, store_history=False)
        except error_type as error:
            return error.ename, cell.metadata.get("nbgrader", {}).get("grade_id")
    return None, None
