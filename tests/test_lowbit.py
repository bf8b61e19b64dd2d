import math

import pytest
import torch

import utils
from utils.lowbit import (dequantize_blockwise, num_blocks, quantize_blockwise, signed_codebook,
                          unsigned_codebook)


def _model() -> torch.nn.Module:
    # a matrix, a vector, a 3-d tensor and a tensor not a multiple of the block size
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.LayerNorm(30), torch.nn.Linear(30, 3))
    model.register_parameter("cube", torch.nn.Parameter(torch.randn(2, 7, 5)))
    return model


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean() + model.cube.pow(2).mean()


def test_codebooks_are_sorted_and_span_the_unit_interval():
    signed, unsigned = signed_codebook(), unsigned_codebook()
    assert signed.numel() == 255 and unsigned.numel() == 256
    assert bool((signed[1:] > signed[:-1]).all()) and bool((unsigned[1:] > unsigned[:-1]).all())
    assert signed[0] == -1 and signed[-1] == 1 and (signed == 0).sum() == 1
    assert unsigned[-1] == 1 and unsigned[0] > 0      # no zero: v never reads back as 0


@pytest.mark.parametrize("numel, block_size", [(1000, 256), (256, 256), (7, 256), (513, 64)])
def test_round_trip_keeps_a_few_percent_and_the_zeros(numel, block_size):
    torch.manual_seed(0)
    x = torch.randn(numel) * torch.logspace(-3, 0, numel)       # a wide range inside each block
    x[::5] = 0
    codes, scales = quantize_blockwise(x, signed_codebook(), block_size)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (math.ceil(numel / block_size),)
    assert codes.untyped_storage().nbytes() == numel                   # not padded to whole blocks
    back = dequantize_blockwise(codes, scales, signed_codebook(), block_size)
    assert bool((back[::5] == 0).all())
    big = x.abs() > 1e-3 * scales.repeat_interleave(block_size)[:numel]
    relative = ((back - x).abs() / x.abs())[big]
    assert float(relative.max()) < 0.04
    # the block maximum is stored exactly
    assert torch.equal(back.abs().reshape(-1)[x.abs().argmax()], x.abs().max())


def test_unsigned_round_trip_never_reads_back_zero_for_a_positive_value():
    v = torch.tensor([1.0, 1e-3, 1e-9, 1e-20])
    codes, scales = quantize_blockwise(v, unsigned_codebook(), 256)
    back = dequantize_blockwise(codes, scales, unsigned_codebook(), 256)
    assert bool((back > 0).all()) and back[0] == 1.0
    assert abs(float(back[1]) / 1e-3 - 1) < 0.04


def test_quantize_writes_into_existing_state():
    codes = torch.zeros(10, dtype=torch.uint8)
    scales = torch.zeros(1)
    out_codes, out_scales = quantize_blockwise(torch.ones(10), signed_codebook(), 256, out_codes=codes,
                                               out_scales=scales)
    assert out_codes is codes and out_scales is scales and scales.item() == 1.0


def test_state_bytes_equal_prediction_to_the_byte():
    model = _model()
    optimizer = utils.AdamW8bit(model.parameters(), lr=1e-3, block_size=64)
    _loss(model, torch.randn(4, 20)).backward()
    with utils.measure_memory("cpu", include=[model, optimizer]) as mem:
        optimizer.step()
    predicted = utils.predict_optimizer_state_bytes([p.shape for p in model.parameters()], "adamw8bit",
                                                    block_size=64)
    assert mem.end_bytes == predicted == utils.tensor_bytes(optimizer)
    assert predicted == sum(2 * p.numel() + 8 * num_blocks(p.numel(), 64) for p in model.parameters())
    with utils.measure_memory("cpu", include=[model, optimizer]) as second:
        optimizer.step()
    assert second.end_bytes == 0          # the state is updated in place, never reallocated


def test_first_step_equals_adamw_and_training_follows_it():
    torch.manual_seed(0)
    reference, quantized = _model(), _model()
    quantized.load_state_dict(reference.state_dict())
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    adamw8 = utils.AdamW8bit(quantized.parameters(), lr=1e-2)
    x = torch.randn(16, 20)
    losses = {"fp32": [], "8bit": []}
    for step in range(60):
        for model, optimizer, name in ((reference, adamw, "fp32"), (quantized, adamw8, "8bit")):
            loss = _loss(model, x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
        if step == 0:   # zero moments are stored exactly, so the first update is AdamW's own
            for a, b in zip(reference.parameters(), quantized.parameters()):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert losses["8bit"][-1] < 0.5 * losses["8bit"][0]
    assert max(abs(a - b) for a, b in zip(losses["fp32"], losses["8bit"])) < 0.05 * losses["fp32"][0]


def test_weight_decay_is_decoupled_like_adamw():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = utils.AdamW8bit([param], lr=0.1, weight_decay=0.5)
    param.grad = torch.zeros(3)
    optimizer.step()
    torch.testing.assert_close(param.detach(), torch.full((3,), 1 - 0.1 * 0.5))


def test_state_dict_round_trip_keeps_uint8_codes():
    model = _model()
    optimizer = utils.AdamW8bit(model.parameters())
    _loss(model, torch.randn(4, 20)).backward()
    optimizer.step()
    saved = optimizer.state_dict()
    restored = utils.AdamW8bit(model.parameters())
    restored.load_state_dict(saved)
    for param in model.parameters():
        for key in ("exp_avg_codes", "exp_avg_sq_codes", "exp_avg_scales", "exp_avg_sq_scales"):
            assert torch.equal(restored.state[param][key], optimizer.state[param][key]), key
            assert restored.state[param][key].dtype == optimizer.state[param][key].dtype
        assert restored.state[param]["step"] == 1
    assert utils.tensor_bytes(restored) == utils.tensor_bytes(optimizer)


def test_bf16_parameters_and_closure():
    param = torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16))
    optimizer = utils.AdamW8bit([param], lr=0.5, weight_decay=0.0)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (param.float() ** 2).sum()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert loss.item() == 5.0 and param.dtype == torch.bfloat16 and bool((param < 1).all())


@pytest.mark.parametrize("kwargs, message", [
    ({"lr": 0}, "lr must be"), ({"lr": -1e-3}, "lr must be"), ({"betas": (0.9, 1.0)}, "betas must be"),
    ({"betas": (0.9,)}, "betas must be"), ({"eps": 0}, "eps must be"), ({"weight_decay": -0.1}, "weight_decay"),
    ({"block_size": 0}, "block_size must be a positive int"), ({"block_size": -256}, "block_size"),
    ({"block_size": 2.5}, "block_size"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        utils.AdamW8bit([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_quantize_bad_block_size():
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        quantize_blockwise(torch.ones(3), signed_codebook(), 0)
    with pytest.raises(ValueError, match="block_size"):
        num_blocks(10, -1)
