"""Check mode, device choice, seeding and a one-line environment report.

Introduced in notebook 00. Every notebook starts with ``CHECK_MODE = utils.check_mode()`` so that
``PYTORCH_INTRO_CHECK_MODE=1`` picks the small, fast path used by CI.
"""

from __future__ import annotations

import os
import platform
import random
from pathlib import Path
from typing import Any, Mapping

import torch

CHECK_MODE_VARIABLE = "PYTORCH_INTRO_CHECK_MODE"
_FULL_VALUES = ("", "0")
_CHECK_VALUES = ("1",)


def check_mode() -> bool:
    """Read ``PYTORCH_INTRO_CHECK_MODE`` and say whether the notebook takes its small, fast path.

    Unset, ``""`` or ``"0"`` means the full lesson; ``"1"`` means check mode (tiny sizes, few steps,
    every assertion still runs). Any other value is an error rather than silently "off", so that a
    CI job written with ``=yes`` or ``=true`` fails loudly instead of running for an hour.

    Returns:
        True in check mode, False for the full lesson.

    Raises:
        ValueError: the variable holds something other than the accepted values.

    Example:
        >>> CHECK_MODE = check_mode()
        >>> NUM_STEPS = 3 if CHECK_MODE else 200
    """
    raw = os.environ.get(CHECK_MODE_VARIABLE)
    if raw is None:
        return False
    value = raw.strip()
    if value in _FULL_VALUES:
        return False
    if value in _CHECK_VALUES:
        return True
    raise ValueError(
        f"{CHECK_MODE_VARIABLE}={raw!r} is not understood: use 1 for check mode "
        f"(small and fast), or 0, an empty value or leave it unset for the full lesson."
    )


def pick_device(prefer: str | torch.device | None = None) -> torch.device:
    """Choose the device a notebook runs on: CUDA when available, else the CPU.

    Args:
        prefer: force a device ("cpu", "cuda", "cuda:1" or a ``torch.device``). ``None`` picks
            ``cuda`` if ``torch.cuda.is_available()`` and ``cpu`` otherwise.

    Returns:
        The chosen ``torch.device``.

    Raises:
        TypeError: ``prefer`` is neither None, a string nor a ``torch.device``.
        ValueError: CUDA was asked for on a machine without it.
    """
    if prefer is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(prefer, (str, torch.device)):
        raise TypeError(f"prefer must be None, a device string or a torch.device, not {type(prefer).__name__}")
    device = torch.device(prefer)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for, but torch.cuda.is_available() is False here")
    return device


def device_name(device: torch.device | str) -> str:
    """A short human name for a device, used in plot titles and recorded results.

    On CUDA this is the GPU's name (e.g. ``"NVIDIA H100 80GB HBM3"``); on the CPU the processor
    architecture and the number of threads torch uses (e.g. ``"CPU x86_64, 2 threads"``).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    return f"CPU {platform.machine()}, {threads} thread{'s' if threads != 1 else ''}"


def supports_bf16(device: torch.device | str) -> bool:
    """Whether to train in bf16 there: on CUDA where it is native (compute capability 8.0+: A100, H100, RTX 30xx
    on), and on any CPU.

    On CUDA this asks the device's capability, not ``torch.cuda.is_bf16_supported()``, whose default
    (``including_emulation=True``) also answers True on a T4 (7.5), where bf16 is emulated, slow, and
    gets neither Inductor nor the flash kernels; there fp16 with a GradScaler is the format. CPUs always *run*
    bf16, natively with AVX512-BF16 or AMX and emulated, slower than fp32, without them: :func:`cpu_bf16_native`
    says which. CPU autocast runs fp16 too (with a GradScaler, as on a GPU). Whether either 16-bit format is faster
    than fp32 depends on the CPU, so the notebooks that compute in 16 bits measure each format's speed on the
    machine (``utils.formats.format_speed``) instead of assuming it.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return True


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")      # /proc/cpuinfo's names of the instructions that multiply bf16


def cpu_bf16_native(flags: set[str] | None = None, capability: str | None = None, onednn_isa: str | None = None,
                    machine: str | None = None) -> bool | None:
    """Whether torch multiplies bf16 natively on this CPU (AVX512-BF16 or AMX instructions, in use): True; emulated,
    slower than fp32: False; None where the CPU's flags cannot be read (not Linux on x86-64).

    Native needs the instructions (``flags``, from /proc/cpuinfo) and kernels allowed to use them: torch's
    ``get_cpu_capability()`` AVX512 (``ATEN_CPU_CAPABILITY=avx2`` lowers it to AVX2) and oneDNN's ISA not capped
    below bf16 (``ONEDNN_MAX_CPU_ISA=AVX2``, say). The arguments stand in for what this machine reports (tests).

    Example:
        >>> cpu_bf16_native({"avx2", "amx_bf16"}, "AVX512", "ALL", "x86_64")
        True
    """
    machine = (platform.machine() if machine is None else machine).lower()
    if machine not in ("x86_64", "amd64"):
        return None
    if flags is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
        flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
        if not flags:
            return None
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    if onednn_isa is None:
        onednn_isa = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL"))
    onednn_isa = onednn_isa.strip().upper() or "ALL"
    isa_allows = onednn_isa in ("ALL", "DEFAULT") or any(name in onednn_isa for name in ("BF16", "AMX", "FP16"))
    return bool(set(BF16_CPU_FLAGS) & set(flags)) and capability.upper().startswith("AVX512") and isa_allows


