"""Helpers for the course notebooks: measuring memory and time, predicting footprints, audits, plots.

Importing the package has no side effects (no seeding, no backend changes) and imports nothing heavy: each helper's
module (and torch, matplotlib) loads on first use (PEP 562), so ``python -m utils.calculator`` answers a question
about a config file without importing torch or matplotlib. The notebooks use ``import utils`` and call the helpers
through it, e.g. ``utils.measure_memory(device)``; a module of its own is reached as ``utils.moe`` or
``from utils.moe import ...``.
"""

from __future__ import annotations

import importlib

# public name -> the module of utils that defines it
_EXPORTS: dict[str, str] = {
    "chunked_cross_entropy": "activations",
    "LayerActivations": "attention", "attention_saved_bytes": "attention", "layer_activation_bytes": "attention",
    "padding_fraction": "attention", "playbook_layer_activation_bytes": "attention",
    "sample_document_lengths": "attention",
    "BatchSearch": "capacity", "CapacityError": "capacity", "TechniqueCapacity": "capacity",
    "check_budget": "capacity", "find_max_batch_size": "capacity", "largest_batches": "capacity",
    "predict_max_batch_size": "capacity", "run_under_budget": "capacity", "what_to_try_first": "capacity",
    "CHECK_MODE_VARIABLE": "env", "MEMORY_CLASSES_GB": "env", "autocast_dtype": "env", "build_dir": "env",
    "by_memory": "env", "check_mode": "env", "device_memory_bytes": "env", "device_name": "env",
    "environment_report": "env", "memory_class_gb": "env", "pick_device": "env", "seed_everything": "env",
    "supports_bf16": "env", "cpu_bf16_native": "env",
    "BytesPerParameter": "footprint", "ModelStateFootprint": "footprint", "bytes_per_parameter": "footprint",
    "count_parameters": "footprint", "max_trainable_parameters": "footprint",
    "predict_mlp_activation_bytes": "footprint", "predict_model_state": "footprint",
    "predict_optimizer_state_bytes": "footprint",
    "GradientAudit": "grads", "assert_all_parameters_have_gradients": "grads", "audit_gradients": "grads",
    "flat_gradients": "grads", "parameter_changes": "grads", "snapshot_parameters": "grads",
    "AdamW8bit": "lowbit",
    "MemoryMeasurement": "memory", "MemorySample": "memory", "SavedTensors": "memory", "measure_memory": "memory",
    "tensor_bytes": "memory", "to_mib": "memory", "track_saved_tensors": "memory",
    "CATEGORIES": "memory_by_category", "CategoryPeaks": "memory_by_category",
    "measure_memory_by_category": "memory_by_category",
    "MLP": "models", "SmallConvNet": "models", "TinyTransformer": "models", "TransformerBlock": "models",
    "make_classification_data": "models", "make_token_data": "models",
    "LaunchError": "parallel", "ZeroFootprint": "parallel", "predict_communication_bytes": "parallel",
    "predict_zero_bytes_per_rank": "parallel",
    "plot_memory_timeline": "plots", "plot_stacked_bars": "plots", "save_figure": "plots",
    "BOTTLENECK_VERDICTS": "profiling", "DataWaitTimer": "profiling", "RandomDrawDataset": "profiling",
    "SyntheticImageDataset": "profiling", "classify_bottleneck": "profiling",
    "linear_arithmetic_intensity": "profiling", "linear_flops": "profiling", "range_times_ms": "profiling",
    "recommend_num_workers": "profiling", "seed_worker": "profiling", "step_breakdown_ms": "profiling",
    "validate_trace": "profiling", "workers_needed": "profiling",
    "Results": "results", "load_results": "results",
    "expected_overhead": "state", "simulate_preemptions": "state", "young_daly_interval": "state",
    "Comparison": "timing", "Timing": "timing", "compare": "timing", "speedup": "timing", "time_fn": "timing",
    "time_interleaved": "timing",
    "MemoryBreakdown": "calculator", "ModelConfig": "calculator", "TrainingSetup": "calculator",
}

__all__ = list(_EXPORTS) + ["calculator"]


def __getattr__(name: str):  # noqa: ANN202 - PEP 562: a helper's module loads on first use
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")     # a submodule: utils.calculator, utils.moe
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'utils' has no attribute {name!r}") from None
    globals()[name] = value          # the next lookup finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
