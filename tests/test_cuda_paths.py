"""Every CUDA branch of ``utils/``, executed on a CPU against a fake ``torch.cuda`` (``tests/fake_cuda.py``).

What these tests check: the bookkeeping of the CUDA code paths (which allocator figure is read when, what is
subtracted, what is reset and restored, which device each call names, which backend a launch picks, which
error a reader gets) and the names and signatures of the ``torch.cuda`` functions they call, bound against
the real functions of the torch under test. Run them on torch 2.11 (the GPU machines' version) and 2.13:
``.venv-torch2.11.0/bin/python -m pytest tests/test_cuda_paths.py`` and the same with ``.venv``.

What they do not check: numbers. No kernel runs; the fake allocator follows the caching allocator's
documented rules (512-byte blocks, 2 MiB and 20 MiB segments, reserved >= allocated, peaks since the last
reset, a fraction checked only when a segment is added) so that a wrong reading of them fails, but no byte
count here is a measurement of a card. The last tests (``needs_cuda``) run the same rules against the real
allocator where a GPU is present (``tools/gpu_reference.sh`` runs them), which checks the fake itself.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import utils
from fake_cuda import LARGE_BUFFER, MIB, SMALL_BUFFER, FakeCuda, cublas_workspace_bytes, round_size, segment_size
from utils.memory_by_category import _by_category

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the fake's rules on a real GPU")
GIB = 2**30


@pytest.fixture
def make_fake(monkeypatch):
    """Install a fake ``torch.cuda`` for one test: ``make_fake(device_count=2, total_memory=..., capability=...)``."""
    def install(**kwargs) -> FakeCuda:
        return FakeCuda(**kwargs).install(monkeypatch)
    return install


@pytest.fixture
def fake(make_fake) -> FakeCuda:
    """Two fake 16 GiB cards: cuda:0 of capability 8.0 (native bf16), cuda:1 of 7.5 (a T4)."""
    return make_fake(device_count=2, total_memory=16 * GIB, capability=[(8, 0), (7, 5)])


def _names(fake: FakeCuda) -> list[str]:
    return [name for name, _, _ in fake.calls]


# --- the fake itself: the real signatures, the allocator's rules ---------------------------------------------

def test_fake_binds_every_call_to_the_real_signature(fake):
    with pytest.raises(TypeError, match="would reject"):
        torch.cuda.memory_allocated(0, "extra")
    with pytest.raises(TypeError, match="would reject"):
        torch.cuda.synchronize(device=0, stream=None)
    with pytest.raises(TypeError, match="must be `float`"):     # the real function's own check: 1 is not 1.0
        torch.cuda.set_per_process_memory_fraction(1, 0)
    with pytest.raises(ValueError, match="Expected a cuda device"):
        torch.cuda.memory_allocated("cpu")
    assert torch.cuda.get_device_capability("cuda:1") == (7, 5)


def test_fake_allocator_rounds_caches_and_limits_like_the_caching_allocator(fake):
    assert [round_size(n) for n in (0, 1, 512, 513)] == [0, 512, 512, 1024]
    assert segment_size(512) == SMALL_BUFFER and segment_size(MIB + 512) == LARGE_BUFFER
    assert segment_size(10 * MIB) == 10 * MIB and segment_size(11 * MIB + 1) == 12 * MIB
    small = fake.alloc(1)
    assert torch.cuda.memory_allocated() == 512 and torch.cuda.memory_reserved() == SMALL_BUFFER
    big = fake.alloc(3 * MIB)
    assert torch.cuda.memory_reserved() == SMALL_BUFFER + LARGE_BUFFER
    big.free()
    assert torch.cuda.memory_allocated() == 512                       # freed ...
    assert torch.cuda.memory_reserved() == SMALL_BUFFER + LARGE_BUFFER  # ... but cached: reserved >= allocated
    assert torch.cuda.max_memory_allocated() == 512 + 3 * MIB
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == 512
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == SMALL_BUFFER                 # the segment still in use stays
    # a fraction is checked only when a segment is added: a block served from the cache passes unchecked
    cached = fake.alloc(30 * MIB)
    cached.free()
    torch.cuda.set_per_process_memory_fraction(8 * MIB / (16 * GIB))
    from_cache = fake.alloc(20 * MIB)
    assert torch.cuda.memory_allocated() > 8 * MIB
    from_cache.free()
    with pytest.raises(torch.OutOfMemoryError):
        fake.alloc(40 * MIB)                      # a new segment: the cache is released first, then the limit holds
    assert torch.cuda.memory_reserved() == SMALL_BUFFER
    del small
    assert torch.cuda.memory_allocated() == 0 and torch.cuda.memory_allocated(1) == 0


# --- utils/memory.py: the allocator backend --------------------------------------------------------------------

def test_allocator_backend_subtracts_the_baseline_and_resets_the_peak(fake):
    device = torch.device("cuda", 1)              # not the current device: every call must name it
    kept = fake.alloc(4096, device)               # alive before the region: the baseline
    earlier = fake.alloc(50 * MIB, device)        # an earlier peak the region must not report
    earlier.free()
    with utils.measure_memory(device, timeline=False) as mem:
        temporary = fake.alloc(10_000, device)
        left = fake.alloc(1000, device)
        temporary.free()
    assert mem.backend == "cuda-allocator" and mem.device == "Fake GPU 1"
    assert mem.baseline_bytes == 4096
    assert mem.peak_bytes == round_size(10_000) + round_size(1000)
    assert mem.end_bytes == round_size(1000)
    assert mem.reserved_peak_bytes == torch.cuda.max_memory_reserved(device) >= mem.peak_bytes + mem.baseline_bytes
    names = _names(fake)
    assert names.index("synchronize") < names.index("reset_peak_memory_stats") < names.index("memory_allocated")
    device_calls = ("synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated",
                    "max_memory_reserved")
    for name in device_calls:
        assert all(args and torch.device(args[0]) == device for args, _ in fake.called(name)), name
    assert fake.devices[0].allocated == 0
    del kept, left


def test_allocator_backend_counts_512_byte_blocks(fake):
    with fake.mirror(), utils.measure_memory("cuda") as mem:
        one = torch.ones(1)                       # 4 bytes of storage, one 512-byte block
        tensor = torch.ones(200)                  # 800 bytes, two blocks' worth
    with utils.measure_memory("cpu") as exact:
        again = torch.ones(1)
    assert mem.end_bytes == 512 + 1024 and exact.end_bytes == 4
    del one, tensor, again


def test_timeline_samples_each_op_and_labels_the_phases(fake):
    model = utils.MLP(32, 64, 8, num_hidden_layers=2)
    x = torch.randn(16, 32)
    with fake.mirror():
        with utils.measure_memory("cuda", phase="forward") as mem:
            loss = model(x).square().mean()
            mem.phase("backward")
            loss.backward()
            del loss
    assert [s.event for s in mem.timeline] == list(range(len(mem.timeline)))
    assert list(mem.phase_end_bytes()) == ["forward", "backward"]
    assert mem.peak_bytes == max(s.bytes for s in mem.timeline)
    assert mem.phase_peak_bytes()["forward"] < mem.peak_bytes or mem.phase_peak_bytes()["backward"] == mem.peak_bytes
    grads = sum(round_size(p.grad.untyped_storage().nbytes()) for p in model.parameters())
    # the first matmul of the forward and of the backward each allocate a cuBLAS workspace that stays (a real GPU
    # does the same: a process's first measured region holds them, which is why a budget must sit above them)
    workspaces = sum(block.size for block in fake.workspaces.values())
    assert len(fake.workspaces) == 2 and workspaces == 2 * cublas_workspace_bytes((8, 0))
    assert mem.end_bytes == grads + workspaces == mem.timeline[-1].bytes


def test_the_fake_allocator_splits_a_large_block_only_above_1_mib_and_counts_the_whole_block(fake):
    """The real rule (CUDACachingAllocator: a large-pool block is split only when the remainder exceeds
    kSmallSize): a request that leaves 1 MiB or less of its segment takes all of it, and memory_allocated says so."""
    almost_whole = fake.alloc(19 * MIB + 512 * 1024)          # a fresh 20 MiB segment, 0.5 MiB would remain
    assert torch.cuda.memory_allocated() == LARGE_BUFFER
    almost_whole.free()
    split = fake.alloc(3 * MIB)                                # 17 MiB remain: split
    assert torch.cuda.memory_allocated() == 3 * MIB and torch.cuda.memory_reserved() == LARGE_BUFFER
    rest = fake.alloc(16 * MIB + 512 * 1024)                   # 0.5 MiB of the cached segment would remain
    assert torch.cuda.memory_allocated() == LARGE_BUFFER
    del split, rest
    small = fake.alloc(MIB - 512)                              # the small pool always splits
    assert torch.cuda.memory_allocated() == MIB - 512


def test_the_first_matmul_allocates_a_cublas_workspace_as_on_a_real_card(fake, monkeypatch):
    with fake.mirror():
        torch.ones(4, 4) @ torch.ones(4, 4)
    assert torch.cuda.memory_allocated() == cublas_workspace_bytes((8, 0)) == 4096 * 1024 * 2 + 16 * 1024 * 8
    fake.clear_workspaces()
    assert torch.cuda.memory_allocated() == 0
    assert cublas_workspace_bytes((9, 0)) == 32 * MIB                  # Hopper (H100)
    assert cublas_workspace_bytes((8, 0), ":4096:8") == 32 * MIB       # CUBLAS_WORKSPACE_CONFIG wins
    assert cublas_workspace_bytes((8, 6), ":16:8") == 128 * 1024       # the deterministic setting's small one


def test_a_foreach_optimizer_step_ends_on_a_sample_without_its_temporary(fake):
    """CUDA_REVIEW finding 1, checked: the sqrt temporary is freed before the step's last sampled op.

    ``Optimizer.step`` runs inside ``record_function``, whose exit is an op the sampler sees after the update
    function returned (torch 2.11 and 2.13), so the optimizer phase ends on the state alone even without the
    phase switch's fresh sample. The fresh sample matters for frees with no op after them (next test).
    """
    model = nn.Linear(256, 256)
    model(torch.randn(4, 256)).sum().backward()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    with fake.mirror():
        with utils.measure_memory("cuda", phase="optimizer") as mem:
            optimizer.step()
            mem.phase("zero_grad")
            optimizer.zero_grad(set_to_none=True)
    state = sum(round_size(t.untyped_storage().nbytes()) for s in optimizer.state.values() for t in s.values())
    ends = mem.phase_end_bytes()
    assert ends["optimizer"] == state
    optimizer_samples = [s.bytes for s in mem.timeline if s.phase == "optimizer"]
    assert max(optimizer_samples) > state        # the temporary was there, at the step's last op
    assert ends["zero_grad"] == state            # gradients are not mirrored (they existed before the mirror)


def test_phase_takes_a_fresh_sample_for_the_outgoing_phase(fake):
    """The allocator backend samples after ops: a free that no op follows is seen only by the phase switch."""
    with fake.mirror(), utils.measure_memory("cuda", phase="first") as mem:
        temporary = torch.ones(1000)
        kept = temporary + 1
        del temporary                             # no op runs after the free: only the phase switch sees it
        mem.phase("second")
    assert mem.phase_end_bytes()["first"] == round_size(4000)
    assert mem.end_bytes == round_size(4000)
    mem.phase("after")                            # outside the region: no sample, and no CUDA call
    assert len(mem.timeline) == 5
    del kept


def test_timeline_off_keeps_the_endpoints_and_samples_no_phase(fake):
    with fake.mirror(), utils.measure_memory("cuda", timeline=False) as mem:
        kept = [torch.ones(10) for _ in range(4)]
        mem.phase("later")
    assert len(mem.timeline) == 2 and mem.end_bytes == 4 * 512
    del kept


def test_tracker_backend_on_cuda_synchronises_and_follows_cuda_tensors_only(fake):
    with utils.measure_memory("cuda:1", backend="tracker") as mem:
        kept = torch.ones(100)                    # a CPU tensor: not the measured device's
    assert mem.backend == "tracker" and mem.end_bytes == 0
    assert [torch.device(args[0]) for args, _ in fake.called("synchronize")] == [torch.device("cuda", 1)]
    del kept


# --- utils/memory.py: the budget (capacity's searches run under it) ------------------------------------------

def test_budget_sets_the_fraction_from_an_empty_cache_and_resets_it(fake):
    cache = fake.alloc(100 * MIB)
    cache.free()
    budget = 64 * MIB
    with utils.measure_memory("cuda", budget_bytes=budget):
        assert fake.devices[0].fraction == budget / (16 * GIB)
        assert torch.cuda.memory_reserved() == 0   # the cache went before the fraction was set
    assert fake.devices[0].fraction == 1.0
    names = _names(fake)
    assert names.index("empty_cache") < names.index("set_per_process_memory_fraction")
    with pytest.raises(torch.OutOfMemoryError):
        with utils.measure_memory("cuda", budget_bytes=budget):
            blocks = [fake.alloc(20 * MIB) for _ in range(4)]
    assert fake.devices[0].fraction == 1.0 and torch.cuda.memory_allocated() == 0
    assert [args[0] for args, _ in fake.called("set_per_process_memory_fraction")] == [budget / (16 * GIB), 1.0] * 2


def test_a_warm_cache_neither_spends_nor_stretches_the_budget(fake):
    """CUDA_REVIEW finding 8: cached free blocks are reused without any check against the fraction."""
    for _ in range(2):
        warm = fake.alloc(100 * MIB)
        warm.free()                               # 100 MiB reserved and free: what an earlier measurement leaves
        with utils.measure_memory("cuda", budget_bytes=40 * MIB) as mem:
            fits = fake.alloc(30 * MIB)           # the cache is not counted against the budget ...
        assert mem.peak_bytes == 30 * MIB
        del fits
    warm = fake.alloc(100 * MIB)
    warm.free()
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        with utils.measure_memory("cuda", budget_bytes=40 * MIB):
            fake.alloc(60 * MIB)                  # ... nor can it serve more than the budget


def test_a_budget_larger_than_the_card_is_an_error(make_fake):
    """CUDA_REVIEW finding 7: the fraction stops at 1.0, so such a budget was silently the card's size."""
    make_fake(total_memory=8 * 10**9)
    with pytest.raises(ValueError, match=r"more than Fake GPU 0 has .*by_memory"):
        with utils.measure_memory("cuda", budget_bytes=16384 * MIB):
            pass
    assert torch.cuda.memory_allocated() == 0


