"""Shared test set-up: the repo root on sys.path (for tools/), a non-interactive matplotlib, and the order in which
pytest-xdist's workers take the tests (the longest first, shared out evenly)."""

import os
import sys
from pathlib import Path

# jsonschema (under nbformat, papermill and nbgrader) imports rfc3987_syntax, when it is installed (jupyter-events
# asks for it), to check two string formats ("iri", "iri-reference") that no notebook schema uses; that module
# builds a Lark grammar on import: about 2 s of CPU in every process that imports nbformat. The tests' processes
# skip it (jsonschema then checks those two formats less strictly). This works only when nothing imported jsonschema
# before this file: nbval's pytest plugin does, so `make check` turns the plugin off (`-p no:nbval`; the tests
# compare the marked outputs themselves, with nbval's coalesce_streams).
sys.modules.setdefault("rfc3987_syntax", None)

import matplotlib  # noqa: E402
import pytest  # noqa: E402

matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiets the kernel's debugger warning


# --- torch's threads in pytest-xdist's workers ---------------------------------------------------------------
# Each worker is one process on a share of the cores; left at torch's default (a thread per core), N workers run N
# times the threads there are cores for, and OpenMP's spinning threads burn CPU time waiting for each other (the
# recipe and calculator tests took 1.3 to 2 times their CPU time under `pytest -n 2` on 2 cores). The notebooks'
# kernels are capped the same way (tools/nbtools.notebook_environment); only the workers' own torch is set here,
# not the environment their subprocesses inherit.
def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


# --- the order pytest-xdist's workers take the tests in -------------------------------------------------------
# `make check` runs `pytest -n N --dist worksteal`: each worker starts with one contiguous share of the collected
# tests (the first len // N, then the next, ...), and a worker that runs out takes the second half of the longest
# queue left. In file order the notebooks' check-mode runs (5-25 s each on 2 cores, most of the suite) sit together,
# so one worker could start the capstone's run while the other had nothing left. Instead each share gets an equal
# weight of long tests, longest first, and the short tests after them, where stealing evens out the end.
LONG_TEST_S = 15          # a test marked `notebook` (it runs a kernel) that is not a check-mode run with a budget
SHORT_TEST_S = 0.3        # any other test
SHARED_FIXTURE_S = 3      # a module- or session-scoped fixture of ours: its tests stay together, on one worker


def _expected_seconds(item: pytest.Item) -> float:
    """A rough CPU cost: a check-mode run's reference CPU seconds (tests/test_notebooks.py), else by marker."""
    references = getattr(item.module, "REFERENCE_CHECK_CPU_S", None)
    callspec = getattr(item, "callspec", None)
    if references and callspec and item.originalname == "test_notebook_runs_in_check_mode":
        return references[Path(callspec.params["path"]).stem]
    return LONG_TEST_S if item.get_closest_marker("notebook") else SHORT_TEST_S


def _shares_a_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a module- or session-scoped fixture defined in tests/ (its set-up runs per worker)."""
    definitions = getattr(item, "_fixtureinfo", None)
    for fixturedefs in (definitions.name2fixturedefs.values() if definitions else ()):
        for fixturedef in fixturedefs:
            if fixturedef.scope in ("module", "package", "session") and str(fixturedef.baseid).startswith("tests"):
                return True
    return False


def balanced_order(items: list, workers: int, seconds=_expected_seconds, grouped=_shares_a_fixture) -> list:
    """``items`` reordered so that xdist's first contiguous shares (``len // workers`` each) weigh about the same.

    Tests that share a module's fixture stay together as one unit; units are placed longest first on the lightest
    share that has room (longest-processing-time first), then the short single tests fill each share up to its
    size, in their collected order. Every worker computes the same order from the same collection.
    """
    if workers < 2 or len(items) < 2 * workers:
        return items
    sizes, left = [], len(items)
    for index in range(workers):              # as xdist's worksteal scheduler deals the first shares
        sizes.append(left // (workers - index))
        left -= sizes[-1]
    units, by_module = [], {}
    for item in items:
        if grouped(item):
            if item.module not in by_module:
                by_module[item.module] = []
                units.append(by_module[item.module])
            by_module[item.module].append(item)
        else:
            units.append([item])
    weight = {id(unit): sum(seconds(i) for i in unit) + (SHARED_FIXTURE_S if grouped(unit[0]) else 0) for unit in units}
    heavy = sorted((u for u in units if len(u) > 1 or weight[id(u)] > SHORT_TEST_S), key=lambda u: -weight[id(u)])
    shares = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for unit in heavy:
        fitting = [s for s in range(workers) if len(shares[s]) + len(unit) <= sizes[s]] or range(workers)
        share = min(fitting, key=lambda s: (loads[s], s))
        shares[share].extend(unit)
        loads[share] += weight[id(unit)]
    placed = {id(item) for share in shares for item in share}
    rest = iter(item for item in items if id(item) not in placed)
    for share, size in zip(shares, sizes):
        share.extend(item for _, item in zip(range(max(0, size - len(share))), rest))
    shares[-1].extend(rest)
    return [item for share in shares for item in share]


@pytest.hookimpl(trylast=True)          # after -k and -m have deselected
def pytest_collection_modifyitems(config, items):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    items[:] = balanced_order(items, workers)
