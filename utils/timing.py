"""Honest timing: warm-up, synchronisation, repeats, median and spread.

Introduced in notebook 00. CUDA kernels run asynchronously: a host clock read right after a
launch measures the launch, not the work. ``time_fn`` therefore times each repeat with CUDA events
(and synchronises) on CUDA, and with ``time.perf_counter`` on the CPU, after warm-up calls that pay
for one-off costs (allocator growth, cuDNN autotuning, lazy initialisation, compilation).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .env import check_mode as _check_mode
from .env import device_name


@dataclass(frozen=True)
class Timing:
    """Times of repeated calls, in milliseconds.

    Attributes:
        device: the device's human name.
        samples_ms: one time per repeat, in call order.
        warmup: calls made before timing started.
    """

    device: str
    samples_ms: tuple[float, ...]
    warmup: int

    @property
    def median_ms(self) -> float:
        """Median time per call: robust to the odd slow repeat."""
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        """Fastest call."""
        return min(self.samples_ms)

    @property
    def spread_ms(self) -> float:
        """Interquartile range (75th minus 25th percentile): how noisy the measurement is."""
        if len(self.samples_ms) < 2:
            return 0.0
        quartiles = statistics.quantiles(self.samples_ms, n=4, method="inclusive")
        return quartiles[2] - quartiles[0]

    def summary(self) -> str:
        """e.g. ``12.31 ms median (IQR 0.40 ms, 10 repeats after 2 warm-up) on CPU x86_64, 2 threads``."""
        return (f"{self.median_ms:.3f} ms median (IQR {self.spread_ms:.3f} ms, {len(self.samples_ms)} repeats "
                f"after {self.warmup} warm-up) on {self.device}")


def time_fn(fn: Callable[[], object], device: torch.device | str, *, warmup: int = 2,
            repeats: int = 10, max_seconds: float | None = None) -> Timing:
    """Time ``fn()`` honestly: warm-up calls, then ``repeats`` timed calls.

    Args:
        fn: a function of no arguments (wrap arguments with a lambda or functools.partial).
        device: where the work runs; on CUDA each call is timed with CUDA events recorded on that
            device's current stream (``"cuda:1"`` times cuda:1's work whichever device is current).
        warmup: untimed calls first (>= 0).
        repeats: timed calls (>= 1).
        max_seconds: stop repeating once the timed calls have taken this long (at least one call is
            always timed). For a case that may be very slow on some hardware (fp16 matmuls on most
            CPUs): ``len(timing.samples_ms)`` then says how many repeats were made. None: no limit.

    Returns:
        A ``Timing`` with the median and interquartile range.

    Example:
        >>> timing = time_fn(lambda: model(x).sum().backward(), "cpu", warmup=1, repeats=5)
        >>> timing.median_ms

    Known limitations:
        Each repeat is timed separately, so on CUDA the launch gaps between calls are included;
        for kernels of a few microseconds, time a loop of many calls instead.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if max_seconds is not None and (isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float))
                                    or not max_seconds > 0):
        raise ValueError(f"max_seconds must be a positive number of seconds or None, got {max_seconds!r}")
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if on_cuda:
        torch.cuda.synchronize(device)
    stream = torch.cuda.current_stream(device) if on_cuda else None  # the timed device's, not the current one's
    for _ in range(repeats):
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - started) * 1e3)
        if max_seconds is not None and sum(samples) >= max_seconds * 1e3:
            break
    return Timing(device=device_name(device), samples_ms=tuple(samples), warmup=warmup)


