"""Validation against the real thing: transformers models trained one step on the CPU, measured, beside ``predict_hf``.

``python -m utils.calculator --validate-hf [--check]`` builds each configuration of ``hf_validation_grid`` as
a real ``transformers`` model from a small config (random weights, nothing downloaded), with peft's LoRA
where the configuration asks for it, trains it one step exactly as ``hf_reference_step`` writes it, and
measures that step twice, independently of the course's own tracker:

* torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``), where it runs: torch 2.13's refuses
  a model with frozen parameters, so LoRA configurations are measured by the second tool only;
* ``StorageCounter`` (``counter.py``), a ``TorchDispatchMode`` written apart from the course's tracker that
  follows every storage an op returns with a weakref (they agree to the byte wherever both run; the grid
  asserts it).

Both count the model's parameters and buffers, the optimizer's state and the batch from the start.

Result (issue 43; torch 2.13.0+cpu, transformers 5.24.0, peft 0.21.2): on all 74 configurations of the grid
(``hf_grid.py``: the Llama family, Qwen3, Phi-3, Gemma 2, Gemma 3 and GPT-2, with dropout, sliding layers, reentrant
checkpointing, LoRA, padding, each loop's kept outputs and each precision) the predicted peak equals the measured one
to the byte (worst error 0 bytes), and MemTracker and the counter agree to the byte wherever MemTracker runs (it
refuses frozen parameters (LoRA), a module called twice (accumulation), and is not run with reentrant
checkpointing). The tests assert it on an 8-configuration subset, one row per family. One thing a tracker changes:
under any ``TorchDispatchMode`` (MemTracker, the counter) sdpa's math kernel (attention dropout on the CPU) adds its
mask out of place, one (B, H, T, T) tensor more for a moment than an untracked step; the replay follows the tracked
step. Under ``outputs="kept"`` the measured step begins with what the loop's variables hold from the step before
(the output object, and what its autograd graph keeps: a checkpointed model's input leaf and its gradient, a
reentrant checkpoint's arguments), each followed from the start. Not covered: CUDA (the replay has CUDA's op-level
choices, e.g. dropout's bool mask, but no GPU has measured them).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from . import registry
from .counter import StorageCounter
from .hf_grid import _tiny, _tiny_gpt2, hf_validation_grid, tiny_config  # noqa: F401  (the grid, named here too)


def _torch():  # noqa: ANN202 - imported lazily
    import torch

    return torch


# --- the real model and its step -------------------------------------------------------------------------------

def hf_config_for(model: Any, fields: dict[str, Any] | None = None) -> Any:
    """The transformers config to build: from its fields when the grid gives them (a config dict, as a reader's
    config.json), else the family's config of a calculator ``ModelConfig``."""
    if fields is not None:
        import transformers

        fields = {k: v for k, v in fields.items() if not k.startswith("_") and k != "attn_implementation"}
        return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    return registry.family_of(model.arch).transformers_config(model)


