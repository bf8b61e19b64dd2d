"""What notebook 16 keeps out of its recipe: the arithmetic of how often to save, and a folder fsync.

Notebook 16 writes the checkpoint recipe itself in plain PyTorch (the complete training state, an
atomic save, a ``torch.load(weights_only=True)`` restore) and runs it. What stays here:

- how often to save: Young's and Daly's interval, the expected overhead, and a simulation of
  preemptions that checks them (``young_daly_interval``, ``expected_overhead``, ``simulate_preemptions``);
- ``_fsync_directory``, which makes a rename durable (the distributed checkpoint of notebook 12 uses it).
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path


# --- files -------------------------------------------------------------------------------------

def _fsync_directory(directory: Path) -> None:
    """Persist a rename: on POSIX the directory entry lives in the directory's own blocks."""
    if os.name != "posix":  # Windows cannot open a directory; its rename is journaled by NTFS
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- how often to save --------------------------------------------------------------------------

def _positive_float(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def young_daly_interval(save_cost_s: float, mtbf_s: float, *, daly: bool = False) -> float:
    """The checkpoint interval (compute time between saves) that minimises expected lost time.

    Young (1974): ``sqrt(2 * C * M)`` for save cost ``C`` and mean time between failures ``M``.
    Daly (2006) adds higher-order terms: ``sqrt(2CM) * (1 + sqrt(C / 2M) / 3 + C / 18M) - C`` for
    ``C < 2M`` (and ``M`` beyond that).

    Args:
        save_cost_s: seconds one save stalls training.
        mtbf_s: mean seconds between preemptions (an assumption about your cloud, not a measurement).
        daly: use Daly's higher-order formula.

    Returns:
        Seconds of training between two saves.

    Example:
        >>> round(young_daly_interval(2.0, 3600.0))
        120
    """
    cost, mtbf = _positive_float("save_cost_s", save_cost_s), _positive_float("mtbf_s", mtbf_s)
    young = math.sqrt(2 * cost * mtbf)
    if not daly:
        return young
    if cost >= 2 * mtbf:
        return mtbf
    return young * (1 + math.sqrt(cost / (2 * mtbf)) / 3 + cost / (18 * mtbf)) - cost


def expected_overhead(interval_s: float, save_cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """First-order expected overhead, as a fraction of the useful compute time.

    Each interval pays one save (``C / tau``); each preemption, about once per ``M`` seconds, loses
    half an interval plus its save on average and pays a restart: ``(tau + C) / 2M + R / M``.
    Minimising ``C / tau + tau / 2M`` over ``tau`` gives Young's ``sqrt(2CM)``.

    Args:
        interval_s: seconds of training between saves.
        save_cost_s, mtbf_s: as in ``young_daly_interval``.
        restart_s: seconds to restart after a preemption (new process, load the checkpoint).

    Returns:
        Expected extra wall time per unit of training time (0.01 = 1 %).

    Example:
        >>> round(expected_overhead(120.0, 2.0, 3600.0), 4)   # at Young's interval
        0.0336
    """
    tau = _positive_float("interval_s", interval_s)
    cost, mtbf = _positive_float("save_cost_s", save_cost_s), _positive_float("mtbf_s", mtbf_s)
    if isinstance(restart_s, bool) or not isinstance(restart_s, (int, float)) or restart_s < 0:
        raise ValueError(f"restart_s must be a non-negative number of seconds, got {restart_s!r}")
    return cost / tau + (tau + cost) / (2 * mtbf) + restart_s / mtbf


def simulate_preemptions(interval_s: float, save_cost_s: float, mtbf_s: float, work_s: float, *,
                         restart_s: float = 0.0, num_runs: int = 200, seed: int = 0) -> tuple[float, float]:
    """Simulate training runs interrupted by preemptions; return the mean overhead and its standard error.

    Each run needs ``work_s`` seconds of training, done as intervals of ``interval_s`` each followed
    by a save of ``save_cost_s``. Preemptions arrive as a Poisson process (exponential gaps, mean
    ``mtbf_s``; also during saves and restarts); a preemption loses everything since the last
    *completed* save, then the run restarts (``restart_s``) from that save.

    Args:
        interval_s, save_cost_s, mtbf_s, restart_s: seconds, as in ``expected_overhead``.
        work_s: seconds of training the run needs.
        num_runs: simulated runs.
        seed: seeds a private ``random.Random`` (the global generators are untouched).

    Returns:
        ``(mean, standard_error)`` of ``wall_time / work_s - 1`` over the runs.
    """
    tau = _positive_float("interval_s", interval_s)
    cost, mtbf = _positive_float("save_cost_s", save_cost_s), _positive_float("mtbf_s", mtbf_s)
    work = _positive_float("work_s", work_s)
    if isinstance(num_runs, bool) or not isinstance(num_runs, int) or num_runs < 2:
        raise ValueError(f"num_runs must be an int >= 2, got {num_runs!r}")
    if isinstance(restart_s, bool) or not isinstance(restart_s, (int, float)) or restart_s < 0:
        raise ValueError(f"restart_s must be a non-negative number of seconds, got {restart_s!r}")
    generator = random.Random(seed)
    full_segments = int(work // tau)
    last_segment = work - tau * full_segments   # a shorter final interval (0 when tau divides the work)
    overheads = []
    for _ in range(num_runs):
        wall, done, pending_restart = 0.0, 0, 0.0   # done: full intervals saved so far
        finished = False
        while not finished:
            # time until the next preemption; the run goes through restart, intervals and saves
            remaining = generator.expovariate(1.0 / mtbf)
            if remaining < pending_restart:           # preempted while restarting
                wall += remaining
                continue
            remaining -= pending_restart
            wall += pending_restart
            # whole (interval + save) pairs that fit before the preemption (arithmetic, not a loop)
            fit = min(full_segments - done, int(remaining // (tau + cost)))
            done += fit
            remaining -= fit * (tau + cost)
            wall += fit * (tau + cost)
            if done == full_segments and (last_segment <= 1e-12 or remaining >= last_segment + cost):
                wall += last_segment + cost if last_segment > 1e-12 else 0.0
                finished = True
            else:                                     # preempted inside an interval or its save: lost
                wall += remaining
                pending_restart = restart_s
        overheads.append(wall / work - 1.0)
    mean = sum(overheads) / num_runs
    variance = sum((o - mean) ** 2 for o in overheads) / (num_runs - 1)
    return mean, math.sqrt(variance / num_runs)
