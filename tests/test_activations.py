"""Unit tests of utils.activations: the budget context, the bf16 saved-tensor hooks, the chunked loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import utils
from utils.activations import validate_chunk_size, validate_memory_budget


# --- compile's activation-memory budget -------------------------------------------------------

def test_budget_context_sets_and_restores_the_config():
    import torch._functorch.config as functorch_config

    assert utils.has_activation_memory_budget()
    before = functorch_config.activation_memory_budget
    with utils.activation_memory_budget(0.25, reset=False) as budget:
        assert budget == 0.25 and functorch_config.activation_memory_budget == 0.25
    assert functorch_config.activation_memory_budget == before


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), float("inf")])
def test_budget_outside_unit_interval_is_a_value_error(bad):
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        with utils.activation_memory_budget(bad):
            pass


@pytest.mark.parametrize("bad", ["0.5", None, True])
def test_budget_that_is_not_a_number_is_a_type_error(bad):
    with pytest.raises(TypeError, match="number in"):
        validate_memory_budget(bad)


def test_budget_accepts_the_ends_and_ints():
    assert validate_memory_budget(0) == 0.0 and validate_memory_budget(1) == 1.0


def test_budget_changes_what_a_compiled_step_saves():
    # the budget is read when the graph compiles: budget 0 must save less than budget 1, with the same gradients
    torch.manual_seed(0)
    model = utils.MLP(16, 32, 4, num_hidden_layers=2)
    inputs = torch.randn(8, 16)
    saved, grads = {}, {}
    for budget in (1.0, 0.0):
        with utils.activation_memory_budget(budget):
            compiled = torch.compile(model, backend="aot_eager_decomp_partition")
            compiled(inputs).square().mean().backward()             # compiles with this budget
            model.zero_grad(set_to_none=True)
            with utils.track_saved_tensors(exclude=(model, inputs)) as tracked:
                loss = compiled(inputs).square().mean()
            loss.backward()
        saved[budget], grads[budget] = tracked.bytes, utils.flat_gradients(model, zero=True)
    assert saved[0.0] < saved[1.0]
    assert torch.allclose(grads[0.0], grads[1.0], rtol=1e-5, atol=1e-7)


# --- bf16 saved activations -------------------------------------------------------------------

def _mlp_and_data():
    torch.manual_seed(0)
    model = utils.MLP(32, 64, 5, num_hidden_layers=2)
    inputs = torch.randn(16, 32)
    return model, inputs


def test_bf16_hooks_halve_the_saved_activations_exactly():
    model, inputs = _mlp_and_data()
    with utils.track_saved_tensors(exclude=(model, inputs)) as saved:
        loss = model(inputs).square().mean()
    del loss
    kept = {}
    for label in ["float32", "bf16"]:
        with utils.measure_memory("cpu", include=(model, inputs)) as mem:
            if label == "bf16":
                with utils.bf16_saved_activations(exclude=inputs) as hooks:
                    loss = model(inputs).square().mean()
            else:
                loss = model(inputs).square().mean()
        kept[label] = mem.end_bytes
        del loss
    assert kept["float32"] - kept["bf16"] == saved.bytes // 2
    assert hooks.stats.packed_bytes * 2 == hooks.stats.original_bytes == saved.bytes
    assert hooks.stats.converted_count == saved.count   # ReLU's output, saved twice, converted once


def test_bf16_hooks_give_close_gradients_and_leave_parameters_alone():
    model, inputs = _mlp_and_data()
    model(inputs).square().mean().backward()
    reference = utils.flat_gradients(model, zero=True)
    with utils.bf16_saved_activations(exclude=inputs) as hooks:
        loss = model(inputs).square().mean()
    loss.backward()
    got = utils.flat_gradients(model, zero=True)
    error = float((got - reference).norm() / reference.norm())
    assert 0 < error < 2**-7
    assert hooks.stats.kept_count > 0          # the weights (views of parameters) were not converted


def test_bf16_hooks_leave_non_float32_tensors_alone():
    x = torch.randn(8, dtype=torch.float64, requires_grad=True)
    with utils.bf16_saved_activations() as hooks:
        y = (x * x).sum()
    y.backward()
    assert hooks.stats.converted_count == 0
    assert torch.equal(x.grad, 2 * x.detach())


# --- chunked cross-entropy --------------------------------------------------------------------

def _head(tokens=37, width=16, vocab=101, dtype=torch.float32, bias=True):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=generator, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, width, generator=generator, dtype=dtype).requires_grad_()
    b = torch.randn(vocab, generator=generator, dtype=dtype).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    return hidden, weight, b, targets


@pytest.mark.parametrize("chunk_size", [1, 5, 37, 1000])
def test_chunked_loss_equals_the_plain_loss_and_gradients(chunk_size):
    hidden, weight, bias, targets = _head()
    targets[3] = -100                                          # an ignored token
    plain = F.cross_entropy(F.linear(hidden, weight, bias), targets)
    plain.backward()
    expected = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    chunked = utils.chunked_cross_entropy(hidden, weight, targets, bias=bias, chunk_size=chunk_size)
    chunked.backward()
    assert torch.allclose(chunked, plain, rtol=1e-6, atol=1e-6)
    for got, want in zip((hidden.grad, weight.grad, bias.grad), expected):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_chunked_loss_keeps_batch_shape_and_bf16():
    hidden, weight, _, targets = _head(tokens=24, dtype=torch.bfloat16, bias=False)
    batched_hidden = hidden.detach().view(4, 6, -1).requires_grad_()
    loss = utils.chunked_cross_entropy(batched_hidden, weight, targets.view(4, 6), chunk_size=7)
    plain = F.cross_entropy(F.linear(batched_hidden, weight).float().flatten(0, 1), targets)
    assert loss.dtype == torch.float32 and torch.allclose(loss, plain, rtol=1e-3)
    loss.backward()
    assert batched_hidden.grad.shape == batched_hidden.shape and weight.grad.dtype == torch.bfloat16


def test_chunked_loss_peak_is_below_the_plain_loss():
    hidden, weight, _, targets = _head(tokens=64, vocab=2000, bias=False)
    peaks = {}
    for label in ["plain", "chunked"]:
        with utils.measure_memory("cpu", include=(hidden, weight, targets)) as mem:
            if label == "plain":
                loss = F.cross_entropy(F.linear(hidden, weight), targets)
            else:
                loss = utils.chunked_cross_entropy(hidden, weight, targets, chunk_size=8)
            loss.backward()
        peaks[label] = mem.peak_bytes
    assert peaks["chunked"] < peaks["plain"] / 2


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-3, ValueError), (2.0, ValueError), (True, ValueError)])
def test_chunk_size_must_be_a_positive_int(bad, error):
    hidden, weight, _, targets = _head()
    with pytest.raises(error, match="chunk_size must be a positive int"):
        utils.chunked_cross_entropy(hidden, weight, targets, chunk_size=bad)
    with pytest.raises(error):
        validate_chunk_size(bad)


def test_shape_mismatches_are_clear_errors():
    hidden, weight, bias, targets = _head()
    with pytest.raises(ValueError, match="leading shape"):
        utils.chunked_cross_entropy(hidden, weight, targets[:-1])
    with pytest.raises(ValueError, match="d_model"):
        utils.chunked_cross_entropy(hidden[:, :-1], weight, targets)
    with pytest.raises(ValueError, match=r"\(vocab, d_model\)"):
        utils.chunked_cross_entropy(hidden, weight[0], targets)
    with pytest.raises(ValueError, match=r"bias must be \(vocab,\)"):
        utils.chunked_cross_entropy(hidden, weight, targets, bias=bias[:-1])
    with pytest.raises(TypeError, match="int64 token ids"):
        utils.chunked_cross_entropy(hidden, weight, targets.float())
    with pytest.raises(ValueError, match="same dtype"):
        utils.chunked_cross_entropy(hidden.double(), weight, targets)
    with pytest.raises(TypeError, match="must be a tensor"):
        utils.chunked_cross_entropy(hidden.tolist(), weight, targets)
