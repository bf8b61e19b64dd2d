"""`make run`: execute every notebook in full mode into build/, render HTML, gather results.

Usage: python tools/run_notebooks.py [NOTEBOOK_STEM_OR_NUMBER ...]   (default: all notebooks)
Set PYTORCH_INTRO_CHECK_MODE=1 to run the fast path instead (the executed copies say which), and
PYTORCH_INTRO_BUILD_DIR to write somewhere other than build/.

Every notebook runs even when an earlier one fails. For each one the executed copy goes to
``build/executed/`` (a failed notebook's copy holds the outputs up to the failing cell and its
traceback), its HTML to ``build/html/``, and its wall time, status, mode and device to
``build/runtimes.json``. The end prints which notebooks failed and why (the cell and the error),
gathers ``build/results.json``, and exits 1 when any notebook failed.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import utils  # noqa: E402
from tools.devices import describe_device  # noqa: E402
from tools.gpu_plan import code_hash  # noqa: E402
from tools.nbtools import execute, list_notebooks  # noqa: E402
from utils.results import main as summarize  # noqa: E402

RUNTIMES_FILE = "runtimes.json"


@dataclass
class Outcome:
    """How one notebook's run went."""

    stem: str
    seconds: float
    ok: bool
    where: str = ""   # the failing cell, e.g. 'cell 12 (In [9]): loss = train(model)'
    error: str = ""   # the error, e.g. 'ValueError: shapes do not match'
    load_average: float | None = None  # the machine's 1-minute load average when it finished
    cpu_seconds: float | None = None   # CPU time of the kernel and what it started (less sensitive to a busy machine)
    finished: str = ""                 # when it finished (UTC, ISO 8601)
    code_hash: str = ""                # what it ran (tools/gpu_plan.code_hash): a filed figure is stale when it changes


def select(notebooks: list[Path], wanted: list[str]) -> list[Path]:
    """The notebooks named by stem (``03_activation_checkpointing``) or number (``03``), in course order.

    Raises:
        ValueError: a name matches no notebook (the message lists the notebooks there are).
    """
    if not wanted:
        return notebooks
    unknown = [w for w in wanted if not any(w in (nb.stem, nb.stem[:2]) for nb in notebooks)]
    if unknown:
        names = ", ".join(nb.stem for nb in notebooks)
        raise ValueError(f"no notebook matches {unknown}; the notebooks are: {names}")
    return [nb for nb in notebooks if nb.stem in wanted or nb.stem[:2] in wanted]


def describe_failure(exc: BaseException) -> tuple[str, str]:
    """(where, error) for a failed run: papermill's failing cell and exception, or the exception itself."""
    from papermill.exceptions import PapermillExecutionError

    if isinstance(exc, PapermillExecutionError):
        first_line = next((line.strip() for line in (exc.source or "").splitlines() if line.strip()), "")
        if len(first_line) > 80:
            first_line = first_line[:77] + "..."
        where = f"cell {exc.cell_index} (In [{exc.exec_count}]): {first_line}"
        return where, f"{exc.ename}: {exc.evalue}".strip()
    return "outside any cell", "".join(traceback.format_exception_only(type(exc), exc)).strip()


def clear_previous_outputs(build: Path, notebook: Path) -> None:
    """Remove what an earlier run of this notebook left (results, figures), so nothing stale survives."""
    (build / "results" / f"{notebook.stem}.json").unlink(missing_ok=True)
    for figure in (build / "figures").glob(f"{notebook.stem[:2]}_*.png"):
        figure.unlink()


# nbconvert's page template takes RequireJS (for widgets, which the notebooks do not use) and
# MathJax 2 from a CDN; offline they only fail. The book (make book) is where math is typeset.
_CDN_SCRIPT = re.compile(r'<script src="https?://[^"]*(?:require|mathjax)[^"]*">\s*</script>\s*', re.IGNORECASE)


def write_html(executed: Path, build: Path) -> Path | None:
    """Render an executed notebook to ``build/html/<stem>.html`` (loading nothing from the network).

    Returns:
        The page's path, or None when there is no executed copy.
    """
    import nbformat
    from nbconvert import HTMLExporter

    if not executed.exists():
        return None
    html, _ = HTMLExporter().from_notebook_node(nbformat.read(executed, as_version=4))
    html = _CDN_SCRIPT.sub("", html)
    html_path = build / "html" / f"{executed.stem}.html"
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(html)
    return html_path