def build_hf_reference(model: Any, setup: Any, *, seed: int = 0, fields: dict[str, Any] | None = None
                       ) -> tuple[Any, Any]:
    """The transformers model (peft-wrapped under LoRA) and optimizer ``hf_reference_step`` trains, on the CPU.

    Random weights from the config (``AutoModelForCausalLM.from_config``); pure bf16 converts the model
    with ``.to(torch.bfloat16)`` before peft adds its (float32) adapters; checkpointing is
    ``activation_checkpointing_enable()`` (``{"use_reentrant": True}`` when the set-up says so).
    """
    torch = _torch()
    import transformers

    torch.manual_seed(seed)
    net = transformers.AutoModelForCausalLM.from_config(hf_config_for(model, fields),
                                                        attn_implementation=model.attention)
    if setup.precision == "bf16":
        net = net.to(torch.bfloat16)
    if setup.lora_rank:
        from peft import LoraConfig, get_peft_model

        targets = sorted(registry.family_of(model.arch).lora_targets(model, setup))
        net = get_peft_model(net, LoraConfig(r=setup.lora_rank, lora_alpha=2 * setup.lora_rank,
                                             lora_dropout=setup.lora_dropout, target_modules=targets))
    if setup.checkpointing == "every_block":
        enable = getattr(net, "activation_checkpointing_enable", None) or net.gradient_checkpointing_enable
        enable({"use_reentrant": True} if setup.reentrant else None)
    net.train()
    params = [p for p in net.parameters() if p.requires_grad]
    impl = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[setup.optimizer_impl]
    options = {**impl, **dict(setup.optimizer_options)}
    optimizers = {"sgd": lambda: torch.optim.SGD(params, **{"lr": 1e-3, **options}),
                  "sgd_momentum": lambda: torch.optim.SGD(params, **{"lr": 1e-3, "momentum": 0.9, **options}),
                  "adam": lambda: torch.optim.Adam(params, **{"lr": 1e-3, **options}),
                  "adamw": lambda: torch.optim.AdamW(params, **{"lr": 1e-3, **options}),
                  "adafactor": lambda: torch.optim.Adafactor(params, **{"lr": 1e-3, **options})}
    if setup.optimizer not in optimizers:
        raise ValueError(f"the transformers grid trains with torch.optim: expected one of {sorted(optimizers)}")
    return net, optimizers[setup.optimizer]()


