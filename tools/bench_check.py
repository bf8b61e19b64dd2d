"""Benchmark `make check`: its wall time, the CPU time of all its processes, each notebook's check-mode CPU seconds
and the slowest other tests. The figures are reported, never asserted (issue 45): a loaded machine stretches them.

    .venv/bin/python tools/bench_check.py              # the whole suite, as `make check` runs it
    .venv/bin/python tools/bench_check.py -k 13_       # a subset (pytest's -k)

The notebooks' CPU seconds are the kernel's and its children's (tools/nbtools.py: ``CheckRun.kernel_cpu_seconds``),
which the check-mode test prints; its budget in tests/test_notebooks.py (``CHECK_BUDGET_S``) only catches a runaway.
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_LINE = re.compile(r"^(\d\d_\w+): ([\d.]+) s in check mode \(([\d.]+) s of CPU\)", re.M)


def run_suite(workers: int, selection: list[str]) -> tuple[float, float, Path]:
    """Run pytest as `make check` does, with a JUnit report that keeps each test's printed lines.

    Returns:
        (wall seconds, CPU seconds of pytest and every process it waited for, the report's path).
    """
    report = Path(tempfile.mkdtemp(prefix="bench_check_")) / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-n", str(workers), "--dist", "worksteal", "-p", "no:nbval", "-q",
               f"--junitxml={report}", "-o", "junit_logging=system-out", *selection]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": ""}     # as `make check`: compiled modules cached
    subprocess.run(command, cwd=ROOT, check=False, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, report


def read_report(report: Path) -> tuple[dict[str, tuple[float, float]], list[tuple[float, str]]]:
    """Each notebook's (wall s, kernel CPU s) and every other test's (wall s, id), from the JUnit report."""
    notebooks, others = {}, []
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        out = "".join(node.text or "" for node in case.iter("system-out"))
        match = NOTEBOOK_LINE.search(out)
        if match and "test_notebook_runs_in_check_mode" in name:
            notebooks[match.group(1)] = (float(match.group(2)), float(match.group(3)))
        else:
            others.append((float(case.get("time") or 0), name))
    return notebooks, sorted(others, reverse=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    parser.add_argument("-k", default=None, help="pytest -k expression (default: every test)")
    parser.add_argument("--top", type=int, default=15, help="how many of the slowest other tests to list")
    args = parser.parse_args(argv)
    wall, cpu, report = run_suite(args.workers, ["-k", args.k] if args.k else [])
    notebooks, others = read_report(report)
    print(f"\nmake check: {wall:.0f} s of wall time, {cpu:.0f} CPU-seconds in all, {args.workers} workers on "
          f"{os.cpu_count()} cores, load average now {os.getloadavg()[0]:.1f}")
    if notebooks:
        print(f"\n{'notebook':45} {'wall s':>7} {'CPU s':>7}")
        for stem, (seconds, cpu_seconds) in sorted(notebooks.items()):
            print(f"{stem:45} {seconds:7.1f} {cpu_seconds:7.1f}")
        print(f"{'all notebooks':45} {sum(w for w, _ in notebooks.values()):7.1f} "
              f"{sum(c for _, c in notebooks.values()):7.1f}")
    print(f"\nslowest other tests (wall s, {sum(t for t, _ in others):.0f} s in all):")
    for seconds, name in others[:args.top]:
        print(f"{seconds:7.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
