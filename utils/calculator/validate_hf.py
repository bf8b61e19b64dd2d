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

Result (issue 33; torch 2.13.0+cpu, transformers 5.24.0, peft 0.21.2): on all 42 configurations of the grid
(32 of the Llama family, 10 of GPT-2) the predicted peak equals the measured one to the byte (worst error 0
bytes), and MemTracker and the counter agree to the byte on the 31 where MemTracker runs (it refuses the 8
LoRA models and, with accumulation, a module called twice). The tests assert it on a 5-configuration subset.
One thing a tracker changes: under any ``TorchDispatchMode`` (MemTracker, the counter) sdpa's math kernel
(attention dropout on the CPU) adds its mask out of place, one (B, H, T, T) tensor more for a moment than an
untracked step; the replay follows the tracked step. Not covered: CUDA (the replay has CUDA's op-level
choices, e.g. dropout's bool mask, but no GPU has measured them), a padded batch together with Mistral's
sliding window (its mask's temporaries are not modelled).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from .counter import StorageCounter


def _torch():  # noqa: ANN202 - imported lazily
    import torch

    return torch


# --- the real model and its step -------------------------------------------------------------------------------

def hf_config_for(model: Any) -> Any:
    """The transformers config of a calculator ``ModelConfig`` of arch ``"hf-llama"`` / ``"hf-gpt2"``."""
    import transformers

    if model.arch == "hf-gpt2":
        return transformers.GPT2Config(n_layer=model.num_layers, n_embd=model.d_model, n_head=model.num_heads,
                                       vocab_size=model.vocab_size, n_positions=model.max_seq_len,
                                       n_inner=model.ffn if model.ffn != 4 * model.d_model else None,
                                       tie_word_embeddings=model.tied_embeddings, use_cache=model.use_cache,
                                       embd_pdrop=model.dropout[0], attn_pdrop=model.dropout[1],
                                       resid_pdrop=model.dropout[2], activation_function=model.activation or "gelu_new")
    config_class = transformers.Qwen2Config if model.qkv_bias and not model.out_bias else transformers.LlamaConfig
    if model.sliding_window is not None:
        config_class = transformers.MistralConfig
    fields = dict(num_hidden_layers=model.num_layers, hidden_size=model.d_model, num_attention_heads=model.num_heads,
                  num_key_value_heads=model.kv_heads, intermediate_size=model.ffn, vocab_size=model.vocab_size,
                  max_position_embeddings=model.max_seq_len, tie_word_embeddings=model.tied_embeddings,
                  use_cache=model.use_cache)
    if config_class is transformers.LlamaConfig:
        fields.update(attention_bias=model.qkv_bias, mlp_bias=model.mlp_bias, head_dim=model.head_dim)
    if config_class is transformers.MistralConfig:
        fields.update(sliding_window=model.sliding_window, head_dim=model.head_dim)
    return config_class(**fields)


def build_hf_reference(model: Any, setup: Any, *, seed: int = 0) -> tuple[Any, Any]:
    """The transformers model (peft-wrapped under LoRA) and optimizer ``hf_reference_step`` trains, on the CPU.

    Random weights from the config (``AutoModelForCausalLM.from_config``); pure bf16 converts the model
    with ``.to(torch.bfloat16)`` before peft adds its (float32) adapters; checkpointing is
    ``activation_checkpointing_enable()`` (``gradient_checkpointing_enable`` before transformers 5).
    """
    torch = _torch()
    import transformers

    torch.manual_seed(seed)
    net = transformers.AutoModelForCausalLM.from_config(hf_config_for(model), attn_implementation=model.attention)
    if setup.precision == "bf16":
        net = net.to(torch.bfloat16)
    if setup.lora_rank:
        from peft import LoraConfig, get_peft_model

        from .hf_llama import hf_lora_targets

        if model.arch == "hf-gpt2":
            from .hf_gpt2 import gpt2_lora_targets

            targets = sorted(gpt2_lora_targets(model, setup))
        else:
            targets = sorted(hf_lora_targets(model, setup))
        net = get_peft_model(net, LoraConfig(r=setup.lora_rank, lora_alpha=2 * setup.lora_rank,
                                             lora_dropout=setup.lora_dropout, target_modules=targets))
    if setup.checkpointing == "every_block":
        enable = getattr(net, "activation_checkpointing_enable", None) or net.gradient_checkpointing_enable
        enable()
    net.train()
    params = [p for p in net.parameters() if p.requires_grad]
    impl = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[setup.optimizer_impl]
    optimizers = {"sgd": lambda: torch.optim.SGD(params, lr=1e-3, **impl),
                  "sgd_momentum": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9, **impl),
                  "adam": lambda: torch.optim.Adam(params, lr=1e-3, **impl),
                  "adamw": lambda: torch.optim.AdamW(params, lr=1e-3, **impl),
                  "adafactor": lambda: torch.optim.Adafactor(params, lr=1e-3, **impl)}
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
                      mark: Callable[[str], None] | None = None) -> None:
    """One training step of a transformers model, as a reader writes it (what ``predict_hf`` replays).

    For each micro-batch: under ``torch.autocast`` when the precision says so,
    ``loss = net(input_ids=..., attention_mask=..., labels=...).loss`` (the output object, which holds the
    logits and the cache, is dropped at once), or with ``setup.loss == "logits"`` your own
    ``F.cross_entropy(net(...).logits.flatten(0, 1).float(), targets.flatten())``, or with ``"shifted-sum"``
    notebook 17's ``train_step`` (the targets counted first, ``loss_sum(net(...), labels) / count``, a running
    total, each loss kept until the next replaces it); then ``loss.backward()``
    (``(loss / accumulation_steps).backward()`` when accumulating); then ``optimizer.step()`` and
    ``optimizer.zero_grad(set_to_none=True)``. ``mark(phase)`` is called where the replay's phases begin
    (embeddings, each layer's forward and backward, the head, the loss's backward, the optimizer).
    """
    torch = _torch()
    import torch.nn.functional as F

    autocast = setup.precision == "bf16-autocast"
    layers, final_norm = _layers_and_norm(net)
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
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                if setup.loss == "labels":
                    loss = net(**kwargs, labels=batch["labels"][micro]).loss
                elif setup.loss == "shifted-sum":
                    loss = _shifted_sum(net(**kwargs), batch["labels"][micro]) / count
                else:
                    logits = net(**kwargs).logits
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"][micro].flatten())
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
    finally:
        for handle in handles:
            handle.remove()


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


