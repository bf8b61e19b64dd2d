"""Recording a notebook's measured figures, for the tests and for ``make run``'s summary.

Introduced in notebook 00. Each notebook records its headline figures with the device they came
from; the file ``build/results/<notebook>.json`` is rewritten after every ``record`` so a
notebook that fails half-way still leaves what it measured. ``python -m utils.results`` gathers
every file into ``build/results.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .env import build_dir, check_mode, device_name, environment_report

if TYPE_CHECKING:
    from .timing import Comparison, Timing


@dataclass(frozen=True)
class Figure:
    """One recorded figure: ``value`` in ``unit``, measured on ``device``."""

    name: str
    value: float
    unit: str
    device: str
    note: str = ""
    # timing figures only: the relative noise band of the ratio measured in the same run (utils.compare), and
    # the verdict it allowed ("faster", "slower", "within noise", "too few repeats")
    noise: float | None = None
    verdict: str | None = None


class Results:
    """The figures one notebook records.

    Args:
        notebook: the notebook's stem, e.g. ``"00_measuring_memory_and_time"``.
        device: the device the figures come from.

    Example:
        >>> results = Results("00_measuring_memory_and_time", device)
        >>> results.record("step_peak_mib", mem.peak_mib, "MiB")
    """

    def __init__(self, notebook: str, device: torch.device | str) -> None:
        if not isinstance(notebook, str) or not notebook or "/" in notebook:
            raise ValueError(f"notebook must be a notebook's file stem, got {notebook!r}")
        self.notebook = notebook
        self.device = torch.device(device)
        self.figures: dict[str, Figure] = {}
        self.path = build_dir() / "results" / f"{notebook}.json"

    def record(self, name: str, value: float, unit: str, note: str = "", *, noise: float | None = None,
               verdict: str | None = None) -> float:
        """Record (or overwrite) a figure and save the file; returns ``value`` for chaining.

        Args:
            noise: for a timing figure derived from a ``utils.compare`` ratio (an overhead, ``1 / ratio - 1``), the
                relative noise band it was judged by (``comparison.noise``), which the README prints beside it.
            verdict: what that band allows (``comparison.verdict``); for a one-off time that no run repeats (a
                first compile), why it has no band, e.g. ``"one compile, not repeated"``.

        Raises:
            ValueError: an empty name or unit, a value that is not a finite number, a negative or infinite noise.
        """
        if noise is not None and (isinstance(noise, bool) or not isinstance(noise, (int, float))
                                  or not math.isfinite(noise) or noise < 0):
            raise ValueError(f"figure {name!r}: noise must be a finite relative band >= 0, got {noise!r}")
        if verdict is not None and (not isinstance(verdict, str) or not verdict):
            raise ValueError(f"figure {name!r}: verdict must be a non-empty string, got {verdict!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"a figure needs a non-empty name, got {name!r}")
        if not isinstance(unit, str) or not unit:
            raise ValueError(f"figure {name!r} needs a unit (e.g. 'MiB', 'ms', 'x', 'bytes')")
        if isinstance(value, torch.Tensor):
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"figure {name!r} must be a finite number, got {value!r}")
        self.figures[name] = Figure(name, float(value), unit, device_name(self.device), note,
                                    noise=None if noise is None else float(noise), verdict=verdict)
        self.save()
        return value

    def record_comparison(self, name: str, comparison: "Comparison", note: str = "") -> float:
        """Record a timing ratio with the noise band and verdict it was judged by (``utils.compare``).

        The value is ``comparison.ratio`` (baseline time / candidate time, unit ``"x"``); the README prints a
        timing figure with its band, so a reader sees whether it is a difference or the machine's noise.

        Example:
            >>> results.record_comparison("step_speedup_bf16", utils.compare(fp32_timing, bf16_timing))
        """
        return self.record(name, comparison.ratio, "x", note, noise=float(comparison.noise), verdict=comparison.verdict)

    def record_timing(self, name: str, timing: "Timing", note: str = "", *, scale: float = 1.0) -> float:
        """Record a measured time (the median of ``timing``, in ms) with its relative noise band (IQR / median).

        For a time that is not a ratio (a step, a sample), so that the README prints it with its band as it does a
        ``record_comparison`` figure. ``scale`` multiplies the median (``1 / batch_size`` for a per-sample time from
        a timed batch); the band is relative, so it does not change.

        Example:
            >>> results.record_timing("model_step_ms", utils.time_fn(step, device, repeats=10))
        """
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        median = timing.median_ms
        return self.record(name, median * scale, "ms", note, noise=timing.spread_ms / median if median > 0 else 0.0)

    def save(self) -> Path:
        """Write ``build/results/<notebook>.json``."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "notebook": self.notebook,
            "device": device_name(self.device),
            "environment": environment_report(self.device),
            "check_mode": check_mode(),
            "figures": {name: asdict(fig) for name, fig in self.figures.items()},
        }
        self.path.write_text(json.dumps(payload, indent=2) + "\n")
        return self.path


def load_results(notebook: str, directory: Path | str | None = None) -> dict:
    """Read what a notebook recorded: the whole file, with ``["figures"][name]["value"]``.

    Args:
        notebook: the notebook's stem.
        directory: the folder holding ``<notebook>.json`` (default ``build/results``).

    Raises:
        FileNotFoundError: the notebook has recorded nothing there.
    """
    folder = Path(directory) if directory is not None else build_dir() / "results"
    path = folder / f"{notebook}.json"
    if not path.exists():
        raise FileNotFoundError(f"no recorded results for {notebook!r}: {path} does not exist (run the notebook)")
    return json.loads(path.read_text())


def collect(directory: Path | str | None = None) -> list[dict]:
    """Every notebook's results file in ``directory`` (default ``build/results``), by notebook."""
    folder = Path(directory) if directory is not None else build_dir() / "results"
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]


def format_table(all_results: list[dict]) -> str:
    """A plain-text table: notebook, figure, value, unit, device."""
    rows = [("notebook", "figure", "value", "unit", "device")]
    for result in all_results:
        for fig in result["figures"].values():
            rows.append((result["notebook"], fig["name"], f"{fig['value']:,.4g}", fig["unit"], fig["device"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m utils.results [--results DIR] [--out FILE]``: gather, write JSON, print the table."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--results", type=Path, default=None, help="folder of <notebook>.json files")
    parser.add_argument("--out", type=Path, default=None, help="where to write the gathered JSON")
    args = parser.parse_args(argv)
    all_results = collect(args.results)
    if not all_results:
        print("no recorded results found: run the notebooks first (make run)", file=sys.stderr)
        return 1
    out = args.out or build_dir() / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(all_results, indent=2) + "\n")
    print(format_table(all_results))
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