def test_a_budget_already_spent_on_entry_is_out_of_memory(fake):
    model_state = fake.alloc(30 * MIB)            # alive: emptying the cache cannot return it
    with pytest.raises(torch.OutOfMemoryError, match="before the region started"):
        with utils.measure_memory("cuda", budget_bytes=16 * MIB):
            pass
    assert fake.devices[0].fraction is None      # never set
    del model_state


# --- utils/timing.py -------------------------------------------------------------------------------------------

def test_time_fn_times_the_devices_work_with_events(fake):
    timing = utils.time_fn(lambda: fake.launch(2.5), "cuda", warmup=2, repeats=4)
    assert timing.samples_ms == (2.5,) * 4 and timing.device == "Fake GPU 0"
    names = _names(fake)
    assert names.index("synchronize") < names.index("Event")      # warm-up work finished before timing
    assert all(kwargs == {"enable_timing": True} for name, _, kwargs in fake.calls if name == "Event")


def test_time_fn_records_its_events_on_the_timed_device(fake):
    """CUDA_REVIEW finding 16: events recorded on the current device (cuda:0) time nothing of cuda:1's work."""
    assert torch.cuda.current_device() == 0
    timing = utils.time_fn(lambda: fake.launch(3.0, 1), "cuda:1", warmup=1, repeats=3)
    assert timing.samples_ms == (3.0,) * 3
    assert {args for name, args, _ in fake.calls if name == "Event.record"} == {(1,)}


