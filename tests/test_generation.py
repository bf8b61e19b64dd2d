"""utils.generation: the cache's bytes, generate measured phase by phase, a step measured by phase, and the GRPO step
(the copy of notebook 15's recipe that the calculator validates against, held equal to the notebook's cells here)."""
from __future__ import annotations

import ast
import copy
import warnings

import pytest
import torch

import utils
from tests.recipe_models import recipe_cells
from utils import generation

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")   # deprecations inside transformers and peft


def _config(**changes):
    from transformers import LlamaConfig
    settings = dict(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=None,
                    eos_token_id=None, pad_token_id=0)
    return LlamaConfig(**{**settings, **changes})


def _model(config=None, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config or _config()).to(dtype).eval()


def _kv(config, rows, tokens, itemsize=4):
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * rows * config.num_key_value_heads * tokens * head_dim * itemsize


def _prompts(rows, length, vocab=96, seed=0):
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


# --- cache_bytes and measure_generate --------------------------------------------------------------------------------

def test_cache_bytes_reads_a_forward_cache():
    model, ids = _model(), _prompts(3, 7)
    with torch.no_grad():
        cache = model(input_ids=ids).cache
    held = generation.cache_bytes(cache)
    assert held.key_value_bytes == _kv(model.config, 3, 7) and held.other_bytes == 0 and held.layers == 2
    assert held.total_bytes == held.key_value_bytes


@pytest.mark.parametrize("bad", [None, (torch.zeros(2), torch.zeros(2)), torch.zeros(3)])
def test_cache_bytes_refuses_what_is_not_a_cache(bad):
    with pytest.raises(TypeError, match="transformers Cache"):
        generation.cache_bytes(bad)


def test_measure_generate_splits_the_phases_and_reads_the_cache_each_step():
    model, ids = _model(), _prompts(2, 5)
    output, memory = generation.measure_generate(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                                 do_sample=False, return_dict_in_generate=True)
    assert list(memory.phase_peak_bytes) == ["set-up", "prefill", "decode 1", "decode 2", "decode 3"]
    assert list(memory.cache_bytes) == [_kv(model.config, 2, 5 + step) for step in range(4)]
    assert memory.decode_steps == 3 and memory.final_cache_bytes == _kv(model.config, 2, 8)
    assert memory.prefill_logits_bytes == 4 * 2 * 96                          # logits_to_keep=1 by default
    assert memory.end_bytes == memory.final_cache_bytes + output.sequences.nbytes
    assert memory.sequences_shape == (2, 9) and memory.baseline_bytes == utils.tensor_bytes([model, ids])
    assert memory.peak_bytes == max(memory.phase_peak_bytes.values())
    assert memory.as_measurement().timeline == memory.timeline


def test_measure_generate_sees_logits_to_keep_static_caches_and_no_cache():
    model, ids = _model(), _prompts(2, 5)
    common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, disable_compile=True)
    _, every = generation.measure_generate(model, ids, logits_to_keep=0, **common)
    assert every.prefill_logits_bytes == 4 * 2 * 5 * 96
    _, static = generation.measure_generate(model, ids, cache_implementation="static", **common)
    assert set(static.cache_bytes) == {_kv(model.config, 2, 7)} and static.cache_other_bytes == 8 * 2
    output, none = generation.measure_generate(model, ids, use_cache=False, **common)
    assert set(none.cache_bytes) == {0} and none.end_bytes == output.nbytes


