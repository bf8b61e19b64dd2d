"""A training-memory calculator: the peak bytes of a training step per device, term by term, checked by measuring.

Introduced in notebook 12 (distributed), which prints its 7B and 70B tables; notebook 17 (capstone) predicts
its model with it before measuring. As a program::

    python -m utils.calculator --hf-config utils/calculator/configs/llama-2-7b.json   # a transformers config.json
    python -m utils.calculator --preset 7B                     # Llama-2-7B, micro-batch 1 x 4096, bf16 autocast
    python -m utils.calculator --preset 70B --strategy fsdp --ranks 64 --checkpointing every_block
    python -m utils.calculator --layers 12 --d-model 768 --heads 12 --vocab 50257 --arch gpt --seq-len 1024
    python -m utils.calculator --validate [--check]            # the course's designs: prediction vs exact tracker
    python -m utils.calculator --validate-hf [--check]         # real transformers models vs torch's MemTracker

What it predicts. From a transformer's shape (``ModelConfig``; ``PRESETS`` holds Llama 3.2 1B and Llama 2
7B, 13B and 70B, read from the shipped ``configs/*.json``) or a Hugging Face config (``predict_hf``,
``load_hf_config``) and a training set-up (``TrainingSetup``: precision, optimizer and its torch.optim
implementation, activation checkpointing, LoRA, chunked loss, accumulation, data parallelism), ``predict``
returns a ``MemoryBreakdown``: the peak bytes of one steady-state training step on one device, what is alive
at that moment (parameters, gradients, optimizer state, activations, the loss and its logits, autocast's
weight copies, data-parallel buffers, the batch, temporaries) and each term at its own largest.
``largest_micro_batch`` finds the largest micro-batch whose peak fits a device; ``format_table`` prints a
breakdown.

How. The peak depends on *when* each tensor lives, so the calculator replays one step of a training loop
as the sequence of tensor allocations and frees eager PyTorch performs (each event's size is a product of
the shapes; the peak is the replay's highest point). The package's files are its design, read in this order:

* ``config.py``: ``ModelConfig`` and ``TrainingSetup``, what the reader describes;
* ``replay.py``: the engine (storages, tensors, autograd nodes, the backward engine in autograd's order,
  non-reentrant checkpointing's holders and recompute);
* ``ops.py``: the aten ops (linear, layer_norm, sdpa, cross_entropy, ...) as allocations and nodes;
* ``shapes.py``: the parameters of a model in ``model.parameters()`` order, LoRA's adapters included;
* ``gpt.py``, ``llama.py``: the blocks of the course's two designs, ``"gpt"`` (``utils.TinyTransformer``)
  and ``"llama"`` (``llama_like``, Llama written out in plain PyTorch);
* ``hf.py``: the reader's own model: a transformers config (and peft's ``LoraConfig``) read in
  (``predict_hf``, ``load_hf_config``, the shipped ``configs/*.json``); ``hf_llama.py``: transformers'
  ``LlamaForCausalLM`` and the family that shares its block (Mistral, Qwen2), replayed as transformers 5
  trains it; ``hf_gpt2.py``: ``GPT2LMHeadModel`` (Conv1D, learned positions, dropout, its activations),
  replayed the same way;
* ``loss.py``: transformers' losses (``labels=``, your own, notebook 17's summed shifted loss) and the
  chunked loss; ``counter.py``: the storage counter the transformers grid measures with beside ``MemTracker``;
* ``dataparallel.py``, ``optimizers.py``: ZeRO/FSDP, torch.optim's state and
  temporaries;  ``step.py``: one whole step; ``predict.py``: the public API; ``presets.py``;
* ``lowbit.py``: fewer bits (notebook 10): an NF4 base under LoRA, peft's upcast, pure bf16 with stochastic
  rounding or Kahan, FP8 linears; what each replays and what it only models;
* ``model_parallel.py``: tensor, sequence, pipeline and context parallelism with data parallelism, bytes per GPU
  (notebook 13);
* ``reference.py``, ``validate.py``, ``validate_hf.py``: the measured side and the validation grids;
  ``cli.py``: the command line.

Exactness. On the CPU the exact tracker (``utils.measure_memory``) measures the course's step
(``reference_step``) on small models of both designs over a grid of 38 configurations that covers every
option, and the prediction equals the measurement **to the byte** for every term, for the peak, and for the
bytes alive at every phase boundary (on torch 2.13 and 2.11; the tests assert it on an 11-configuration
subset). ``validate_hf`` measures real transformers models (random weights from a config, nothing
downloaded) with torch's ``MemTracker`` over a grid of its own (see its docstring for the worst error).
What those bounds do not cover:

* a GPU: the caching allocator rounds each block up to 512 bytes and keeps cuBLAS workspaces, and CUDA's
  attention kernels save slightly different statistics (logsumexp padding, RNG state). ``validate(device=
  "cuda")`` / ``--validate --on cuda`` measures that difference with the allocator. Its first GPU run (H100,
  torch 2.11) counted the process's 64 MiB of cuBLAS workspaces in every peak; the step's own bytes are
  compared now, not yet rerun on a GPU (``measure_reference_step`` says what that run left unexplained). The CUDA context and fragmentation (``max_memory_reserved``) are outside every term;
* data parallelism across processes: each rank's parameters, gradients and optimizer state follow ZeRO's
  formulas (equal to ``utils.parallel.predict_zero_bytes_per_rank``, tested; FSDP2 pads dim 0 of each
  tensor, up to one row per tensor more), DDP's gradient buckets are measured on one in-process rank
  (tested); FSDP's all-gathered units (two at a time) and unsharded gradients before their
  reduce-scatter follow FSDP2's design and are not measured here. With ``"bf16-autocast"`` and FSDP the
  replay keeps autocast's bf16 copy of every gathered weight until its backward, as plain ``torch.autocast``
  does; FSDP2's ``MixedPrecisionPolicy`` is not modelled;
* other models, ``torch.compile``'d steps and fused kernels (flash attention variants, Liger): the replay
  knows the ops of the designs above, run eagerly.
"""

from __future__ import annotations

from .config import (ARCHS, ATTENTIONS, BASE_QUANTS, BF16_ROUNDINGS, CHECKPOINTING, DEVICES, HF_ARCHS, KINDS,
                     LORA_TARGETS, LOSSES, OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS, STRATEGIES, ModelConfig,
                     TrainingSetup)
from .hf import HF_MODEL_TYPES, SHIPPED_CONFIGS, load_hf_config, model_config_from_hf, predict_hf
from .optimizers import ADAMW8BIT_BLOCK, ADAMW8BIT_CODEBOOKS
from .predict import TERM_LABELS, MemoryBreakdown, format_table, largest_micro_batch, predict
from .presets import PRESETS, preset
from .reference import build_reference, llama_like, reference_step
from .shapes import count_parameters, parameter_shapes
from .validate import (GRID_GPT, GRID_LLAMA, MEASURED_TERMS, VALIDATION_HEADER, StepBytes, ValidationRow,
                       format_validation, format_validation_row, measure_reference_step, model_state_per_rank,
                       predict_step_bytes, validate, validation_grid, worst_errors)
from .model_parallel import (ParallelLayout, ParallelModel, format_parallel, predict_parallel,
                             smallest_fitting_layout)
from .cli import main

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
    "ParallelModel", "format_parallel", "predict_parallel", "smallest_fitting_layout",
]
