"""utils.memory_by_category: torch's MemTracker, by category and by module (notebook 07)."""

import pytest
import torch
from torch import nn

import utils


def test_memory_by_category_matches_predictions_and_the_tracker():
    torch.manual_seed(0)
    model = utils.MLP(16, 32, 4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = utils.make_classification_data(8, 16, 4)
    loss_fn = nn.CrossEntropyLoss()

    def step(mark):
        loss = loss_fn(model(x), y)
        mark("forward")
        loss.backward()
        del loss
        mark("backward")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(lambda name: None)                                   # the state exists from now on
    peaks = utils.measure_memory_by_category(step, model, optimizer, x, y)
    predicted = utils.predict_model_state(model, "adamw")
    assert set(peaks.peak_by_category) == set(utils.CATEGORIES)
    assert peaks.peak_by_category["Parameter"] == predicted.params_bytes
    assert peaks.marks["backward"]["Gradient"] == predicted.grads_bytes
    assert peaks.marks["backward"]["Activation"] == 0
    assert peaks.peak_by_category["Optstate"] == predicted.optimizer_bytes      # fused: no temporaries
    assert peaks.marks["forward"]["Activation"] == utils.predict_mlp_activation_bytes(model, 8) + 8
    assert sum(peaks.peak_by_category.values()) == peaks.peak_bytes
    with utils.measure_memory("cpu", include=[model, optimizer, x, y]) as mem:
        step(lambda name: None)
    assert peaks.peak_bytes == mem.baseline_bytes + mem.peak_bytes
    assert "MLP.layers.0" in peaks.module_backward_peak_bytes and "MLP" in peaks.module_forward_peak_bytes


def test_memory_by_category_bad_inputs():
    with pytest.raises(TypeError, match="region must be callable"):
        utils.measure_memory_by_category(42)
    with pytest.raises(ValueError, match="non-empty name"):
        utils.measure_memory_by_category(lambda mark: mark(""))
    with pytest.raises(TypeError):
        utils.measure_memory_by_category(lambda mark: None, "not a tensor")
    with pytest.raises(TypeError, match="device must be"):
        utils.measure_memory_by_category(lambda mark: None, device=0)
