"""A training-memory calculator: the peak bytes of a training step per device, term by term, checked by measuring.

Introduced in notebook 12 (distributed), which prints its 7B and 70B tables; notebook 10 (fewer bits) and 17
(capstone) predict with it before measuring; notebook 13 uses ``model_parallel``. As a program::

    python -m utils.calculator --hf-config utils/calculator/configs/gemma-2-9b.json   # a transformers config.json
    python -m utils.calculator --hf-config llama-2-70b --precision bf16 --lora-rank 16 --base-quant nf4-double \
        --checkpointing every_block --seq-len 2048        # QLoRA on a shipped config, and the largest micro-batch
    python -m utils.calculator --preset 7B                     # the course's Llama design, Llama-2-7B's shape
    python -m utils.calculator --validate [--check]            # the course's designs: prediction vs exact tracker
    python -m utils.calculator --validate-hf [--check]         # real transformers models vs MemTracker

What it predicts. From a model (a ``ModelConfig``: the course's designs, a preset, or a transformers config read by
``model_config_from_hf``/``predict_hf``) and a training set-up (``TrainingSetup``: precision, optimizer and its
options, checkpointing (reentrant or not), LoRA, the loss and what the loop keeps of the output, accumulation,
data parallelism, fewer bits), ``predict`` returns a ``MemoryBreakdown``: the peak bytes of one steady-state
training step on one device, what is alive then, and each term at its own largest; ``largest_micro_batch`` finds
the largest micro-batch that fits a device. It replays the step as the allocations and frees eager PyTorch
performs, in order, because the peak is a question of what is alive at the same moment.

The files, in reading order:

* ``config.py``: ``ModelConfig`` and ``TrainingSetup``, what the reader describes; ``registry.py``: the families
  by name;
* the engine: ``graph.py`` (storages, tensors, autograd nodes, phases), ``replay.py`` (allocations, frees, the
  backward in autograd's order, non-reentrant checkpointing's recompute), ``ops.py`` (aten ops as allocations),
  ``step.py`` (one step: model state, the family's forward, backward, reentrant checkpointing, the loop's
  variables, the optimizer), ``loss.py``, ``optimizers.py``, ``data_parallel.py`` (ZeRO, FSDP), ``fewer_bits.py``
  (notebook 10's NF4, bf16 rounding, FP8), ``layer_reuse.py`` (one layer replayed stands for every identical
  one), ``predict.py`` (the public API);
* ``families/``: one module per model family (below);
* ``from_transformers.py``: a config.json, a ``PretrainedConfig``, peft's ``LoraConfig`` and the checkpointing
  kwargs, read field by field; ``presets.py``; ``configs/*.json``: shipped configs, each naming its source;
* ``model_parallel.py`` (notebook 13: bytes per GPU under TP, SP, PP, CP with DP), ``parallel_layout.py``,
  ``parallel_tensors.py``;
* ``reference.py``, ``validate.py`` (the course's designs, measured with the exact tracker), ``validate_hf.py``,
  ``hf_grid.py``, ``counter.py`` (transformers models, measured with MemTracker and an independent storage
  counter); ``cli.py``: the command line.

A family (``families/base.py``'s ``Family``), one module registered by ``arch`` and transformers ``model_type``:

* ``rules`` and ``read_config(fields, attention, name)``: every field of its config class replayed, harmless (a
  reason each) or refused away from its default; ``check_model``, ``check_setup``: refusals, before any work;
* ``parameter_shapes``, ``leaf_item``, ``lora_targets``, ``peft_default_targets``, ``block_linear_weights`` (NF4,
  FP8), ``tensor_parallel_dim`` and ``activation_design`` (model parallelism): its tensors;
* ``buffers``, ``step_begin``, ``forward(r, micro)`` (one micro-batch up to its loss, with ``r.run_layers`` for the
  blocks and ``r.hold`` for what the reader's loop keeps), ``after_backward``, ``outputs``, ``divides_loss``: its step;
* ``layer_signature``: which of its layers replay alike (``layer_reuse`` replays one of each).

``families/decoder.py``'s ``TransformersDecoder`` is transformers' causal-LM skeleton (embedding, cache, masks, rotary,
layers, head, loss); a family overrides what differs: ``project_qkv`` (Qwen3's q/k norms, Phi-3's fused qkv),
``mlp``, ``block`` (Gemma's four norms), ``masks``, ``rotaries``, ``head`` (Gemma's soft-capping), ``attend``. To add
one: a module, its import in ``families/__init__.py``, a shipped config and grid rows in ``hf_grid.py``; the
field-walking test names the fields to decide. Follow-ups plug in the same way: a mixture-of-experts block is a
family's ``block`` with routing given as tokens per expert (the busiest expert's activations set the peak, and its
``layer_signature`` marks MoE layers); generation (notebook 15) is ``generate.py`` (transformers' ``generate``:
the cache in ``generate_cache.py``, the family's ``generating_forward`` in ``families/decoder_generation.py``) and
``rl.py`` / ``rl_ops.py`` (a GRPO step), on the command line ``--generate`` and ``--rl`` (``generate_cli.py``); other pipeline schedules (interleaved, zero-bubble) belong to
``parallel_layout.micro_batches_in_flight``.

Exactness. On the CPU the exact tracker measures the course's step (``reference_step``) over a grid of 38
configurations that covers every option, and the prediction equals it to the byte for every term, the peak and
every phase boundary. ``validate_hf`` trains 74 tiny transformers models of every family (Llama, Mistral, Qwen2,
Qwen3, Phi-3, Gemma 2, Gemma 3, GPT-2) one step each with the options readers set (dropout, sliding layers,
reentrant checkpointing, LoRA, padding, the loop's kept outputs, each precision) and measures them with torch's
``MemTracker`` and the storage counter: the predicted peak equals both to the byte on all 74. What those bounds do
not cover:

* a GPU: the caching allocator rounds each block up to 512 bytes and keeps cuBLAS workspaces, and CUDA's
  attention kernels save slightly different statistics (logsumexp padding, RNG state). ``validate(device=
  "cuda")`` / ``--validate --on cuda`` measures that difference with the allocator. Its first GPU run (H100,
  torch 2.11) counted the process's 64 MiB of cuBLAS workspaces in every peak; the step's own bytes are
  compared now, not yet rerun on a GPU (``measure_reference_step`` says what that run left unexplained). The CUDA
  context and fragmentation (``max_memory_reserved``) are outside every term;
* data parallelism across processes: each rank's parameters, gradients and optimizer state follow ZeRO's
  formulas (equal to ``utils.parallel.predict_zero_bytes_per_rank``, tested; FSDP2 pads dim 0 of each
  tensor, up to one row per tensor more), DDP's gradient buckets are measured on one in-process rank
  (tested); FSDP's all-gathered units (two at a time) and unsharded gradients before their
  reduce-scatter follow FSDP2's design and are not measured here;
* ``torch.compile``'d steps and fused kernels (flash attention variants, Liger): the replay knows the ops of the
  families above, run eagerly; what it does not model it refuses with a message that names the option.
"""

