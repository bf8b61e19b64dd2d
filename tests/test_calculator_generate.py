"""The calculator's generation and RL step (issue 41, items 4-5) against notebook 15's measurements, to the byte.

``predict_generate`` is compared with ``utils.generation.measure_generate`` (transformers' ``generate`` under the
exact tracker) and ``predict_rl_step`` with ``utils.generation.measure_grpo_step`` (notebook 15's GRPO recipe, phase
by phase), on tiny models built from configs on the CPU. Each measurement runs once per module (cached).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from utils import calculator as C
from utils import generation
from utils.calculator import generate as G
from utils.calculator.generate import GenerateSetup, predict_generate
from utils.calculator.hf_grid import _tiny, tiny_config
from utils.calculator.rl import RLSetup, predict_rl_step
from utils.calculator.validate_hf import hf_config_for

SHAPE = dict(num_layers=2, d_model=16, num_heads=4, num_kv_heads=2, ffn_width=32, vocab_size=96, max_seq_len=128)
MODELS = {  # name: (ModelConfig, config fields or None)
    "llama gqa": (_tiny(**SHAPE), None),
    "mistral window 4": (_tiny(**SHAPE, sliding_window=4, name="tiny mistral"), None),
    "qwen2 biases": (None, tiny_config("qwen2", max_position_embeddings=128, vocab_size=96)),
    "qwen2 mixed layers": (None, tiny_config("qwen2", max_position_embeddings=128, vocab_size=96,
                                             use_sliding_window=True, sliding_window=3, max_window_layers=1)),
}


def model_of(name: str) -> tuple[C.ModelConfig, dict | None]:
    model, fields = MODELS[name]
    return (model if fields is None else C.model_config_from_hf(fields)), fields


def transformers_config(name: str):
    model, fields = model_of(name)
    config = hf_config_for(model, fields)
    config.eos_token_id, config.bos_token_id, config.pad_token_id = None, None, 0   # answers run to N
    return config


@functools.lru_cache(maxsize=None)
def measured_generate(name: str, gen: GenerateSetup) -> generation.GenerateMemory:
    """``model.generate`` as GenerateSetup describes it, measured by notebook 15's ``measure_generate``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(transformers_config(name), attn_implementation="sdpa")
    net = net.to(torch.bfloat16 if gen.precision == "bf16" else torch.float32).eval()
    net.generation_config.eos_token_id, net.generation_config.pad_token_id = None, 0
    if gen.lora_rank:
        from peft import LoraConfig, get_peft_model
        net = get_peft_model(net, LoraConfig(r=gen.lora_rank, lora_alpha=2 * gen.lora_rank, lora_dropout=0.0,
                                             target_modules="all-linear"))
    prompts = torch.randint(0, 96, (gen.batch, gen.prompt_length), generator=torch.Generator().manual_seed(0))
    options = dict(max_new_tokens=gen.new_tokens, num_return_sequences=gen.generations, disable_compile=True,
                   return_dict_in_generate=gen.return_cache, do_sample=gen.sampling == "sample")
    if gen.sampling == "sample":
        options["top_k"] = 0
    if gen.cache == "static":
        options["cache_implementation"] = "static"
    if gen.prefill_logits == "all":
        options["logits_to_keep"] = 0
    _, memory = generation.measure_generate(net, prompts, attention_mask=torch.ones_like(prompts),
                                            **options)
    return memory


def cpu(**fields) -> GenerateSetup:
    return GenerateSetup(**{"batch": 2, "prompt_length": 5, "new_tokens": 3, "precision": "fp32", "device": "cpu",
                            **fields})


GENERATIONS = [  # the model, the call: each measured and predicted
    ("llama gqa", cpu()),
    ("llama gqa", cpu(cache="static")),
    ("llama gqa", cpu(generations=3, sampling="sample", prefill_logits="all", return_cache=True)),
    ("llama gqa", cpu(lora_rank=2, batch=1, generations=2, sampling="sample")),
    ("mistral window 4", cpu(new_tokens=5)),
    ("mistral window 4", cpu(new_tokens=4, cache="static", generations=2, sampling="sample")),
    ("qwen2 biases", cpu(batch=1, precision="bf16", prefill_logits="all")),
    ("qwen2 mixed layers", cpu(new_tokens=5, return_cache=True)),
]


