"""The calculator on the reader's own model: transformers configs, peft's LoRA, measured against the real thing."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from utils import calculator as C

ROOT = Path(__file__).resolve().parents[1]

PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320,
             "llama-2-70b": 68_976_648_192, "mistral-7b": 7_241_732_096, "qwen2.5-7b": 7_615_616_512,
             "gpt2": 124_439_808, "qwen3-8b": 8_190_735_360, "phi-3-mini-4k": 3_821_079_552,
             "gemma-2-9b": 9_241_705_984, "gemma-3-4b-text": 3_880_263_168}


@pytest.mark.parametrize("name,count", sorted(PUBLISHED.items()))
def test_shipped_configs_have_the_published_parameter_counts_and_name_their_source(name, count):
    assert C.count_parameters(C.model_config_from_hf(name)) == count
    fields = C.load_hf_config(name, as_dict=True)
    assert "config.json" in fields["_source"] and "/" in fields["_source"], f"{name}: the shipped config names its source"


def test_presets_are_the_shipped_configs():
    for key, (config, _) in C.presets.PRESET_CONFIGS.items():
        hf = C.model_config_from_hf(config)
        assert C.count_parameters(C.PRESETS[key]) == C.count_parameters(hf) == PUBLISHED[config]


def test_a_config_reads_the_same_from_a_path_a_dict_and_a_pretrained_config(tmp_path):
    fields = C.load_hf_config("llama-3.2-1b", as_dict=True)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    setup = C.TrainingSetup(seq_len=256)
    from_path = C.predict_hf(path, setup)
    assert C.predict_hf(fields, setup).total == from_path.total
    assert C.predict_hf(C.load_hf_config("llama-3.2-1b"), setup).total == from_path.total   # a PretrainedConfig
    assert C.predict_hf("llama-3.2-1b", setup, seq_len=512).total > from_path.total          # overrides apply


def test_predict_hf_reads_a_lora_config():
    from peft import LoraConfig

    setup = C.TrainingSetup(seq_len=256)
    lora = C.predict_hf("llama-2-7b", setup, lora=LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    full = C.predict_hf("llama-2-7b", setup)
    assert lora.setup.lora_targets == ("q_proj", "v_proj") and lora.setup.lora_rank == 8
    assert lora.trainable_parameters == 32 * 2 * 8 * (4096 + 4096)    # A (8 x 4096) and B (4096 x 8), q and v
    assert lora.total < full.total
    everything = C.predict_hf("llama-2-7b", setup, lora=LoraConfig(r=8, target_modules="all-linear"))
    assert everything.setup.lora_targets == "all"


def test_bad_input_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="model_type 'bert' is not modelled: expected one of"):
        C.predict_hf({"model_type": "bert", "hidden_size": 8})
    fields = C.load_hf_config("llama-2-7b", as_dict=True)
    del fields["intermediate_size"]
    with pytest.raises(ValueError, match=r"lacks \['intermediate_size'\]"):
        C.predict_hf(fields)
    with pytest.raises(ValueError, match=r"LoRA target\(s\) \['qproj'\] name no Linear layer"):
        C.predict_hf("llama-2-7b", lora_rank=8, lora_targets=("qproj",))
    with pytest.raises(ValueError, match="no config 'llama-9b': expected one of"):
        C.load_hf_config("llama-9b")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a transformers config.json"):
        C.predict_hf(tmp_path / "bad.json")
    with pytest.raises(TypeError, match="config must be a transformers PretrainedConfig"):
        C.predict_hf(42)
    with pytest.raises(ValueError, match="chunked loss is modelled for the course's designs"):
        C.predict_hf("llama-2-7b", chunked_loss=128)
    with pytest.raises(ValueError, match="padded: modelled for transformers' designs"):
        C.predict(C.PRESETS["7B"], C.TrainingSetup(padded=True))
    with pytest.raises(ValueError, match="outputs 'kept': modelled for transformers' designs"):
        C.predict(C.PRESETS["7B"], C.TrainingSetup(outputs="kept"))
    gpt2 = C.load_hf_config("gpt2", as_dict=True)
    with pytest.raises(ValueError, match="GPT-2 activation_function 'relu' is not modelled"):
        C.predict_hf({**gpt2, "activation_function": "relu"})
    with pytest.raises(ValueError, match=r"reorder_and_upcast_attn=True is not modelled"):
        C.predict_hf({**gpt2, "reorder_and_upcast_attn": True})
    with pytest.raises(ValueError, match="Gemma 2 with eager attention only"):
        C.model_config_from_hf("gemma-2-9b", attention="sdpa")
    with pytest.raises(ValueError, match="peft has no default target_modules for Phi-3"):
        C.predict_hf("phi-3-mini-4k", lora=__import__("peft").LoraConfig(r=8))
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not modelled"):
        C.predict_hf({**C.load_hf_config("llama-3.2-1b", as_dict=True), "rope_scaling": {"rope_type": "dynamic",
                                                                                         "factor": 2.0}})
    with pytest.raises(ValueError, match="outputs must be one of"):
        C.predict_hf("llama-2-7b", outputs="kept-forever")
    with pytest.raises(ValueError, match="reentrant=True is use_reentrant=True of torch.utils.checkpoint"):
        C.predict_hf("llama-2-7b", reentrant=True)
    with pytest.raises(ValueError, match=r"LoRA target\(s\) \['q_proj'\] name no Conv1D layer of a GPT-2 block"):
        C.predict_hf("gpt2", lora_rank=8, lora_targets=("q_proj",))


@pytest.mark.filterwarnings("ignore::UserWarning")   # peft: Conv1D's fan_in_fan_out is set to True
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")   # peft calls it
def test_parameters_follow_the_real_models_of_every_family():
    """Names, order, shapes and trainability of every parameter equal those of transformers + peft (on the meta
    device), for a tiny model of each family and each shipped config."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from utils.calculator.validate_hf import _tiny, _tiny_gpt2, hf_config_for, tiny_config

    cases = [(_tiny(qkv_bias=True, tied_embeddings=True), None, ["o_proj", "up_proj"]),
             (_tiny_gpt2(), None, ["c_attn", "c_proj"]), (_tiny_gpt2(tied_embeddings=False), None, ["c_attn"])]
    cases += [(None, tiny_config(t), targets) for t, targets in (("qwen3", ["q_proj", "down_proj"]),
                                                                 ("phi3", ["qkv_proj", "gate_up_proj"]),
                                                                 ("gemma2", ["k_proj", "o_proj"]),
                                                                 ("gemma3_text", ["v_proj", "up_proj"]))]
    cases += [(None, C.load_hf_config(name, as_dict=True), None) for name in C.SHIPPED_CONFIGS]
    for model, fields, targets in cases:
        model = model or C.model_config_from_hf(fields)
        setup = C.TrainingSetup(lora_rank=4 if targets else 0, lora_targets=tuple(targets) if targets else "all")
        with torch.device("meta"):
            net = AutoModelForCausalLM.from_config(hf_config_for(model, fields), attn_implementation=model.attention)
            if targets:
                net = get_peft_model(net, LoraConfig(r=4, target_modules=targets))
        real = [(name.removeprefix("base_model.model."), tuple(p.shape), p.requires_grad)
                for name, p in net.named_parameters()]
        assert C.parameter_shapes(model, setup) == real, model.name
        buffers = sum(b.numel() * 4 for b in net.buffers())        # inv_freq (per kind of layer), Gemma's scale
        assert C.predict(model, C.TrainingSetup(seq_len=16, precision="fp32")).largest["parameters"] == \
            4 * C.count_parameters(model) + buffers, model.name


