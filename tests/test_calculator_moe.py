"""The calculator on mixtures of experts (issue 40, notebook 14): Mixtral, Qwen3-MoE and OLMoE replayed to the byte
against the notebook's own measurement, the routing as an input, peft's LoRA on the experts, QLoRA leaving the
experts 16-bit, and expert parallelism (``--ep``) against notebook 14's ranks, launched once."""

import math
import re
from dataclasses import replace

import pytest

from utils import calculator as C
from utils.calculator import registry
from utils.calculator.expert_parallel import pair_matrix, predict_expert_parallel, routed_per_rank
from utils.calculator.hf_grid import tiny_config
from utils.calculator.parallel_layout import ParallelLayout
from utils.calculator.parallel_tensors import ParallelModel

PUBLISHED = {"mixtral-8x7b": 46_702_792_704, "qwen3-30b-a3b": 30_532_122_624, "olmoe-1b-7b": 6_919_161_856}
STEP = C.TrainingSetup(micro_batch=2, seq_len=16, precision="fp32", optimizer_impl="for-loop", device="cpu",
                       outputs="dropped")   # utils.moe.measure_hf_moe_step's: loss = model(...).loss, AdamW(foreach=False)


@pytest.mark.parametrize("name,count", sorted(PUBLISHED.items()))
def test_shipped_moe_configs_have_the_published_counts_and_name_their_source(name, count):
    model = C.model_config_from_hf(name)
    assert C.count_parameters(model) == count and model.is_hf
    assert "config.json" in C.load_hf_config(name, as_dict=True)["_source"]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_each_family_equals_the_notebooks_measured_step_whatever_the_routing():
    """utils.moe.measure_hf_moe_step (MemTracker, by category) against predict_hf given the routing it measured: the
    peak and the model state to the byte; the grouped experts' bytes follow T·k, not the tokens per expert, so two
    steps routed differently measure alike and a balanced routing predicts the same."""
    from utils import moe

    for family, overrides in (("mixtral", {}), ("qwen3_moe", {"norm_topk_prob": True}), ("olmoe", {})):
        step = moe.measure_hf_moe_step(family, batch=2, seq=16, **overrides)
        routing = tuple(tuple(counts) for counts in step.tokens_per_expert)
        predicted = C.predict_hf(step.config, STEP, routing=routing)
        assert predicted.total == step.peak_bytes, family
        assert predicted.largest["gradients"] == step.marks["step"]["Gradient"], family
        assert predicted.largest["parameters"] == step.marks["step"]["Parameter"] + step.marks["step"]["Buffer"]
        assert C.predict_hf(step.config, STEP, routing="balanced").total == predicted.total, family
    long = replace(STEP, seq_len=48)                      # activations set the peak: top-4 of 8, wider experts
    steps = [moe.measure_hf_moe_step("mixtral", batch=2, seq=48, seed=seed, num_experts_per_tok=4,
                                     intermediate_size=96) for seed in (0, 1)]
    assert steps[0].tokens_per_expert != steps[1].tokens_per_expert
    for step in steps:
        routing = tuple(tuple(counts) for counts in step.tokens_per_expert)
        predicted = C.predict_hf(step.config, long, routing=routing)
        assert predicted.total == step.peak_bytes and predicted.phase.startswith(("forward", "backward"))
    assert steps[0].peak_bytes == steps[1].peak_bytes