@pytest.mark.parametrize("name, gen", GENERATIONS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(GENERATIONS)])
def test_generate_is_predicted_to_the_byte_phase_by_phase(name, gen):
    measured = measured_generate(name, gen)
    predicted = predict_generate(model_of(name)[0], gen)
    assert predicted.phase_peak_bytes == measured.phase_peak_bytes
    assert predicted.phase_end_bytes == measured.phase_end_bytes
    assert (predicted.peak_bytes, predicted.end_bytes) == (measured.peak_bytes, measured.end_bytes)
    assert predicted.cache_bytes == measured.cache_bytes and predicted.logits_bytes == measured.logits_bytes
    assert predicted.cache_other_bytes == measured.cache_other_bytes
    assert predicted.sequences_shape == measured.sequences_shape


def test_a_long_generation_jumps_over_steps_without_changing_a_byte(monkeypatch):
    """Past REPLAYED_STEPS decode steps the replay jumps; every replayed step equals the step-by-step replay."""
    window = _tiny(**SHAPE, sliding_window=20)
    for model, gen in ((_tiny(**SHAPE), cpu(new_tokens=40)), (window, cpu(new_tokens=40, cache="static")),
                       (window, cpu(new_tokens=40, prompt_length=30))):
        jumped = predict_generate(model, gen)
        monkeypatch.setattr(G, "REPLAYED_STEPS", 10**6)
        whole = predict_generate(model, gen)
        monkeypatch.undo()
        assert len(jumped.phase_peak_bytes) < len(whole.phase_peak_bytes)
        assert all(whole.phase_peak_bytes[k] == v for k, v in jumped.phase_peak_bytes.items())
        assert all(whole.phase_end_bytes[k] == v for k, v in jumped.phase_end_bytes.items())
        assert (jumped.peak_bytes, jumped.end_bytes, jumped.decode_peak_bytes, jumped.cache_bytes) == \
            (whole.peak_bytes, whole.end_bytes, whole.decode_peak_bytes, whole.cache_bytes)


# --- the RL step --------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def measured_step(name: str, rl: RLSetup) -> generation.StepMemory:
    """One GRPO step of notebook 15's recipe as RLSetup describes it, measured phase by phase."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return generation.measure_grpo_step(
        transformers_config(name), batch=rl.batch, prompt_length=rl.prompt_length, new_tokens=rl.new_tokens,
        group_size=rl.group_size, beta=rl.beta, reference=rl.reference, lora_rank=rl.lora_rank or None,
        reference_dtype=dtypes[rl.reference_precision] if rl.reference_precision else None, chunk=rl.chunk or None,
        micro_batches=rl.micro_batches, dtype=dtypes[rl.precision])


def step(**fields) -> RLSetup:
    return RLSetup(**{"batch": 2, "prompt_length": 4, "new_tokens": 3, "group_size": 2, "precision": "fp32",
                      "device": "cpu", **fields})


STEPS = [  # the levers of notebook 15, on three families
    ("llama gqa", step()),                                                         # a full copy as the reference
    ("llama gqa", step(reference_precision="bf16", chunk=2)),                     # a bf16 copy, chunked log-probs
    ("qwen2 biases", step(lora_rank=2, reference="adapters", chunk=2, micro_batches=2)),   # the LoRA base
    ("mistral window 4", step(micro_batches=3, prompt_length=3)),                 # micro-batches, a window
    ("qwen2 mixed layers", step(beta=0.0, reference="none", precision="bf16")),   # no reference, pure bf16
]


@pytest.mark.parametrize("name, rl", STEPS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(STEPS)])
def test_a_grpo_step_is_predicted_to_the_byte_phase_by_phase(name, rl):
    measured = measured_step(name, rl)
    predicted = predict_rl_step(model_of(name)[0], rl)
    assert predicted.resident_bytes == measured.baseline_bytes
    phases = [name for name in generation.RL_PHASES if name in measured.phase_peak_bytes]   # the step's, not "start"
    assert predicted.phase_peak_bytes == {name: measured.phase_peak_bytes[name] for name in phases}
    assert predicted.phase_end_bytes == {name: measured.phase_end_bytes[name] for name in phases}
    assert (predicted.peak_bytes, predicted.end_bytes) == (measured.peak_bytes, measured.end_bytes)


def test_the_levers_move_the_phases_they_act_on():
    """On a real model's shape (symbolic: no tensors), each lever lowers the phase it acts on."""
    model = C.model_config_from_hf("llama-3.2-1b")
    base = RLSetup(prompt_length=256, new_tokens=768, group_size=8)
    plain = predict_rl_step(model, base)
    chunked = predict_rl_step(model, RLSetup(prompt_length=256, new_tokens=768, group_size=8, chunk=256))
    micro = predict_rl_step(model, RLSetup(prompt_length=256, new_tokens=768, group_size=8, micro_batches=4))
    lora = predict_rl_step(model, RLSetup(prompt_length=256, new_tokens=768, group_size=8, lora_rank=16,
                                          reference="adapters"))
    assert chunked.phase_peak_bytes["reference"] < plain.phase_peak_bytes["reference"]
    assert micro.phase_peak_bytes["policy backward"] < plain.phase_peak_bytes["policy backward"]
    assert lora.reference_bytes == 0 < plain.reference_bytes == plain.policy_bytes
    assert plain.total_bytes == plain.resident_bytes + plain.peak_bytes


