"""The calculator's fewer-bits options (notebook 10), each prediction against the exact CPU tracker, to the byte."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import utils
from utils.calculator import ModelConfig, TrainingSetup, predict, predict_hf
from utils.calculator.reference import build_reference, reference_step
from utils.lowbit import NF4_BITSANDBYTES, AdamWBF16

TINY_GPT = ModelConfig(num_layers=2, d_model=64, num_heads=2, vocab_size=48, max_seq_len=16, name="tiny gpt")
TINY_LLAMA = ModelConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, ffn_width=128, vocab_size=48,
                         max_seq_len=16, arch="llama", name="tiny llama")
HF_TINY = {"model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16}


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
@pytest.mark.parametrize("model", [TINY_GPT, TINY_LLAMA], ids=["gpt", "llama"])
def test_pure_bf16_step_with_stochastic_rounding_or_kahan_to_the_byte(model, rounding):
    setup = TrainingSetup(micro_batch=2, seq_len=16, precision="bf16", optimizer_impl="for-loop", device="cpu",
                          bf16_rounding=rounding)
    net, _ = build_reference(model, replace(setup, bf16_rounding="nearest"))
    optimizer = AdamWBF16(net.parameters(), lr=1e-3, rounding=rounding)
    tokens, targets = utils.make_token_data(2, 16, model.vocab_size)
    tokens, targets = tokens[None].contiguous(), targets[None].contiguous()   # (accumulation, B, T), own storages
    reference_step(net, optimizer, tokens, targets, model, setup)          # creates the state
    with utils.measure_memory("cpu", include=[net, optimizer, tokens, targets]) as mem:
        reference_step(net, optimizer, tokens, targets, model, setup)
    predicted = predict(model, setup)
    numel = sum(p.numel() for p in net.parameters())
    state = utils.tensor_bytes(optimizer)
    assert state == predicted.optimizer_state == (6 if rounding == "kahan" else 4) * numel
    assert predicted.model_state - utils.tensor_bytes(list(net.buffers())) == (10 if rounding == "kahan" else 8) * numel
    assert mem.baseline_bytes + mem.peak_bytes == predicted.total
    assert predicted.phase == "optimizer step"


def _nf4_linear_class(double: bool, block: int = 64):
    levels = torch.tensor(NF4_BITSANDBYTES)

    class LoRALinear4bit(nn.Module):
        """Notebook 10's 4-bit LoRA linear, as stored: packed codes, the absmaxes (double-quantised or not)."""

        def __init__(self, base: nn.Linear, rank: int) -> None:
            super().__init__()
            blocks = base.weight.detach().float().reshape(-1, block)
            absmax = blocks.abs().amax(dim=1)
            codes = torch.bucketize(blocks / absmax[:, None], (levels[1:] + levels[:-1]) / 2).to(torch.uint8).view(-1)
            self.register_buffer("packed", codes[0::2] << 4 | codes[1::2])
            if double:
                offset = absmax.mean()
                padded = F.pad(absmax - offset, (0, -absmax.numel() % 256)).view(-1, 256)
                group = padded.abs().amax(dim=1)
                self.register_buffer("scale_codes", (padded / group[:, None] * 127).round().to(torch.int8)
                                     .view(-1)[:absmax.numel()].clone())
                self.register_buffer("scale_absmax", group)
                self.register_buffer("scale_offset", offset)
            else:
                self.register_buffer("absmax", absmax)
            self.shape = tuple(base.weight.shape)
            self.A = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features ** 0.5)   # fp32, as peft
            self.B = nn.Parameter(torch.zeros(base.out_features, rank))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            codes = torch.stack([self.packed >> 4, self.packed & 15], dim=1).view(-1, block)
            absmax = (self.scale_codes.float() * self.scale_absmax.repeat_interleave(256)[:codes.shape[0]] / 127
                      + self.scale_offset) if double else self.absmax
            weight = (levels[codes.long()] * absmax[:, None]).to(x.dtype).view(self.shape)
            return F.linear(x, weight) + (x.float() @ self.A.T @ self.B.T * 2.0).to(x.dtype)

    return LoRALinear4bit