def autocast_dtype(device: torch.device | str) -> torch.dtype:
    """The 16-bit format to train in on ``device``: bf16 where it is native, fp16 (with a GradScaler) otherwise.

    bf16 has fp32's range, so it needs no loss scaling; fp16 does (notebook 04). A T4 or a V100 has no
    native bf16, so there the notebooks train in fp16 with ``torch.amp.GradScaler`` and say why.

    Example:
        >>> dtype = autocast_dtype(device)
        >>> scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    """
    return torch.bfloat16 if supports_bf16(device) else torch.float16


# Memory classes of the cards readers have: an 8 GB laptop GPU, a free Colab T4 (16 GB), a 24 GB desktop
# card, a 40-48 GB A100/L40S and an 80 GB (or larger) A100/H100. A class is the largest one whose size
# (in GB of 10**9 bytes, as cards are sold, less 10 % for the context and the allocator) fits the card.
MEMORY_CLASSES_GB = (8, 16, 24, 40, 80)


def device_memory_bytes(device: torch.device | str) -> int | None:
    """Total memory of a CUDA device in bytes (``torch.cuda.get_device_properties``); None on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def memory_class_gb(device: torch.device | str) -> int | None:
    """The card's memory class in GB (one of ``MEMORY_CLASSES_GB``), or None on the CPU.

    Raises:
        ValueError: a CUDA device with less than 90 % of 8 GB: the course's GPU sizes need at least that.
    """
    total = device_memory_bytes(device)
    if total is None:
        return None
    fitting = [gb for gb in MEMORY_CLASSES_GB if total >= 0.9 * gb * 10**9]
    if not fitting:
        raise ValueError(f"{torch.device(device)} has {total / 10**9:.1f} GB: the course's GPU sizes expect a card of "
                         f"at least {MEMORY_CLASSES_GB[0]} GB (run on the CPU with utils.pick_device('cpu'))")
    return fitting[-1]


def by_memory(device: torch.device | str, *, cpu: Any, gpu: Mapping[int, Any]) -> Any:
    """Pick a size for this device: ``cpu`` on the CPU, else the entry of ``gpu`` for the largest class that fits.

    Args:
        device: where the notebook runs.
        cpu: the value on a CPU.
        gpu: memory class in GB -> value, e.g. ``{8: 256, 24: 512, 80: 1024}``; it must hold the smallest class
            (8), and a card gets the entry of the largest class at or below its own.

    Raises:
        ValueError: ``gpu`` has no entry for 8 GB, or a key that is not a class of ``MEMORY_CLASSES_GB``.

    Example:
        >>> HIDDEN = 64 if CHECK_MODE else utils.by_memory(DEVICE, cpu=256, gpu={8: 512, 80: 2048})
    """
    unknown = [key for key in gpu if key not in MEMORY_CLASSES_GB]
    if unknown or MEMORY_CLASSES_GB[0] not in gpu:
        raise ValueError(f"gpu must map memory classes {MEMORY_CLASSES_GB} (GB) to values and hold "
                         f"{MEMORY_CLASSES_GB[0]}, got keys {sorted(gpu)}")
    memory_class = memory_class_gb(device)
    if memory_class is None:
        return cpu
    return gpu[max(key for key in gpu if key <= memory_class)]


def environment_report(device: torch.device | str) -> str:
    """One line that names the software and hardware behind every number a notebook prints.

    Example output: ``torch 2.13.0+cpu | CPU x86_64, 2 threads | bf16: native | CPU threads: 2`` (a CPU's bf16:
    ``native``, ``emulated (slower than fp32)`` or, where its flags cannot be read, ``runs``; a GPU's: ``yes`` or
    ``no (fp16 + GradScaler instead)``)
    """
    device = torch.device(device)
    parts = [f"torch {torch.__version__}", device_name(device)]
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        parts.append(f"CUDA {torch.version.cuda}, capability {major}.{minor}")
        parts.append(f"{device_memory_bytes(device) / 10**9:.1f} GB ({memory_class_gb(device)} GB class)")
    if device.type == "cuda":
        parts.append(f"bf16: {'yes' if supports_bf16(device) else 'no (fp16 + GradScaler instead)'}")
    else:                   # a CPU always runs bf16: the question is whether natively
        native = cpu_bf16_native()
        parts.append("bf16: " + {True: "native", False: "emulated (slower than fp32)", None: "runs (native or not: "
                                 "unknown here)"}[native])
    parts.append(f"CPU threads: {torch.get_num_threads()}")
    return " | ".join(parts)


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's random generators (all CUDA devices included).

    Args:
        seed: a non-negative integer.

    Raises:
        TypeError / ValueError: ``seed`` is not a non-negative integer.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, not {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


BUILD_DIR_VARIABLE = "PYTORCH_INTRO_BUILD_DIR"


def build_dir() -> Path:
    """Where executed notebooks, figures and recorded results go: ``build/`` at the repo root.

    ``PYTORCH_INTRO_BUILD_DIR`` moves it (the tests point it at a temporary folder so that a
    check-mode run never overwrites the results of a full ``make run``).
    """
    override = os.environ.get(BUILD_DIR_VARIABLE, "").strip()
    if override:
        return Path(override).resolve()
    return Path(__file__).resolve().parent.parent / "build"
