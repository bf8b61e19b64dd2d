"""Helpers for the course notebooks: measuring memory and time, predicting footprints, audits, plots.

Importing the package has no side effects (no seeding, no backend changes). The notebooks use
``import utils`` and call the helpers through it, e.g. ``utils.measure_memory(device)``.
"""

from .env import (CHECK_MODE_VARIABLE, build_dir, check_mode, device_name, environment_report, pick_device,
                  seed_everything, supports_bf16)
from .footprint import (BytesPerParameter, ModelStateFootprint, bytes_per_parameter, count_parameters,
                        max_trainable_parameters, predict_mlp_activation_bytes, predict_model_state)
from .grads import (GradientAudit, assert_all_parameters_have_gradients, audit_gradients, flat_gradients,
                    parameter_changes, snapshot_parameters)
from .memory import (MemoryMeasurement, MemorySample, SavedTensors, measure_memory, tensor_bytes, to_mib,
                     track_saved_tensors)
from .models import MLP, SmallConvNet, TinyTransformer, TransformerBlock, make_classification_data, make_token_data
from .plots import plot_memory_timeline, plot_stacked_bars, save_figure
from .results import Results, load_results
from .timing import Timing, speedup, time_fn

__all__ = [
    "CHECK_MODE_VARIABLE", "build_dir", "check_mode", "device_name", "environment_report", "pick_device",
    "seed_everything", "supports_bf16",
    "BytesPerParameter", "ModelStateFootprint", "bytes_per_parameter", "count_parameters",
    "max_trainable_parameters", "predict_mlp_activation_bytes", "predict_model_state",
    "GradientAudit", "assert_all_parameters_have_gradients", "audit_gradients", "flat_gradients", "parameter_changes",
    "snapshot_parameters",
    "MemoryMeasurement", "MemorySample", "SavedTensors", "measure_memory", "tensor_bytes", "to_mib",
    "track_saved_tensors",
    "MLP", "SmallConvNet", "TinyTransformer", "TransformerBlock", "make_classification_data", "make_token_data",
    "plot_memory_timeline", "plot_stacked_bars", "save_figure",
    "Results", "load_results",
    "Timing", "speedup", "time_fn",
]
