"""The GPU reference run's plan: which notebooks run, in which mode and order, each within its own time limit.

A GPU is lent rarely and briefly: 15 minutes of device time a session, the machine's start included. So the plan
fills gaps first and spreads the work over a few calls on one warm machine (``CALLS``, each ``CALL_BUDGET_S`` of
command time, so that they and the start fit ``SESSION_S``). In order of value:

1. full mode for every notebook that has never passed in full mode on this GPU (its figures are missing), in
   ``FULL_PRIORITY`` order (those whose GPU figures the README and the prose promise first);
2. the unit tests that exercise CUDA branches and the memory calculator's CUDA grid (``UNIT_TESTS``), when the code
   they test changed since they last passed, and check mode for the notebooks whose *code* (code cells and the
   ``utils`` modules they use, not their prose) changed since they last passed on this GPU and that step 1 does not
   run in full mode anyway; these go four at a time in the background;
3. full mode again for notebooks filed from code that has changed since (stale figures), last.

Full mode runs alone, one notebook at a time (its timings are reported), each with a limit derived from its
estimated time, never past the call's total. What each call ran is recorded in ``results/<gpu>/reference_run.json``
(per notebook and mode: status, seconds, the notebook file's hash and its code hash), and the next call's plan
starts where the last one stopped. ``--calls N`` prints the following calls too, as if everything planned passed.

``tools/gpu_reference.sh`` calls this module; run it alone to see a plan::

    python tools/gpu_plan.py --print --calls 3           # the default plan, call by call, with estimates
    python tools/gpu_plan.py --print 05:full 03:check    # what was asked for, in that order

Arguments name notebooks by number or stem, alone (full mode; check mode in a dry run) or as ``NN:check`` /
``NN:full``. Only the standard library is used: the GPU image may lack the rest when this runs.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
UTILS = ROOT / "utils"
MODES = ("check", "full")

# Estimated seconds of one notebook on an H100, kernel start included: (check mode, full mode). Measured on an
# H100 (torch 2.11, 2026-11-27) where a run finished: check mode four at a time (each slower than alone), full mode
# alone. The rest come from each notebook's GPU sizes (tests/test_gpu_sizes.py) and the work they do, below. A
# notebook new to the table gets DEFAULT_ESTIMATE_S.
# 03, 05, 08 and 09 in full mode, from the work left once issue 42 sized their GPU runs to show each effect rather
# than fill the card (the 80 GB class had made them 210-290 s). Rates from the H100's own figures: fp32 matmuls at
# ~50 TFLOP/s (TF32 off, as the course leaves it; 06's peak_matmul_gflops) and ~20 s of papermill, imports and CUDA
# start (00's whole run took 36 s).
# - 03 (80 GB class: 8 x 1024 tokens, width 1024, 12 blocks; was 32 sequences and 16 blocks): one fp32 forward is
#   ~2.9 TFLOP, ~0.065 s with fp32 attention; section 3's 16 strategies (4 + 12 sequential) cost ~26 forwards each (a
#   forward, a measured step and 6 timed ones, a step ~3.6 forwards with recomputation), ~420, and sections 1, 2 and 5
#   ~100 more: ~34 s, + ~25 s start, plots and exercises: ~60 s (the same count at the old sizes, ~0.31 s a forward,
#   gave the old 210 s).
# - 05: 99 s measured on the H100 before section 1's transformer came. max-autotune, now off on a GPU (two GEMM shapes,
#   ~20 Triton configurations each compiled and benchmarked, coordinate descent, CUDA graphs), was ~30 s of it: what
#   the 99 s leaves after the start, eight default compiles of ~4 s (the training step's measured 4.5 s) and ~15 s of
#   profiling, Dynamo-only tracing and timing. The transformer adds two Inductor compiles (the 4-block model's forward
#   and backward, AdamW's step over its 54 tensors), ~8 s each, and 44 steps of ~10 ms: 99 - 30 + 17 = ~85 s.
# - 08 (4 blocks on every device, 4 x 1024 tokens of width 1024; the two ends of the budget curve timed, not four):
#   seven aot_eager traces of the step, one per budget, ~2.5 s each (3.5-5.5 s measured on a loaded 2-core CPU), ~18 s;
#   two Inductor compiles of it, ~12 s each, ~25 s; ~130 steps of ~0.05 s, ~7 s; sections 3 and 4 (~1 GB of
#   save_on_cpu copies, the 128k-vocabulary losses) ~5 s; the exercises, on the CPU, ~3 s; + ~20 s start: ~80 s.
# - 09 (a 24 GB card's sizes on larger ones, width 1024 and 4096 tokens in the vocabulary, not 2048 and 16384; 100
#   steps a loss curve on a GPU, not 300; section 5's searches under 4 GiB, not 16): 3 x 100 steps (LoRA ~45 ms, AdamW
#   ~65, the plain-torch 8-bit AdamW ~110 with its ~4,000 small kernels), ~22 s; sections 1-4's tracked steps and the
#   rank table ~8 s; section 5's timed steps and probes ~8 s and five searches of ~12 tries each (a model built and
#   trained two steps, ~0.3 s a try), ~20 s; + ~25 s start with peft and transformers: ~85 s.
# 12, 16 and 17 in full mode, from the work they now do (issue 42; none has filed a full run yet). 12: on one GPU its
# ranks run on the CPU with gloo (an NCCL rank needs a GPU of its own), so a 2-rank and a 4-rank torchrun launch, each
# process importing torch (~5 s a launch on a many-core host), the one-rank runs in the kernel and the calculator's
# rows: ~50 s. 16: the resumed MLP's 120 steps and its child's six resumes, six killed writers saving CPU tensors (no
# CUDA start), a SIGTERM child, 18 saves of a 200 MB checkpoint (TIMED_HIDDEN 2048; 4096's 800 MB timed out at 75 s)
# and the preemption simulation: ~60 s. 17: a 15 M-parameter model under a 2 GiB budget (searches of steps of tens
# of 512-token rows, each well under a second), three Inductor compiles (the recipe's loop, the compiled rung, the
# larger batch; the fused rung's graph comes from the cache), ~15 s each, and the Llama's searches under 512 MiB: ~90 s.
ESTIMATE_S: dict[str, tuple[int, int]] = {
    "00": (25, 40), "01": (25, 45), "02": (25, 45), "03": (30, 60), "04": (30, 45), "05": (40, 85),
    "06": (45, 60), "07": (30, 35), "08": (35, 80), "09": (50, 85), "10": (40, 60), "11": (40, 70),
    "12": (55, 50), "13": (45, 90), "14": (35, 60), "15": (45, 80), "16": (45, 60), "17": (60, 90),
}
DEFAULT_ESTIMATE_S = (30, 120)
# Full mode's order when a call cannot run them all: the figures the README and the prose promise on a GPU first
# (bf16 and TF32 speed, compile, the capstone's ladder, checkpointing's cost, FP8 on an H100), then the rest.
FULL_PRIORITY = ["04", "05", "17", "03", "10", "00", "01", "09", "08", "11", "15", "06", "02", "07", "12", "13", "16",
                 "14"]
# a notebook's limit: its estimate times this, and at least this many seconds more than the estimate
LIMIT_FACTOR, LIMIT_MIN_EXTRA_S = 1.5, 30
# A session's device time and how it is spent: the machine's start once (a minute or more, KINDS.md), then CALLS
# calls on the warm machine, each with a few seconds of transfer and Python start around its command.
SESSION_S, START_S, CALLS, CALL_OVERHEAD_S = 900, 120, 3, 30
CALL_BUDGET_S = (SESSION_S - START_S) // CALLS - CALL_OVERHEAD_S   # one call's command time (tools/gpu_reference.sh)
SETUP_S, PACK_RESERVE_S = 25, 25      # inside each call: installing and describing the machine; filing and packing
NOTEBOOK_BUDGET_S = CALL_BUDGET_S - SETUP_S - PACK_RESERVE_S           # what a call's plan may fill
# the unit tests that run CUDA branches and the calculator's grid on CUDA: a background step like a check-mode run
UNIT_TESTS = "unit-tests"
UNIT_TESTS_ESTIMATE_S = 60
UNIT_TEST_FILES = ("tests/test_cuda_paths.py", "tests/test_memory.py", "tests/test_env.py",
                   "tests/test_timing_grads_models.py", "tests/test_gpu_sizes.py")
# A GPU's time against the H100 estimates. The H200 is the H100's chip (the same arithmetic rates) with 141 GB at
# 4.8 TB/s instead of 80 GB at 3.35: memory-bound steps go about 1.4x faster, compute-bound ones no faster; the
# notebooks' steps are mostly small and launch- or memory-bound, so 0.9 of the H100's time, until a run measures it.
SPEED_VS_H100 = {"nvidia-h100": 1.0, "nvidia-h200": 0.9}


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
    """The first 16 hex digits of the notebook file's SHA-256 (prose and code): what a filed figure was measured on."""
    return hashlib.sha256((folder / f"{stem}.ipynb").read_bytes()).hexdigest()[:16]