def make_hf_batch(model: Any, setup: Any, *, seed: int = 0) -> dict[str, Any]:
    """Token ids, labels (or targets) and, with ``setup.padded``, an attention mask: (accumulation, B, T) each.

    Padding: the last sequence of each micro-batch ends in ``T // 4`` pad tokens (mask 0, label -100).
    """
    torch = _torch()
    generator = torch.Generator().manual_seed(seed)
    shape = (setup.accumulation_steps, setup.micro_batch, setup.seq_len)
    ids = torch.randint(0, model.vocab_size, shape, generator=generator)
    batch = {"input_ids": ids}
    if setup.loss in ("labels", "shifted-sum"):       # shifted by the model, or by the loss
        labels = ids.clone()
    else:                                             # your own loss: next-token targets
        labels = torch.roll(ids, -1, dims=-1).contiguous()
    if setup.padded:
        mask = torch.ones(shape, dtype=torch.int64)
        mask[:, -1, setup.seq_len - setup.seq_len // 4:] = 0
        labels[mask == 0] = -100
        batch["attention_mask"] = mask
    batch["labels"] = labels
    return batch


def hf_reference_step(net: Any, optimizer: Any, batch: dict[str, Any], setup: Any,
                      mark: Callable[[str], None] | None = None, loop: dict[str, Any] | None = None,
                      outputs: str = "dropped") -> None:
    """One training step of a transformers model, as a reader writes it (what ``predict_hf`` replays).

    For each micro-batch, under ``torch.autocast`` when the precision says so, the forward and the loss as
    ``setup.loss`` says: ``net(input_ids=..., attention_mask=..., labels=...).loss``; your own
    ``F.cross_entropy(net(...).logits.flatten(0, 1).float(), targets.flatten())``; or notebook 17's ``train_step``
    (the targets counted first, ``loss_sum(net(...), labels) / count``, a running total, each loss kept until the
    next replaces it). ``outputs`` is what the loop does with the model's output: ``"dropped"`` at once;
    ``"kept"`` in the loop's variables (``loop``, a dict that outlives the call, as a training loop's variables
    outlive an iteration: ``outputs = net(...)``, ``loss = outputs.loss``; or ``logits = net(...).logits`` and
    ``loss = F.cross_entropy(logits...)``), or ``"kept-in-step"``, the same variables dropped when the step ends.
    Then ``loss.backward()`` (``(loss / accumulation_steps).backward()`` when accumulating), ``optimizer.step()``
    and ``optimizer.zero_grad(set_to_none=True)``. ``mark(phase)`` is called where the replay's phases begin
    (embeddings, each layer's forward and backward, the head, the loss's backward, the optimizer).
    """
    torch = _torch()
    import torch.nn.functional as F

    autocast = setup.precision == "bf16-autocast"
    layers, final_norm = _layers_and_norm(net)
    loop = {} if loop is None else loop
    keep = outputs != "dropped"
    handles = []
    if mark is not None:
        for index, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(lambda m, a, i=index: mark(f"{_micro[0]}.f{i}")))

            def after(m: Any, args: Any, out: Any, i: int = index) -> None:
                hidden = out[0] if isinstance(out, tuple) else out
                if hidden.requires_grad:
                    hidden.register_hook(lambda grad: mark(f"{_micro[0]}.b{i}"))
            handles.append(layer.register_forward_hook(after))
        handles.append(final_norm.register_forward_pre_hook(lambda m, a: mark(f"{_micro[0]}.head")))
    _micro = ["m0"]
    if setup.loss == "shifted-sum":                   # notebook 17's train_step: the whole batch's targets counted
        count = (batch["labels"][..., 1:] != -100).sum()
        total = torch.zeros(())
    try:
        for micro in range(setup.accumulation_steps):
            _micro[0] = f"m{micro}"
            if mark is not None:
                mark(f"m{micro}.embed")
            kwargs = {"input_ids": batch["input_ids"][micro]}
            if "attention_mask" in batch:
                kwargs["attention_mask"] = batch["attention_mask"][micro]
            labels = batch["labels"][micro]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                if setup.loss == "labels" and keep:
                    loop["outputs"] = net(**kwargs, labels=labels)
                    loss = loop["outputs"].loss
                elif setup.loss == "labels":
                    loss = net(**kwargs, labels=labels).loss
                elif setup.loss == "shifted-sum" and keep:
                    loop["outputs"] = net(**kwargs)
                    loss = _shifted_sum(loop["outputs"], labels) / count
                elif setup.loss == "shifted-sum":
                    loss = _shifted_sum(net(**kwargs), labels) / count
                elif keep:
                    loop["logits"] = net(**kwargs).logits
                    loop["loss"] = F.cross_entropy(loop["logits"].flatten(0, 1).float(), labels.flatten())
                    loss = loop["loss"]
                else:
                    logits = net(**kwargs).logits
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                    del logits
                if mark is not None:
                    mark(f"m{micro}.exit")
            if mark is not None:
                mark(f"m{micro}.bloss")
            if setup.loss == "shifted-sum":
                loss.backward()
                total += loss.detach()                # the loss lives on until the next one replaces it
                continue
            (loss / setup.accumulation_steps if setup.accumulation_steps > 1 else loss).backward()
            del loss
        if mark is not None:
            mark("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if mark is not None:
            mark("end")
        if outputs == "kept-in-step":
            loop.clear()
    finally:
        for handle in handles:
            handle.remove()


def loop_tensors(loop: dict[str, Any]) -> list[Any]:
    """Every tensor the loop's variables hold (an output object's loss, logits and cache included) and what their
    autograd graph keeps (a checkpointed model's input leaf and its ``.grad``, a reentrant checkpoint's arguments).

    Written without a recursive closure: a closure that refers to itself is a reference cycle, which would keep the
    tensors it collected alive until the garbage collector runs (and the measured step would depend on when)."""
    torch = _torch()
    found: list[Any] = []
    values: list[Any] = [loop]
    nodes: list[Any] = []
    seen: set[int] = set()
    while values or nodes:
        while values:
            value = values.pop()
            if isinstance(value, torch.Tensor):
                found.append(value)
                if value.grad_fn is not None:
                    nodes.append(value.grad_fn)
            elif isinstance(value, dict):
                values.extend(value.values())
            elif isinstance(value, (list, tuple)):
                values.extend(value)
            elif hasattr(value, "layers"):                 # a transformers Cache
                values.extend(getattr(layer, name, None) for layer in value.layers
                              for name in ("keys", "values", "_sliding_window_tensor"))
            elif hasattr(value, "to_tuple"):               # a ModelOutput
                values.append(value.to_tuple())
        if nodes:
            node = nodes.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            variable = getattr(node, "variable", None)      # AccumulateGrad: a leaf (the embedding's output)
            if isinstance(variable, torch.Tensor) and not isinstance(variable, torch.nn.Parameter):
                values.extend([variable, variable.grad])
            function = getattr(node, "run_function", None)  # a reentrant checkpoint keeps its block's arguments
            if function is not None:
                values.extend([*getattr(function, "keywords", {}).values(), *getattr(function, "args", ())])
            nodes.extend(next_node for next_node, _ in node.next_functions)
    return found


def _shifted_sum(outputs: Any, labels: Any) -> Any:
    """Notebook 17's ``llama_loss_sum``: position t predicts t + 1, summed over the targets that count."""
    import torch.nn.functional as F

    logits = outputs.logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, -2), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")


