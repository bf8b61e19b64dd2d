"""Tests of utils.capacity (the largest-batch search, its prediction, the comparison of configurations) and of
measure_memory's budget, on the CPU tracker. Its CUDA branches run against a fake in tests/test_cuda_paths.py."""

import dataclasses
import gc

import pytest
import torch
from torch import nn

import utils
from utils.capacity import (BatchSearch, CapacityError, TechniqueCapacity, check_budget, find_max_batch_size,
                            largest_batches, predict_max_batch_size, run_under_budget, what_to_try_first)

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


def _tiny_training(hidden: int = 64):
    """A model, its AdamW and a plain training step(batch_size), as a reader writes them."""
    torch.manual_seed(0)
    model = utils.MLP(16, hidden, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch_size):
        inputs, targets = torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model, optimizer


def test_failed_steps_leak_nothing():
    step, model, optimizer = _tiny_training()
    step(2)                                      # the optimizer state exists before we measure
    with utils.measure_memory(CPU, include=[model, optimizer]) as mem:
        found = find_max_batch_size(step, CPU, 400_000, model=model, optimizer=optimizer)
    assert any(not ok for _, ok in found.trials), "the search must have failed at least once"
    assert mem.end_bytes == 0, f"{mem.end_bytes} bytes left behind by the search"
    assert all(p.grad is None for p in model.parameters())
    assert gc.get_freeze_count() == 0, "the search unfreezes the objects it froze for fast collections"


def test_run_under_budget_reports_peak_or_none():
    step, model, optimizer = _tiny_training()
    step(2)
    peak = run_under_budget(step, 4, CPU, 10**9, include=[model, optimizer])
    assert peak is not None and peak > utils.tensor_bytes([model, optimizer])
    assert run_under_budget(step, 4, CPU, peak - 1, include=[model, optimizer]) is None
    with pytest.raises(ValueError, match="batch_size"):
        run_under_budget(step, 0, CPU, 10**9)
    with pytest.raises(ValueError, match="budget_bytes"):
        run_under_budget(step, 4, CPU, -1)


@pytest.mark.parametrize("guess", [37, 36, 38, 10, 60])
def test_a_guess_settles_the_search_in_two_tries_when_it_is_right(guess):
    """Right (37): two tries. Off: the search goes on from what the two tries showed and still finds 37."""
    budget = 37 * ROW_BYTES + 64
    blind = find_max_batch_size(allocating_step([]), CPU, budget)
    found = find_max_batch_size(allocating_step([]), CPU, budget, guess=guess)
    assert found.largest == blind.largest == 37 and found.first_failure == 38
    assert found.trials[0] == (guess, guess <= 37)
    assert len(found.trials) <= {37: 2}.get(guess, len(blind.trials)), found.trials
    assert all(ran == (size <= 37) for size, ran in found.trials)


def test_a_guess_at_the_limit_or_below_start_is_clamped():
    found = find_max_batch_size(allocating_step([]), CPU, 10**9, limit=20, guess=500)
    assert found.largest == 20 and found.trials == ((20, True),)
    with pytest.raises(CapacityError, match="batch size 4 does not fit"):
        find_max_batch_size(allocating_step([]), CPU, 2 * ROW_BYTES, start=4, guess=1)
    with pytest.raises(ValueError, match="guess"):
        find_max_batch_size(allocating_step([]), CPU, 10**9, guess=0)


