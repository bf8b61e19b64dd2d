"""Notebook 15's GRPO recipe, taken from the notebook's `recipe` cells, on the reader's models.

Recipes: ``completion_logprobs`` (one forward, no cache, ``logits_to_keep``, optionally in chunks),
``group_advantages``, ``completion_mask``, ``grpo_loss``, ``sample_answers``, ``reference_logprobs`` (a frozen copy,
or a peft policy's base with its adapters disabled) and ``grpo_step``. Models: the transformers families of
``recipe_models`` (a Llama; a Qwen2 with q/k/v biases and a tied head; GPT-2 with Conv1D layers, dropout and an
end-of-sequence token inside its vocabulary; a bf16 Mistral with a sliding window shorter than the sequences), each
with peft's LoRA too. Cases: the log-probabilities against the plain whole-sequence forward, the gradient against
GRPO's formula written answer by answer with an end-of-sequence token planted mid-answer, chunks that do and do not
divide the answer, micro-batches, one whole step that trains, dropout off while scoring, and the refusals (one answer
per prompt; no reference for a policy that is not a peft model).
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests.recipe_models import CAUSAL_LM_FAMILIES, run_recipe

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),      # deprecations inside transformers and peft
              pytest.mark.filterwarnings("ignore:fan_in_fan_out:UserWarning")]   # peft's note on GPT-2's Conv1D
PROMPT, ANSWER, ROWS = 5, 6, 4
FAMILIES = list(CAUSAL_LM_FAMILIES)


@pytest.fixture(scope="module")
def recipe() -> dict:
    return run_recipe("15")


def _model(family: str, seed: int = 0):
    model = CAUSAL_LM_FAMILIES[family](seed=seed)
    model.generation_config.pad_token_id = 0
    return model


def _tolerance(model) -> float:
    return 1e-5 if next(model.parameters()).dtype == torch.float32 else 2e-2


def _sequences(model, seed: int = 1) -> torch.Tensor:
    """Prompt + answer token ids; the first answer ends early with the model's end-of-sequence token, if it has one."""
    vocab = model.get_output_embeddings().weight.shape[0]
    sequences = torch.randint(3, vocab - 1, (ROWS, PROMPT + ANSWER), generator=torch.Generator().manual_seed(seed))
    eos = model.generation_config.eos_token_id
    if eos is not None:
        sequences[0, PROMPT + 2] = eos if isinstance(eos, int) else eos[0]
        sequences[0, PROMPT + 3:] = model.generation_config.pad_token_id
    return sequences


def _plain_logprobs(model, sequences):
    logits = model(input_ids=sequences, use_cache=False).logits[:, PROMPT - 1:-1].float()       # every position's
    return logits.log_softmax(-1).gather(-1, sequences[:, PROMPT:].unsqueeze(-1)).squeeze(-1)


def _flat_gradient(model) -> torch.Tensor:
    gradient = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return gradient