def test_routing_is_an_input_checked_against_the_model():
    model = C.model_config_from_hf(tiny_config("mixtral"))
    setup = replace(STEP, seq_len=8)                      # 2 x 8 tokens, k = 2: 32 pairs per layer, 8 experts
    one_expert = (32, 0, 0, 0, 0, 0, 0, 0)
    assert C.predict(model, replace(setup, routing=one_expert)).total == C.predict(model, setup).total
    assert C.predict(model, replace(setup, routing=(one_expert, (4,) * 8))).total == C.predict(model, setup).total
    for routing, message in [((4,) * 7, "7 counts for 8 experts"), ((5,) * 8, "sums to 40 pairs: expected"),
                             (((4,) * 8,) * 3, "3 layers of tokens per expert"), ("even", "routing must be None")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            C.predict(model, replace(setup, routing=routing))
    with pytest.raises(ValueError, match="has no experts: expected routing=None"):
        C.predict_hf("llama-3.2-1b", seq_len=64, routing="balanced")


def test_refusals_name_what_is_not_modelled():
    for model_type, field, value in (("mixtral", "router_jitter_noise", 0.1), ("olmoe", "clip_qkv", 8.0),
                                     ("qwen3_moe", "output_router_logits", True)):
        with pytest.raises(ValueError, match=f"{field}={value!r} is not modelled"):
            C.model_config_from_hf(tiny_config(model_type, **{field: value}))
    with pytest.raises(ValueError, match="experts_implementation 'eager' is not modelled"):
        C.model_config_from_hf(tiny_config("mixtral", experts_implementation="eager"))
    with pytest.raises(ValueError, match="model_type 'deepseek_v3' is not modelled"):
        C.model_config_from_hf({"model_type": "deepseek_v3", "hidden_size": 8})
    for targets, message in (("all", "adapts the router"), (("gate",), "LoRA on the router"),
                             (("gate_proj", "q_proj"), "without \\['up_proj'\\]"), (("w1", "w3"), "name no Linear")):
        with pytest.raises(ValueError, match=message):
            C.predict_hf("qwen3-30b-a3b", seq_len=64, lora_rank=8, lora_targets=targets)
    with pytest.raises(ValueError, match="refuses lora_dropout"):
        C.predict_hf("mixtral-8x7b", seq_len=64, lora_rank=8, lora_targets=("w1", "w3"), lora_dropout=0.1)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_parameters_follow_peft_on_the_experts():
    """Names, order, shapes and trainability equal transformers + peft 0.21 (meta device), LoRA on the experts
    included: peft turns gate_proj/up_proj (w1/w3) into one ParamWrapper on gate_up_proj with twice the rank."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from utils.calculator.validate_hf import hf_config_for

    for model_type, targets in (("mixtral", ["w1", "w3", "w2", "q_proj"]), ("qwen3_moe", ["gate_proj", "up_proj"]),
                                ("olmoe", ["down_proj", "o_proj"]), ("qwen3_moe", ["k_proj"])):
        fields = tiny_config(model_type, **({"mlp_only_layers": [1]} if targets == ["k_proj"] else {}))
        model = C.model_config_from_hf(fields)
        setup = C.TrainingSetup(lora_rank=4, lora_targets=tuple(targets))
        with torch.device("meta"):
            net = get_peft_model(AutoModelForCausalLM.from_config(hf_config_for(model, fields)),
                                 LoraConfig(r=4, target_modules=targets))
        real = [(name.removeprefix("base_model.model."), tuple(p.shape), p.requires_grad)
                for name, p in net.named_parameters()]
        ours = [(re.sub(r"experts\.(gate_up_proj|down_proj)\.lora", "experts.lora", n), s, t)
                for n, s, t in C.parameter_shapes(model, setup)]
        assert [s for _, s, _ in ours] == [s for _, s, _ in real], model_type
        assert [t for _, _, t in ours] == [t for _, _, t in real], model_type


def test_lora_on_the_experts_keeps_a_merged_copy_of_each_layers_experts():
    """peft's ParamWrapper folds W + B @ A into one baddbmm per forward and autograd keeps that copy for the input's
    gradient: on OLMoE the activations grow by about the experts' bf16 bytes, layer after layer."""
    model = C.model_config_from_hf("olmoe-1b-7b")
    setup = C.TrainingSetup(seq_len=256, precision="bf16", lora_rank=8, outputs="dropped")
    attention = C.predict(model, replace(setup, lora_targets=("q_proj", "v_proj")))
    experts = C.predict(model, replace(setup, lora_targets=("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")))
    stacks = model.num_layers * 3 * 64 * 1024 * 2048 * 2          # every layer's experts, bf16
    assert experts.largest["activations"] - attention.largest["activations"] >= stacks


def test_qlora_quantises_the_attention_and_leaves_the_experts_16_bit():
    model = C.model_config_from_hf("mixtral-8x7b")
    family = registry.family_of(model.arch)
    setup = C.TrainingSetup(seq_len=256, precision="bf16", lora_rank=8, lora_targets="attention", base_quant="nf4")
    weights = family.block_linear_weights(model, setup)
    assert weights and all("self_attn" in name for name in weights)
    prediction = C.predict(model, setup)
    experts = model.num_layers * 3 * 8 * 14336 * 4096
    assert prediction.largest["parameters"] > 2 * experts > 4 * C.count_parameters(model) // 10


def test_cli_takes_moe_configs_routing_and_ep(capsys):
    assert C.main(["--hf-config", "qwen3-30b-a3b", "--seq-len", "512", "--routing", "balanced",
                   "--device-gb", "0"]) == 0
    out = capsys.readouterr().out
    assert "128 experts, top-8, routing balanced" in out
    counts = ",".join(["30"] * 127 + [str(512 * 8 - 30 * 127)])          # the last expert the busiest
    assert C.main(["--hf-config", "qwen3-30b-a3b", "--seq-len", "512", "--tokens-per-expert", counts, "--dp", "8",
                   "--ep", "8", "--zero", "3", "--checkpointing", "every_block"]) == 0
    out = capsys.readouterr().out
    assert "dp8 (FSDP) × ep8" in out and "busiest GPU" in out
    for argv, message in ((["--hf-config", "llama-3.2-1b", "--dp", "4", "--ep", "4"], "has none: expected ep=1"),
                          (["--hf-config", "mixtral-8x7b", "--dp", "4", "--ep", "8"], "an ep that divides dp"),
                          (["--hf-config", "mixtral-8x7b", "--tokens-per-expert", "1,x"], "expected integers")):
        with pytest.raises(SystemExit):
            C.main(argv)
        assert message in capsys.readouterr().err


def test_expert_parallelism_follows_the_busiest_rank():
    """Balanced, each rank receives T·k rows per layer; routed to one expert, its rank receives every
    rank's pairs and its activations set the stage's; the experts are not gathered by FSDP (resident), the
    all-to-all's rows are held instead."""
    model = ParallelModel.from_hf("mixtral-8x7b")
    setup = C.TrainingSetup(seq_len=1024, checkpointing="every_block")
    layout = ParallelLayout(dp=8, ep=8, zero=3)
    balanced = C.predict_parallel(model, setup, layout)
    skewed = C.predict_parallel(model, replace(setup, routing=(2048, 0, 0, 0, 0, 0, 0, 0)), layout)
    assert balanced.details["received rows (busiest expert rank)"] == 1024 * 2
    assert skewed.details["received rows (busiest expert rank)"] == 8 * 2048
    assert skewed.terms()["activations"] > balanced.terms()["activations"]
    fsdp = C.predict_parallel(model, setup, ParallelLayout(dp=8, zero=3))
    assert fsdp.terms()["parameters"] == balanced.terms()["parameters"]
    assert fsdp.terms()["comm_buffers"] > balanced.terms()["comm_buffers"]
    with pytest.raises(ValueError, match="8 experts per layer cannot be split over ep = 16"):
        C.predict_parallel(model, setup, ParallelLayout(dp=16, ep=16, zero=3))
    per_rank = routed_per_rank(model, 10, 4, None)
    assert sum(map(sum, pair_matrix(model, per_rank, 4))) == 4 * 10 * 2


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_expert_parallel_prediction_equals_notebook_14s_ranks(tmp_path):
    """One launch of notebook 14's ranks (4 gloo ranks, FSDP2 for the rest, dimensions FSDP2 must pad, k = 3, an
    uneven routing): every rank's model state by part, what its forward kept for backward, and every all-to-all
    call's bytes to and from each rank equal predict_expert_parallel's, to the byte."""
    import torch

    from utils import expert_parallel_ranks as script, moe

    config = moe.ExpertParallelConfig(world_size=4, width=18, ffn=20, num_experts=8, top_k=3, tokens_per_rank=21,
                                      clusters=3, seed=1)
    ranks = moe.launch_expert_parallel(config, tmp_path / "ep").ranks
    model = ParallelModel.from_module(script.TinyMoEModel(config), {}, heads=1, experts=("gate_up", "down"),
                                      top_k=config.top_k)
    setup = C.TrainingSetup(micro_batch=1, seq_len=config.tokens_per_rank, precision="fp32", device="cpu",
                            optimizer_impl="for-loop")
    routing = [tuple(torch.bincount(torch.tensor(r["routing"]).flatten(), minlength=config.num_experts).tolist())
               for r in ranks]
    predicted = predict_expert_parallel(model, setup, ParallelLayout(dp=4, ep=4, zero=3), routing=routing)
    assert len({p.activations for p in predicted}) > 1                      # the routing is uneven
    assert len({p.state["rest"]["optimizer"] for p in predicted}) > 1      # FSDP2's last piece is shorter
    for measured, prediction in zip(ranks, predicted):
        assert measured["state_bytes"] == prediction.state
        assert measured["activation_bytes"] == prediction.activations
        calls = [{key: call[key] for key in ("phase", "dtype", "sent", "received")} for call in measured["all_to_all"]]
        assert calls == prediction.all_to_all
        assert list(prediction.experts) == measured["experts_held"]
    assert math.isclose(sum(p.received_rows for p in predicted), 4 * 21 * 3)
