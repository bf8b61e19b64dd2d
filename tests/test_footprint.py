import pytest
import torch

import utils


@pytest.mark.parametrize("optimizer, precision, fp32_grads, total", [
    ("sgd", "fp32", False, 8), ("sgd_momentum", "fp32", False, 12), ("adam", "fp32", False, 16),
    ("adamw", "fp32", False, 16), ("adamw", "mixed", False, 16), ("adamw", "mixed", True, 18),
    ("sgd", "mixed", False, 8),
])
def test_bytes_per_parameter(optimizer, precision, fp32_grads, total):
    assert utils.bytes_per_parameter(optimizer, precision, fp32_grads).total == total


def test_bad_choices_are_named():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        utils.bytes_per_parameter("lion")
    with pytest.raises(ValueError, match="precision must be one of"):
        utils.bytes_per_parameter("adamw", "fp8")
    with pytest.raises(ValueError, match="fp32_grads"):
        utils.bytes_per_parameter("adamw", "fp32", fp32_grads=True)
    with pytest.raises(TypeError, match="nn.Module or an iterable"):
        utils.predict_model_state(42)


def test_predict_model_state_counts_step_tensors_and_skips_frozen():
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2))
    model[1].requires_grad_(False)
    state = utils.predict_model_state(model, "adamw")
    assert state.num_parameters == 110 and state.num_tensors == 2
    assert state.optimizer_bytes == 110 * 8 + 2 * 4
    assert state.total_bytes == 110 * 16 + 8


@pytest.mark.parametrize("name, factory", [
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.1)),
    ("sgd_momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    ("adam", lambda p: torch.optim.Adam(p)),
    ("adamw", lambda p: torch.optim.AdamW(p)),
])
def test_prediction_equals_tracker_on_cpu(name, factory):
    model = utils.MLP(16, 32, 4, 2)
    optimizer = factory(model.parameters())
    model(torch.randn(8, 16)).sum().backward()
    with utils.measure_memory("cpu", include=model) as mem:
        optimizer.step()
    assert mem.end_bytes == utils.predict_model_state(model, name).optimizer_bytes


def test_max_trainable_parameters():
    assert utils.max_trainable_parameters(80 * 10**9, "adamw") == 5 * 10**9
    assert utils.max_trainable_parameters(80 * 10**9, "adamw", activation_fraction=0.5) == 2_500_000_000
    with pytest.raises(ValueError):
        utils.max_trainable_parameters(0)
    with pytest.raises(ValueError):
        utils.max_trainable_parameters(10, activation_fraction=1.0)


def test_mlp_activation_prediction_matches_tracker():
    model = utils.MLP(12, 24, 3, num_hidden_layers=3)
    x = torch.randn(5, 12)
    with utils.measure_memory("cpu") as mem:
        out = model(x)
    assert mem.end_bytes == utils.predict_mlp_activation_bytes(model, 5)
    with pytest.raises(TypeError):
        utils.predict_mlp_activation_bytes(torch.nn.Linear(2, 2), 5)
    with pytest.raises(ValueError, match="dropout"):
        utils.predict_mlp_activation_bytes(utils.MLP(2, 2, 2, dropout=0.1), 5)
    del out


def test_count_parameters():
    model = torch.nn.Linear(4, 3)
    assert utils.count_parameters(model) == 15
    model.bias.requires_grad_(False)
    assert utils.count_parameters(model) == 12 and utils.count_parameters(model, trainable_only=False) == 15


def _model_with_every_kind_of_shape() -> torch.nn.Module:
    # matrices, vectors, a 3-d tensor and a 0-dim scalar: Adafactor factors only the first two kinds
    model = torch.nn.Sequential(torch.nn.Linear(12, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3, bias=False))
    model.register_parameter("cube", torch.nn.Parameter(torch.randn(2, 5, 3)))
    model.register_parameter("scalar", torch.nn.Parameter(torch.tensor(0.5)))
    return model


@pytest.mark.parametrize("name, factory", [
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.1)),
    ("sgd_momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    ("adam", lambda p: torch.optim.Adam(p)),
    ("adamw", lambda p: torch.optim.AdamW(p)),
    ("adafactor", lambda p: torch.optim.Adafactor(p)),
])
def test_optimizer_state_bytes_equal_torch_state_after_a_step(name, factory):
    model = _model_with_every_kind_of_shape()
    optimizer = factory(model.parameters())
    loss = model[2](model[1](model[0](torch.randn(4, 12)))).sum() + model.cube.sum() + model.scalar
    loss.backward()
    with utils.measure_memory("cpu", include=model) as mem:
        optimizer.step()
    predicted = utils.predict_optimizer_state_bytes([p.shape for p in model.parameters()], name)
    assert utils.tensor_bytes(optimizer) == predicted
    assert mem.end_bytes == predicted


def test_optimizer_state_bytes_by_formula():
    assert utils.predict_optimizer_state_bytes([(10, 10), (10,)], "adamw") == 888
    assert utils.predict_optimizer_state_bytes([(10, 10), (10,)], "adafactor") == (10 + 10) * 4 + 4 + 10 * 4 + 4
    assert utils.predict_optimizer_state_bytes([torch.Size([4, 6, 8])], "adafactor") == (24 + 32) * 4 + 4
    assert utils.predict_optimizer_state_bytes([(1000,)], "adamw8bit") == 2000 + 2 * 4 * 4
    assert utils.predict_optimizer_state_bytes([(1000,)], "adamw8bit", block_size=1000) == 2000 + 8
    assert utils.predict_optimizer_state_bytes([torch.zeros(3, 3)], "sgd_momentum") == 36
    assert utils.predict_optimizer_state_bytes([], "adam") == 0


def test_optimizer_state_bytes_bad_input():
    with pytest.raises(ValueError, match="adafactor.*adamw8bit"):
        utils.predict_optimizer_state_bytes([(3,)], "lion")
    for bad in (0, -256, 1.5, True):
        with pytest.raises(ValueError, match="block_size must be a positive int"):
            utils.predict_optimizer_state_bytes([(3,)], "adamw8bit", block_size=bad)
    with pytest.raises(ValueError, match="ints >= 0"):
        utils.predict_optimizer_state_bytes([(3, -1)], "adamw")
    with pytest.raises(TypeError, match="sequence of ints"):
        utils.predict_optimizer_state_bytes([3], "adamw")
    with pytest.raises(TypeError, match="iterable of shapes"):
        utils.predict_optimizer_state_bytes(torch.zeros(3), "adamw")
