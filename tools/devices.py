"""Naming the machine behind a run: a readable description and a folder-safe slug.

Used by `make run` (tools/run_notebooks.py records the device with each notebook's runtime) and by
`make results` (tools/save_results.py files a run under ``results/<device-slug>/``). The slug is
computed, never typed: the GPU's name on a CUDA machine (``nvidia-h100-80gb-hbm3``), else the CPU
model from /proc/cpuinfo and the number of threads torch uses
(``intel-xeon-platinum-8375c-cpu-2-90ghz-2-threads``).
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

SLUG_PATTERN = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
# Words that make a device name longer without telling two devices apart.
_NOISE = re.compile(r"\((?:r|tm)\)|\bprocessor\b|\bwith\b.*$", re.IGNORECASE)


def slugify(name: str) -> str:
    """Turn a device name into a lower-case folder name of letters, digits and single hyphens.

    Args:
        name: e.g. ``"Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz, 2 threads"``.

    Returns:
        e.g. ``"intel-xeon-platinum-8375c-cpu-2-90ghz-2-threads"``.

    Raises:
        ValueError: nothing usable is left of ``name`` (empty or only punctuation).

    Example:
        >>> slugify("NVIDIA H100 80GB HBM3")
        'nvidia-h100-80gb-hbm3'
    """
    if not isinstance(name, str):
        raise TypeError(f"a device name must be a string, not {type(name).__name__}")
    slug = re.sub(r"[^a-z0-9]+", "-", _NOISE.sub(" ", name).lower()).strip("-")
    if not slug:
        raise ValueError(f"cannot make a folder name out of the device name {name!r}")
    return slug


def cpu_model(cpuinfo: Path | str = "/proc/cpuinfo") -> str:
    """The CPU's model name from /proc/cpuinfo, or ``platform.processor()``/machine where absent."""
    path = Path(cpuinfo)
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return " ".join(value.split())
    return platform.processor() or f"CPU {platform.machine()}"


def describe_device(device: str | None = None) -> dict[str, object]:
    """What ran the notebooks: the device's name and slug, torch's version, the CPU and its threads.

    Args:
        device: ``"cpu"`` or ``"cuda"``/``"cuda:N"``; ``None`` picks what the notebooks pick
            (CUDA when available).

    Returns:
        A JSON-ready dict with ``name``, ``slug``, ``kind`` (``"cpu"`` or ``"cuda"``), ``torch``,
        ``cpu_model``, ``threads``, ``gpu`` (the GPU's name or None) and ``environment`` (the
        one-line report the notebooks print).
    """
    import torch

    import utils

    chosen = utils.pick_device(device)
    threads = torch.get_num_threads()
    cpu = cpu_model()
    capability = torch.backends.cpu.get_cpu_capability()        # "AVX512", "AVX2", "DEFAULT", ...
    gpu = torch.cuda.get_device_name(chosen) if chosen.type == "cuda" else None
    name = gpu if gpu else f"{cpu}{cpu_kind(capability)}, {threads} threads"
    return {
        "name": name,
        "slug": slugify(name),
        "kind": chosen.type,
        "torch": torch.__version__,
        "cpu_model": cpu,
        "cpu_capability": capability,
        "threads": threads,
        "gpu": gpu,
        "environment": utils.environment_report(chosen),
    }


def cpu_kind(capability: str, forced: str | None = None) -> str:
    """What a CPU's name needs to tell two kinds of one model apart: ``""`` for one with AVX-512 (native bf16 on
    the Xeons this course is filed on), ``" (AVX2)"`` for a CPU whose widest vector unit torch uses is AVX2 (bf16
    and fp16 matmuls tens of times slower than fp32: notebooks size their 16-bit sections down there), and
    ``" (AVX2, emulated)"`` when ``ATEN_CPU_CAPABILITY`` forced torch below what the processor has.

    Args:
        capability: ``torch.backends.cpu.get_cpu_capability()``.
        forced: the ``ATEN_CPU_CAPABILITY`` variable (read from the environment when None).
    """
    import os

    forced = os.environ.get("ATEN_CPU_CAPABILITY", "") if forced is None else forced
    if capability.upper().startswith("AVX512"):
        return ""
    return f" ({capability}, emulated)" if forced else f" ({capability})"