def time_interleaved(fns: dict[str, Callable[[], object]], device: torch.device | str, *, warmup: int = 2,
                     repeats: int = 10) -> dict[str, Timing]:
    """Time several functions round-robin: repeat 1 of each, then repeat 2 of each, and so on.

    Why: a machine's speed drifts (another process starts, the clock throttles, two threads share a core with a
    neighbour). Timed one series after another, the drift lands on one series and reads as "faster" or "slower";
    each series' own spread cannot see it. Interleaved, every series meets the same drift, so the ratio of their
    medians (``compare``) holds on a loaded machine too. Introduced in notebook 00; used wherever a notebook
    compares settings' step times.

    Args:
        fns: name -> a function of no arguments, in the order to call them.
        device: where the work runs (as ``time_fn``: CUDA events on CUDA, ``time.perf_counter`` on the CPU).
        warmup: untimed rounds first (>= 0): each function called this many times.
        repeats: timed rounds (>= 1).

    Returns:
        name -> ``Timing``, each with ``repeats`` samples.

    Example:
        >>> timings = time_interleaved({"eager": eager_step, "compiled": compiled_step}, "cpu", repeats=9)
        >>> compare(timings["eager"], timings["compiled"]).sentence("compiled", "eager")
    """
    if not isinstance(fns, dict) or not fns or not all(callable(fn) for fn in fns.values()):
        raise TypeError(f"fns must be a non-empty dict of name -> function of no arguments, got {fns!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].extend(time_fn(fn, device, warmup=0, repeats=1).samples_ms)
    return {name: Timing(device=device_name(torch.device(device)), samples_ms=tuple(times), warmup=warmup)
            for name, times in samples.items()}


def speedup(baseline: Timing, candidate: Timing) -> float:
    """How many times faster ``candidate`` is than ``baseline`` (ratio of medians, > 1 is faster).

    Both timings should come from the same run on the same device: ratios travel between
    machines far better than absolute times.
    """
    if baseline.device != candidate.device:
        raise ValueError(f"timings come from different devices: {baseline.device!r} vs {candidate.device!r}")
    return baseline.median_ms / candidate.median_ms


#: Fewer repeats than this give an IQR that means little: a comparison then says it cannot tell.
MIN_REPEATS_FOR_VERDICT = 5


def format_band(noise: float) -> str:
    """A relative noise band as printed beside a ratio: ``"±12 %"``, ``"±0.4 %"``, ``"±<0.1 %"``.

    One decimal under 10 %, so that a narrow band (a GPU's steady kernels) never prints as "±0 %".

    Raises:
        ValueError: ``noise`` is negative or not a finite number.
    """
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not 0 <= noise < float("inf"):
        raise ValueError(f"noise must be a finite relative band >= 0 (0.05 for 5 %), got {noise!r}")
    percent = 100 * noise
    if percent < 0.05:
        return "±<0.1 %"
    return f"±{percent:.1f} %" if percent < 9.95 else f"±{percent:.0f} %"


@dataclass(frozen=True)
class Comparison:
    """Two timings from the same run, compared against their own noise.

    Attributes:
        ratio: baseline median / candidate median (> 1: the candidate is faster).
        noise: the relative noise band of that ratio: the two timings' IQRs relative to their medians,
            added (a ratio inside ``[1 / (1 + noise), 1 + noise]`` is not told apart from 1).
        verdict: ``"faster"``, ``"slower"``, ``"within noise"`` or ``"too few repeats"``.
        repeats: the fewer of the two timings' repeat counts.
        max_repeats: the larger of the two counts (None: not recorded, taken as ``repeats``).
        check_mode: the timings come from check mode's tiny sizes (``compare`` reads ``utils.check_mode()``):
            there a band wider than the difference says that the sizes are too small to judge, not that the two
            run equally fast, and ``sentence`` says so instead of printing the band.
    """

    ratio: float
    noise: float
    verdict: str
    repeats: int
    max_repeats: int | None = None
    check_mode: bool = False

    @property
    def effect(self) -> float:
        """The size of the difference, on the band's scale: ``ratio - 1`` for a faster candidate, ``1 / ratio - 1``
        for a slower one (0.25: one of the two took 25 % longer). The verdict is "within noise" exactly when the
        band is at least this wide."""
        return self.ratio - 1 if self.ratio >= 1 else 1 / self.ratio - 1

    @property
    def too_small_to_judge(self) -> bool:
        """True in check mode when the noise band is wider than the effect: check mode's sizes are too small for
        a verdict (a band of ±200 % says nothing about the full-size lesson)."""
        return self.check_mode and self.verdict == "within noise" and self.noise >= self.effect

    def sentence(self, candidate: str, baseline: str) -> str:
        """The comparison in words, its verdict judged against the noise band.

        A ratio of at least 1 reads "ran ...x as fast"; below 1 it reads "took ...x as long" (the inverse
        ratio), so a candidate 18.7 times slower is not reported as "0.05x as fast". The repeat count is
        the fewer of the two timings' ("at least N repeats each" where the counts differ).

        In check mode a band wider than the effect is not printed: the sentence says that check mode's sizes are
        too small to judge (``too_small_to_judge``), since a verdict at those sizes says nothing about the lesson's.

        Example: ``bf16 ran 1.94x as fast as fp32 (noise band ±12 %, 10 repeats each): faster here``; in check
        mode, ``bf16 took 1.10x as long as fp32 (5 repeats each): check mode's sizes are too small to judge this
        timing (its noise exceeds the difference); the full lesson measures it``.
        """
        what = {"faster": "faster here", "slower": "slower here",
                "within noise": "within noise here: no difference this run can tell",
                "too few repeats": f"too few repeats (< {MIN_REPEATS_FOR_VERDICT}) to tell"}[self.verdict]
        if self.ratio >= 1:
            how = f"ran {self.ratio:.2f}x as fast as"
        else:
            how = f"took {1 / self.ratio:.2f}x as long as"
        counted = (f"{self.repeats} repeats each" if self.max_repeats in (None, self.repeats)
                   else f"at least {self.repeats} repeats each")
        if self.too_small_to_judge:
            return (f"{candidate} {how} {baseline} ({counted}): check mode's sizes are too small to judge this timing "
                    f"(its noise exceeds the difference); the full lesson measures it")
        return f"{candidate} {how} {baseline} (noise band {format_band(self.noise)}, {counted}): {what}"


def compare(baseline: Timing, candidate: Timing) -> Comparison:
    """Is ``candidate`` faster or slower than ``baseline``, or is the difference inside the noise?

    A timing verdict printed from a ratio of medians flips on a loaded machine; this one is computed
    against the spread measured in the same run: the verdict is "faster" only when the ratio exceeds
    ``1 + noise``, "slower" only below ``1 / (1 + noise)``, where ``noise`` adds the two timings'
    interquartile ranges relative to their medians.

    Args:
        baseline: the reference timing (e.g. fp32, eager, no checkpointing).
        candidate: the timing being judged, from the same run and device.

    Returns:
        A ``Comparison`` (ratio, noise band, verdict, and whether it was measured in check mode); ``sentence()``
        prints it, and in check mode, where the band is wider than the difference, says that the sizes are too
        small to judge rather than printing the band.

    Raises:
        ValueError: the timings come from different devices.

    Example:
        >>> result = compare(time_fn(fp32_step, "cpu", repeats=10), time_fn(bf16_step, "cpu", repeats=10))
        >>> print(result.sentence("bf16", "fp32"))
    """
    if baseline.device != candidate.device:
        raise ValueError(f"timings come from different devices: {baseline.device!r} vs {candidate.device!r}")
    ratio = baseline.median_ms / candidate.median_ms
    noise = baseline.spread_ms / baseline.median_ms + candidate.spread_ms / candidate.median_ms
    repeats = min(len(baseline.samples_ms), len(candidate.samples_ms))
    max_repeats = max(len(baseline.samples_ms), len(candidate.samples_ms))
    if repeats < MIN_REPEATS_FOR_VERDICT:
        verdict = "too few repeats"
    elif ratio > 1 + noise:
        verdict = "faster"
    elif ratio < 1 / (1 + noise):
        verdict = "slower"
    else:
        verdict = "within noise"
    return Comparison(ratio=ratio, noise=noise, verdict=verdict, repeats=repeats, max_repeats=max_repeats,
                      check_mode=_check_mode())