def _utils_exports(utils_dir: Path = UTILS) -> dict[str, str]:
    """``utils/__init__.py``'s public name -> module map (``_EXPORTS``), read without importing the package."""
    tree = ast.parse((utils_dir / "__init__.py").read_text())
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign)
                                                                       else None)
        if isinstance(target, ast.Name) and target.id == "_EXPORTS":
            return ast.literal_eval(node.value)
    return {}


def _module_files(name: str, utils_dir: Path) -> list[Path]:
    """The files of ``utils.<name>``: a module, or a package's modules."""
    if (utils_dir / f"{name}.py").is_file():
        return [utils_dir / f"{name}.py"]
    return sorted((utils_dir / name).rglob("*.py")) if (utils_dir / name).is_dir() else []


def code_hash(stem: str, folder: Path = NOTEBOOKS, utils_dir: Path = UTILS) -> str:
    """A hash of what a notebook *runs*: its code cells, and every ``utils`` module they name (``utils.measure_memory``
    names ``utils/memory.py``; ``utils.calculator.predict_hf`` the calculator package). Its prose is left out, so an
    edited sentence does not send a notebook back to the GPU; a changed code path does."""
    notebook = json.loads((folder / f"{stem}.ipynb").read_text())
    code = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in notebook.get("cells", []) if c.get("cell_type") == "code"]
    exports = _utils_exports(utils_dir)
    names = set(re.findall(r"\butils\.(\w+)", "\n".join(code)))
    names |= set(re.findall(r"^\s*from utils\.(\w+)", "\n".join(code), flags=re.M))
    modules = sorted({exports.get(name, name) for name in names})
    digest = hashlib.sha256("\n\x00".join(code).encode())
    for module in modules:
        for path in _module_files(module, utils_dir):
            digest.update(path.relative_to(utils_dir).as_posix().encode() + b"\x00" + path.read_bytes())
    return digest.hexdigest()[:16]


