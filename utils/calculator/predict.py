"""The public API: ``predict``, ``largest_micro_batch``, ``format_table`` and the ``MemoryBreakdown`` they share."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import functools

from ..checks import positive_int
from . import registry
from .config import KINDS, ModelConfig, TrainingSetup
from .fewer_bits import _LowBitStep, check_lowbit, lowbit_notes, lowbit_on
from .layer_reuse import StepResult, replay
from .optimizers import check_optimizer_options
from .shapes import count_parameters
from .step import _Step

TERM_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations (saved for backward)",
    "loss": "loss and logits",
    "weight_copies": "autocast's bf16 weight copies",
    "comm_buffers": "data-parallel buffers",
    "inputs": "token ids and targets",
    "temporaries": "temporaries",
}


@dataclass(frozen=True)
class MemoryBreakdown:
    """The predicted peak of one training step on one device, and what is alive at that moment.

    The nine byte fields sum to ``total`` (the peak); ``largest`` gives each term at its own largest over
    the step (the terms peak at different moments, so ``sum(largest.values()) >= total``).

    Attributes:
        model, setup: what was predicted.
        parameters: the model's weights (this rank's shard under FSDP).
        gradients: ``param.grad`` (this rank's shards under ZeRO-2 and FSDP).
        optimizer_state: the optimizer's state (1/N under ZeRO-1/2 and FSDP).
        activations: tensors saved for backward (and recomputed ones, with checkpointing).
        loss: the logits, log-probabilities and loss tensors (the chunked loss's masks and chunks).
        weight_copies: autocast's bf16 copies of the weights.
        comm_buffers: DDP's gradient buckets; FSDP's all-gathered parameters; unsharded gradients before
            their reduce-scatter (modelled from the designs of DDP and FSDP2, not measured here).
        inputs: the step's token ids and targets (int64).
        temporaries: everything else: gradients flowing back, optimizer temporaries, recomputation.
        phase: where the peak happens ("forward, block 3", "backward, loss", "optimizer step", ...).
        largest: term -> its largest value during the step, bytes.
        num_parameters: parameter elements (adapters included); trainable_parameters: those that train.
        notes: what the replay models without measuring, or does not replay, for the set-up's fewer-bits
            options (``calculator/fewer_bits.py``); empty otherwise.
    """

    model: ModelConfig
    setup: TrainingSetup
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    loss: int
    weight_copies: int
    comm_buffers: int
    inputs: int
    temporaries: int
    phase: str
    largest: dict[str, int] = field(default_factory=dict)
    num_parameters: int = 0
    trainable_parameters: int = 0
    notes: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        """The peak, bytes: the sum of the terms alive at that moment."""
        return sum(getattr(self, kind) for kind in KINDS)

    @property
    def model_state(self) -> int:
        """Parameters (and buffers), gradients and optimizer state, each at its largest: what stays between steps
        (the gradients until ``zero_grad``), bytes. Notebook 10's table divides it by the parameter count."""
        return sum(self.largest.get(kind, 0) for kind in ("parameters", "gradients", "optimizer_state"))

    def terms(self) -> dict[str, int]:
        """Term -> bytes alive at the peak, in ``KINDS`` order."""
        return {kind: getattr(self, kind) for kind in KINDS}


def _phase_label(phase: str, setup: TrainingSetup) -> str:
    if phase in ("optimizer", "end"):
        return "optimizer step"
    if phase in ("init", "start"):
        return "before the step"
    micro, _, where = phase.partition(".")
    names = {"embed": "forward, embeddings", "cache": "forward, embeddings", "head": "forward, loss",
             "outputs": "forward, loss",
             "loss": "forward, your loss", "lossvar": "forward, your loss", "count": "forward, your loss",
             "exit": "forward, leaving autocast",
             "bloss": "backward, loss"}
    if where in names:
        text = names[where]
    elif where[:1] == "f":
        text = f"forward, block {where[1:]}"
    elif where[:1] == "b":
        text = f"backward, block {where[1:]}"
    else:
        text = where
    if setup.accumulation_steps > 1:
        index = int(micro[1:])
        text += f" (micro-batch {index + 1}{'' if index == 0 else ' and later'})"
    return text


def check(model: ModelConfig, setup: TrainingSetup) -> None:
    """Refuse, before any work, what the model's family or the engine does not model (each message names it)."""
    if not isinstance(model, ModelConfig):
        raise TypeError(f"model must be a ModelConfig, got {type(model).__name__}")
    if not isinstance(setup, TrainingSetup):
        raise TypeError(f"setup must be a TrainingSetup, got {type(setup).__name__}")
    family = registry.family_of(model.arch)
    if setup.routing is not None and not getattr(family, "routes_tokens", False):
        raise ValueError(f"routing {setup.routing!r} is a mixture of experts' input, and {model.name} has no experts: "
                         "expected routing=None")
    family.check_setup(model, setup)
    check_lowbit(model, setup)
    check_optimizer_options(setup)


def _replay(model: ModelConfig, setup: TrainingSetup, trace: bool = False) -> StepResult:
    """The replayed step (checked first), cached: a question asked twice is answered once."""
    check(model, setup)
    return _cached_replay(model, setup, trace)


@functools.lru_cache(maxsize=256)
def _cached_replay(model: ModelConfig, setup: TrainingSetup, trace: bool) -> StepResult:
    return replay(model, setup, _LowBitStep if lowbit_on(setup) else _Step, trace)


def predict(model: ModelConfig, setup: TrainingSetup) -> MemoryBreakdown:
    """Predict the peak memory of one training step on one device, term by term.

    Why: "will my model fit, and with what?" is answered by the peak, and the peak is a question of
    which tensors are alive together. This replays the step's allocations and frees (see the module's
    docstring) and reports the highest point and its make-up; on the CPU the exact tracker measures the
    same step to the byte (``validate``).

    Args:
        model: the transformer's shape (``ModelConfig`` or ``PRESETS[...]``).
        setup: how it trains (``TrainingSetup``).

    Returns:
        A ``MemoryBreakdown``; ``.total`` is the peak in bytes.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: a sequence longer than a ``"gpt"`` model's position table (the dataclasses check
            everything else when they are made).

    Example:
        >>> peak = predict(PRESETS["7B"], TrainingSetup(micro_batch=1, seq_len=4096))
        >>> peak.total / 2**30, peak.phase
    """
    step = _replay(model, setup)
    kinds = step.peak_kinds
    return MemoryBreakdown(model=model, setup=setup, phase=_phase_label(step.peak_phase, setup),
                           largest=dict(step.largest), num_parameters=count_parameters(model, setup),
                           trainable_parameters=count_parameters(model, setup, trainable_only=True),
                           notes=lowbit_notes(setup), **{kind: kinds.get(kind, 0) for kind in KINDS})


def largest_micro_batch(model: ModelConfig, setup: TrainingSetup, device_bytes: int, *, limit: int = 4096) -> int:
    """The largest micro-batch whose predicted peak fits in ``device_bytes`` (0 if not even one fits).

    The peak never shrinks as the micro-batch grows, and for a given set-up it grows by a nearly constant step per
    sequence; so this replays two micro-batches, draws the line through their peaks, replays the size where the
    line crosses the budget and the next one, and is done when the first fits and the second does not (usually
    four replays). Where the line was off, it searches between the sizes it knows, as
    ``utils.find_max_batch_size`` does with real steps; the answer is exact either way.

    Args:
        model, setup: as for ``predict`` (``setup.micro_batch`` is ignored).
        device_bytes: memory available to tensors on one device, bytes (what the allocator may use:
            leave room for the CUDA context and fragmentation, e.g. 90 % of the card).
        limit: the largest micro-batch tried.

    Returns:
        The micro-batch (an int in [0, limit]).

    Example:
        >>> largest_micro_batch(PRESETS["1B"], TrainingSetup(seq_len=2048, checkpointing="every_block"),
        ...                     int(0.9 * 80 * 10**9))
    """
    positive_int("device_bytes", device_bytes, "bytes")
    positive_int("limit", limit)

    def fits(batch: int) -> bool:
        return _replay(model, replace(setup, micro_batch=batch)).peak <= device_bytes

    if not fits(1):
        return 0
    good, bad = 1, None                                 # good fits; bad does not
    if limit >= 4:
        two, three = (_replay(model, replace(setup, micro_batch=b)).peak for b in (2, 3))
        if two > device_bytes:
            bad = 2
        elif three > device_bytes:
            good, bad = 2, 3
        else:
            good = 3
            if three > two:                             # the line through 2 and 3 crosses the budget at `guess`
                guess = min(3 + (device_bytes - three) // (three - two), limit)
                if guess > good:
                    if fits(guess):
                        good = guess
                    else:
                        bad = guess
                if bad is None and good < limit:        # verified when the next size does not fit
                    if fits(good + 1):
                        good += 1
                    else:
                        bad = good + 1
    while bad is None and good < limit:                 # the line was low (or flat): double from what fits
        trial = min(2 * good, limit)
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad is not None and bad - good > 1:           # the line was high: bisect between what is known
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:,.2f}"


def format_table(breakdown: MemoryBreakdown, *, device_bytes: int | None = None) -> str:
    """The breakdown as a plain-text table: each term at the peak and at its own largest, in GiB.

    Args:
        breakdown: what ``predict`` returned.
        device_bytes: optionally, a device's memory: the last line says whether the peak fits.

    Returns:
        The table, one line per term, without a trailing newline.
    """
    if not isinstance(breakdown, MemoryBreakdown):
        raise TypeError(f"expected a MemoryBreakdown, got {type(breakdown).__name__}")
    model, setup = breakdown.model, breakdown.setup
    targets = setup.lora_targets if isinstance(setup.lora_targets, str) else ", ".join(setup.lora_targets)
    lora = f"LoRA r={setup.lora_rank} ({targets})" if setup.lora_rank else "full fine-tuning"
    if setup.base_quant != "none":
        lora += (f" on an NF4 base (block {setup.quant_block}{', double quantisation' if setup.base_quant == 'nf4-double' else ''}"
                 f"{', prepare_model_for_kbit_training' if setup.kbit_prepared else ''})")
    if setup.bf16_rounding != "nearest":
        lora += f", bf16 updates with {setup.bf16_rounding} {'rounding' if setup.bf16_rounding == 'stochastic' else 'summation'}"
    if setup.fp8:
        lora += ", FP8 block linears"
    lines = [
        f"{model.name}: {breakdown.num_parameters / 1e9:,.3f} B parameters ({breakdown.trainable_parameters / 1e9:,.3f} B "
        f"trainable), {model.num_layers} layers, d_model {model.d_model}, {model.num_heads} heads "
        f"({model.kv_heads} kv), ffn {model.ffn}, vocab {model.vocab_size}",
        f"micro-batch {setup.micro_batch} x {setup.seq_len} tokens, {setup.precision}, {setup.optimizer} "
        f"({setup.optimizer_impl}), checkpointing {setup.checkpointing}, {lora}, "
        + registry.family_of(model.arch).describe(model, setup) +
        f"accumulation {setup.accumulation_steps}, {setup.strategy} on {setup.ranks} rank(s), {setup.device}",
        "",
        f"{'term (GiB per device)':<36}{'at the peak':>14}{'own largest':>14}",
    ]
    for kind in KINDS:
        at_peak, largest = getattr(breakdown, kind), breakdown.largest.get(kind, 0)
        if at_peak == 0 and largest == 0:
            continue
        lines.append(f"{TERM_LABELS[kind]:<36}{_gib(at_peak):>14}{_gib(largest):>14}")
    lines.append(f"{'peak (' + breakdown.phase + ')':<36}{_gib(breakdown.total):>14}")
    if device_bytes is not None:
        positive_int("device_bytes", device_bytes, "bytes")
        verdict = "fits" if breakdown.total <= device_bytes else "does not fit"
        lines.append(f"{verdict} in {_gib(device_bytes)} GiB ({breakdown.total / device_bytes:.0%} of it)")
    lines += [f"note: {note}" for note in breakdown.notes]
    return "\n".join(lines)
