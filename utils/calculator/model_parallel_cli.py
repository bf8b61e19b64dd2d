"""Searching and printing for ``model_parallel.py``: the candidate layouts, the smallest that fits a card, the
per-stage table, and the command line's ``--tp --pp --cp --dp --zero --schedule --micro-batches`` (wired into
``python -m utils.calculator`` by ``cli.py``). Split from ``model_parallel.py`` to keep each file one sitting.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any, Iterable, Sequence

from .config import TrainingSetup

from .model_parallel import (SCHEDULES, ZERO_STAGES, ParallelBreakdown, ParallelLayout, as_parallel_model,
                             predict_parallel)

# --- searching and printing ----------------------------------------------------------------------------------------

def candidate_layouts(max_gpus: int = 4096, tp_degrees: Sequence[int] = (1, 2, 4, 8),
                      pp_degrees: Sequence[int] = (1, 2, 4, 8, 16), cp_degrees: Sequence[int] = (1, 2, 4),
                      zero_stages: Sequence[int] = (0, 1, 3), **options: Any) -> list[ParallelLayout]:
    """Every layout with power-of-two data-parallel degrees up to ``max_gpus`` GPUs (tp within one 8-GPU node)."""
    layouts = []
    for tp, pp, cp, zero in itertools.product(tp_degrees, pp_degrees, cp_degrees, zero_stages):
        dp = 1
        while dp * tp * pp * cp <= max_gpus:
            if zero == 0 or dp > 1:
                layouts.append(ParallelLayout(tp=tp, pp=pp, cp=cp, dp=dp, zero=zero, **options))
            dp *= 2
    return layouts


def smallest_fitting_layout(model: Any, setup: TrainingSetup, device_bytes: float, *,
                            layouts: Iterable[ParallelLayout] | None = None) -> ParallelBreakdown | None:
    """The layout with the fewest GPUs whose busiest GPU fits ``device_bytes`` (ties: the least memory per GPU).

    Layouts the model or the sequence cannot be split into are skipped; None when nothing fits.
    """
    model = as_parallel_model(model)
    by_gpus: dict[int, list[ParallelLayout]] = {}
    for layout in layouts if layouts is not None else candidate_layouts():
        by_gpus.setdefault(layout.gpus, []).append(layout)
    for gpus in sorted(by_gpus):                 # the fewest GPUs first: stop at the first count where one fits
        fitting = []
        for layout in by_gpus[gpus]:
            try:
                breakdown = predict_parallel(model, setup, layout)
            except ValueError:
                continue
            if breakdown.fits(device_bytes):
                fitting.append(breakdown)
        if fitting:
            return min(fitting, key=lambda breakdown: breakdown.total)
    return None


TERM_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
               "activations": "activations (in flight)", "loss": "loss and logits", "weight_copies": "bf16 weight copies",
               "comm_buffers": "gathered layers / buckets", "inputs": "batch"}


def format_parallel(breakdown: ParallelBreakdown, device_bytes: float | None = None) -> str:
    """A table: each stage's GPU by category, in GB (10^9 bytes), and the fit verdict."""
    layout, setup = breakdown.layout, breakdown.setup
    lines = [f"{breakdown.model.name}: {layout.label()} = {layout.gpus} GPUs; {layout.schedule} with {layout.m} "
             f"micro-batches of {setup.micro_batch} x {setup.seq_len} tokens; {setup.precision}, {setup.optimizer}, "
             f"checkpointing {setup.checkpointing}"
             + ("; sequence parallel" if layout.tp > 1 and layout.sequence_parallel else ""),
             f"{'stage':<28}" + "".join(f"{stage.stage:>10}" for stage in breakdown.stages)]
    for key, label in TERM_LABELS.items():
        lines.append(f"{label:<28}" + "".join(f"{stage.terms[key] / 1e9:>10.2f}" for stage in breakdown.stages))
    lines.append(f"{'total (GB per GPU)':<28}" + "".join(f"{stage.total / 1e9:>10.2f}" for stage in breakdown.stages))
    lines.append(f"{'micro-batches in flight':<28}" + "".join(f"{stage.in_flight:>10}" for stage in breakdown.stages))
    busiest = breakdown.busiest
    verdict = f"busiest GPU: stage {busiest.stage}, {busiest.total / 1e9:.2f} GB"
    if device_bytes:
        verdict += f" of {device_bytes / 1e9:.0f} GB: {'fits' if breakdown.fits(device_bytes) else 'does not fit'}"
    lines.append(verdict + f"; pipeline bubble {breakdown.details['bubble']:.1%}")
    return "\n".join(lines)


# --- the command line (wired into python -m utils.calculator) -------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--tp --pp --cp --dp --zero --schedule --micro-batches --no-sequence-parallel`` to the calculator's parser."""
    group = parser.add_argument_group("model parallelism (any of these switches to the per-stage prediction)")
    group.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    group.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    group.add_argument("--cp", type=int, default=1, help="context-parallel degree (default 1)")
    group.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    group.add_argument("--zero", type=int, choices=sorted(ZERO_STAGES), default=0,
                       help="with --dp: 0 DDP, 1 ZeRO-1, 2 ZeRO-2, 3 FSDP (default 0)")
    group.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (default 1f1b)")
    group.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step (default: --pp)")
    group.add_argument("--no-sequence-parallel", action="store_true",
                       help="with --tp: keep the norms and residual stream whole on every rank")


def wants_model_parallel(args: argparse.Namespace) -> bool:
    """Whether the command line asked for any model-parallel flag (``cli.main`` then calls ``run``)."""
    return (args.tp, args.pp, args.cp, args.dp, args.zero, args.schedule, args.micro_batches,
            args.no_sequence_parallel) != (1, 1, 1, 1, 0, "1f1b", None, False)


def run(args: argparse.Namespace) -> str:
    """The report of ``python -m utils.calculator ... --tp/--pp/--cp/--dp``: the per-stage table and the verdict.

    Uses the calculator's own flags for the model (``--hf-config``, ``--preset`` or a shape) and the training
    set-up (``--micro-batch``, ``--seq-len``, ``--precision``, ``--optimizer``, ``--impl``, ``--checkpointing``,
    ``--device``, ``--device-gb``); data parallelism is ``--dp`` and ``--zero``, not ``--strategy``/``--ranks``.

    Raises:
        ValueError: a layout or set-up this module refuses (``cli.main`` turns it into a usage error).
    """
    from .cli import _model_from_args
    if getattr(args, "strategy", "single") != "single" or getattr(args, "ranks", 1) != 1:
        raise ValueError("with --tp/--pp/--cp/--dp, data parallelism is --dp and --zero: expected no --strategy or "
                         "--ranks")

    class _Refuse:
        @staticmethod
        def error(message: str) -> None:
            raise ValueError(message)

    model = _model_from_args(args, _Refuse())
    impl = getattr(args, "impl", None) or ("for-loop" if args.optimizer == "adamw8bit" else "foreach")
    setup = TrainingSetup(micro_batch=args.micro_batch, seq_len=args.seq_len, precision=args.precision,
                          optimizer=args.optimizer, optimizer_impl=impl, checkpointing=args.checkpointing,
                          device=args.device)
    layout = ParallelLayout(tp=args.tp, pp=args.pp, cp=args.cp, dp=args.dp, zero=args.zero, schedule=args.schedule,
                            micro_batches=args.micro_batches, sequence_parallel=not args.no_sequence_parallel)
    device_bytes = args.device_gb * 1e9 if getattr(args, "device_gb", 0) else None
    return format_parallel(predict_parallel(model, setup, layout), device_bytes)