def test_measure_generate_measures_a_peft_model_through_its_base():
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(_model(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    ids = _prompts(2, 4)
    _, memory = generation.measure_generate(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                            do_sample=False)
    assert len(memory.cache_bytes) == 3 and memory.final_cache_bytes == _kv(model.config, 2, 6)


@pytest.mark.parametrize("model, ids, message", [
    (torch.nn.Linear(2, 2), torch.zeros(1, 2, dtype=torch.long), "generate method"),
    (None, torch.zeros(1, 2), "integer tensor"),
    (None, torch.zeros(4, dtype=torch.long), "integer tensor"),
])
def test_measure_generate_refuses_bad_input(model, ids, message):
    with pytest.raises(TypeError, match=message):
        generation.measure_generate(model if model is not None else _model(), ids, max_new_tokens=2)


# --- measure_phases ---------------------------------------------------------------------------------------------

def test_measure_phases_labels_each_phase():
    kept = torch.zeros(4)

    def step(phase):
        phase("make")
        a = torch.ones(256)
        phase("grow")
        b = torch.ones(512)
        del a
        phase("drop")
        del b
        return "done"

    result, memory = generation.measure_phases(step, include=kept, device="cpu")
    assert result == "done" and memory.baseline_bytes == 16
    assert memory.phase_end_bytes == {"start": 0, "make": 1024, "grow": 2048, "drop": 0}
    assert memory.phase_peak_bytes["grow"] == 3072 and memory.peak_bytes == 3072
    assert memory.as_measurement().peak_bytes == 3072


def test_measure_phases_refuses_a_non_callable():
    with pytest.raises(TypeError, match="callable"):
        generation.measure_phases(3, include=None, device="cpu")


# --- the GRPO step: the same code as the notebook's recipe, and what it measures -----------------------------------

RECIPE_FUNCTIONS = ("completion_logprobs", "group_advantages", "completion_mask", "grpo_loss", "sample_answers",
                    "reference_logprobs", "grpo_step")


def _bare(function: ast.FunctionDef) -> str:
    """A function's code without its docstring, annotations and comments (comments are not in the tree)."""
    function = copy.deepcopy(function)
    if function.body and isinstance(function.body[0], ast.Expr) and isinstance(function.body[0].value, ast.Constant):
        function.body = function.body[1:]
    function.returns = None
    for argument in (*function.args.args, *function.args.kwonlyargs):
        argument.annotation = None
    return ast.dump(function, include_attributes=False)


def test_utils_grpo_step_is_the_notebooks_recipe():
    notebook = {node.name: _bare(node) for cell in recipe_cells("15") for node in ast.parse(cell).body
                if isinstance(node, ast.FunctionDef)}
    source = ast.parse(open(generation.__file__).read())
    ours = {node.name: _bare(node) for node in source.body if isinstance(node, ast.FunctionDef)}
    for name in RECIPE_FUNCTIONS:
        assert name in notebook, f"the notebook's recipe cells define no {name}"
        assert ours[name] == notebook[name], f"utils.generation.{name} differs from the notebook's recipe cell"


def test_group_advantages_and_completion_mask():
    advantages = generation.group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 2)
    assert torch.allclose(advantages[:2], torch.tensor([0.5, -0.5]) / (0.5**0.5 + 1e-4))   # unbiased std of {1, 0}
    assert torch.equal(advantages[2:], torch.zeros(2))                         # equal rewards: no advantage, no NaN
    with pytest.raises(ValueError, match="at least 2"):
        generation.group_advantages(torch.ones(3), 1)
    answers = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [9, 9, 9, 3]])
    expected = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    assert torch.equal(generation.completion_mask(answers, 2), expected)
    assert torch.equal(generation.completion_mask(answers, [2, 3])[2], torch.ones(4))
    assert torch.equal(generation.completion_mask(answers, None), torch.ones(3, 4))


def test_measure_grpo_step_phases_leave_what_the_notebook_predicts():
    batch, prompt_length, new_tokens, group = 2, 5, 4, 3
    memory = generation.measure_grpo_step(_config(), batch=batch, prompt_length=prompt_length, new_tokens=new_tokens,
                                          group_size=group)
    rows = batch * group
    assert [p for p in memory.phase_peak_bytes if p != "start"] == list(generation.RL_PHASES)
    ends = memory.phase_end_bytes
    assert ends["generate"] == 8 * rows * (prompt_length + new_tokens)
    assert ends["score"] == ends["generate"] + 4 * rows * (2 + new_tokens)
    assert ends["reference"] == ends["score"] + 4 * rows * new_tokens
    parameters = utils.tensor_bytes(list(_model().parameters()))
    assert ends["policy backward"] == ends["reference"] + parameters + 4
    assert ends["optimizer step"] == memory.end_bytes == 4 * rows
    # the baseline: policy and reference copy (parameters and rotary buffers), AdamW's two moments and a 4-byte step
    # counter per parameter tensor, the prompts
    counters = 4 * len(list(_model().parameters()))
    prompts = 8 * batch * prompt_length
    assert memory.baseline_bytes == 2 * utils.tensor_bytes(_model()) + 2 * parameters + counters + prompts


def test_measure_grpo_step_levers_move_the_bytes_they_should():
    shape = dict(batch=2, prompt_length=5, new_tokens=4, group_size=2)
    copy_reference = generation.measure_grpo_step(_config(), lora_rank=2, **shape)
    adapters = generation.measure_grpo_step(_config(), lora_rank=2, reference="adapters", **shape)
    whole = {label: m.baseline_bytes + m.peak_bytes for label, m in (("copy", copy_reference), ("adapters", adapters))}
    assert whole["copy"] - whole["adapters"] == utils.tensor_bytes(_model())
    half = generation.measure_grpo_step(_config(), reference_dtype=torch.bfloat16, **shape)
    full = generation.measure_grpo_step(_config(), **shape)
    assert 2 * (full.baseline_bytes - half.baseline_bytes) == utils.tensor_bytes(_model())   # weights and buffers
    none = generation.measure_grpo_step(_config(), beta=0.0, reference="none", **shape)
    # beta = 0: no reference forward, so the phase allocates nothing (and leaves no sample of its own)
    assert none.phase_end_bytes.get("reference", none.phase_end_bytes["score"]) == none.phase_end_bytes["score"]


@pytest.mark.parametrize("changes, message", [
    ({"group_size": 1}, "group_size"),
    ({"batch": 0}, "batch"),
    ({"reference": "twin"}, "reference must be one of"),
    ({"reference": "adapters"}, "lora_rank"),
    ({"reference": "none"}, "needs a reference"),
    ({"chunk": 0}, "chunk"),
    ({"warmup_steps": -1}, "warmup_steps"),
])
def test_measure_grpo_step_refuses_bad_arguments(changes, message):
    arguments = {"batch": 1, "prompt_length": 3, "new_tokens": 2, "group_size": 2, **changes}
    with pytest.raises(ValueError, match=message):
        generation.measure_grpo_step(_config(), **arguments)