def _qlora_llama(double: bool, prepared: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    fields = {k: v for k, v in HF_TINY.items() if k != "model_type"}
    model = LlamaForCausalLM(LlamaConfig(**fields)).to(torch.bfloat16).requires_grad_(False)
    layer_class = _nf4_linear_class(double)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, layer_class(child, 4))
    if prepared:
        from peft import prepare_model_for_kbit_training

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    adapters = [p for m in model.modules() if isinstance(m, layer_class) for p in (m.A, m.B)]
    for p in adapters:
        p.requires_grad_(True)
    return model, adapters


@pytest.mark.parametrize("quant, prepared", [("nf4", False), ("nf4-double", False), ("nf4-double", True)])
def test_qlora_model_state_on_a_transformers_llama_to_the_byte(quant, prepared):
    model, adapters = _qlora_llama(quant == "nf4-double", prepared)
    optimizer = torch.optim.AdamW(adapters, lr=1e-3, foreach=False)
    tokens, targets = utils.make_token_data(2, 16, HF_TINY["vocab_size"])
    model(input_ids=tokens, labels=targets).loss.backward()
    optimizer.step()
    measured = utils.tensor_bytes([model, optimizer])       # weights, buffers, gradients, AdamW state and counters
    setup = TrainingSetup(micro_batch=2, seq_len=16, precision="bf16", lora_rank=4, device="cpu",
                          base_quant=quant, kbit_prepared=prepared)
    predicted = predict_hf(HF_TINY, setup)
    assert predicted.model_state == measured
    assert predicted.trainable_parameters == sum(p.numel() for p in adapters)


def test_prepare_model_for_kbit_training_upcasts_every_non_4bit_parameter():
    plain, _ = _qlora_llama(True, False)
    prepared, _ = _qlora_llama(True, True)
    upcast = sum(p.numel() for p in plain.parameters() if p.dtype == torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in prepared.parameters())
    setup = TrainingSetup(seq_len=16, precision="bf16", lora_rank=4, device="cpu", base_quant="nf4-double")
    extra = predict_hf(HF_TINY, replace(setup, kbit_prepared=True)).largest["parameters"] \
        - predict_hf(HF_TINY, setup).largest["parameters"]
    assert extra == 2 * upcast == utils.tensor_bytes(prepared) - utils.tensor_bytes(plain)


def test_nf4_replays_the_bf16_lora_activations_and_adds_the_dequantised_weight():
    setup = TrainingSetup(seq_len=512, precision="bf16", lora_rank=16)
    lora = predict_hf("llama-2-7b", setup)
    qlora = predict_hf("llama-2-7b", replace(setup, base_quant="nf4-double"))
    assert qlora.largest["activations"] == lora.largest["activations"]      # MatMul4Bit saves what F.linear saves
    assert qlora.largest["temporaries"] >= 2 * 11008 * 4096                 # one MLP weight dequantised to bf16
    assert qlora.notes and not lora.notes
    bits = 8 * (qlora.largest["parameters"] - (lora.largest["parameters"] - 2 * 6_476_005_376)) / 6_476_005_376
    assert math.isclose(bits, 4.127, abs_tol=2e-3)                          # QLoRA's 4.127 bits per weight


class _FP8Matmul(torch.autograd.Function):
    """Notebook 10's emulated FP8 matmul (e4m3 copies of x and W; keeps the 16-bit input)."""

    @staticmethod
    def forward(ctx, x, weight):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, weight)
        casts = []
        for t in (x, weight):
            scale = 448.0 / t.detach().abs().amax().float().clamp(min=1e-12)
            casts.append((t.float() * scale).to(torch.float8_e4m3fn).float() / scale)
        return (casts[0] @ casts[1].T).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        return (grad @ weight.to(grad.dtype)).to(x.dtype), (grad.reshape(-1, grad.shape[-1]).T
                                                            @ x.reshape(-1, x.shape[-1]).to(grad.dtype)).to(weight.dtype)