def unit_tests_hash(root: Path = ROOT) -> str:
    """A hash of what the GPU run's unit tests exercise: their files and every module of ``utils``."""
    digest = hashlib.sha256()
    for path in [root / name for name in UNIT_TEST_FILES] + sorted((root / "utils").rglob("*.py")):
        if path.is_file():
            digest.update(path.relative_to(root).as_posix().encode() + b"\x00" + path.read_bytes())
    return digest.hexdigest()[:16]


def speed_factor(slug: str | None) -> float:
    """How long a GPU takes against the H100 estimates (``SPEED_VS_H100``; 1.0 for a GPU not named there)."""
    for prefix, factor in SPEED_VS_H100.items():
        if slug and slug.startswith(prefix):
            return factor
    return 1.0


def estimate(stem: str, mode: str, factor: float = 1.0) -> tuple[int, int]:
    """(estimated seconds, time limit in seconds) of one notebook in one mode, on an H100 times ``factor``."""
    if stem == UNIT_TESTS:
        estimate_s = int(round(UNIT_TESTS_ESTIMATE_S * factor))
    else:
        check_s, full_s = ESTIMATE_S.get(stem[:2], DEFAULT_ESTIMATE_S)
        estimate_s = int(round((check_s if mode == "check" else full_s) * factor))
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
        if name == UNIT_TESTS:
            requests.append((UNIT_TESTS, "check"))        # the unit tests run in the background, as check mode does
            continue
        mode = mode or ("check" if dry_run else "full")
        if mode not in MODES:
            raise PlanError(f"{argument!r}: the mode after ':' must be one of {', '.join(MODES)}")
        matches = [s for s in stems if name in (s, s[:2])]
        if not matches:
            raise PlanError(f"no notebook matches {name!r}; the notebooks are: {' '.join(stems)}")
        requests.append((matches[0], mode))
    return requests