def _layers_and_norm(net: Any) -> tuple[Any, Any]:
    base = net.get_base_model() if hasattr(net, "get_base_model") else net
    if hasattr(base, "transformer"):                  # GPT-2
        return base.transformer.h, base.transformer.ln_f
    return base.model.layers, base.model.norm


# --- measuring it ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HfMeasurement:
    """One measured step of a transformers model.

    Attributes:
        peak_bytes: ``StorageCounter``'s peak (model, optimizer state and batch included).
        memtracker_peak_bytes: torch ``MemTracker``'s peak of the same step, or None where it cannot run
            (torch 2.13's refuses frozen parameters: the LoRA configurations).
        peak_phase: the phase of the counter's peak.
        boundaries: phase -> bytes alive when it ended (as the replay's ``phase_marks``).
        events: with ``trace=True``, the counter's (phase, +/- bytes, op) sequence.
    """

    peak_bytes: int
    memtracker_peak_bytes: int | None
    peak_phase: str
    boundaries: dict[str, int] = field(default_factory=dict)
    events: list = field(default_factory=list)


def measure_hf_step(model: Any, setup: Any, *, seed: int = 0, trace: bool = False, memtracker: bool = True,
                    fields: dict[str, Any] | None = None) -> HfMeasurement:
    """Build, warm up (one step creates the optimizer state, and the loop's variables under ``outputs="kept"``)
    and measure one ``hf_reference_step`` on the CPU (``fields``: the config dict the model was read from)."""
    with warnings.catch_warnings():       # transformers' and peft's own deprecation notices, not ours
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", "fan_in_fan_out is set to False", UserWarning)   # peft on GPT-2's Conv1D
        warnings.filterwarnings("ignore", ".*use_reentrant.*", UserWarning)
        return _measure_hf_step(model, setup, seed, trace, memtracker, fields)


def _measure_hf_step(model: Any, setup: Any, seed: int, trace: bool, memtracker: bool,
                     fields: dict[str, Any] | None) -> HfMeasurement:
    torch = _torch()

    setup = replace(setup, device="cpu")
    outputs = registry.family_of(model.arch).outputs(setup)
    net, optimizer = build_hf_reference(model, setup, seed=seed, fields=fields)
    batch = make_hf_batch(model, setup, seed=seed)
    loop: dict[str, Any] = {}
    hf_reference_step(net, optimizer, batch, setup, loop=loop, outputs=outputs)
    existing = (list(net.parameters()) + list(net.buffers()) + list(batch.values()) + loop_tensors(loop)
                + [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)])
    with StorageCounter(trace=trace) as counter:
        counter.follow(existing)
        del existing                                  # the loop's old outputs must be free to go when rebound
        hf_reference_step(net, optimizer, batch, setup, counter.mark, loop=loop, outputs=outputs)
    tracked = None
    frozen = any(not p.requires_grad for p in net.parameters())
    if memtracker and not frozen and setup.accumulation_steps == 1 and not setup.reentrant:
        from torch.distributed._tools.mem_tracker import MemTracker   # one forward per module: no recompute

        tracker = MemTracker()
        tracker.track_external(net, optimizer, *batch.values(), *loop_tensors(loop))
        with tracker:
            hf_reference_step(net, optimizer, batch, setup, loop=loop, outputs=outputs)
        tracked = sum(int(v) for device, kinds in tracker.get_tracker_snapshot("peak").items()
                      if torch.device(device).type == "cpu" for k, v in kinds.items() if _plain(k) == "Total")
    return HfMeasurement(peak_bytes=counter.peak_bytes, memtracker_peak_bytes=tracked, peak_phase=counter.peak_phase,
                         boundaries=dict(counter.marks), events=counter.events or [])


