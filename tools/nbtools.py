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

from tools.kernel_zygote import KernelZygote, use_zygote

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
NBVAL_MARKER = "# NBVAL_CHECK_OUTPUT"
WRONG_ANSWERS = ROOT / "tests" / "wrong_answers"
# errors that say a wrong answer is broken code rather than a wrong idea: a graded cell failing with one of these
# proves nothing about the check
TRIVIAL_ERRORS = ("NameError", "SyntaxError", "IndentationError", "ImportError", "ModuleNotFoundError")


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


def nbgrader_api(course_root: Path):
    """nbgrader's ``NbGraderAPI`` on a course folder, its gradebook inside it (``--CourseDirectory.root``, ``.db_url``).

    It runs the applications of the ``nbgrader`` command (``generate_assignment``, ``autograde``, ...) in this
    process; each method returns ``{"success": bool, "log": str, "error": str}``. Creating the gradebook runs the
    ``alembic`` program, which must be on PATH (the venv's bin folder).
    """
    from nbgrader.apps import NbGraderAPI
    from traitlets.config import Config

    config = Config()
    config.CourseDirectory.root = str(course_root)
    config.CourseDirectory.db_url = "sqlite:///" + str(Path(course_root) / "gradebook.db")
    return NbGraderAPI(config=config)


def nbgrader_succeeded(step: str, result: dict) -> None:
    """Fail with nbgrader's own log when an ``NbGraderAPI`` step did not succeed.

    Raises:
        AssertionError: ``result["success"]`` is false; the message holds the step's log and error.
    """
    assert result["success"], f"nbgrader {step} failed:\n{result.get('log', '')}\n{result.get('error', '')}"


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


def load_wrong_answers(stem: str, folder: Path = WRONG_ANSWERS) -> dict[str, dict[str, str]]:
    """The wrong solutions held for a notebook's exercises: ``{grade_id: {what is wrong: source}}``.

    They live in ``tests/wrong_answers/<stem>.py`` as a dict named ``WRONG``; each source replaces the
    exercise's solution cell (the cell whose nbgrader ``grade_id`` is the key), and the graded cell after it
    must then fail. A notebook without such a file has none (the tests require them).

    Raises:
        ValueError: the file defines no ``WRONG`` dict of dicts of strings.
    """
    import runpy

    path = folder / f"{stem}.py"
    if not path.exists():
        return {}
    wrong = runpy.run_path(str(path)).get("WRONG")
    if not isinstance(wrong, dict) or not all(isinstance(v, dict) and all(isinstance(s, str) for s in v.values())
                                               for v in wrong.values()):
        raise ValueError(f"{path} must define WRONG = {{grade_id: {{'what is wrong': 'source', ...}}, ...}}")
    return wrong


@dataclass
class WrongAnswerOutcome:
    """What one wrong solution did: ``rejected`` when the graded cell failed on it (with ``error``), else why not.

    Attributes:
        rejected: the graded cell raised, with an error that is not a ``TRIVIAL_ERRORS`` one.
        error: the exception name the graded cell raised, or None when it passed (the wrong answer was accepted).
        problem: set when the wrong answer could not be judged: its own cell raised, or the graded cell raised
            a trivial error; or, after it, the real solution's cell raised; or, after the exercise's last wrong
            answer, the real solution no longer passed its graded cell (then every outcome of the exercise says so).
    """

    rejected: bool
    error: str | None = None
    problem: str | None = None


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
        wrong_answers: ``{grade_id: {what is wrong: outcome}}`` for the wrong solutions that were tried.
        wrong_answer_seconds: time spent on them (included in ``seconds``).
        kernel_cpu_seconds: CPU seconds the kernel and the children it waited for used (None if unread): what the
            check-mode budgets hold, since wall time grows on a loaded machine and CPU time hardly does.
    """

    notebook: nbformat.NotebookNode
    seconds: float
    student_error: str | None = None
    student_failed_cell: str | None = None
    marked_outputs: dict[str, str] = field(default_factory=dict)
    wrong_answers: dict[str, dict[str, WrongAnswerOutcome]] = field(default_factory=dict)
    wrong_answer_seconds: float = 0.0
    kernel_cpu_seconds: float | None = None


# Run in the kernel after the last cell: CPU seconds of the kernel and of every child it waited for (DataLoader
# workers, launched ranks, subprocesses). Unlike wall time it does not grow when other jobs share the machine.
_CPU_PROBE = ("import os as _os\n_t = _os.times()\n"
              "print('kernel-cpu-seconds', _t.user + _t.system + _t.children_user + _t.children_system)")


def _kernel_cpu_seconds(client, notebook: nbformat.NotebookNode) -> float | None:
    """The kernel's CPU seconds so far (``os.times()``, children included), read by a cell run at the end."""
    index = len(notebook.cells) - 1
    last = notebook.cells[index]
    probe = nbformat.v4.new_code_cell(_CPU_PROBE)
    try:
        client.execute_cell(probe, index, store_history=False)
    finally:
        notebook.cells[index] = last                 # nbclient stores the executed copy at that index
    for line in stream_text(probe).splitlines():
        if line.startswith("kernel-cpu-seconds "):
            return float(line.split()[1])
    return None


# one kernel server per process that runs check-mode notebooks (a test worker), shared by every test there that
# starts a notebook kernel (tests/test_grading.py, tests/test_kernel_zygote.py)
CHECK_KERNELS = KernelZygote()


def forked_kernel_options() -> dict:
    """nbclient's (and papermill's) keyword for a kernel forked from :data:`CHECK_KERNELS`, where ``use_zygote()``
    allows one; ``{}`` (a fresh kernel) elsewhere."""
    return {"kernel_manager_class": CHECK_KERNELS.kernel_manager_class()} if use_zygote() else {}