def measure_hf_step(model: Any, setup: Any, *, seed: int = 0, trace: bool = False,
                    memtracker: bool = True) -> HfMeasurement:
    """Build, warm up (one step creates the optimizer state) and measure one ``hf_reference_step`` on the CPU."""
    with warnings.catch_warnings():       # transformers' and peft's own deprecation notices, not ours
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", "fan_in_fan_out is set to False", UserWarning)   # peft on GPT-2's Conv1D
        return _measure_hf_step(model, setup, seed, trace, memtracker)


def _measure_hf_step(model: Any, setup: Any, seed: int, trace: bool, memtracker: bool) -> HfMeasurement:
    torch = _torch()

    setup = replace(setup, device="cpu")
    net, optimizer = build_hf_reference(model, setup, seed=seed)
    batch = make_hf_batch(model, setup, seed=seed)
    hf_reference_step(net, optimizer, batch, setup)
    existing = (list(net.parameters()) + list(net.buffers()) + list(batch.values())
                + [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)])
    with StorageCounter(trace=trace) as counter:
        counter.follow(existing)
        hf_reference_step(net, optimizer, batch, setup, counter.mark)
    tracked = None
    frozen = any(not p.requires_grad for p in net.parameters())
    if memtracker and not frozen and setup.accumulation_steps == 1:   # MemTracker: one forward per module
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(net, optimizer, *batch.values())
        with tracker:
            hf_reference_step(net, optimizer, batch, setup)
        tracked = sum(int(v) for device, kinds in tracker.get_tracker_snapshot("peak").items()
                      if torch.device(device).type == "cpu" for k, v in kinds.items() if _plain(k) == "Total")
    return HfMeasurement(peak_bytes=counter.peak_bytes, memtracker_peak_bytes=tracked, peak_phase=counter.peak_phase,
                         boundaries=dict(counter.marks), events=counter.events or [])


def _plain(key: Any) -> str:
    return getattr(key, "value", str(key))


# --- the grid ------------------------------------------------------------------------------------------------------

def _tiny(**changes: Any) -> Any:
    from .config import ModelConfig

    fields = dict(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, ffn_width=48, vocab_size=64, max_seq_len=16,
                  arch="hf-llama", name="tiny LlamaForCausalLM")
    fields.update(changes)
    return ModelConfig(**fields)