def passed_already(record: dict, stem: str, mode: str, content_hash: str, current_code_hash: str | None = None) -> bool:
    """Whether ``reference_run.json`` holds a passing run of this notebook in this mode on code as it is now: the same
    code hash (an entry filed before code hashes were kept: the same file hash)."""
    entry = record.get("runs", {}).get(stem, {}).get(mode)
    if not entry or entry.get("status") != "ok":
        return False
    if current_code_hash is not None and entry.get("code_hash"):
        return entry["code_hash"] == current_code_hash
    return entry.get("hash") == content_hash


def ever_passed(record: dict, stem: str, mode: str) -> bool:
    """Whether this notebook ever passed in this mode on this GPU, on any version of it (its figures are filed)."""
    entry = record.get("runs", {}).get(stem, {}).get(mode)
    return bool(entry) and entry.get("status") == "ok"


def default_requests(stems: list[str], record: dict, *, dry_run: bool = False,
                     folder: Path = NOTEBOOKS) -> list[tuple[str, str]]:
    """Gaps first, then what changed, then re-measurements (the module's docstring); a dry run (on a CPU) plans
    check mode only, for every notebook not passed as it is now."""
    def current(stem: str, mode: str) -> bool:
        return passed_already(record, stem, mode, notebook_hash(stem, folder), code_hash(stem, folder))

    if dry_run:
        return [(s, "check") for s in stems if not current(s, "check")]
    rank = {number: i for i, number in enumerate(FULL_PRIORITY)}
    by_priority = sorted(stems, key=lambda s: (rank.get(s[:2], len(rank)), s))
    gaps = [s for s in by_priority if not ever_passed(record, s, "full")]
    requests = [(s, "full") for s in gaps]
    tests = record.get("tests", {})
    if not (tests.get("status") == "ok" and tests.get("hash") == unit_tests_hash()):
        requests.append((UNIT_TESTS, "check"))
    requests += [(s, "check") for s in stems if s not in gaps and not current(s, "check")
                 and not current(s, "full")]
    requests += [(s, "full") for s in by_priority if s not in gaps and not current(s, "full")]
    return requests


def plan(requests: list[tuple[str, str]], budget_s: float, check_jobs: int = 1,
         factor: float = 1.0) -> tuple[list[Step], list[Step]]:
    """Split the requests into the steps that fit ``budget_s`` (by estimate, in order) and those left for a later call.

    Every wait is counted. Check-mode runs and the unit tests go in the background, ``check_jobs`` at a time (the GPU
    machine has 16 cores), each in the lane that frees first; a full-mode run waits for everything in the background
    to finish (it runs alone: its timings are reported), so a background group costs its longest lane, not its
    average. A step that does not fit is left out and the next, shorter ones are still tried: the call never runs
    past its total, and it uses the time it has. ``factor`` scales the H100 estimates to the GPU at hand.
    """
    if check_jobs < 1:
        raise PlanError(f"check_jobs must be at least 1, got {check_jobs}")
    planned, left_over = [], []
    foreground_s, lanes = 0.0, [0.0] * check_jobs     # when the current background group began; each lane's work
    for stem, mode in requests:
        estimate_s, limit_s = estimate(stem, mode, factor)
        step = Step(stem, mode, estimate_s, limit_s)
        if mode == "check":
            lane = min(range(check_jobs), key=lambda i: lanes[i])
            if foreground_s + max(max(lanes), lanes[lane] + estimate_s) <= budget_s:
                lanes[lane] += estimate_s
                planned.append(step)
                continue
        elif foreground_s + max(lanes) + estimate_s <= budget_s:
            foreground_s, lanes = foreground_s + max(lanes) + estimate_s, [0.0] * check_jobs
            planned.append(step)
            continue
        left_over.append(step)
    return planned, left_over


def plan_calls(requests: list[tuple[str, str]], budget_s: float, check_jobs: int = 1, factor: float = 1.0,
               calls: int = CALLS) -> list[list[Step]]:
    """The steps of ``calls`` successive calls, each planned on what the one before left, as if everything planned
    passed; a last list holds what ``calls`` calls leave (empty when they finish the set)."""
    if calls < 1:
        raise PlanError(f"calls must be at least 1, got {calls}")
    schedule, left = [], list(requests)
    for _ in range(calls):
        planned, left_over = plan(left, budget_s, check_jobs, factor)
        schedule.append(planned)
        left = [(step.stem, step.mode) for step in left_over]
    schedule.append([Step(stem, mode, *estimate(stem, mode, factor)) for stem, mode in left])
    return schedule