def test_gpt2_reads_its_dropouts_activation_and_peft_default():
    from peft import LoraConfig

    gpt2 = C.model_config_from_hf("gpt2")
    assert gpt2.dropout == (0.1, 0.1, 0.1) and gpt2.activation == "gelu_new" and gpt2.tied_embeddings
    setup = C.TrainingSetup(seq_len=256, micro_batch=2)
    lora = C.predict_hf("gpt2", setup, lora=LoraConfig(r=8))
    assert lora.setup.lora_targets == ("c_attn",)                        # peft's default for GPT-2
    assert lora.trainable_parameters == 12 * 8 * (768 + 3 * 768)         # A (8 x 768), B (2304 x 8) per block
    no_dropout = C.load_hf_config("gpt2", as_dict=True) | {"embd_pdrop": 0.0, "attn_pdrop": 0.0, "resid_pdrop": 0.0}
    cpu = replace(setup, device="cpu")          # noise tensors; on the CPU sdpa's math kernel with attention dropout
    assert C.predict_hf(no_dropout, cpu).largest["activations"] < C.predict_hf("gpt2", cpu).largest["activations"]


def test_the_replay_equals_transformers_measured_by_memtracker_to_the_byte():
    """The check subset of the transformers grid: real models of every family, one step each, two independent
    trackers (MemTracker runs on the first rows only: the storage counter agrees with it to the byte)."""
    from utils.calculator.validate_hf import validate_hf

    rows = validate_hf(check=True, memtracker_rows=3)
    assert len(rows) >= 8
    for row in rows:
        assert row.trackers_agree, f"{row.label}: MemTracker and the storage counter disagree"
        assert row.predicted_peak_bytes == row.measured.peak_bytes, f"{row.label}: the prediction is off"
    assert any(row.measured.memtracker_peak_bytes is not None for row in rows)
    assert {row.model.arch for row in rows} == set(C.HF_ARCHS)