from __future__ import annotations

from . import families, registry  # noqa: F401  (the families register themselves before any ModelConfig is made)
from .config import (ATTENTIONS, BASE_QUANTS, BF16_ROUNDINGS, CHECKPOINTING, DEVICES, KINDS, LAYER_TYPES,
                     LORA_TARGETS, LOSSES, OPTIMIZER_IMPLS, OPTIMIZERS, OUTPUTS, PRECISIONS, STRATEGIES, ModelConfig,
                     TrainingSetup)
from .from_transformers import (HF_MODEL_TYPES, SHIPPED_CONFIGS, load_hf_config, lora_overrides, model_config_from_hf,
                                predict_hf)
from .optimizers import ADAMW8BIT_BLOCK, ADAMW8BIT_CODEBOOKS, OPTIMIZER_OPTIONS
from .predict import TERM_LABELS, MemoryBreakdown, format_table, largest_micro_batch, predict
from .presets import PRESETS, preset
from .reference import build_reference, reference_step
from .families.course_llama import llama_like
from .shapes import count_parameters, parameter_shapes
from .validate import (GRID_GPT, GRID_LLAMA, MEASURED_TERMS, VALIDATION_HEADER, StepBytes, ValidationRow,
                       format_validation, format_validation_row, measure_reference_step, model_state_per_rank,
                       predict_step_bytes, validate, validation_grid, worst_errors)
from .model_parallel import (ParallelLayout, ParallelModel, format_parallel, predict_parallel,
                             smallest_fitting_layout)
from .cli import main

# generation and the RL step (notebook 15), loaded on first use: name -> module
_LAZY = {"GenerateSetup": "generate", "GenerationBreakdown": "generate", "predict_generate": "generate",
         "RLSetup": "rl", "RLBreakdown": "rl", "predict_rl_step": "rl", "RL_PHASES": "rl"}


def __getattr__(name: str) -> object:
    """The names of ``generate.py`` and ``rl.py``, imported when first asked for."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ARCHS = registry.arches(transformers=False)      # the course's designs: "gpt", "llama"
HF_ARCHS = registry.arches(transformers=True)    # transformers' families: "hf-llama", "hf-gpt2", ...
Prediction = MemoryBreakdown   # the name the issues use for what predict and predict_hf return

__all__ = [
    "ARCHS", "PRECISIONS", "OPTIMIZERS", "OPTIMIZER_IMPLS", "CHECKPOINTING", "LORA_TARGETS", "STRATEGIES", "DEVICES",
    "KINDS", "ModelConfig", "TrainingSetup", "parameter_shapes", "count_parameters", "ADAMW8BIT_BLOCK",
    "ADAMW8BIT_CODEBOOKS", "build_reference", "llama_like", "reference_step", "TERM_LABELS", "MemoryBreakdown",
    "Prediction", "predict", "largest_micro_batch", "format_table", "PRESETS", "preset", "MEASURED_TERMS",
    "StepBytes", "model_state_per_rank", "predict_step_bytes", "measure_reference_step", "GRID_GPT", "GRID_LLAMA",
    "validation_grid", "ValidationRow", "validate", "worst_errors", "VALIDATION_HEADER", "format_validation_row",
    "format_validation", "main", "predict_hf", "load_hf_config", "model_config_from_hf", "HF_MODEL_TYPES",
    "SHIPPED_CONFIGS", "HF_ARCHS", "ATTENTIONS", "LOSSES", "BASE_QUANTS", "BF16_ROUNDINGS", "ParallelLayout",
    "ParallelModel", "format_parallel", "predict_parallel", "smallest_fitting_layout", "OUTPUTS", "LAYER_TYPES",
    "OPTIMIZER_OPTIONS", "lora_overrides", "registry", *sorted(_LAZY),
]
