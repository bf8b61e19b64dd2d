"""Unit tests of utils.activations: the chunked cross-entropy that notebook 08 writes as its recipe."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import utils
from utils.activations import validate_chunk_size


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


def test_every_target_ignored_gives_a_zero_loss_and_zero_gradients_not_nan():
    """F.cross_entropy's mean over no tokens is 0/0 = NaN; the helper documents 0 with zero gradients instead."""
    hidden, weight, bias, targets = _head()
    targets[:] = -100
    assert F.cross_entropy(F.linear(hidden, weight, bias), targets).isnan()        # what the helper avoids
    loss = utils.chunked_cross_entropy(hidden, weight, targets, bias=bias, chunk_size=5)
    loss.backward()
    assert loss.item() == 0
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in (hidden, weight, bias))


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
