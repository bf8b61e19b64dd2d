"""The GPU reference run's plan: which notebooks run, in which mode and order, each within its own time limit.

A GPU is lent rarely and briefly: one device call of at most ~8 minutes of command time. So one call first runs
every notebook in check mode on CUDA, four at a time (every CUDA path exercised, 25-60 s each, about 3 minutes on an
H100), then as many notebooks in full mode as fit, one at a time, in ``FULL_PRIORITY`` order (those whose GPU figures the README and the prose promise first), each
with a limit derived from its estimated H100 time, never past the total. What each call ran is recorded in
``results/<gpu>/reference_run.json`` (per notebook and mode: status, seconds, the notebook's content hash), and
the default plan skips what already passed on that GPU for the notebook as it is now, so a few calls complete
the set.

``tools/gpu_reference.sh`` calls this module; run it alone to see a plan::

    python tools/gpu_plan.py --print                    # the default plan, with estimated seconds per notebook
    python tools/gpu_plan.py --print 05:full 03:check   # what was asked for, in that order

Arguments name notebooks by number or stem, alone (full mode; check mode in a dry run) or as ``NN:check`` /
``NN:full``. Only the standard library is used: the GPU image may lack the rest when this runs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
MODES = ("check", "full")

# Estimated seconds of one notebook on an H100, kernel start included: (check mode, full mode). Measured on an
# H100 (torch 2.11, 2026-11-27) where a run finished: check mode four at a time (each slower than alone), full mode
# alone. The rest come from each notebook's GPU sizes (tests/test_gpu_sizes.py) and the work they do: 03 sweeps 20
# strategies of about seven fp32 steps each, 08 seven budgeted compiles, 09 two 300-step loss curves and its width
# searches, 17 nine budgeted searches and a compiled speed ladder. A notebook new to the table gets
# DEFAULT_ESTIMATE_S.
ESTIMATE_S: dict[str, tuple[int, int]] = {
    "00": (25, 40), "01": (25, 45), "02": (25, 45), "03": (30, 210), "04": (30, 45), "05": (40, 110),
    "06": (45, 60), "07": (30, 35), "08": (35, 215), "09": (50, 290), "10": (40, 60), "11": (40, 70),
    "12": (55, 70), "13": (45, 90), "16": (45, 90), "17": (60, 235),
}
DEFAULT_ESTIMATE_S = (30, 120)
# Full mode's order when a call cannot run them all: the figures the README and the prose promise on a GPU first
# (bf16 and TF32 speed, compile, the capstone's ladder, checkpointing's cost, FP8 on an H100), then the rest.
FULL_PRIORITY = ["04", "05", "17", "03", "10", "00", "01", "09", "08", "11", "06", "02", "07", "12", "13", "16"]
# a notebook's limit: its estimate times this, and at least this many seconds more than the estimate
LIMIT_FACTOR, LIMIT_MIN_EXTRA_S = 1.5, 30


class PlanError(ValueError):
    """A request the plan cannot follow (an unknown notebook or mode)."""


@dataclass(frozen=True)
class Step:
    """One notebook run: ``stem`` in ``mode`` ("check" or "full"), its estimate and its time limit, in seconds."""

    stem: str
    mode: str
    estimate_s: int
    limit_s: int


def notebook_stems(folder: Path = NOTEBOOKS) -> list[str]:
    """The course's notebooks, in course order (``NN_topic``)."""
    return sorted(p.stem for p in folder.glob("[0-9][0-9]_*.ipynb"))


def notebook_hash(stem: str, folder: Path = NOTEBOOKS) -> str:
    """The first 16 hex digits of the notebook file's SHA-256: a run is "done" only for the notebook as it is now."""
    return hashlib.sha256((folder / f"{stem}.ipynb").read_bytes()).hexdigest()[:16]


def estimate(stem: str, mode: str) -> tuple[int, int]:
    """(estimated seconds, time limit in seconds) of one notebook in one mode on an H100."""
    check_s, full_s = ESTIMATE_S.get(stem[:2], DEFAULT_ESTIMATE_S)
    estimate_s = check_s if mode == "check" else full_s
    return estimate_s, int(max(estimate_s * LIMIT_FACTOR, estimate_s + LIMIT_MIN_EXTRA_S))


def parse_requests(arguments: list[str], stems: list[str], *, dry_run: bool = False) -> list[tuple[str, str]]:
    """``["05:full", "03", "00_measuring_memory_and_time:check"]`` -> ``[(stem, mode), ...]`` in the order given.

    A notebook named without a mode runs in full mode, or in check mode in a dry run (which runs on a CPU); a mode
    given explicitly is honoured in both.

    Raises:
        PlanError: a name that matches no notebook, or a mode other than check or full.
    """
    requests = []
    for argument in arguments:
        name, _, mode = argument.partition(":")
        mode = mode or ("check" if dry_run else "full")
        if mode not in MODES:
            raise PlanError(f"{argument!r}: the mode after ':' must be one of {', '.join(MODES)}")
        matches = [s for s in stems if name in (s, s[:2])]
        if not matches:
            raise PlanError(f"no notebook matches {name!r}; the notebooks are: {' '.join(stems)}")
        requests.append((matches[0], mode))
    return requests


