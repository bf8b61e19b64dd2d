"""Tests of utils.capacity (the largest-batch search) and of measure_memory's budget, on the CPU tracker."""

import dataclasses
import gc

import pytest
import torch
from torch import nn

import utils
from utils.capacity import (BatchSearch, CapacityError, Checkpointed, Technique, TechniqueCapacity, checkpoint_each,
                            find_max_batch_size, largest_batches, make_train_step, predict_max_batch_size,
                            run_under_budget, what_to_try_first)

CPU = torch.device("cpu")
ROW_BYTES = 4 * 1000          # one float32 row of 1000 features


def allocating_step(sizes_seen):
    """A 'step' whose only allocation is batch_size rows of 1000 floats, kept alive until it returns."""
    def step(batch_size):
        sizes_seen.append(batch_size)
        rows = torch.ones(batch_size, 1000)
        return float(rows.sum())
    return step


def test_budget_raises_out_of_memory_when_tracked_bytes_would_pass_it():
    with utils.measure_memory(CPU, budget_bytes=10 * ROW_BYTES) as mem:
        kept = torch.ones(9, 1000)
    assert mem.peak_bytes == 9 * ROW_BYTES
    with pytest.raises(torch.OutOfMemoryError, match="budget"):
        with utils.measure_memory(CPU, budget_bytes=10 * ROW_BYTES):
            torch.ones(11, 1000)
    with pytest.raises(torch.OutOfMemoryError):   # the baseline (include) counts against the budget
        with utils.measure_memory(CPU, budget_bytes=10 * ROW_BYTES, include=kept):
            torch.ones(2, 1000)
    with pytest.raises(ValueError, match="budget_bytes"):
        utils.measure_memory(CPU, budget_bytes=0)
    with pytest.raises(ValueError, match="budget_bytes"):
        utils.measure_memory(CPU, budget_bytes=1.5)


def test_search_returns_the_largest_size_that_ran_and_only_sizes_it_tried():
    seen = []
    found = find_max_batch_size(allocating_step(seen), CPU, 37 * ROW_BYTES + 64)  # + the 4-byte sum
    assert isinstance(found, BatchSearch)
    assert found.largest == 37 and found.first_failure == 38 and found.resolution == 1
    ran = [size for size, ok in found.trials if ok]
    failed = [size for size, ok in found.trials if not ok]
    assert found.largest in ran and found.largest == max(ran)
    assert all(size > found.largest for size in failed)
    assert [size for size, _ in found.trials] == seen            # every size reported was tried, in order
    assert seen[:7] == [1, 2, 4, 8, 16, 32, 64]                  # doubling, then bisection
    assert found.peak_bytes[37] == 37 * ROW_BYTES + 4


def test_search_stops_at_the_limit_and_respects_start():
    found = find_max_batch_size(allocating_step([]), CPU, 10**9, start=3, limit=20)
    assert found.largest == 20 and found.first_failure is None and found.resolution == 0
    assert [size for size, _ in found.trials] == [3, 6, 12, 20]


def test_budget_too_small_for_the_first_batch_raises_clearly():
    with pytest.raises(CapacityError, match="batch size 1 does not fit"):
        find_max_batch_size(allocating_step([]), CPU, ROW_BYTES // 2)


@pytest.mark.parametrize("kwargs, error", [({"budget_bytes": 0}, ValueError), ({"budget_bytes": 2.5}, ValueError),
                                           ({"budget_bytes": 100, "start": 0}, ValueError),
                                           ({"budget_bytes": 100, "start": 5, "limit": 4}, ValueError)])
def test_search_rejects_bad_arguments(kwargs, error):
    with pytest.raises(error):
        find_max_batch_size(allocating_step([]), CPU, **kwargs)
    with pytest.raises(TypeError, match="callable"):
        find_max_batch_size(42, CPU, 100)


def _tiny_training():
    torch.manual_seed(0)
    model = utils.MLP(16, 64, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def make_batch(batch_size):
        return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))

    return model, optimizer, make_train_step(model, optimizer, make_batch, nn.functional.cross_entropy)


def test_failed_steps_leak_nothing():
    model, optimizer, step = _tiny_training()
    step(2)                                      # the optimizer state exists before we measure
    with utils.measure_memory(CPU, include=[model, optimizer]) as mem:
        found = find_max_batch_size(step, CPU, 400_000, model=model, optimizer=optimizer)
    assert any(not ok for _, ok in found.trials), "the search must have failed at least once"
    assert mem.end_bytes == 0, f"{mem.end_bytes} bytes left behind by the search"
    assert all(p.grad is None for p in model.parameters())
    assert gc.get_freeze_count() == 0, "the search unfreezes the objects it froze for fast collections"


def test_run_under_budget_reports_peak_or_none():
    model, optimizer, step = _tiny_training()
    step(2)
    peak = run_under_budget(step, 4, CPU, 10**9, include=[model, optimizer])
    assert peak is not None and peak > utils.tensor_bytes([model, optimizer])
    assert run_under_budget(step, 4, CPU, peak - 1, include=[model, optimizer]) is None


def test_prediction_matches_the_search_on_a_linear_model():
    def build():
        torch.manual_seed(0)
        return utils.MLP(8, 128, 4)

    def make_batch(batch_size):
        return torch.randn(batch_size, 8), torch.randint(0, 4, (batch_size,))

    # activations set the peak above ~100 rows here, so the prediction measures at 256 and 512
    capacities = largest_batches(build, make_batch, nn.functional.cross_entropy, CPU, 2_000_000,
                                 techniques={"fp32": Technique()}, small_batch=256)
    capacity = capacities["fp32"]
    assert abs(capacity.predicted - capacity.found) <= capacity.search.resolution
    assert gc.get_freeze_count() == 0, "nested freezes (largest_batches around the search) are all undone"
    with pytest.raises(ValueError, match="single technique"):
        what_to_try_first(capacities)
    with pytest.raises(ValueError, match="fp32"):
        what_to_try_first({"other": capacity})
    bigger = TechniqueCapacity(capacity.predicted, dataclasses.replace(capacity.search, largest=2 * capacity.found),
                               capacity.state_bytes, capacity.per_sample_bytes, capacity.fixed_bytes)
    assert what_to_try_first({"fp32": capacity, "bf16 autocast": bigger}).startswith("try bf16 autocast first")
    assert what_to_try_first({"fp32": capacity, "bf16 autocast": capacity}).startswith("no single technique")


def test_predict_max_batch_size_arithmetic_and_errors():
    assert predict_max_batch_size(1000, 1000 + 4 * 100 + 50, 1000 + 8 * 100 + 50, 4, 1000 + 50 + 1234) == (12, 100, 50)
    with pytest.raises(ValueError, match="did not grow"):
        predict_max_batch_size(1000, 2000, 2000, 4, 10_000)


def test_checkpoint_each_wraps_blocks_and_keeps_gradients():
    torch.manual_seed(0)
    model = utils.TinyTransformer(vocab_size=32, d_model=16, num_heads=2, num_layers=2, max_seq_len=8)
    tokens = torch.randint(0, 32, (2, 8))
    reference = torch.autograd.grad(model(tokens).sum(), list(model.parameters()))
    model.blocks = checkpoint_each(model.blocks)
    assert all(isinstance(block, Checkpointed) for block in model.blocks)
    checkpointed = torch.autograd.grad(model(tokens).sum(), list(model.parameters()))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(reference, checkpointed))
    with pytest.raises(TypeError):
        checkpoint_each(nn.Linear(2, 2))