@pytest.mark.parametrize("precision", ["bf16-autocast", "bf16"])
def test_fp8_keeps_the_model_state_of_its_precision(precision):
    setup = TrainingSetup(micro_batch=2, seq_len=16, precision=precision, optimizer_impl="for-loop", device="cpu")
    net, optimizer = build_reference(TINY_GPT, setup)
    for block in net.blocks:
        for linear in (block.qkv, block.proj, block.mlp[0], block.mlp[2]):
            linear.forward = lambda x, m=linear: _FP8Matmul.apply(x, m.weight) + m.bias
    tokens, targets = utils.make_token_data(2, 16, TINY_GPT.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-autocast"):
        loss = F.cross_entropy(net(tokens).flatten(0, 1).float(), targets.flatten())
    loss.backward()
    optimizer.step()
    predicted = predict(TINY_GPT, replace(setup, fp8=True))
    assert predicted.model_state == utils.tensor_bytes([net, optimizer]) == predict(TINY_GPT, setup).model_state
    assert predicted.notes


def test_fp8_copies_are_one_byte_per_element_and_a_scale_each():
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    w = torch.randn(256, 64, dtype=torch.bfloat16)
    with utils.measure_memory("cpu", timeline=False) as mem, torch.no_grad():
        copies = [((t.float() * (448.0 / t.abs().amax().float())).to(torch.float8_e4m3fn),
                   448.0 / t.abs().amax().float()) for t in (x, w)]
    assert mem.end_bytes == x.numel() + w.numel() + 8 and len(copies) == 2
    fp8 = predict(TINY_GPT, TrainingSetup(seq_len=16, precision="bf16", fp8=True, device="cpu"))
    plain = predict(TINY_GPT, TrainingSetup(seq_len=16, precision="bf16", device="cpu"))
    assert fp8.largest["activations"] == plain.largest["activations"]       # the 16-bit input is what is kept


@pytest.mark.parametrize("changes, message", [
    ({"base_quant": "nf8"}, "base_quant must be one of"),
    ({"base_quant": "nf4", "precision": "bf16"}, "lora_rank > 0"),
    ({"base_quant": "nf4", "lora_rank": 8}, "precision 'bf16'"),
    ({"base_quant": "nf4", "lora_rank": 8, "precision": "bf16", "quant_block": 63}, "positive even int"),
    ({"quant_block": 128}, "base_quant 'nf4'"),
    ({"kbit_prepared": True}, "4-bit model"),
    ({"bf16_rounding": "up"}, "bf16_rounding must be one of"),
    ({"bf16_rounding": "stochastic"}, "expected {'precision': 'bf16'"),
    ({"fp8": True, "precision": "fp32"}, "bf16-autocast"),
    ({"fp8": "yes"}, "fp8 must be True or False"),
    ({"base_quant": "nf4", "lora_rank": 8, "precision": "bf16", "fp8": True}, "separate recipes"),
    ({"base_quant": "nf4", "lora_rank": 8, "precision": "bf16", "strategy": "fsdp", "ranks": 2}, "strategy 'single'"),
])
def test_bad_fewer_bits_setups_are_named(changes, message):
    with pytest.raises(ValueError, match=re_escape(message)):
        TrainingSetup(**changes)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_a_block_that_does_not_divide_a_weight_is_named():
    model = ModelConfig(num_layers=1, d_model=36, num_heads=2, vocab_size=16, ffn_width=36, max_seq_len=8,
                        arch="llama")
    with pytest.raises(ValueError, match="quant_block 64 does not divide layers.0.self_attn.q_proj.weight"):
        predict(model, TrainingSetup(seq_len=8, precision="bf16", lora_rank=2, base_quant="nf4"))
    with pytest.raises(ValueError, match="transformers"):
        predict(TINY_LLAMA, TrainingSetup(seq_len=8, precision="bf16", lora_rank=2, base_quant="nf4",
                                          kbit_prepared=True))


def test_command_line_takes_the_fewer_bits_options(capsys):
    from utils.calculator import main

    assert main(["--hf-config", "llama-2-7b", "--seq-len", "512", "--precision", "bf16", "--lora-rank", "16",
                 "--base-quant", "nf4-double", "--kbit-prepared"]) == 0
    text = capsys.readouterr().out
    assert "NF4 base (block 64, double quantisation, prepare_model_for_kbit_training)" in text and "note:" in text
    assert main(["--preset", "7B", "--seq-len", "512", "--precision", "bf16", "--bf16-rounding", "kahan"]) == 0
    assert "kahan summation" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--preset", "7B", "--base-quant", "nf4"])
    assert "lora_rank > 0" in capsys.readouterr().err
