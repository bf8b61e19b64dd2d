"""utils.calculator.model_parallel: per-GPU bytes under tensor, sequence, pipeline and context parallelism with data
parallelism. Nothing here starts a process: notebook 13's check-mode run launches its four gloo ranks and asserts
these predictions against what they measure; the figures below are what those ranks measured (torch 2.13, CPU,
fp32, ``AdamW(foreach=False)``, notebook 13's check-mode sizes), and the one-process figures are measured here."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from utils import model_parallel as mp
from utils.calculator import ModelConfig, TrainingSetup, count_parameters, model_state_per_rank
from utils.calculator import model_parallel as calc
from utils.calculator.cli import _parser

CONFIG = mp.ModelParallelConfig(width=32, heads=4, ffn=128, layers=4, batch=2, seq=16, vocab=64, micro_batches=6,
                                cp_seq=32)
CPU_STEP = dict(precision="fp32", optimizer="adamw", optimizer_impl="for-loop", device="cpu")
STEP = TrainingSetup(micro_batch=CONFIG.batch, seq_len=CONFIG.seq, **CPU_STEP)
# notebook 13's ranks, check mode: every rank measured the same, except the pipeline's stages
MEASURED = {"tp state": 51240, "tp activations": 29312, "sp activations": 22784, "fsdp state": 198816,
            "tp stack state": 204960, "fsdp+tp state": 200864, "stage parameters": 49664, "keys and values": 4096,
            "gpipe peaks": [374784, 399360, 399360, 423936], "1f1b peaks": [249856, 199680, 133120, 70656]}


def block_model() -> calc.ParallelModel:
    return calc.ParallelModel.from_module(mp.make_block(CONFIG), mp.tensor_parallel_plan(), heads=CONFIG.heads)


def stack_model() -> calc.ParallelModel:
    return calc.ParallelModel.from_module(mp.make_stack(CONFIG), mp.tensor_parallel_plan(), heads=CONFIG.heads)


def state(stage: calc.StageBytes) -> int:
    return stage.terms["parameters"] + stage.terms["gradients"] + stage.terms["optimizer_state"]


def test_from_module_reads_the_plan():
    model = block_model()
    split = {t.name: t.tp_dim for t in model.tensors}
    assert split["attention.q.weight"] == 0 and split["attention.o.weight"] == 1 and split["mlp.up.weight"] == 0
    assert split["mlp.down.weight"] == 1 and split["attention_norm.weight"] is None
    assert (model.layers, model.width, model.ffn, model.vocab, model.embedded) == (1, 32, 128, 0, False)
    stack = stack_model()
    assert stack.layers == 4 and {t.place for t in stack.tensors} == {0, 1, 2, 3}


def test_equals_notebook_13s_ranks_to_the_byte():
    block, stack, layout = block_model(), stack_model(), calc.ParallelLayout
    for name, sp in (("tp", False), ("sp", True)):
        stage = calc.predict_parallel(block, STEP, layout(tp=4, sequence_parallel=sp)).stages[0]
        assert state(stage) == MEASURED["tp state"]
        assert stage.terms["activations"] + stage.terms["inputs"] == MEASURED[f"{name} activations"]
    for name, degrees in {"fsdp state": dict(dp=4, zero=3), "tp stack state": dict(tp=4),
                          "fsdp+tp state": dict(dp=2, tp=2, zero=3)}.items():
        assert state(calc.predict_parallel(stack, STEP, layout(**degrees)).stages[0]) == MEASURED[name]
    for schedule in calc.SCHEDULES:
        stages = calc.predict_parallel(stack, STEP, layout(pp=4, schedule=schedule, micro_batches=6)).stages
        assert [s.terms["activations"] + s.terms["loss"] for s in stages] == MEASURED[f"{schedule} peaks"]
        assert [s.terms["parameters"] for s in stages] == [MEASURED["stage parameters"]] * 4
    ring = calc.predict_parallel(block, TrainingSetup(micro_batch=2, seq_len=32, **CPU_STEP), layout(cp=4))
    assert ring.details["keys and values per layer"] == MEASURED["keys and values"]


def test_one_process_measured_here():
    """tp = 1: the block's activations (saved-tensor counter) and its model state after one AdamW step."""
    block = mp.make_block(CONFIG)
    counter = mp.SavedActivations(exclude=block)
    with counter.hooks():
        out = block(mp.make_input(CONFIG).requires_grad_())
    stage = calc.predict_parallel(block_model(), STEP, calc.ParallelLayout()).stages[0]
    assert counter.live == stage.terms["activations"] + stage.terms["inputs"]
    optimizer = torch.optim.AdamW(block.parameters(), foreach=False)
    out.square().mean().backward()
    optimizer.step()
    assert sum(mp.model_state_bytes(block, optimizer).values()) == state(stage)