def passed_already(record: dict, stem: str, mode: str, content_hash: str) -> bool:
    """Whether ``reference_run.json`` holds a passing run of this notebook, as it is now, in this mode."""
    entry = record.get("runs", {}).get(stem, {}).get(mode)
    return bool(entry) and entry.get("status") == "ok" and entry.get("hash") == content_hash


def default_requests(stems: list[str], record: dict, *, dry_run: bool = False,
                     folder: Path = NOTEBOOKS) -> list[tuple[str, str]]:
    """Every notebook in check mode (course order), then full mode in ``FULL_PRIORITY`` order, less what already
    passed on this GPU for the notebook as it is now. A dry run (on a CPU) plans check mode only."""
    check = [(s, "check") for s in stems if not passed_already(record, s, "check", notebook_hash(s, folder))]
    if dry_run:
        return check
    rank = {number: i for i, number in enumerate(FULL_PRIORITY)}
    by_priority = sorted(stems, key=lambda s: (rank.get(s[:2], len(rank)), s))
    full = [(s, "full") for s in by_priority if not passed_already(record, s, "full", notebook_hash(s, folder))]
    return check + full


def plan(requests: list[tuple[str, str]], budget_s: float,
         check_jobs: int = 1) -> tuple[list[Step], list[Step]]:
    """Split the requests into the steps that fit ``budget_s`` (by estimate, in order) and those left for a later call.

    Check-mode runs go ``check_jobs`` at a time (each is small; the GPU machine has 16 cores), so each costs its
    estimate divided by ``check_jobs``; full-mode runs go one at a time (their timings are reported). A step that
    does not fit is left out and the next, shorter ones are still tried: the call never runs past its total, and it
    uses the time it has.
    """
    if check_jobs < 1:
        raise PlanError(f"check_jobs must be at least 1, got {check_jobs}")
    planned, left_over, used = [], [], 0.0
    for stem, mode in requests:
        estimate_s, limit_s = estimate(stem, mode)
        step = Step(stem, mode, estimate_s, limit_s)
        cost_s = estimate_s / check_jobs if mode == "check" else estimate_s
        if used + cost_s <= budget_s:
            planned.append(step)
            used += cost_s
        else:
            left_over.append(step)
    return planned, left_over


def format_plan(planned: list[Step], left_over: list[Step], budget_s: float, check_jobs: int = 1) -> str:
    """The plan as a reader sees it: each notebook, its mode, estimate and limit, and the total."""
    wall_s = sum(s.estimate_s / (check_jobs if s.mode == "check" else 1) for s in planned)
    lines = [f"GPU reference plan: {len(planned)} runs in about {wall_s:.0f} s of the "
             f"{budget_s:.0f} s budget (estimates for an H100; check mode {check_jobs} at a time)", f"{'notebook':<46}{'mode':<7}{'estimate':>9}{'limit':>7}"]
    lines += [f"{s.stem:<46}{s.mode:<7}{s.estimate_s:>8}s{s.limit_s:>6}s" for s in planned]
    if left_over:
        lines.append(f"left for a later call ({sum(s.estimate_s for s in left_over)} s): "
                     + " ".join(f"{s.stem[:2]}:{s.mode}" for s in left_over))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the plan (``--print``) or its steps as ``stem<TAB>mode<TAB>estimate<TAB>limit`` lines for the script."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("requests", nargs="*", help="NN, NN:check or NN:full, in the order to run them")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds the notebooks may take in all")
    parser.add_argument("--record", type=Path, default=None, help="results/<gpu>/reference_run.json, if any")
    parser.add_argument("--dry-run", action="store_true", help="plan check mode only (a run on a CPU)")
    parser.add_argument("--print", action="store_true", help="print the plan for a reader instead of the steps")
    parser.add_argument("--check-jobs", type=int, default=1, help="check-mode runs at a time (full mode: one)")
    args = parser.parse_args(argv)
    if not args.budget > 0:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget}")
    stems = notebook_stems()
    record = json.loads(args.record.read_text()) if args.record and args.record.exists() else {}
    try:
        requests = (parse_requests(args.requests, stems, dry_run=args.dry_run) if args.requests
                    else default_requests(stems, record, dry_run=args.dry_run))
    except PlanError as error:
        print(f"gpu_plan: {error}", file=sys.stderr)
        return 2
    if args.check_jobs < 1:
        parser.error(f"--check-jobs must be at least 1, got {args.check_jobs}")
    planned, left_over = plan(requests, args.budget, args.check_jobs)
    if args.print:
        print(format_plan(planned, left_over, args.budget, args.check_jobs))
    else:
        for step in planned:
            print(f"{step.stem}\t{step.mode}\t{step.estimate_s}\t{step.limit_s}")
        for step in left_over:
            print(f"{step.stem}\t{step.mode}\t{step.estimate_s}\t0")     # limit 0: listed as not run
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