def _mlp_configuration(hidden: int = 128):
    def build():
        torch.manual_seed(0)
        model = utils.MLP(8, hidden, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(batch_size):
            inputs, targets = torch.randn(batch_size, 8), torch.randint(0, 4, (batch_size,))
            nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return step, model, optimizer
    return build


def test_prediction_matches_the_search_on_a_linear_model():
    # activations set the peak above ~100 rows here, so the prediction measures at 256 and 512
    capacities = largest_batches({"fp32": _mlp_configuration()}, CPU, 2_000_000, small_batch=256)
    capacity = capacities["fp32"]
    assert abs(capacity.predicted - capacity.found) <= capacity.search.resolution
    assert len(capacity.search.trials) == 2, "a right prediction settles the search in two tries"
    assert capacity.state_bytes == utils.predict_model_state(utils.MLP(8, 128, 4), "adamw").total_bytes
    assert gc.get_freeze_count() == 0, "nested freezes (largest_batches around the search) are all undone"
    with pytest.raises(ValueError, match="single technique"):
        what_to_try_first(capacities)
    with pytest.raises(ValueError, match="fp32"):
        what_to_try_first({"other": capacity})
    bigger = TechniqueCapacity(capacity.predicted, dataclasses.replace(capacity.search, largest=2 * capacity.found),
                               capacity.state_bytes, capacity.per_sample_bytes, capacity.fixed_bytes)
    assert what_to_try_first({"fp32": capacity, "autocast": bigger}).startswith("try autocast first")
    assert what_to_try_first({"fp32": capacity, "autocast": capacity}).startswith("no single technique")
    assert "autocast + checkpointing" not in what_to_try_first(
        {"fp32": capacity, "autocast": capacity, "autocast + checkpointing": bigger}), "combinations are not singles"


def test_the_probes_may_pass_the_budget_on_the_cpu():
    """The tracker measures the probes whole even past the budget: the prediction still comes from them."""
    capacities = largest_batches({"fp32": _mlp_configuration()}, CPU, 600_000, small_batch=256)
    assert capacities["fp32"].found < 512 and abs(capacities["fp32"].predicted - capacities["fp32"].found) <= 1


def test_largest_batches_rejects_what_is_not_a_configuration():
    with pytest.raises(TypeError, match="must be a function returning"):
        largest_batches({"fp32": 3}, CPU, 10**6)
    with pytest.raises(TypeError, match="must return \\(step, model, optimizer\\)"):
        largest_batches({"fp32": lambda: (lambda b: None, None)}, CPU, 10**6)
    with pytest.raises(ValueError, match="small_batch"):
        largest_batches({"fp32": _mlp_configuration()}, CPU, 10**6, small_batch=0)
    with pytest.raises(ValueError, match="budget_bytes"):
        largest_batches({"fp32": _mlp_configuration()}, CPU, 0)


def test_check_budget():
    assert check_budget(CPU, 10**12) == 10**12     # the CPU tracker has no card to exceed
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="budget_bytes"):
            check_budget(CPU, bad)


def test_predict_max_batch_size_arithmetic_and_errors():
    assert predict_max_batch_size(1000, 1000 + 4 * 100 + 50, 1000 + 8 * 100 + 50, 4, 1000 + 50 + 1234) == (12, 100, 50)
    assert predict_max_batch_size(1000, 1450, 1850, 4, 1000) == (0, 100, 50)
    with pytest.raises(ValueError, match="did not grow"):
        predict_max_batch_size(1000, 2000, 2000, 4, 10_000)
    with pytest.raises(ValueError, match="small_batch"):
        predict_max_batch_size(1000, 2000, 3000, 0, 10_000)


def test_on_cuda_the_budget_is_checked_against_the_card_and_each_try_starts_from_an_empty_cache(monkeypatch):
    """The CUDA branches (fake torch.cuda: bookkeeping and API names, not numbers): a budget above the card is
    refused before any work, each try empties the cache before the fraction is set, and the prediction's probes
    run under the budget there (a CapacityError when twice the small batch does not fit)."""
    from fake_cuda import MIB, FakeCuda

    fake = FakeCuda(total_memory=64 * MIB).install(monkeypatch)
    with pytest.raises(ValueError, match="exceeds cuda.*expected a budget the card can hold"):
        check_budget("cuda", 65 * MIB)
    with pytest.raises(ValueError, match="exceeds"):
        find_max_batch_size(lambda size: None, "cuda", 65 * MIB)

    def step(batch_size):
        block = fake.alloc(MIB * batch_size)
        del block

    assert run_under_budget(step, 4, "cuda", 32 * MIB) is not None
    names = [name for name, _, _ in fake.calls]
    assert names.index("empty_cache") < names.index("set_per_process_memory_fraction")

    def build():
        model = nn.Linear(2, 2)
        return step, model, torch.optim.SGD(model.parameters())

    with pytest.raises(CapacityError, match="probe at batch 32 does not fit"):
        largest_batches({"fp32": build}, "cuda", 24 * MIB, small_batch=16)
