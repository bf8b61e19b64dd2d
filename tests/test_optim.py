"""utils.optim: the optimizer step in backward (notebook 07)."""

import pytest
import torch
from torch import nn

import utils


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def test_parameters_equal_a_normal_loop_and_gradients_are_freed():
    normal, hooked = _model(), _model()
    optimizer = _adamw(normal.parameters())
    handle = utils.attach_optimizer_in_backward(hooked, _adamw)
    for step in range(3):
        torch.manual_seed(100 + step)
        x, y = torch.randn(5, 8), torch.randn(5, 4)
        nn.functional.mse_loss(normal(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(hooked(x), y).backward()
        assert all(p.grad is None for p in hooked.parameters()), "each gradient is freed after its step"
    for p, q in zip(normal.parameters(), hooked.parameters()):
        assert torch.equal(p, q)
    assert handle.num_steps == 3 * 4 and len(handle.optimizers) == 4
    handle.remove()


def test_remove_restores_normal_gradients_and_allows_reattaching():
    model = _model()
    with utils.attach_optimizer_in_backward(model, _adamw) as handle:
        assert handle.attached
    assert not handle.attached
    handle.remove()                                          # a second remove is harmless
    model(torch.randn(2, 8)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    again = utils.attach_optimizer_in_backward(model, _adamw)
    again.remove()


def test_frozen_parameters_of_a_module_are_skipped_and_tied_ones_attached_once():
    model = _model()
    model[0].requires_grad_(False)
    handle = utils.attach_optimizer_in_backward(model, _adamw)
    assert len(handle.optimizers) == 2
    handle.remove()
    shared = nn.Parameter(torch.randn(3))
    handle = utils.attach_optimizer_in_backward([shared, shared], _adamw)
    assert len(handle.optimizers) == 1
    handle.remove()


def test_bad_inputs_are_named():
    model = _model()
    with pytest.raises(TypeError, match="make_optimizer must be callable"):
        utils.attach_optimizer_in_backward(model, "adamw")
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer"):
        utils.attach_optimizer_in_backward(model, lambda params: params)
    with pytest.raises(ValueError, match="exactly the parameter"):
        utils.attach_optimizer_in_backward(model, lambda params: _adamw(list(model.parameters())))
    with pytest.raises(ValueError, match="does not require grad"):
        utils.attach_optimizer_in_backward([torch.zeros(3)], _adamw)
    with pytest.raises(ValueError, match="not a leaf"):
        utils.attach_optimizer_in_backward([torch.zeros(3, requires_grad=True) * 2], _adamw)
    with pytest.raises(TypeError, match="nn.Module or an iterable"):
        utils.attach_optimizer_in_backward(42, _adamw)
    with pytest.raises(TypeError, match="expected parameters"):
        utils.attach_optimizer_in_backward(["weight"], _adamw)
    with pytest.raises(ValueError, match="no parameter"):
        utils.attach_optimizer_in_backward(model.requires_grad_(False), _adamw)


def test_a_parameter_cannot_be_attached_twice_and_a_failed_attach_leaves_nothing():
    model = _model()
    first = utils.attach_optimizer_in_backward(model, _adamw)
    with pytest.raises(ValueError, match="already has an optimizer in backward"):
        utils.attach_optimizer_in_backward(model, _adamw)
    first.remove()
    calls = []

    def fails_on_third(params):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return _adamw(params)

    with pytest.raises(RuntimeError, match="boom"):
        utils.attach_optimizer_in_backward(model, fails_on_third)
    model(torch.randn(2, 8)).sum().backward()                # no hook left behind: gradients stay
    assert all(p.grad is not None for p in model.parameters())
    utils.attach_optimizer_in_backward(model, _adamw).remove()