def record_runtimes(build: Path, outcomes: list[Outcome], *, check: bool, device: dict) -> Path:
    """Merge this run's wall times into ``build/runtimes.json`` (one entry per mode and notebook).

    The file keeps earlier entries for notebooks not run this time, so ``make run`` of one notebook
    updates only that notebook's line. Each entry names its device, so a table made from it can say
    where it was measured.
    """
    path = build / RUNTIMES_FILE
    data: dict = {"modes": {}}
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            print(f"warning: {path} was not valid JSON; starting it again", file=sys.stderr)
            data = {"modes": {}}
    mode = "check" if check else "full"
    entries = data.setdefault("modes", {}).setdefault(mode, {})
    for outcome in outcomes:
        entries[outcome.stem] = {"seconds": round(outcome.seconds, 1), "ok": outcome.ok,
                                 "cpu_seconds": outcome.cpu_seconds, "load_average": outcome.load_average,
                                 "device": device["name"], "device_slug": device["slug"],
                                 "finished": outcome.finished, "code_hash": outcome.code_hash}
    data["device"] = device
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def run_one(notebook: Path, build: Path, *, check: bool) -> Outcome:
    """Execute one notebook into ``build/executed/`` and render its HTML, failing or not."""
    clear_previous_outputs(build, notebook)
    executed = build / "executed" / notebook.name
    ran = code_hash(notebook.stem, notebook.parent)            # before the run: an edit during it is not what ran
    started = time.perf_counter()
    cpu_before = _children_cpu_seconds()
    try:
        execute(notebook, executed, check_mode=check, build=build, timeout_s=3600)
        outcome = Outcome(notebook.stem, time.perf_counter() - started, ok=True)
    except Exception as exc:  # noqa: BLE001 - any failure is reported, and the next notebook still runs
        where, error = describe_failure(exc)
        outcome = Outcome(notebook.stem, time.perf_counter() - started, ok=False, where=where, error=error)
    outcome.code_hash = ran
    outcome.load_average = _load_average()
    cpu_after = _children_cpu_seconds()
    if cpu_before is not None and cpu_after is not None:
        outcome.cpu_seconds = round(cpu_after - cpu_before, 1)
    outcome.finished = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    try:
        html = write_html(executed, build)
    except Exception as exc:  # noqa: BLE001 - a broken HTML export must not hide the run's result
        html = None
        print(f"  {notebook.stem}: HTML export failed: {exc}", file=sys.stderr)
    status = "ok" if outcome.ok else "FAILED"
    shown = executed.relative_to(build.parent) if executed.exists() else "no executed copy"
    print(f"  {notebook.stem}: {status} in {outcome.seconds:.1f} s -> {shown}{'' if html else ' (no HTML)'}",
          flush=True)
    return outcome


def _load_average() -> float | None:
    """The 1-minute load average (a busy machine makes every wall time longer), where the OS has one."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _children_cpu_seconds() -> float | None:
    """User + system CPU time of this process's finished children (the kernels), where the OS counts it."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


RESULTS = Path(__file__).resolve().parent.parent / "results"


def reference_seconds(stem: str, mode: str, device: dict, results: Path = RESULTS) -> tuple[float, str] | None:
    """(seconds, folder) a reference machine took for this notebook in this mode, from ``results/*/runtimes.json``.

    This machine's own folder first (its slug), then a folder of the same kind (a CPU's for a CPU), so a reader
    sees an estimate before each notebook; None when no folder has the notebook.
    """
    folders = sorted(p for p in results.glob("*/runtimes.json"))
    own = [p for p in folders if p.parent.name == device.get("slug")]
    same_kind = [p for p in folders if p not in own
                 and (p.parent.name.startswith(("nvidia", "amd-instinct")) == (device.get("kind") == "cuda"))]
    for path in own + same_kind:
        try:
            entry = json.loads(path.read_text()).get(stem, {}).get(mode)
        except (OSError, json.JSONDecodeError):
            continue
        if entry and entry.get("seconds"):
            return float(entry["seconds"]), path.parent.name
    return None


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def progress_line(index: int, notebooks: list[Path], estimates: list[tuple[float, str] | None],
                  elapsed_s: float) -> str:
    """``[3/18] 03_activation_checkpointing: 2.1 min so far; estimate 28 s (intel-xeon-2-threads), about 9.5 min
    left in all``: printed before each notebook, so a long `make run` or `make book` says where it is."""
    estimate = estimates[index]
    own = f"estimate {_minutes(estimate[0])} ({estimate[1]})" if estimate else "no reference time for it"
    left = [e[0] for e in estimates[index:] if e]
    unknown = sum(e is None for e in estimates[index:])
    rest = f", about {_minutes(sum(left))} left in all" if left else ""
    rest += f" (+{unknown} without a reference)" if left and unknown else ""
    return f"[{index + 1}/{len(notebooks)}] {notebooks[index].stem}: {_minutes(elapsed_s)} so far; {own}{rest}"


def format_failures(outcomes: list[Outcome]) -> str:
    """The closing summary: one block per failed notebook with the cell and the error."""
    failed = [o for o in outcomes if not o.ok]
    if not failed:
        return f"all {len(outcomes)} notebooks ran"
    lines = [f"{len(failed)} of {len(outcomes)} notebooks failed:"]
    for outcome in failed:
        lines.append(f"  {outcome.stem}: {outcome.where}")
        lines.append(f"      {outcome.error}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    check = utils.check_mode()  # an invalid value fails here, before anything runs
    build = utils.build_dir()
    try:
        notebooks = select(list_notebooks(), argv)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    device = describe_device()
    # Inductor's compiled kernels go to a cache of this build's own (unless the reader chose one): a shared cache in
    # /tmp holds code built for whatever CPU capability another run asked for (ATEN_CPU_CAPABILITY=avx2 emulates a
    # CPU without AVX-512), and one such stale entry crashed 08's kernel with a segmentation fault.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(build / "inductor_cache"))
    print(f"{'check' if check else 'full'} mode on {device['name']}, into {build}", flush=True)
    outcomes = []
    started = time.perf_counter()
    estimates = [reference_seconds(nb.stem, "check" if check else "full", device) for nb in notebooks]
    for index, notebook in enumerate(notebooks):
        print(progress_line(index, notebooks, estimates, time.perf_counter() - started), flush=True)
        outcomes.append(run_one(notebook, build, check=check))
        runtimes = record_runtimes(build, outcomes[-1:], check=check, device=device)  # kept even if stopped later
    print(f"\nwall times in {runtimes}")
    print(format_failures(outcomes))
    print()
    gathered = summarize([]) if (build / "results").is_dir() else 1
    return 1 if any(not o.ok for o in outcomes) or gathered != 0 else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