def run_check_mode(notebook_path: Path, output: Path, *, build: Path, timeout_s: int = 300,
                   torch_threads: int = 1, wrong_answers: dict[str, dict[str, str]] | None = None) -> CheckRun:
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
    run = CheckRun(notebook=source, seconds=0.0)
    started = time.perf_counter()
    with notebook_environment(check_mode=True, build=build, torch_threads=torch_threads):
        # the kernel is forked from a server that has imported torch & co. once (tools/kernel_zygote.py; started
        # here on first use, so that it imports them in this environment), unless PYTORCH_INTRO_FRESH_KERNELS=1
        client = NotebookClient(source, timeout=timeout_s, kernel_name="python3",
                                resources={"metadata": {"path": str(notebook_path.parent)}}, **forked_kernel_options())
        with client.setup_kernel():
            try:
                for index, cell in enumerate(source.cells):
                    if index == first:
                        run.student_error, run.student_failed_cell = _probe_student(client, student, first,
                                                                                    CellExecutionError)
                    if cell.cell_type == "code":
                        client.execute_cell(cell, index)
                    graded_id = _graded_exercise(source, index)
                    if graded_id is not None and wrong_answers and graded_id in wrong_answers:
                        tried = time.perf_counter()
                        run.wrong_answers[graded_id] = _try_wrong_answers(client, source, index - 1,
                                                                          wrong_answers[graded_id])
                        run.wrong_answer_seconds += time.perf_counter() - tried
                run.kernel_cpu_seconds = _kernel_cpu_seconds(client, source)
            finally:      # once, also when a cell failed: the executed copy then ends with that cell's traceback
                output.parent.mkdir(parents=True, exist_ok=True)
                nbformat.write(source, output)
    run.seconds = time.perf_counter() - started
    run.marked_outputs = {c.id: stream_text(c) for c in source.cells
                          if c.cell_type == "code" and NBVAL_MARKER in c.source}
    return run


def _graded_exercise(notebook: nbformat.NotebookNode, index: int) -> str | None:
    """The solution cell's grade_id when cell ``index`` is the graded cell right after a solution cell."""
    if index == 0:
        return None
    solution = notebook.cells[index - 1].metadata.get("nbgrader", {})
    graded = notebook.cells[index].metadata.get("nbgrader", {})
    if solution.get("solution") and graded.get("grade") and not graded.get("solution"):
        return solution.get("grade_id")
    return None


def _run_in_place(client, notebook: nbformat.NotebookNode, index: int, cell: nbformat.NotebookNode,
                  source: str | None = None) -> str | None:
    """Run a copy of ``cell`` (with ``source`` if given) at ``index``; return its error as "Name: value", or None."""
    probe = copy.deepcopy(cell)
    if source is not None:
        probe.source = source
    # run it as a cell that may raise: the error comes back as an output, and the kernel does not abort the
    # requests that follow (with stop_on_error it would drop the restoring cells sent right after a failure)
    probe.metadata["tags"] = [*probe.metadata.get("tags", []), "raises-exception"]
    kept = notebook.cells[index]
    try:
        client.execute_cell(probe, index, store_history=False)
    finally:
        notebook.cells[index] = kept                  # nbclient stores the executed copy there
    errors = [o for o in probe.get("outputs", []) if o.get("output_type") == "error"]
    return f"{errors[0]['ename']}: {errors[0]['evalue']}" if errors else None


def _try_wrong_answer(client, notebook: nbformat.NotebookNode, solution_index: int,
                      wrong_source: str) -> WrongAnswerOutcome:
    """Run ``wrong_source`` in place of the solution, then the graded cell; then the real solution cell again.

    The graded cell is not run again here: ``_try_wrong_answers`` runs it once, on the real solution, after the
    last wrong answer (the graded cells of the capstone train models, and this halves their runs).
    """
    solution, graded = notebook.cells[solution_index], notebook.cells[solution_index + 1]
    outcome = WrongAnswerOutcome(rejected=False)
    setup_error = _run_in_place(client, notebook, solution_index, solution, wrong_source)
    if setup_error is not None:
        outcome.problem = f"the wrong answer's own cell raised {setup_error}"
    else:
        graded_error = _run_in_place(client, notebook, solution_index, graded)
        if graded_error is not None:
            outcome.error = graded_error.split(":", 1)[0]
            if outcome.error in TRIVIAL_ERRORS:
                outcome.problem = f"the graded cell failed on broken code, not on the idea: {graded_error}"
            else:
                outcome.rejected = True
    restored = _run_in_place(client, notebook, solution_index, solution)
    if restored is not None:
        outcome.problem = f"after it, the real solution's cell failed: {restored}"
        outcome.rejected = False
    return outcome


def _try_wrong_answers(client, notebook: nbformat.NotebookNode, solution_index: int,
                       wrong: dict[str, str]) -> dict[str, WrongAnswerOutcome]:
    """Try each wrong solution in turn (``_try_wrong_answer``), then run the graded cell on the real solution once.

    That last run is what the lesson goes on from. If it fails, a wrong answer left the kernel in a state in which
    the real solution no longer passes, and so in which a later wrong answer may have failed for that reason
    rather than for its idea: no outcome counts as rejected then, and each says so.
    """
    outcomes = {name: _try_wrong_answer(client, notebook, solution_index, source) for name, source in wrong.items()}
    restored = _run_in_place(client, notebook, solution_index, notebook.cells[solution_index + 1])
    if restored is not None:
        for outcome in outcomes.values():
            outcome.problem = f"after the wrong answers, the real solution failed its graded cell: {restored}"
            outcome.rejected = False
    return outcomes


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
