"""Validation: the same step measured with the exact CPU tracker (or the allocator), beside the prediction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from .config import ModelConfig, TrainingSetup
from .predict import _phase_label, _replay, check
from .shapes import parameter_shapes
from .reference import _torch, build_reference, reference_step

MEASURED_TERMS = ("parameters", "optimizer_state", "inputs", "activations", "loss", "gradients", "peak")


@dataclass(frozen=True)
class StepBytes:
    """The figures of one training step that prediction and measurement both give, bytes.

    Attributes:
        parameters: the model's parameters and buffers.
        optimizer_state: the optimizer's state (and AdamW8bit's codebooks).
        inputs: token ids and targets of the step.
        activations: bytes alive above those three when the head begins (saved activations, plus
            autocast's bf16 weight copies).
        loss: what the head and the loss add by the end of the forward pass.
        gradients: bytes alive when ``optimizer.step()`` begins, above the baseline (the gradients).
        peak: the highest point of the step, the baseline included.
        boundaries: phase -> bytes alive above the baseline when it ended (a phase is a block's forward
            or backward, the head, the loss's backward, the optimizer step).
    """

    parameters: int
    optimizer_state: int
    inputs: int
    activations: int
    loss: int
    gradients: int
    peak: int
    boundaries: dict[str, int] = field(default_factory=dict)


def model_state_per_rank(model: ModelConfig, setup: TrainingSetup) -> dict[str, int]:
    """Parameters, gradients (when the optimizer step begins) and optimizer state held by one rank, bytes.

    ZeRO's accounting, as ``utils.parallel.predict_zero_bytes_per_rank`` gives it for ``ddp`` (stage 0),
    ``zero1``, ``zero2`` and ``fsdp`` (stage 3); FSDP2 pads every tensor's dim 0 to a multiple of N,
    so with dims that N does not divide its shards are up to one row per tensor larger than Ψ/N.

    Returns:
        ``{"params": ..., "grads": ..., "optimizer": ...}``; also ``"buckets"``: DDP's (and ZeRO-1's)
        gradient buckets, one copy of the trainable gradients (``gradient_as_bucket_view=False``).
    """
    step = _replay(model, setup)
    buckets = sum(math.prod(shape) for _, shape, trainable in parameter_shapes(model, setup) if trainable) * (
        2 if setup.precision == "bf16" else 4) if setup.strategy in ("ddp", "zero1") else 0
    return {"params": step.largest["parameters"], "grads": step.grads_at_step,
            "optimizer": step.largest["optimizer_state"], "buckets": buckets}


def predict_step_bytes(model: ModelConfig, setup: TrainingSetup) -> StepBytes:
    """The prediction of the figures ``measure_reference_step`` measures (see ``StepBytes``)."""
    step = _replay(model, setup)
    base = step.baseline
    last = f"m0.f{model.num_layers - 1}"
    marks = {phase: value - base for phase, value in step.phase_marks.items() if phase not in ("init", "start", "end")}
    return StepBytes(parameters=step.largest["parameters"], optimizer_state=step.largest["optimizer_state"],
                     inputs=step.largest["inputs"], activations=marks[last], loss=marks["m0.head"] - marks[last],
                     gradients=step.grads_mark - base, peak=step.peak, boundaries=marks)


def measure_reference_step(model: ModelConfig, setup: TrainingSetup, *, device: Any = "cpu",
                           seed: int = 0) -> StepBytes:
    """Measure ``reference_step`` on a device: the same figures as ``predict_step_bytes``.

    One warm-up step creates the optimizer state; the second step is measured with
    ``utils.measure_memory``, its baseline being the model, the optimizer and the batch. On the CPU
    that is the exact storage tracker; on CUDA the caching allocator (``torch.cuda.reset_peak_memory_stats``
    and ``max_memory_allocated`` around the step, through ``measure_memory``'s "cuda-allocator" backend).
    On CUDA the peak is the step's own bytes above the state plus the state's 512-byte blocks: the first run
    on a GPU (H100, torch 2.11, 2026-11-27) counted the whole process's allocated bytes instead, which hold
    the two cuBLAS workspaces the warm-up step created (32 MiB each: one for forward's thread, one for
    backward's) and put every configuration 66 MiB over its prediction. That run also left about 1.2 MB per
    step unexplained (attention statistics and cuBLASLt's workspace are the suspects); it has not been
    rerun since this change.

    Args:
        model, setup: what to build and train (``setup.device`` is set to the device's type).
        device: where to run it.
        seed: for the weights and the data.

    Returns:
        A ``StepBytes``.
    """
    torch = _torch()
    from ..memory import measure_memory, tensor_bytes
    from ..models import make_token_data

    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("measuring on 'cuda' needs a CUDA GPU, and torch.cuda.is_available() is False here: "
                           "expected device='cpu' (the exact tracker)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"expected device 'cpu' or 'cuda', got {str(device)!r}")
    setup = replace(setup, device="cuda" if device.type == "cuda" else "cpu")
    check(model, setup)
    net, optimizer = build_reference(model, setup, seed=seed, device=device)
    k, batch, seq = setup.accumulation_steps, setup.micro_batch, setup.seq_len
    tokens, targets = make_token_data(batch * k, seq, model.vocab_size, seed=seed, device=device)
    tokens, targets = tokens.reshape(k, batch, seq).contiguous(), targets.reshape(k, batch, seq).contiguous()
    reference_step(net, optimizer, tokens, targets, model, setup)          # creates the optimizer state
    codebooks = list(getattr(optimizer, "_codebooks", {}).values())        # AdamW8bit keeps them on itself
    with measure_memory(device, include=[net, optimizer, tokens, targets, codebooks], phase="start") as mem:
        reference_step(net, optimizer, tokens, targets, model, setup, mem)
    ends = mem.phase_end_bytes()
    last = f"m0.f{model.num_layers - 1}"
    optimizer_index = next(i for i, sample in enumerate(mem.timeline) if sample.phase == "optimizer")
    before_step = mem.timeline[optimizer_index - 1].bytes
    boundaries = {phase: value for phase, value in ends.items() if phase not in ("start", "end")}
    # torch.optim keeps `step` on the host unless fused: count what lives on the measured device
    state = [t for t in _state_tensors(optimizer) if t.device.type == device.type] + codebooks
    baseline = mem.baseline_bytes
    if device.type == "cuda":   # the allocator's baseline is the whole process: count the state's own blocks
        baseline = _cuda_block_bytes([net.parameters(), net.buffers(), _state_tensors(optimizer), tokens, targets,
                                      codebooks])
    return StepBytes(parameters=tensor_bytes(list(net.parameters()) + list(net.buffers())),
                     optimizer_state=tensor_bytes(state), inputs=tensor_bytes([tokens, targets]),
                     activations=ends[last], loss=ends["m0.head"] - ends[last], gradients=before_step,
                     peak=mem.peak_bytes + baseline, boundaries=boundaries)


def _cuda_block_bytes(groups: list) -> int:
    """Bytes of the distinct CUDA storages among ``groups`` (tensors or iterables of them), each rounded up to the
    caching allocator's 512-byte blocks."""
    torch = _torch()
    seen: dict[int, int] = {}
    for group in groups:
        for tensor in ([group] if isinstance(group, torch.Tensor) else list(group)):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
                storage = tensor.untyped_storage()
                seen[storage.data_ptr()] = -(-storage.nbytes() // 512) * 512
    return sum(seen.values())


def _state_tensors(optimizer: Any) -> list:
    torch = _torch()
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


GRID_GPT = ModelConfig(num_layers=2, d_model=32, num_heads=4, vocab_size=64, max_seq_len=16, name="tiny gpt")
GRID_LLAMA = ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, ffn_width=48, vocab_size=64,
                         max_seq_len=16, arch="llama", name="tiny llama")


def validation_grid(check: bool = False) -> list[tuple[str, ModelConfig, TrainingSetup]]:
    """The configurations ``validate`` measures: every option of ``TrainingSetup`` at least once.

    Two small models (``GRID_GPT``, a ``utils.TinyTransformer``; ``GRID_LLAMA``, grouped-query
    attention) with micro-batch 2 x 16 tokens on the CPU. ``check=True`` gives the representative subset
    the tests run in check mode (each precision, optimizer, implementation, checkpointing mode, LoRA
    target, the chunked loss, accumulation and both architectures at least once).

    Returns:
        (label, model, setup) triples.
    """
    base = TrainingSetup(micro_batch=2, seq_len=16, precision="fp32", optimizer="adamw", optimizer_impl="for-loop",
                         device="cpu")
    gpt, llama = GRID_GPT, GRID_LLAMA
    mqa_tied = replace(GRID_LLAMA, num_kv_heads=1, tied_embeddings=True, name="tiny llama, 1 kv head, tied head")
    mha = replace(GRID_LLAMA, num_kv_heads=None, name="tiny llama, 4 kv heads")

    def s(**changes: Any) -> TrainingSetup:
        return replace(base, **changes)

    ac, bf = "bf16-autocast", "bf16"
    grid = [
        ("gpt fp32 adamw", gpt, s()),
        ("gpt autocast", gpt, s(precision=ac)),
        ("gpt bf16", gpt, s(precision=bf)),
        ("gpt fp32 ckpt every block", gpt, s(checkpointing="every_block")),
        ("gpt fp32 ckpt selective", gpt, s(checkpointing="selective")),
        ("gpt autocast ckpt every block", gpt, s(precision=ac, checkpointing="every_block")),
        ("gpt autocast ckpt selective", gpt, s(precision=ac, checkpointing="selective")),
        ("gpt bf16 ckpt selective", gpt, s(precision=bf, checkpointing="selective")),
        ("gpt fp32 lora r4 all", gpt, s(lora_rank=4)),
        ("gpt autocast lora r4 attention", gpt, s(precision=ac, lora_rank=4, lora_targets="attention")),
        ("gpt autocast lora ckpt every block", gpt, s(precision=ac, lora_rank=4, checkpointing="every_block")),
        ("gpt bf16 lora attention ckpt selective", gpt, s(precision=bf, lora_rank=4, lora_targets="attention",
                                                           checkpointing="selective")),
        ("gpt fp32 chunked loss 12", gpt, s(chunked_loss=12)),
        ("gpt autocast chunked loss 12", gpt, s(precision=ac, chunked_loss=12)),
        ("gpt fp32 accumulation 3", gpt, s(accumulation_steps=3)),
        ("gpt autocast accum 2 ckpt every block", gpt, s(precision=ac, accumulation_steps=2,
                                                          checkpointing="every_block")),
        ("gpt fp32 sgd", gpt, s(optimizer="sgd")),
        ("gpt fp32 sgd momentum foreach", gpt, s(optimizer="sgd_momentum", optimizer_impl="foreach")),
        ("gpt fp32 adam fused", gpt, s(optimizer="adam", optimizer_impl="fused")),
        ("gpt fp32 adamw foreach", gpt, s(optimizer_impl="foreach")),
        ("gpt bf16 adamw fused", gpt, s(precision=bf, optimizer_impl="fused")),
        ("gpt fp32 adafactor", gpt, s(optimizer="adafactor")),
        ("gpt bf16 adafactor foreach", gpt, s(precision=bf, optimizer="adafactor", optimizer_impl="foreach")),
        ("gpt fp32 adamw8bit", gpt, s(optimizer="adamw8bit")),
        ("gpt bf16 adamw8bit lora", gpt, s(precision=bf, optimizer="adamw8bit", lora_rank=4)),
        ("llama fp32 gqa", llama, s()),
        ("llama autocast", llama, s(precision=ac)),
        ("llama bf16", llama, s(precision=bf)),
        ("llama autocast ckpt every block", llama, s(precision=ac, checkpointing="every_block")),
        ("llama fp32 ckpt selective", llama, s(checkpointing="selective")),
        ("llama autocast lora r4 all", llama, s(precision=ac, lora_rank=4)),
        ("llama bf16 lora attention ckpt every", llama, s(precision=bf, lora_rank=4, lora_targets="attention",
                                                          checkpointing="every_block")),
        ("llama mqa tied autocast chunked 12", mqa_tied, s(precision=ac, chunked_loss=12)),
        ("llama mqa tied bf16 accumulation 2", mqa_tied, s(precision=bf, accumulation_steps=2)),
        ("llama mha fp32 sgd momentum", mha, s(optimizer="sgd_momentum")),
        ("llama autocast adamw8bit", llama, s(precision=ac, optimizer="adamw8bit")),
        ("llama bf16 adafactor foreach ckpt sel", llama, s(precision=bf, optimizer="adafactor",
                                                           optimizer_impl="foreach", checkpointing="selective")),
        ("llama autocast adamw foreach lora sel", llama, s(precision=ac, optimizer_impl="foreach", lora_rank=4,
                                                           checkpointing="selective")),
    ]
    if not check:
        return grid
    subset = ("gpt autocast lora ckpt every block", "gpt bf16 lora attention ckpt selective", "gpt autocast chunked loss 12",
              "gpt fp32 sgd momentum foreach", "gpt fp32 adam fused", "gpt bf16 adafactor foreach",
              "llama mqa tied bf16 accumulation 2", "llama autocast adamw8bit", "llama autocast lora r4 all",
              "gpt fp32 adafactor", "gpt fp32 sgd")
    return [row for row in grid if row[0] in subset]


@dataclass(frozen=True)
class ValidationRow:
    """One configuration of the grid: predicted and measured ``StepBytes``.

    Attributes:
        label: the configuration's name in the grid.
        model, setup: what was predicted and measured.
        predicted: ``predict_step_bytes(model, setup)``.
        measured: ``measure_reference_step(model, setup)``.
    """

    label: str
    model: ModelConfig
    setup: TrainingSetup
    predicted: StepBytes
    measured: StepBytes

    def errors(self) -> dict[str, float]:
        """Term -> |predicted - measured| / |measured| (0 when both are 0)."""
        out = {}
        for term in MEASURED_TERMS:
            p, m = getattr(self.predicted, term), getattr(self.measured, term)
            out[term] = abs(p - m) / abs(m) if m else float(p != m)
        return out

    def differences(self) -> dict[str, int]:
        """Term -> predicted - measured, bytes."""
        return {term: getattr(self.predicted, term) - getattr(self.measured, term) for term in MEASURED_TERMS}

    @property
    def boundaries_equal(self) -> bool:
        """Whether the bytes alive at every phase boundary of the step agree too (not only the terms)."""
        return all(self.predicted.boundaries.get(k) == v for k, v in self.measured.boundaries.items()
                   if k in self.predicted.boundaries)


def validate(grid: Sequence[tuple[str, ModelConfig, TrainingSetup]] | None = None, *, check: bool = False,
             device: Any = "cpu", progress: Callable[[ValidationRow], None] | None = None) -> list[ValidationRow]:
    """Measure every configuration of the grid and put the prediction beside it.

    Args:
        grid: (label, model, setup) triples; default ``validation_grid(check)``.
        check: the representative subset (a few seconds on the CPU) instead of the whole grid.
        device: where to measure: "cpu" (the exact tracker) or "cuda" (the allocator; see
            ``measure_reference_step`` for what the first GPU run found).
        progress: called with each row as soon as it is measured.

    Returns:
        One ``ValidationRow`` per configuration. On the CPU every difference is 0 bytes.
    """
    rows = []
    for label, model, setup in grid if grid is not None else validation_grid(check):
        kind = "cuda" if str(device).startswith("cuda") else "cpu"
        setup = replace(setup, device=kind)
        row = ValidationRow(label, model, setup, predict_step_bytes(model, setup),
                            measure_reference_step(model, setup, device=device))
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


def worst_errors(rows: Sequence[ValidationRow]) -> dict[str, float]:
    """Term (``MEASURED_TERMS``) -> the largest relative error |predicted - measured| / measured over the rows."""
    return {term: max((row.errors()[term] for row in rows), default=0.0) for term in MEASURED_TERMS}


VALIDATION_HEADER = f"{'configuration (peak, bytes)':<42}{'predicted':>13}{'measured':>13}{'diff':>6}  {'peak in':<44}terms"


def format_validation_row(row: ValidationRow) -> str:
    """One line: predicted and measured peak (bytes), where the peak is, and whether every term agrees."""
    diff = row.differences()
    worst = max(diff, key=lambda term: abs(diff[term]))
    where = _phase_label(_replay(row.model, row.setup).peak_phase, row.setup)
    text = (f"{row.label:<42}{row.predicted.peak:>13,}{row.measured.peak:>13,}{diff['peak']:>+6,}  {where:<44}"
            f"{'all equal' if not any(diff.values()) else f'largest difference: {worst} {diff[worst]:+,} B'}")
    return text + ("" if row.boundaries_equal else "  (phase boundaries differ)")


def format_validation(rows: Sequence[ValidationRow]) -> str:
    """The grid as a table (predicted and measured peak per configuration) and the worst error per term."""
    lines = [VALIDATION_HEADER]
    lines += [format_validation_row(row) for row in rows]
    worst = worst_errors(rows)
    lines.append("worst relative error per term: " + ", ".join(f"{term} {value:.2e}" for term, value in worst.items()))
    return "\n".join(lines)