@pytest.mark.parametrize("strategy, zero", [("ddp", 0), ("zero1", 1), ("zero2", 2), ("fsdp", 3)])
def test_data_parallel_part_equals_the_single_gpu_calculator(strategy, zero):
    model = ModelConfig(num_layers=2, d_model=48, num_heads=4, vocab_size=100, arch="llama", ffn_width=80)
    setup = dict(micro_batch=1, seq_len=16, **CPU_STEP)
    replayed = model_state_per_rank(model, TrainingSetup(strategy=strategy, ranks=3, **setup))
    terms = calc.predict_parallel(model, TrainingSetup(**setup), calc.ParallelLayout(dp=3, zero=zero)).terms()
    assert (terms["parameters"], terms["gradients"], terms["optimizer_state"]) == \
        (replayed["params"], replayed["grads"], replayed["optimizer"])


def test_splits_divide_the_model_state():
    model = calc.ParallelModel.from_hf("llama-2-70b")
    assert sum(math.prod(t.shape) for t in model.tensors) == 68_976_648_192        # the published count
    setup = TrainingSetup(seq_len=4096, precision="fp32", device="cpu", optimizer="sgd")
    rotary = 128 // 2 * 4                  # the rotary embedding's inv_freq buffer, on every stage (as the replay)
    one = calc.predict_parallel(model, setup, calc.ParallelLayout(pp=1))
    assert one.terms()["parameters"] == 4 * 68_976_648_192 + rotary
    tp8 = calc.predict_parallel(model, setup, calc.ParallelLayout(tp=8)).terms()["parameters"]
    norms = sum(math.prod(t.shape) for t in model.tensors if t.tp_dim is None)
    assert tp8 == 4 * ((68_976_648_192 - norms) // 8 + norms) + rotary
    halves = calc.predict_parallel(model, setup, calc.ParallelLayout(pp=2)).stages
    assert sum(s.terms["parameters"] for s in halves) == one.terms()["parameters"] + rotary
    assert halves[0].layers == tuple(range(40)) and halves[1].layers == tuple(range(40, 80))


def test_pipeline_in_flight_and_bubble():
    assert [calc.micro_batches_in_flight(s, 4, 6, "1f1b") for s in range(4)] == [4, 3, 2, 1]
    assert [calc.micro_batches_in_flight(s, 4, 6, "gpipe") for s in range(4)] == [6] * 4
    assert calc.bubble_fraction(4, 12) == 3 / 15
    assert calc.stage_layers(126, 8)[0] == tuple(range(15)) and len(calc.stage_layers(126, 8)[-1]) == 16
    with pytest.raises(ValueError, match="stage must be in 0..3"):
        calc.micro_batches_in_flight(4, 4, 6)


def test_big_models_and_the_smallest_layout():
    setup = TrainingSetup(seq_len=4096, checkpointing="every_block")
    card = 0.9 * 80e9
    best = calc.smallest_fitting_layout("llama-2-70b", setup, card)
    assert best.total <= card and best.layout.gpus >= 16 * 68_976_648_192 / card
    assert calc.predict_parallel("llama-2-70b", setup, calc.ParallelLayout(dp=64)).total > card   # DDP never fits
    one_f_one_b = calc.predict_parallel("llama-2-70b", setup, calc.ParallelLayout(tp=8, pp=4, micro_batches=8))
    gpipe = calc.predict_parallel("llama-2-70b", setup, calc.ParallelLayout(tp=8, pp=4, micro_batches=8,
                                                                          schedule="gpipe"))
    assert gpipe.stages[0].terms["activations"] > one_f_one_b.stages[0].terms["activations"]
    assert calc.ParallelLayout(dp=2, tp=8, pp=4, zero=1).label() == "dp2 (ZeRO-1) × tp8 × pp4"


@pytest.mark.parametrize("call, fragment", [
    (lambda: calc.layout_for_world(12, tp=8), "a world of 12 GPUs cannot be made of tp·pp·cp"),
    (lambda: calc.predict_parallel(block_model(), STEP, calc.ParallelLayout(tp=3)), "width = 32 is not divisible"),
    (lambda: calc.predict_parallel(stack_model(), STEP, calc.ParallelLayout(pp=8)), "8 pipeline stages for 4 layers"),
    (lambda: calc.predict_parallel(block_model(), TrainingSetup(seq_len=20, **CPU_STEP), calc.ParallelLayout(cp=4)),
     "divisible by 2·cp = 8"),
    (lambda: calc.ParallelLayout(pp=4, micro_batches=2), "2 micro-batches for 4 stages"),
    (lambda: calc.ParallelLayout(zero=4), "zero must be one of"),
    (lambda: calc.predict_parallel(block_model(), TrainingSetup(strategy="fsdp", ranks=2), calc.ParallelLayout()),
     "data parallelism is the layout's dp and zero"),
])
def test_bad_input_is_refused_before_any_work(call, fragment):
    with pytest.raises(ValueError, match="expected") as error:
        call()
    assert fragment in str(error.value)


def test_layout_for_world_takes_the_rest_as_data_parallel():
    assert calc.layout_for_world(64, tp=8, pp=4, zero=1).dp == 2


def test_command_line_entry_points():
    parser = _parser()
    args = parser.parse_args(["--hf-config", "llama-2-70b", "--tp", "8", "--pp", "4", "--dp", "2", "--zero", "1",
                              "--micro-batches", "16", "--checkpointing", "every_block"])
    assert calc.wants_model_parallel(args)
    text = calc.run(args)
    assert "dp2 (ZeRO-1) × tp8 × pp4 = 64 GPUs" in text and "busiest GPU: stage 0" in text and "fits" in text
    assert not calc.wants_model_parallel(parser.parse_args(["--preset", "7B"]))
    with pytest.raises(ValueError, match="expected no --strategy"):
        calc.run(parser.parse_args(["--preset", "7B", "--tp", "2", "--strategy", "fsdp", "--ranks", "2"]))
    assert isinstance(args, argparse.Namespace)


def test_model_config_designs_split_by_name():
    gpt = calc.ParallelModel.from_config(ModelConfig(num_layers=2, d_model=32, num_heads=4, vocab_size=64))
    split = {t.name: t.tp_dim for t in gpt.tensors}
    assert split["blocks.0.qkv.weight"] == 0 and split["blocks.0.qkv.bias"] == 0 and split["blocks.0.proj.weight"] == 1
    assert split["blocks.0.proj.bias"] is None and split["token_embedding.weight"] == 0 and split["head.weight"] == 0
    assert split["position_embedding.weight"] is None
    places = {t.name: t.place for t in gpt.tensors}
    assert places["token_embedding.weight"] == "first" and places["head.weight"] == "last"
    assert count_parameters(ModelConfig(num_layers=2, d_model=32, num_heads=4, vocab_size=64)) == \
        sum(math.prod(t.shape) for t in gpt.tensors)