def test_time_fn_stops_after_max_seconds_on_cuda(fake):
    timing = utils.time_fn(lambda: fake.launch(400.0), "cuda", warmup=0, repeats=10, max_seconds=1.0)
    assert timing.samples_ms == (400.0,) * 3


# --- utils/capacity.py -----------------------------------------------------------------------------------------

def _step_that_allocates(fake: FakeCuda, per_sample: int):
    """A training step's memory: batch-sized blocks in a reference cycle that a failure leaves for gc to free."""
    def step(batch_size: int) -> None:
        cycle: list = []
        cycle.append(cycle)
        cycle.append(fake.alloc(per_sample * batch_size))     # activations
        cycle.append(fake.alloc(per_sample * batch_size))     # the backward's peak; out of memory here leaves a cycle
        cycle.clear()                                         # a step that ends frees what it made
    return step


def test_batch_search_under_a_fraction_recovers_from_out_of_memory(fake):
    state = fake.alloc(20 * MIB)                  # the model and optimizer, alive throughout
    step = _step_that_allocates(fake, 64 * 1024)
    found = utils.find_max_batch_size(step, "cuda", 256 * MIB, limit=4096)
    assert found.first_failure == found.largest + 1 and 1 < found.largest < 4096
    assert any(not ran for _, ran in found.trials)
    assert utils.run_under_budget(step, found.largest, "cuda", 256 * MIB) is not None
    assert utils.run_under_budget(step, found.largest + 1, "cuda", 256 * MIB) is None
    gc.collect()
    assert torch.cuda.memory_allocated() == round_size(20 * MIB)   # no failed try left anything allocated
    assert fake.devices[0].fraction == 1.0
    assert found.peak_bytes[found.largest] <= 256 * MIB
    del state