@pytest.mark.parametrize("family", FAMILIES)
def test_log_probabilities_are_the_whole_forwards(recipe, family):
    model = _model(family).eval()
    sequences = _sequences(model)
    with torch.no_grad():
        plain = _plain_logprobs(model, sequences)
        for chunk in (None, 1, 4, ANSWER + 3):                   # whole, every position, not dividing N, longer than N
            ours = recipe["completion_logprobs"](model, sequences, PROMPT, chunk)
            assert ours.dtype == torch.float32 and ours.shape == (ROWS, ANSWER)
            torch.testing.assert_close(ours, plain, rtol=_tolerance(model), atol=_tolerance(model))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gradient_is_grpos_formula(recipe, family):
    """The recipe's loss (with chunks, with micro-batches) against the formula written answer by answer: the mean over
    each answer's tokens up to its end-of-sequence token, then over the answers."""
    policy = _model(family).eval()
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01 * torch.randn_like(p))                  # a reference apart from the policy: the KL matters
    sequences, beta = _sequences(policy), 0.1
    completions = sequences[:, PROMPT:]
    advantages = recipe["group_advantages"](torch.tensor([1.0, 0.0, 0.25, 0.75]), 2)
    mask = recipe["completion_mask"](completions, policy.generation_config.eos_token_id)
    frozen = recipe["reference_logprobs"](policy, reference, sequences, PROMPT)
    for row in range(ROWS):
        logp = _plain_logprobs(policy, sequences[row:row + 1])[0][mask[row].bool()]
        delta = frozen[row][mask[row].bool()] - logp
        (-(advantages[row] * logp - beta * (delta.exp() - delta - 1)).mean() / ROWS).backward()
    formula = _flat_gradient(policy)
    for chunk, pieces in ((None, 1), (4, 1), (None, 3), (3, 2)):
        size = -(-ROWS // pieces)
        for start in range(0, ROWS, size):
            part = slice(start, start + size)
            recipe["grpo_loss"](recipe["completion_logprobs"](policy, sequences[part], PROMPT, chunk), frozen[part],
                                advantages[part], mask[part], beta, ROWS).backward()
        distance = ((_flat_gradient(policy) - formula).norm() / formula.norm()).item()
        assert distance < 10 * _tolerance(policy), f"{family}, chunk={chunk}, {pieces} micro-batches: {distance:.1e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_step_trains_with_dropout_off(recipe, family):
    policy = _model(family).train()                             # GPT-2's dropout is on until the step turns it off
    reference = copy.deepcopy(policy).requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in policy.parameters()]
    prompts = torch.randint(3, 100, (2, PROMPT), generator=torch.Generator().manual_seed(2))
    rewards = recipe["grpo_step"](policy, reference, optimizer, prompts, lambda p, c: (c % 2 == 0).float().mean(1),
                                  group_size=3, new_tokens=ANSWER, chunk=4, micro_batches=2)
    assert rewards.shape == (6,)
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters())), "the step changed nothing"
    assert all(p.grad is None for p in policy.parameters()), "the step leaves no gradients"
    assert not policy.training and not reference.training, "dropout must be off while sampling and scoring"
    sequences = _sequences(policy)
    with torch.no_grad():                                       # scoring is deterministic: no dropout
        assert torch.equal(recipe["completion_logprobs"](policy, sequences, PROMPT),
                           recipe["completion_logprobs"](policy, sequences, PROMPT))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_lora_base_is_the_reference(recipe, family):
    from peft import LoraConfig, get_peft_model
    base = _model(family).eval()
    copy_of_base = copy.deepcopy(base).requires_grad_(False)
    policy = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules="all-linear"))
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    prompts = torch.randint(3, 100, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    recipe["grpo_step"](policy, None, optimizer, prompts, lambda p, c: (c % 2 == 0).float().mean(1), group_size=2,
                        new_tokens=ANSWER)                      # the adapters move
    sequences = _sequences(base)
    disabled = recipe["reference_logprobs"](policy, None, sequences, PROMPT)
    assert torch.equal(disabled, recipe["reference_logprobs"](policy, copy_of_base, sequences, PROMPT))
    with torch.no_grad():
        assert not torch.equal(disabled, recipe["completion_logprobs"](policy, sequences, PROMPT)), \
            "the adapters should have moved the policy away from its base"


def test_the_recipe_refuses_what_it_cannot_do(recipe):
    policy = _model("llama")
    prompts = torch.randint(3, 100, (2, PROMPT))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="at least 2"):
        recipe["grpo_step"](policy, None, optimizer, prompts, lambda p, c: c.float().mean(1), group_size=1,
                            new_tokens=2, beta=0.0)
    with pytest.raises(ValueError, match="peft"):
        recipe["grpo_step"](policy, None, optimizer, prompts, lambda p, c: c.float().mean(1), group_size=2,
                            new_tokens=2)