def wall_seconds(steps: list[Step], check_jobs: int = 1) -> float:
    """A call's notebook time by the same rule as ``plan``: background lanes, each full run after a drain."""
    foreground_s, lanes = 0.0, [0.0] * check_jobs
    for step in steps:
        if step.mode == "check":
            lane = min(range(check_jobs), key=lambda i: lanes[i])
            lanes[lane] += step.estimate_s
        else:
            foreground_s, lanes = foreground_s + max(lanes) + step.estimate_s, [0.0] * check_jobs
    return foreground_s + max(lanes)


def format_plan(schedule: list[list[Step]], budget_s: float, check_jobs: int = 1, factor: float = 1.0) -> str:
    """The plan as a reader sees it: each call's notebooks with mode, estimate and limit, and what is left after."""
    *calls, left_over = schedule
    gpu = "an H100" if factor == 1.0 else f"this GPU ({factor:g} x an H100's)"
    lines = [f"GPU reference plan: estimates for {gpu}; check mode and the unit tests {check_jobs} at a time in the "
             f"background, full mode alone; {budget_s:.0f} s of notebooks per call"]
    for number, steps in enumerate(calls, 1):
        if not steps and number > 1:
            break
        heading = "this call" if number == 1 else f"call {number} (if everything before passes)"
        lines.append(f"{heading}: {len(steps)} runs in about {wall_seconds(steps, check_jobs):.0f} s")
        if number == 1:
            lines.append(f"  {'notebook':<46}{'mode':<7}{'estimate':>9}{'limit':>7}")
            lines += [f"  {s.stem:<46}{s.mode:<7}{s.estimate_s:>8}s{s.limit_s:>6}s" for s in steps]
        else:
            lines.append("  " + " ".join(f"{s.stem[:2] if s.stem != UNIT_TESTS else s.stem}:{s.mode}" for s in steps))
    if left_over:
        lines.append(f"left after {len(calls)} calls ({sum(s.estimate_s for s in left_over)} s): "
                     + " ".join(f"{s.stem[:2]}:{s.mode}" for s in left_over))
    else:
        used = sum(1 for steps in calls if steps)
        lines.append(f"the set is complete after {used} call{'s' if used != 1 else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the plan (``--print``) or its steps as ``stem<TAB>mode<TAB>estimate<TAB>limit`` lines for the script."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("requests", nargs="*", help="NN, NN:check or NN:full, in the order to run them")
    parser.add_argument("--budget", type=float, default=float(NOTEBOOK_BUDGET_S),
                        help="seconds the notebooks may take in one call")
    parser.add_argument("--record", type=Path, default=None, help="results/<gpu>/reference_run.json, if any")
    parser.add_argument("--slug", default=None, help="the GPU's results folder name (scales the H100 estimates)")
    parser.add_argument("--dry-run", action="store_true", help="plan check mode only (a run on a CPU)")
    parser.add_argument("--print", action="store_true", help="print the plan for a reader instead of the steps")
    parser.add_argument("--calls", type=int, default=1, help="with --print: also plan this many calls in all")
    parser.add_argument("--check-jobs", type=int, default=1, help="check-mode runs at a time (full mode: one)")
    args = parser.parse_args(argv)
    if not args.budget > 0:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget}")
    if args.check_jobs < 1:
        parser.error(f"--check-jobs must be at least 1, got {args.check_jobs}")
    if args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    stems = notebook_stems()
    record = json.loads(args.record.read_text()) if args.record and args.record.exists() else {}
    slug = args.slug or (args.record.parent.name if args.record else None)
    factor = speed_factor(slug)
    try:
        requests = (parse_requests(args.requests, stems, dry_run=args.dry_run) if args.requests
                    else default_requests(stems, record, dry_run=args.dry_run))
    except PlanError as error:
        print(f"gpu_plan: {error}", file=sys.stderr)
        return 2
    if args.print:
        print(format_plan(plan_calls(requests, args.budget, args.check_jobs, factor, args.calls), args.budget,
                          args.check_jobs, factor))
        return 0
    planned, left_over = plan(requests, args.budget, args.check_jobs, factor)
    for step in planned:
        print(f"{step.stem}\t{step.mode}\t{step.estimate_s}\t{step.limit_s}")
    for step in left_over:
        print(f"{step.stem}\t{step.mode}\t{step.estimate_s}\t0")     # limit 0: listed as not run
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
