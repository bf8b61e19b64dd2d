import gc

import pytest
import torch

import utils


def test_new_tensor_is_measured_exactly():
    with utils.measure_memory("cpu") as mem:
        kept = torch.empty(1000, 10)
    assert mem.end_bytes == mem.peak_bytes == 40_000
    assert mem.backend == "tracker" and mem.baseline_bytes == 0
    del kept


def test_views_and_in_place_ops_allocate_nothing():
    x = torch.randn(64, 64)
    with utils.measure_memory("cpu") as mem:
        a, b = x.t(), x.view(-1)
        x.mul_(2)
    assert mem.peak_bytes == 0 and mem.end_bytes == 0
    del a, b


def test_freed_temporaries_raise_peak_but_not_end():
    x = torch.randn(256, 256)
    with utils.measure_memory("cpu") as mem:
        y = (x * 2) + 1          # the product is a temporary, freed once the sum exists
    assert mem.end_bytes == x.numel() * 4
    assert mem.peak_bytes == 2 * x.numel() * 4
    del y


def test_torch_tensor_constructor_is_seen():
    with utils.measure_memory("cpu") as mem:
        kept = torch.tensor([1.0, 2.0, 3.0])
    assert mem.end_bytes == 12
    del kept


def test_include_follows_existing_tensors_and_sees_their_free():
    model = torch.nn.Linear(10, 10)
    model(torch.randn(2, 10)).sum().backward()
    grads_bytes = sum(p.grad.numel() * 4 for p in model.parameters())
    with utils.measure_memory("cpu", include=model) as mem:
        model.zero_grad(set_to_none=True)
        gc.collect()
    assert mem.baseline_bytes == 2 * grads_bytes      # parameters and gradients
    assert mem.end_bytes == -grads_bytes


def test_phases_label_the_timeline():
    model = torch.nn.Linear(8, 8)
    with utils.measure_memory("cpu", phase="forward", include=model) as mem:
        loss = model(torch.randn(4, 8)).sum()
        mem.phase("backward")
        loss.backward()
    assert [s.event for s in mem.timeline] == list(range(len(mem.timeline)))
    assert set(mem.phase_end_bytes()) == {"forward", "backward"}
    assert mem.phase_end_bytes()["backward"] >= sum(p.numel() * 4 for p in model.parameters())
    assert max(mem.phase_peak_bytes().values()) == mem.peak_bytes


def test_a_phase_that_only_frees_peaks_where_it_began():
    with utils.measure_memory("cpu", phase="fill") as mem:
        kept = [torch.empty(1000) for _ in range(3)]          # 3 x 4,000 bytes
        mem.phase("free")
        del kept[0], kept[0]                                  # the phase's first sample is already lower
        mem.phase("fill")                                     # a phase entered again starts at the level left
        kept.append(torch.empty(250))
    assert mem.phase_peak_bytes() == {"fill": 12_000, "free": 12_000}
    assert mem.phase_end_bytes() == {"fill": 5_000, "free": 4_000}


def test_timeline_off_keeps_endpoints():
    with utils.measure_memory("cpu", timeline=False) as mem:
        kept = [torch.empty(10) for _ in range(5)]
    assert len(mem.timeline) == 2 and mem.end_bytes == 200
    del kept


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend must be one of"):
        utils.measure_memory("cpu", backend="nvidia-smi")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        utils.measure_memory("cpu", backend="cuda-allocator")
    with pytest.raises(TypeError, match="device must be"):
        utils.measure_memory(0)
    with pytest.raises(TypeError, match="expected tensors, an nn.Module"):
        utils.measure_memory("cpu", include=object())
    with utils.measure_memory("cpu") as mem:
        with pytest.raises(ValueError, match="phase name"):
            mem.phase("")


def test_tensor_bytes_counts_shared_storage_once():
    x = torch.empty(100)
    assert utils.tensor_bytes([x, x[:10], x.view(10, 10)]) == 400
    assert utils.tensor_bytes(torch.nn.Linear(3, 2)) == (6 + 2) * 4
    with pytest.raises(TypeError):
        utils.tensor_bytes(object())


def test_to_mib():
    assert utils.to_mib(2**20) == 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA allocator figures need a GPU")
def test_cuda_allocator_agrees_with_tracker():
    for backend in ("cuda-allocator", "tracker"):
        with utils.measure_memory("cuda", backend=backend) as mem:
            kept = torch.empty(1024, 1024, device="cuda")
        assert mem.end_bytes == 4 * 2**20, backend
        del kept


def test_track_saved_tensors_counts_activations_not_weights():
    model = utils.MLP(16, 32, 4, num_hidden_layers=2)
    x = torch.randn(8, 16)
    with utils.track_saved_tensors(exclude=model) as saved:
        out = model(x)
    # the input and one (8, 32) tensor per hidden layer (ReLU's output, also the next Linear's input)
    assert saved.bytes == 8 * 16 * 4 + 2 * 8 * 32 * 4 and saved.count == 3
    with utils.track_saved_tensors() as everything:
        out = model(x)
    assert everything.bytes > saved.bytes        # the weights Linear saves are counted now
    del out
    with pytest.raises(TypeError):
        utils.track_saved_tensors(exclude=3.5j)