def test_hf_grid_covers_what_the_issue_asks():
    from utils.calculator.validate_hf import hf_validation_grid

    grid = [(label, C.model_config_from_hf(m) if isinstance(m, dict) else m, s) for label, m, s in hf_validation_grid()]
    assert len(grid) >= 60
    models = [m for _, m, _ in grid]
    setups = [s for _, _, s in grid]
    assert {m.attention for m in models} == {"sdpa", "eager"} and {m.arch for m in models} == set(C.HF_ARCHS)
    assert any(m.kv_heads < m.num_heads for m in models) and any(m.tied_embeddings for m in models)
    assert {s.precision for s in setups} == set(C.PRECISIONS)
    assert any(s.lora_rank and s.checkpointing != "none" for s in setups)
    assert any(s.lora_rank and s.checkpointing == "none" for s in setups)
    assert {s.loss for s in setups} == set(C.LOSSES) and {s.outputs for s in setups} >= {None, *C.OUTPUTS} - {"kept"}
    assert any(s.padded for s in setups) and len({s.optimizer for s in setups}) >= 2
    assert any(s.reentrant and s.lora_rank for s in setups) and any(s.reentrant and s.accumulation_steps > 1
                                                                    for s in setups)
    for arch in C.HF_ARCHS:                              # every family with dropout, checkpointing, each precision
        mine = [(m, s) for _, m, s in grid if m.arch == arch]
        assert any(any(m.dropout) for m, _ in mine) or arch == "hf-gemma2", arch
        assert any(s.checkpointing != "none" for _, s in mine) and any(s.lora_rank for _, s in mine), arch
        assert len({s.precision for _, s in mine}) == 3, arch
    assert any(m.layer_types and len(set(m.layer_types)) == 2 for m in models if m.arch == "hf-llama")
    assert any(m.setting("attn_logit_softcapping") for m in models) and any(m.setting("final_logit_softcapping")
                                                                            for m in models)


def test_command_line_reads_a_config_file(capsys):
    assert C.main(["--hf-config", str(ROOT / "utils/calculator/configs/llama-2-7b.json"), "--device-gb", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama-2-7b: 6.738 B parameters") and "loss model(labels=)" in out
    with pytest.raises(SystemExit):
        C.main(["--hf-config", "llama-2-7b", "--layers", "2"])


def test_readme_shows_what_the_hf_config_command_prints(capsys):
    text = (ROOT / "README.md").read_text()
    command = "$ python -m utils.calculator --hf-config utils/calculator/configs/llama-2-7b.json\n"
    assert command in text, "README.md shows the calculator reading a config file"
    shown = text.split(command, 1)[1].split("```", 1)[0]
    C.main(["--hf-config", "utils/calculator/configs/llama-2-7b.json"])
    assert capsys.readouterr().out == shown, "README.md's --hf-config example is stale: paste the command's output"


# that importing utils.calculator and predicting from a shipped config import neither transformers nor peft is
# asserted by tests/test_env.py's test_import_has_no_side_effects, in the same fresh Python as its own check


def test_the_loop_that_keeps_its_outputs_costs_a_logits_tensor_more():
    """The default loop keeps the output object (logits, and the cache without checkpointing) until the next forward
    replaces it; the Trainer drops it before backward; a step function drops it when it returns."""
    setup = C.TrainingSetup(seq_len=512, precision="bf16-autocast", checkpointing="every_block")
    kept, in_step, dropped = (C.predict_hf("gemma-2-9b", setup, outputs=o) for o in ("kept", "kept-in-step", "dropped"))
    logits = 512 * 256_000 * 2                           # bf16 logits under autocast
    assert kept.total > dropped.total and kept.total - dropped.total >= logits
    assert dropped.total <= in_step.total <= kept.total
    assert C.predict_hf("gemma-2-9b", setup).total == kept.total
    assert C.predict_hf("gemma-2-9b", setup, loss="shifted-sum").setup.outputs is None   # notebook 17's: inline


def test_the_cache_and_the_mask_are_counted():
    """transformers keeps a copy of the keys and values (use_cache in training) and, padded, a mask per layer."""
    setup = C.TrainingSetup(seq_len=512, precision="bf16-autocast")
    model = C.model_config_from_hf("llama-3.2-1b")
    cached = C.predict(model, setup).largest["activations"]
    assert C.predict(replace(model, use_cache=False), setup).largest["activations"] < cached
    assert C.predict(model, replace(setup, padded=True)).largest["activations"] > cached