def _plain(key: Any) -> str:
    return getattr(key, "value", str(key))


# --- the grid ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HfValidationRow:
    """One configuration: the prediction's peak beside both measurements.

    Attributes:
        label, model, setup: the configuration.
        predicted_peak_bytes: ``predict(model, setup).total`` on the CPU.
        measured: the ``HfMeasurement``.
    """

    label: str
    model: Any
    setup: Any
    predicted_peak_bytes: int
    measured: HfMeasurement

    @property
    def error(self) -> float:
        """|predicted - measured| / measured, of the peak."""
        return abs(self.predicted_peak_bytes - self.measured.peak_bytes) / self.measured.peak_bytes

    @property
    def trackers_agree(self) -> bool:
        """MemTracker and ``StorageCounter`` give the same peak (True where MemTracker could not run)."""
        tracked = self.measured.memtracker_peak_bytes
        return tracked is None or tracked == self.measured.peak_bytes


def validate_hf(grid: Sequence[tuple[str, Any, Any]] | None = None, *, check: bool = False,
                progress: Callable[[HfValidationRow], None] | None = None,
                memtracker_rows: int | None = None) -> list[HfValidationRow]:
    """Measure every configuration of the transformers grid on the CPU and put ``predict``'s peak beside it.

    Args:
        grid: (label, model, setup) rows, a model being a ``ModelConfig`` or a config dict; default
            ``hf_validation_grid(check)``.
        check: the subset the tests run.
        progress: called with each row as soon as it is measured.
        memtracker_rows: measure with torch's ``MemTracker`` too on the first this many rows only (None: all).
    """
    from .from_transformers import model_config_from_hf
    from .predict import predict

    rows = []
    for index, (label, model, setup) in enumerate(grid if grid is not None else hf_validation_grid(check)):
        fields = model if isinstance(model, dict) else None
        model = model_config_from_hf(fields) if fields is not None else model
        setup = replace(setup, device="cpu")
        memtracker = memtracker_rows is None or index < memtracker_rows
        row = HfValidationRow(label, model, setup, predict(model, setup).total,
                              measure_hf_step(model, setup, fields=fields, memtracker=memtracker))
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


HF_VALIDATION_HEADER = f"{'configuration (peak, bytes)':<36}{'predicted':>11}{'measured':>11}{'MemTracker':>12}{'diff':>7}"


def format_hf_validation_row(row: HfValidationRow) -> str:
    """One line: predicted peak, the counter's, MemTracker's ("-" where it cannot run), the difference."""
    tracked = row.measured.memtracker_peak_bytes
    return (f"{row.label:<36}{row.predicted_peak_bytes:>11,}{row.measured.peak_bytes:>11,}"
            f"{(f'{tracked:,}' if tracked is not None else '-'):>12}{row.predicted_peak_bytes - row.measured.peak_bytes:>+7,}"
            + ("" if row.trackers_agree else "  (the two trackers disagree)"))


def versions() -> str:
    """torch, transformers and peft versions, for the grid's summary line."""
    import peft
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"
