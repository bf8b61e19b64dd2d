"""How fast a number format runs on this machine, measured by a small probe, and sizes scaled to it.

Introduced in notebook 04 (mixed precision); notebooks 08, 10 and 17 size their 16-bit sections with it. A CPU with
native bf16 (AVX512-BF16 or AMX) multiplies bf16 matrices faster than fp32; a CPU with AVX2 only (many laptops,
CI runners, AMD EPYC before Zen 4) emulates bf16 and fp16 and is tens of times *slower* (the probe measures by
how much), so a section that trains for 60 steps in bf16 takes seconds on one machine and twenty minutes on the
other. A notebook measures the format first, then sizes the affected sections from the measurement and says what it
changed.

The probe can be faked for tests: ``PYTORCH_INTRO_FORMAT_SLOWDOWN="bfloat16=40,float16=40"`` makes
:func:`format_speed` report those ratios without timing anything.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

FAKE_SLOWDOWN_VARIABLE = "PYTORCH_INTRO_FORMAT_SLOWDOWN"
# a format this many times slower than fp32 (or more) is "slow": sections that train in it are scaled down
SLOW_RATIO = 3.0
PROBE_SIZE = 256          # the probe multiplies (PROBE_SIZE x PROBE_SIZE) @ (PROBE_SIZE x PROBE_SIZE)


@dataclass(frozen=True)
class FormatSpeed:
    """A format's matmul time relative to fp32 on one device.

    Attributes:
        dtype: the format probed (``torch.bfloat16``, ``torch.float16``).
        device: the device's type (``"cpu"``, ``"cuda"``).
        ratio: the fastest of several ``dtype`` matmuls divided by the fastest fp32 one of the same shape (above 1:
            slower). The fastest call, not the median: on a busy machine a call is only ever slowed down, by other
            work, so the minimum is the closest to the format's own speed.
        faked: True when the ratio came from ``PYTORCH_INTRO_FORMAT_SLOWDOWN``, not from a measurement.
    """

    dtype: torch.dtype
    device: str
    ratio: float
    faked: bool = False

    @property
    def slow(self) -> bool:
        """Whether the format is at least ``SLOW_RATIO`` times slower than fp32 here (emulated, not native)."""
        return self.ratio >= SLOW_RATIO

    def scale(self, value: int, *, minimum: int = 1) -> int:
        """``value`` (a step count, a width, a number of tokens) cut for a slow format, else unchanged.

        A slow format's work is divided by ``ratio / SLOW_RATIO``, so that a section costs about what it would at
        ``SLOW_RATIO`` times fp32's time; never below ``minimum`` (the smallest size at which the lesson and its
        assertions still hold).

        Example:
            >>> STEPS = speed.scale(60, minimum=12)       # 60 on a native-bf16 CPU, 12 or more where bf16 is 40x slower
        """
        if not isinstance(value, int) or not isinstance(minimum, int) or value < 1 or minimum < 1:
            raise ValueError(f"value and minimum must be positive ints, got {value!r} and {minimum!r}")
        if not self.slow:
            return value
        return max(min(minimum, value), math.floor(value * SLOW_RATIO / self.ratio))

    def sentence(self) -> str:
        """What the probe found, for a notebook's Runtime note: e.g. ``bf16 matmuls take 41.2x fp32's time on this
        cpu (emulated: sections that train in bf16 are scaled down)``."""
        name = str(self.dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float16", "fp16")
        how = (f"take {self.ratio:.1f}x fp32's time" if self.ratio >= 1 else
               f"take {self.ratio:.2g}x fp32's time ({1 / self.ratio:.1f}x faster)")
        verdict = ("emulated, not native: sections that compute in it are scaled down" if self.slow
                   else "native enough: sections keep their full size")
        source = " (faked by PYTORCH_INTRO_FORMAT_SLOWDOWN)" if self.faked else ""
        return f"{name} matmuls {how} on this {self.device}{source}: {verdict}"


def _faked_ratio(dtype: torch.dtype) -> float | None:
    raw = os.environ.get(FAKE_SLOWDOWN_VARIABLE, "").strip()
    if not raw:
        return None
    ratios = {}
    for item in raw.split(","):
        name, _, value = item.partition("=")
        try:
            ratios[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"{FAKE_SLOWDOWN_VARIABLE}={raw!r}: expected 'dtype=ratio' items separated by commas, "
                             f"e.g. 'bfloat16=40,float16=40'") from None
    return ratios.get(str(dtype).replace("torch.", ""))


def format_speed(dtype: torch.dtype, device: torch.device | str, *, repeats: int = 7) -> FormatSpeed:
    """Measure how long a ``dtype`` matmul takes against an fp32 one on ``device`` (a probe of a few milliseconds).

    Args:
        dtype: the format to probe, usually ``torch.bfloat16`` or ``torch.float16``.
        device: where to probe; on CUDA the matmuls are synchronised.
        repeats: timed calls of each format after one warm-up (the fastest is kept).

    Returns:
        A :class:`FormatSpeed`; ``ratio`` is above 1 where the format is slower than fp32.

    Example:
        >>> speed = format_speed(torch.bfloat16, "cpu")
        >>> print(speed.sentence())
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    device = torch.device(device)
    faked = _faked_ratio(dtype)
    if faked is not None:
        return FormatSpeed(dtype, device.type, faked, faked=True)

    def fastest_s(kind: torch.dtype) -> float:
        a = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device).to(kind)
        b = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device).to(kind)
        times = []
        for index in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if index:                                   # the first call warms up (and loads kernels)
                times.append(time.perf_counter() - start)
        return min(times)

    # one thread on a CPU: with several, a busy machine's other work lands on the fp32 and the emulated format
    # unevenly (an AVX2 CPU read ~3x with two threads under load, 300-650x with one), and the ratio is what matters
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        return FormatSpeed(dtype, device.type, fastest_s(dtype) / max(fastest_s(torch.float32), 1e-9))
    finally:
        torch.set_num_threads(threads)
