"""Helpers for the course notebooks: measuring memory and time, predicting footprints, audits, plots.

Importing the package has no side effects (no seeding, no backend changes). The notebooks use
``import utils`` and call the helpers through it, e.g. ``utils.measure_memory(device)``.
"""

from .activations import chunked_cross_entropy
from .attention import (LayerActivations, attention_saved_bytes, layer_activation_bytes, padding_fraction,
                        playbook_layer_activation_bytes, sample_document_lengths)
from .capacity import (BatchSearch, CapacityError, TechniqueCapacity, check_budget, find_max_batch_size,
                       largest_batches, predict_max_batch_size, run_under_budget, what_to_try_first)
from .env import (CHECK_MODE_VARIABLE, MEMORY_CLASSES_GB, autocast_dtype, build_dir, by_memory, check_mode,
                  device_memory_bytes, device_name, environment_report, memory_class_gb, pick_device, seed_everything,
                  supports_bf16)
from .footprint import (BytesPerParameter, ModelStateFootprint, bytes_per_parameter, count_parameters,
                        max_trainable_parameters, predict_mlp_activation_bytes, predict_model_state,
                        predict_optimizer_state_bytes)
from .grads import (GradientAudit, assert_all_parameters_have_gradients, audit_gradients, flat_gradients,
                    parameter_changes, snapshot_parameters)
from .lowbit import AdamW8bit
from .memory import (MemoryMeasurement, MemorySample, SavedTensors, measure_memory, tensor_bytes, to_mib,
                     track_saved_tensors)
from .memory_by_category import CATEGORIES, CategoryPeaks, measure_memory_by_category
from .models import MLP, SmallConvNet, TinyTransformer, TransformerBlock, make_classification_data, make_token_data
from .parallel import LaunchError, ZeroFootprint, predict_communication_bytes, predict_zero_bytes_per_rank
from .plots import plot_memory_timeline, plot_stacked_bars, save_figure
from .profiling import (BOTTLENECK_VERDICTS, DataWaitTimer, RandomDrawDataset, SyntheticImageDataset,
                        classify_bottleneck, linear_arithmetic_intensity, linear_flops, range_times_ms,
                        recommend_num_workers, seed_worker, step_breakdown_ms, validate_trace, workers_needed)
from .results import Results, load_results
from .state import expected_overhead, simulate_preemptions, young_daly_interval
from .timing import Comparison, Timing, compare, speedup, time_fn

__all__ = [
    "chunked_cross_entropy",
    "LayerActivations", "attention_saved_bytes", "layer_activation_bytes", "padding_fraction",
    "playbook_layer_activation_bytes", "sample_document_lengths",
    "calculator", "MemoryBreakdown", "ModelConfig", "TrainingSetup",
    "BatchSearch", "CapacityError", "TechniqueCapacity", "check_budget", "find_max_batch_size", "largest_batches",
    "predict_max_batch_size", "run_under_budget", "what_to_try_first",
    "CHECK_MODE_VARIABLE", "MEMORY_CLASSES_GB", "autocast_dtype", "build_dir", "by_memory", "check_mode",
    "device_memory_bytes", "device_name", "environment_report", "memory_class_gb", "pick_device", "seed_everything",
    "supports_bf16",
    "BytesPerParameter", "ModelStateFootprint", "bytes_per_parameter", "count_parameters",
    "max_trainable_parameters", "predict_mlp_activation_bytes", "predict_model_state", "predict_optimizer_state_bytes",
    "GradientAudit", "assert_all_parameters_have_gradients", "audit_gradients", "flat_gradients", "parameter_changes",
    "snapshot_parameters",
    "AdamW8bit",
    "MemoryMeasurement", "MemorySample", "SavedTensors", "measure_memory", "tensor_bytes", "to_mib",
    "track_saved_tensors",
    "MLP", "SmallConvNet", "TinyTransformer", "TransformerBlock", "make_classification_data", "make_token_data",
    "CATEGORIES", "CategoryPeaks", "measure_memory_by_category",
    "LaunchError", "ZeroFootprint", "predict_communication_bytes", "predict_zero_bytes_per_rank",
    "plot_memory_timeline", "plot_stacked_bars", "save_figure",
    "BOTTLENECK_VERDICTS", "DataWaitTimer", "RandomDrawDataset", "SyntheticImageDataset", "classify_bottleneck",
    "linear_arithmetic_intensity", "linear_flops", "range_times_ms", "recommend_num_workers", "seed_worker",
    "step_breakdown_ms", "validate_trace", "workers_needed",
    "Results", "load_results",
    "expected_overhead", "simulate_preemptions", "young_daly_interval",
    "Comparison", "Timing", "compare", "speedup", "time_fn",
]

# the calculator is also a program (python -m utils.calculator): importing it here would make runpy warn
_CALCULATOR_NAMES = ("calculator", "MemoryBreakdown", "ModelConfig", "TrainingSetup")


def __getattr__(name: str):  # noqa: ANN202 - PEP 562: utils.calculator and its dataclasses load on first use
    if name in _CALCULATOR_NAMES:
        import importlib

        calculator = importlib.import_module(f"{__name__}.calculator")
        return calculator if name == "calculator" else getattr(calculator, name)
    raise AttributeError(f"module 'utils' has no attribute {name!r}")
