"""The few plot kinds the notebooks share: memory timelines and stacked footprint bars.

Introduced in notebooks 00 and 01. Every plot is in MiB and names the device in its title, and
``save_figure`` writes a PNG into ``build/figures/`` so that ``make run`` collects them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from .env import build_dir
from .memory import MemoryMeasurement, to_mib

PHASE_COLORS = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green",
                "zero_grad": "tab:gray", "parameters": "tab:purple"}


def plot_memory_timeline(measurements: MemoryMeasurement | Mapping[str, MemoryMeasurement], *,
                         title: str = "Memory over one region", ax: Axes | None = None) -> Figure:
    """Draw allocated memory (MiB above baseline) against event number, coloured by phase.

    Args:
        measurements: one ``MemoryMeasurement``, or several by label (drawn as separate lines,
            e.g. ``{"no checkpointing": a, "checkpointing": b}``).
        title: the plot's title; the device is appended.
        ax: draw into these axes instead of a new figure.

    Returns:
        The figure.
    """
    if isinstance(measurements, MemoryMeasurement):
        measurements = {"": measurements}
    if not isinstance(measurements, Mapping) or not all(isinstance(m, MemoryMeasurement) for m in measurements.values()):
        raise TypeError("expected a MemoryMeasurement or a mapping of label -> MemoryMeasurement")
    if not measurements:
        raise ValueError("nothing to plot: no measurements given")
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 4))
    fig = ax.figure
    single = len(measurements) == 1
    devices = sorted({m.device for m in measurements.values()})
    for label, measurement in measurements.items():
        if not measurement.timeline:
            raise ValueError(f"measurement {label!r} has no timeline (was it taken with timeline=False?)")
        events = [s.event for s in measurement.timeline]
        mib = [to_mib(s.bytes) for s in measurement.timeline]
        if single:
            ax.step(events, mib, where="post", color="black", linewidth=0.8)
            _shade_phases(ax, measurement)
        else:
            ax.step(events, mib, where="post", label=f"{label} (peak {measurement.peak_mib:.1f} MiB)")
    ax.set_xlabel("event (allocations and frees, in order)")
    ax.set_ylabel("allocated above baseline (MiB)")
    ax.set_title(f"{title}\n{', '.join(devices)}")
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _shade_phases(ax: Axes, measurement: MemoryMeasurement) -> None:
    """Colour the span of each phase and label it once in the legend."""
    samples = measurement.timeline
    start = 0
    labelled: set[str] = set()
    for index in range(1, len(samples) + 1):
        if index == len(samples) or samples[index].phase != samples[start].phase:
            phase = samples[start].phase
            color = PHASE_COLORS.get(phase, "tab:olive")
            end_event = samples[index - 1].event if index == len(samples) else samples[index].event
            ax.axvspan(samples[start].event, end_event, color=color, alpha=0.2,
                       label=None if phase in labelled else phase)
            labelled.add(phase)
            start = index


def plot_stacked_bars(categories: Sequence[str], components: Mapping[str, Sequence[float]], *,
                      device: str, title: str, xlabel: str, ax: Axes | None = None,
                      overlay: Mapping[str, Sequence[float]] | None = None) -> Figure:
    """Stacked bars of memory components (given in bytes, drawn in MiB), one bar per category.

    Args:
        categories: the bar labels (e.g. batch sizes).
        components: label -> bytes for each category, stacked bottom to top in the given order.
        device: the device's name, put in the title.
        title, xlabel: texts.
        ax: axes to draw into.
        overlay: optional label -> bytes per category drawn as markers (e.g. the measured peak).

    Returns:
        The figure.
    """
    if not components:
        raise ValueError("nothing to plot: no components given")
    for label, values in {**components, **(overlay or {})}.items():
        if len(values) != len(categories):
            raise ValueError(f"component {label!r} has {len(values)} values for {len(categories)} categories")
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 4))
    fig = ax.figure
    positions = range(len(categories))
    bottom = [0.0] * len(categories)
    for label, values in components.items():
        mib = [to_mib(v) for v in values]
        ax.bar(positions, mib, bottom=bottom, label=label)
        bottom = [b + m for b, m in zip(bottom, mib)]
    for label, values in (overlay or {}).items():
        ax.plot(positions, [to_mib(v) for v in values], "k_", markersize=30, markeredgewidth=2, label=label)
    ax.set_xticks(list(positions), [str(c) for c in categories])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MiB")
    ax.set_title(f"{title}\n{device}")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def save_figure(fig: Figure, name: str) -> Path:
    """Save a figure as ``build/figures/<name>.png`` and return the path.

    Args:
        fig: the matplotlib figure.
        name: a file stem such as ``"00_step_timeline"`` (letters, digits, ``_`` and ``-``).
    """
    if not isinstance(fig, Figure):
        raise TypeError(f"expected a matplotlib Figure, got {type(fig).__name__}")
    if not name or not all(ch.isalnum() or ch in "_-" for ch in name):
        raise ValueError(f"figure name must be letters, digits, '_' or '-', got {name!r}")
    path = build_dir() / "figures" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
