"""Wall time of the memory calculator's README commands, best of N fresh processes each (issue 43: an answer in
under a second on a 2-core CPU).

Each command runs as ``python -m utils.calculator ...`` in a new Python, as a reader types it: the interpreter's
start, the import, the replay and the largest-micro-batch search all count. Best of N, because other work on the
machine only ever slows a run down; the CPU seconds the process used (user and system) are printed beside the wall
time, since they move less when other work shares the cores. Prints one line per command and the machine it ran on;
the README quotes the figures.

    python tools/bench_calculator.py            # best of 5
    python tools/bench_calculator.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "70B QLoRA": "--hf-config llama-2-70b --precision bf16 --lora-rank 16 --base-quant nf4-double "
                 "--checkpointing every_block --seq-len 2048",
    "7B from its config.json": "--hf-config utils/calculator/configs/llama-2-7b.json",
    "Llama 3.2 1B": "--hf-config llama-3.2-1b",
    "Gemma 2 9B LoRA": "--hf-config gemma-2-9b --precision bf16 --lora-rank 16 --checkpointing every_block "
                       "--seq-len 4096",
    "7B pure bf16, stochastic rounding": "--preset 7B --precision bf16 --bf16-rounding stochastic",
    "70B on 64 GPUs (tp, pp, dp)": "--hf-config llama-2-70b --tp 8 --pp 4 --dp 2 --zero 1 --schedule 1f1b "
                                   "--micro-batches 16 --checkpointing every_block",
}


def best_seconds(arguments: str, runs: int) -> tuple[float, float]:
    """The fastest wall time and the fewest CPU seconds of ``runs`` fresh ``python -m utils.calculator`` processes."""
    best_wall = best_cpu = float("inf")
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "utils.calculator", *arguments.split()], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        best_wall, best_cpu = min(best_wall, wall), min(best_cpu, cpu)
    return best_wall, best_cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per command (default 5)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = platform.processor() or platform.machine()
    print(f"python -m utils.calculator, best of {args.runs} fresh processes: wall seconds, CPU seconds; {cpu}, "
          f"{cores} cores, Python {platform.python_version()}; load average {os.getloadavg()[0]:.1f}")
    for label, arguments in COMMANDS.items():
        wall, cpu_seconds = best_seconds(arguments, args.runs)
        print(f"{wall:6.2f} s wall {cpu_seconds:6.2f} s CPU  {label}: {arguments}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