# --- refusals -------------------------------------------------------------------------------------------------------

def test_what_the_replays_do_not_model_is_refused_by_name():
    llama = _tiny(**SHAPE)
    qwen3 = C.model_config_from_hf(tiny_config("qwen3"))
    with pytest.raises(ValueError, match=r"generation is replayed for transformers' Llama, Mistral and Qwen2.*qwen3"):
        predict_generate(qwen3, cpu())
    with pytest.raises(ValueError, match="generation is replayed for transformers' Llama"):
        predict_rl_step(C.preset("7B"), step())
    with pytest.raises(ValueError, match="attn_implementation 'eager' is not modelled"):
        predict_generate(_tiny(**SHAPE, attention="eager"), cpu())
    mixed = model_of("qwen2 mixed layers")[0]
    with pytest.raises(ValueError, match="static cache on a model whose layers mix full and sliding"):
        predict_generate(mixed, cpu(cache="static"))
    with pytest.raises(ValueError, match="a reference copy of a 4-bit base is not modelled"):
        predict_rl_step(llama, step(lora_rank=2, base_quant="nf4", precision="bf16"))
    for bad, message in ((dict(cache="offloaded"), "cache must be one of"),
                         (dict(precision="bf16-autocast"), "precision must be one of"),
                         (dict(sampling="top_p"), "sampling must be one of"),
                         (dict(generations=0), "generations")):
        with pytest.raises(ValueError, match=message):
            cpu(**bad)
    for bad, message in ((dict(reference="adapters"), "expected lora_rank > 0"),
                         (dict(group_size=1), "group_size must be an int >= 2"),
                         (dict(reference="none"), "needs a reference's log-probabilities"),
                         (dict(beta=0.0), "expected reference='none'"),
                         (dict(micro_batches=5), "at most the B·G = 4 answers"),
                         (dict(reference="adapters", lora_rank=2, reference_precision="bf16"),
                          "expected reference='copy'")):
        with pytest.raises(ValueError, match=message):
            step(**bad)
    with pytest.raises(TypeError, match="gen must be a GenerateSetup"):
        predict_generate(llama, step())


def test_the_command_line_answers_generate_and_the_rl_step(capsys):
    assert C.main(["--hf-config", "llama-3.2-1b", "--generate", "--prompt-len", "64", "--new-tokens", "4",
                   "--generations", "8", "--sampling", "sample", "--cache", "static"]) == 0
    out = capsys.readouterr().out
    expected = predict_generate(C.model_config_from_hf("llama-3.2-1b"),
                                GenerateSetup(prompt_length=64, new_tokens=4, generations=8, sampling="sample",
                                              cache="static"))
    assert f"KV cache at the end {expected.final_cache_bytes / 2**30:,.2f} GiB" in out and "fits a 80 GB" in out
    assert C.main(["--hf-config", "llama-3.2-1b", "--rl", "--lora-rank", "8", "--prompt-len", "32", "--new-tokens",
                   "16", "--chunk", "8", "--policy-micro-batches", "2", "--device-gb", "0"]) == 0
    out = capsys.readouterr().out
    step_bytes = predict_rl_step(C.model_config_from_hf("llama-3.2-1b"),
                                 RLSetup(prompt_length=32, new_tokens=16, lora_rank=8, reference="adapters", chunk=8,
                                         micro_batches=2))
    assert f"{step_bytes.total_bytes / 2**30:,.2f} GiB in all" in out and "reference adapters" in out
    for argv, message in ((["--hf-config", "qwen3-8b", "--generate"], "generation is replayed for"),
                          (["--hf-config", "llama-3.2-1b", "--rl", "--reference", "adapters"], "lora_rank > 0"),
                          (["--hf-config", "llama-3.2-1b", "--rl", "--generate"], "expected one of them")):
        with pytest.raises(SystemExit):
            C.main(argv)
        assert message in capsys.readouterr().err