def test_batch_search_finds_the_same_batch_with_a_warm_cache(fake):
    step = _step_that_allocates(fake, 64 * 1024)
    cold = utils.find_max_batch_size(step, "cuda", 128 * MIB, limit=4096)
    warm = fake.alloc(900 * MIB)
    warm.free()                                   # what a speed measurement before the search leaves cached
    again = utils.find_max_batch_size(step, "cuda", 128 * MIB, limit=4096)
    assert again.largest == cold.largest


def test_batch_search_on_cuda_says_when_the_state_alone_exceeds_the_budget(fake):
    state = fake.alloc(300 * MIB)
    with pytest.raises(utils.CapacityError, match="does not fit"):
        utils.find_max_batch_size(_step_that_allocates(fake, 1024), "cuda", 256 * MIB)
    del state


class _Blocks(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(width, 4)


def _configuration(checkpointed: bool):
    """A reader's configuration for ``largest_batches``: builds (step, model, optimizer)."""
    def build():
        model = _Blocks()
        optimizer = torch.optim.AdamW(model.parameters())

        def step(batch_size: int) -> None:
            hidden, targets = torch.randn(batch_size, 32), torch.randint(0, 4, (batch_size,))
            for block in model.blocks:
                hidden = checkpoint(block, hidden, use_reentrant=False) if checkpointed else block(hidden)
            nn.functional.cross_entropy(model.head(hidden), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return step, model, optimizer
    return build


def test_largest_batches_runs_its_cuda_path(fake):
    configurations = {"fp32": _configuration(False), "checkpoint": _configuration(True)}
    with fake.mirror():
        # a real process holds its cuBLAS workspaces (here 2 x 8.1 MiB in one 20 MiB segment) before any search:
        # a budget is a ceiling on everything the process holds, so it must sit above them (issue: 09 and 11's
        # CUDA budgets of 1-3 MiB failed for that reason)
        layer = torch.nn.Linear(4, 4)
        layer(torch.ones(2, 4)).sum().backward()
        held = torch.cuda.memory_reserved()
        assert held >= LARGE_BUFFER
        found = utils.largest_batches(configurations, "cuda", held + 2 * MIB, small_batch=16, limit=128)
    assert set(found) == set(configurations)
    for capacity in found.values():
        assert capacity.found >= 16 and capacity.per_sample_bytes > 0
        assert capacity.search.first_failure is None or capacity.search.first_failure == capacity.found + 1
    assert fake.devices[0].fraction == 1.0
    assert len(fake.called("empty_cache")) >= len(configurations)


# --- utils/distributed.py: the backend a launch picks, the allocator's live bytes -------------------------------

class _Launched(Exception):
    """Raised by the faked init_process_group: the test needs only the arguments it was called with."""


@pytest.mark.parametrize("device_arg, gpus, world_size, backend, device", [
    ("auto", 4, 4, "nccl", "cuda:2"),            # one GPU per rank: NCCL, each rank on its own GPU
    ("auto", 1, 4, "gloo", "cpu"),               # fewer GPUs than ranks: every rank on the CPU
    ("cuda", 2, 2, "nccl", "cuda:2"),
    ("cpu", 4, 4, "gloo", "cpu"),
])
def test_launch_picks_nccl_only_with_a_gpu_per_rank(make_fake, monkeypatch, tmp_path, device_arg, gpus, world_size,
                                                    backend, device):
    import torch.distributed as dist

    fake = make_fake(device_count=max(gpus, 3))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    chosen = {}

    def init_process_group(name, **kwargs):
        chosen.update(backend=name, current=torch.cuda.current_device(), **kwargs)
        raise _Launched

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    args = utils.distributed.build_parser().parse_args(["--strategy", "ddp", "--out", str(tmp_path),
                                                        "--device", device_arg])
    local_rank = 2 if device == "cuda:2" else 0
    with pytest.raises(_Launched):
        utils.distributed._run(args, rank=local_rank, world_size=world_size, local_rank=local_rank)
    assert chosen["backend"] == backend and chosen["timeout"].total_seconds() == args.timeout_s
    if backend == "nccl":
        assert [args for args, _ in fake.called("set_device")] == [(torch.device(device),)]
        assert chosen["current"] == torch.device(device).index
    else:
        assert not fake.called("set_device")


def test_launch_on_cuda_with_too_few_gpus_says_so(make_fake, tmp_path):
    make_fake(device_count=1)
    args = utils.distributed.build_parser().parse_args(["--strategy", "ddp", "--out", str(tmp_path),
                                                        "--device", "cuda"])
    with pytest.raises(RuntimeError, match="needs 2 GPUs.*found 1"):
        utils.distributed._run(args, rank=0, world_size=2, local_rank=0)


def test_live_bytes_and_barrier_bytes_read_the_allocator(fake, monkeypatch):
    import torch.distributed as dist

    region = utils.measure_memory("cuda", phase="setup")
    with region:
        block = fake.alloc(3000)
        assert utils.distributed._live_bytes(region) == round_size(3000)
    kept: list = []

    def barrier_that_keeps_its_tensor():          # torch 2.11's process group: the last barrier's byte stays
        kept[:] = [fake.alloc(1)]

    monkeypatch.setattr(dist, "barrier", barrier_that_keeps_its_tensor)
    assert utils.distributed.barrier_retained_bytes(torch.device("cuda", 0)) == 512
    monkeypatch.setattr(dist, "barrier", lambda: fake.alloc(1))   # torch 2.13: freed on return
    assert utils.distributed.barrier_retained_bytes(torch.device("cuda", 0)) == 0
    del block


# --- utils/env.py and utils/memory_by_category.py ---------------------------------------------------------------

def test_env_describes_the_fake_cards(fake):
    assert utils.pick_device() == torch.device("cuda")
    assert utils.pick_device("cuda:1") == torch.device("cuda", 1)
    assert utils.device_name("cuda:1") == "Fake GPU 1"
    assert utils.supports_bf16("cuda:0") and not utils.supports_bf16("cuda:1")   # the index is honoured
    assert utils.autocast_dtype("cuda:1") == torch.float16
    report = utils.environment_report("cuda:1")
    assert "capability 7.5" in report and "(16 GB class)" in report and "fp16 + GradScaler" in report


def test_category_snapshot_keeps_the_measured_gpu_only():
    snapshot = {torch.device("cuda", 0): {"Parameter": 100, "Total": 100},
                torch.device("cuda", 1): {"Parameter": 7, "Total": 7},
                torch.device("cpu"): {"Parameter": 5, "Total": 5}}
    assert _by_category(snapshot, torch.device("cuda", 1))["Total"] == 7
    assert _by_category(snapshot, torch.device("cuda"))["Total"] == 107     # no index: every GPU


# --- the same rules on a real GPU (the reference run executes these) ---------------------------------------------

@needs_cuda
def test_real_allocator_follows_the_fakes_rules():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    one = torch.empty(1, device="cuda")
    assert torch.cuda.memory_allocated() - before == 512
    assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
    del one
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(torch.OutOfMemoryError):
        with utils.measure_memory("cuda", budget_bytes=64 * MIB):
            torch.empty(128 * MIB, dtype=torch.uint8, device="cuda")
    assert total > 0


@needs_cuda
def test_real_phase_sample_leaves_the_optimizer_state_only():
    model = nn.Linear(1024, 1024, device="cuda")
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    with utils.measure_memory("cuda", phase="optimizer") as mem:
        optimizer.step()
        mem.phase("after")
    state = sum(round_size(t.untyped_storage().nbytes()) for s in optimizer.state.values() for t in s.values()
                if t.device.type == "cuda")
    assert mem.phase_end_bytes()["optimizer"] == state


@needs_cuda
def test_real_time_fn_uses_events():
    x = torch.randn(1024, 1024, device="cuda")
    timing = utils.time_fn(lambda: x @ x, "cuda", warmup=2, repeats=3)
    assert len(timing.samples_ms) == 3 and timing.min_ms > 0


@needs_cuda
def test_real_allocator_splits_and_allocates_workspaces_as_the_fake_does():
    """The two rules the fake learned from the GPU review: no split of a large block for a remainder of 1 MiB or
    less (memory_allocated counts the whole block), and a cuBLAS workspace on a handle's first matmul."""
    import os
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    almost = torch.empty(19 * MIB + 512 * 1024, dtype=torch.uint8, device="cuda")   # a fresh 20 MiB segment
    assert torch.cuda.memory_allocated() - before == LARGE_BUFFER
    del almost
    a = torch.ones(8, 8, device="cuda")
    before = torch.cuda.memory_allocated()
    product = a @ a
    workspace = torch.cuda.memory_allocated() - before - 512                           # less the product's block
    capability = torch.cuda.get_device_capability()
    assert workspace == cublas_workspace_bytes(capability, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    del product


def test_the_allocator_backend_keeps_no_reference_to_include(fake):
    """`x = x + 1` inside the region frees the old x by its end: seen on an H100, a reference kept to `include` left
    the old tensor alive (end 4,096 B instead of 0)."""
    with fake.mirror():
        plain = torch.randn(1024)
        with utils.measure_memory("cuda", include=plain) as out_of_place:
            plain = plain + 1
        assert out_of_place.peak_bytes == 4096 and out_of_place.end_bytes == 0
        del plain