def _tiny_gpt2(**changes: Any) -> Any:
    """A tiny ``GPT2LMHeadModel``: GPT-2's own dropouts (0.1 each) and ``gelu_new`` unless changed."""
    from .config import ModelConfig

    fields = dict(num_layers=2, d_model=32, num_heads=4, ffn_width=48, vocab_size=64, max_seq_len=16,
                  arch="hf-gpt2", tied_embeddings=True, dropout=(0.1, 0.1, 0.1), name="tiny GPT2LMHeadModel")
    fields.update(changes)
    return ModelConfig(**fields)


def hf_validation_grid(check: bool = False) -> list[tuple[str, Any, Any]]:
    """The configurations ``validate_hf`` measures: tiny transformers Llama-family and GPT-2 models, micro-batch 2 x 16.

    Covered: sdpa and eager attention; grouped-query (2 kv heads of 4), multi-head and multi-query attention;
    tied embeddings; q/k/v biases (Qwen2's design, a real ``Qwen2ForCausalLM``); ``MistralForCausalLM`` with a
    sliding window longer and shorter than the sequence; fp32, bf16 autocast and pure bf16; peft LoRA (all linear
    layers, or q/v with dropout) with and without ``gradient_checkpointing_enable``; ``labels=`` and your own
    loss on the logits; a padded batch with its ``attention_mask``; a model without cache; micro-batch 1;
    gradient accumulation; AdamW (for-loop, foreach and fused), SGD with momentum and Adafactor; notebook 17's
    summed loss over the count (``loss="shifted-sum"``). GPT-2 (``GPT2LMHeadModel``): its dropouts at 0.1
    (sdpa's math kernel) and at 0 (the flash kernel), eager attention, untied head, ``gelu_new`` and
    ``gelu_pytorch_tanh``, peft LoRA on its ``Conv1D`` layers, every precision, checkpointing and loss.
    ``check=True`` gives the subset the tests run (a few seconds).
    """
    from .config import TrainingSetup

    base = TrainingSetup(micro_batch=2, seq_len=16, precision="fp32", optimizer="adamw", optimizer_impl="for-loop",
                         device="cpu")
    gqa, mha, mqa_tied = _tiny(), _tiny(num_kv_heads=4, name="tiny, 4 kv heads"), \
        _tiny(num_kv_heads=1, tied_embeddings=True, name="tiny, 1 kv head, tied")
    eager, qwen = _tiny(attention="eager", name="tiny, eager"), _tiny(qkv_bias=True, name="tiny, q/k/v bias (Qwen2)")
    gpt2, gpt2_plain = _tiny_gpt2(), _tiny_gpt2(dropout=(0.0, 0.0, 0.0), name="tiny GPT-2, no dropout")
    gpt2_eager = _tiny_gpt2(attention="eager", name="tiny GPT-2, eager")
    gpt2_untied = _tiny_gpt2(attention="eager", tied_embeddings=False, name="tiny GPT-2, eager, untied")
    gpt2_tanh = _tiny_gpt2(activation="gelu_pytorch_tanh", use_cache=False, name="tiny GPT-2, gelu_pytorch_tanh")

    def s(**changes: Any) -> Any:
        return replace(base, **changes)

    ac, bf, ck = "bf16-autocast", "bf16", "every_block"
    grid = [
        ("sdpa gqa fp32 adamw", gqa, s()),
        ("sdpa gqa autocast", gqa, s(precision=ac)),
        ("sdpa gqa bf16", gqa, s(precision=bf)),
        ("sdpa gqa own loss on logits", gqa, s(loss="logits")),
        ("sdpa mha fp32", mha, s()),
        ("sdpa mqa tied fp32", mqa_tied, s()),
        ("sdpa gqa checkpointing", gqa, s(checkpointing=ck)),
        ("sdpa gqa padded batch", gqa, s(padded=True)),
        ("sdpa gqa lora all-linear", gqa, s(lora_rank=4)),
        ("sdpa gqa lora checkpointing", gqa, s(lora_rank=4, checkpointing=ck)),
        ("sdpa gqa lora autocast", gqa, s(lora_rank=4, precision=ac)),
        ("sdpa gqa lora bf16", gqa, s(lora_rank=4, precision=bf)),
        ("sdpa gqa lora q,v dropout 0.1", gqa, s(lora_rank=4, lora_dropout=0.1, lora_targets=("q_proj", "v_proj"))),
        ("sdpa gqa padded autocast lora", gqa, s(padded=True, precision=ac, lora_rank=4)),
        ("sdpa gqa accumulation 2", gqa, s(accumulation_steps=2)),
        ("sdpa qwen2 bias fp32", qwen, s()),
        ("sdpa gqa sgd momentum", gqa, s(optimizer="sgd_momentum")),
        ("sdpa gqa adafactor foreach", gqa, s(optimizer="adafactor", optimizer_impl="foreach")),
        ("sdpa gqa bf16 adamw foreach", gqa, s(optimizer_impl="foreach", precision=bf)),
        ("sdpa gqa no cache", _tiny(use_cache=False, name="tiny, use_cache=False"), s()),
        ("sdpa gqa batch 1 autocast ckpt", gqa, s(micro_batch=1, precision=ac, checkpointing=ck)),
        ("eager gqa fp32", eager, s()),
        ("eager batch 1", eager, s(micro_batch=1)),
        ("eager mha checkpointing", _tiny(attention="eager", num_kv_heads=4, name="tiny, eager, 4 kv heads"),
         s(checkpointing=ck)),
        ("eager mqa autocast", _tiny(attention="eager", num_kv_heads=1, name="tiny, eager, 1 kv head"),
         s(precision=ac)),
        ("eager bf16 padded checkpointing", eager, s(precision=bf, padded=True, checkpointing=ck)),
        ("mistral window 4096 fp32", _tiny(sliding_window=4096, name="tiny MistralForCausalLM"), s()),
        ("mistral window 8 < 16 tokens", _tiny(sliding_window=8, name="tiny Mistral, window 8"), s()),
        ("sdpa gqa autocast own loss", gqa, s(precision=ac, loss="logits")),
        ("notebook 17: padded shifted-sum fused", _tiny(use_cache=False, name="tiny, use_cache=False"),
         s(padded=True, loss="shifted-sum", optimizer_impl="fused")),
        ("shifted-sum autocast accumulation 2", gqa, s(loss="shifted-sum", precision=ac, accumulation_steps=2)),
        ("shifted-sum bf16 checkpointing", gqa, s(loss="shifted-sum", precision=bf, checkpointing=ck)),
        ("gpt2 sdpa dropout 0.1 fp32", gpt2, s()),
        ("gpt2 sdpa dropout 0.1 autocast", gpt2, s(precision=ac)),
        ("gpt2 sdpa dropout 0.1 bf16 padded", gpt2, s(precision=bf, padded=True)),
        ("gpt2 sdpa no dropout autocast ckpt", gpt2_plain, s(precision=ac, checkpointing=ck)),
        ("gpt2 eager dropout 0.1 padded", gpt2_eager, s(padded=True)),
        ("gpt2 eager untied bf16 checkpointing", gpt2_untied, s(precision=bf, checkpointing=ck)),
        ("gpt2 lora c_attn,c_fc checkpointing", gpt2, s(lora_rank=4, lora_targets=("c_attn", "c_fc"), checkpointing=ck)),
        ("gpt2 lora all autocast dropout 0.1", gpt2, s(lora_rank=4, lora_dropout=0.1, precision=ac)),
        ("gpt2 tanh gelu own loss batch 1", gpt2_tanh, s(micro_batch=1, loss="logits", optimizer="sgd_momentum")),
        ("gpt2 shifted-sum accumulation 2", gpt2, s(loss="shifted-sum", accumulation_steps=2, padded=True,
                                                    optimizer_impl="foreach")),
    ]
    if not check:
        return grid
    subset = ("sdpa gqa padded autocast lora", "eager bf16 padded checkpointing", "notebook 17: padded shifted-sum fused",
              "gpt2 sdpa dropout 0.1 autocast", "gpt2 lora c_attn,c_fc checkpointing")
    return [row for row in grid if row[0] in subset]


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
                progress: Callable[[HfValidationRow], None] | None = None) -> list[HfValidationRow]:
    """Measure every configuration of the transformers grid on the CPU and put ``predict``'s peak beside it."""
    from .predict import predict

    rows = []
    for label, model, setup in grid if grid is not None else hf_validation_grid(check):
        setup = replace(setup, device="cpu")
        row = HfValidationRow(label, model, setup, predict(model, setup).total, measure_hf_step(model, setup))
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
