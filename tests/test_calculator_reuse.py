"""An answer in under a second, and still exact (issue 43): one decoder layer replayed once stands for every identical
one (``layer_reuse.py``), and the largest micro-batch is found from a line through two replays, then verified. Both
are compared here with the slow way: the whole model replayed, every micro-batch searched."""

from dataclasses import replace

import pytest

from utils import calculator as C
from utils.calculator.fewer_bits import _LowBitStep, lowbit_on
from utils.calculator.layer_reuse import compose, replay
from utils.calculator.predict import check
from utils.calculator.step import _Step
from utils.calculator.validate_hf import tiny_config

T = C.TrainingSetup


def deep(model_type, layers=14, **fields):
    """A small model of the family with enough layers for the middle ones to be reused."""
    return C.model_config_from_hf(tiny_config(model_type, num_hidden_layers=layers, max_position_embeddings=256,
                                              **fields))


CASES = [
    ("llama", deep("llama"), T(seq_len=64, micro_batch=2)),
    ("llama lora bf16 ckpt", deep("llama"), T(seq_len=64, lora_rank=4, precision="bf16", checkpointing="every_block")),
    ("llama fsdp accumulation", deep("llama"), T(seq_len=64, strategy="fsdp", ranks=4, accumulation_steps=3)),
    ("llama zero2 own loss", deep("llama"), T(seq_len=64, strategy="zero2", ranks=2, loss="logits")),
    ("llama reentrant kept-in-step", deep("llama"), T(seq_len=64, checkpointing="every_block", reentrant=True,
                                                      outputs="kept-in-step")),
    ("llama qlora padded", deep("llama"), T(seq_len=64, lora_rank=4, precision="bf16", base_quant="nf4",
                                            quant_block=32, padded=True)),
    ("qwen2 sliding from layer 5", deep("qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=5),
     T(seq_len=64)),
    ("qwen3 dropout", deep("qwen3", attention_dropout=0.1), T(seq_len=64, device="cpu")),
    ("phi3 autocast eager", deep("phi3", attn_implementation="eager", resid_pdrop=0.1), T(seq_len=64)),
    ("gemma2 shifted-sum", deep("gemma2", layers=15), T(seq_len=64, loss="shifted-sum", accumulation_steps=2)),
    ("gemma3 pattern 6", deep("gemma3_text", layers=26), T(seq_len=64, checkpointing="every_block")),
    ("gpt2 fp8-free adafactor", C.model_config_from_hf("gpt2"), T(seq_len=64, optimizer="adafactor",
                                                                  optimizer_impl="for-loop")),
    ("course llama fp8", C.PRESETS["1B"], T(seq_len=64, fp8=True)),
    ("course gpt selective", C.ModelConfig(12, 64, 4, 100, max_seq_len=64), T(seq_len=64, checkpointing="selective")),
]


@pytest.mark.parametrize("label, model, setup", CASES, ids=[c[0] for c in CASES])
def test_one_layer_replayed_stands_for_every_identical_one(label, model, setup):
    check(model, setup)
    step_class = _LowBitStep if lowbit_on(setup) else _Step
    short, whole = replay(model, setup, step_class), replay(model, setup, step_class, trace=True)
    assert short.reused and not whole.reused, label
    for field in ("peak", "peak_kinds", "peak_phase", "largest", "baseline", "grads_mark", "grads_at_step"):
        assert getattr(short, field) == getattr(whole, field), (label, field)


def test_the_phases_compose_to_the_replays_own_peak():
    model, setup = C.PRESETS["1B"], T(seq_len=64, outputs="dropped")
    step = _Step(model, setup).run()
    composed = compose(step.phases)
    assert (composed.peak, composed.peak_kinds, composed.peak_phase) == (step.peak, step.peak_kinds, step.peak_phase)
    assert composed.largest == step.largest


def test_a_shallow_or_irregular_model_is_replayed_whole():
    shallow = C.model_config_from_hf(tiny_config("llama", num_hidden_layers=6))
    assert not replay(shallow, T(seq_len=16), _Step).reused


@pytest.mark.parametrize("model, setup, budget", [
    (C.PRESETS["7B"], T(seq_len=2048, lora_rank=16, checkpointing="every_block"), 40 * 10**9),
    (C.model_config_from_hf("gemma-2-9b"), T(seq_len=1024, precision="bf16", lora_rank=8, checkpointing="every_block"),
     40 * 10**9),
    (C.ModelConfig(2, 32, 4, 64, max_seq_len=16), T(micro_batch=2, seq_len=16, precision="fp32",
                                                    optimizer_impl="for-loop", device="cpu"), 800_000),
])
def test_the_largest_micro_batch_is_the_boundary(model, setup, budget):
    """The line through two replays gives the answer; the sizes on either side prove it (the peak only grows)."""
    found = C.largest_micro_batch(model, setup, budget, limit=64)

    def peak(batch):
        return C.predict(model, replace(setup, micro_batch=batch)).total

    assert 1 < found < 64
    assert peak(found // 2) <= peak(found) <= budget < peak(found + 1) <= peak(2 * found)
