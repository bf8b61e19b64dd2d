"""Notebook 11's recipes (the cells tagged ``recipe``: the attention functions, and packing with a document mask)
on models and data they were not written for.

Taken from the notebook itself (``recipe_models.run_recipe``). Claims checked: ``sdpa_attention`` computes what
``naive_attention`` computes (outputs and gradients, fp32, bf16 inputs, bf16 autocast over fp32 inputs), and
plugged into a transformers Llama (grouped-query attention: key/value heads repeated) it gives the model's own
logits; documents from a reader's padded batch (``padded_tokens``), packed into one row with ``pack`` and
attended with ``masked_attention``'s document mask inside that Llama, get the logits each gets alone.
Cases that do not apply: an ``nn.Sequential`` has no attention; a fused qkv weight is split before attention,
so the functions see ordinary q, k, v (the course's own ``TransformerBlock`` is that case in the notebook).
"""
from __future__ import annotations

import pytest
import torch

from recipe_models import padded_tokens, run_recipe, tiny_llama


@pytest.fixture(scope="module")
def recipe():
    return run_recipe("11")


@pytest.mark.parametrize("dtype, autocast, tolerance", [(torch.float32, False, 1e-5), (torch.bfloat16, False, 2e-2),
                                                         (torch.float32, True, 2e-2)])
def test_sdpa_attention_computes_the_naive_attention(recipe, dtype, autocast, tolerance):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 8, generator=generator).to(dtype).requires_grad_() for _ in range(3))
    grad_output = torch.randn(2, 4, 33, 8, generator=generator).to(dtype)
    results = []
    for attend in (recipe["naive_attention"], recipe["sdpa_attention"]):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = attend(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), grad_output.to(out.dtype))
        results.append((out.float(), *(g.float() for g in grads)))
    for naive, sdpa in zip(*results):
        assert (naive - sdpa).abs().max().item() <= tolerance * max(1.0, naive.abs().max().item())


def _register(name: str, attend) -> None:
    """Plug an attention function of the recipe into transformers (key/value heads repeated for grouped queries)."""
    from transformers import AttentionInterface

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):  # noqa: ANN001
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        return attend(query, key, value).transpose(1, 2).contiguous(), None
    AttentionInterface.register(name, attention)


def test_sdpa_attention_inside_a_transformers_llama(recipe):
    _register("course_sdpa", recipe["sdpa_attention"])
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    ours, theirs = tiny_llama(attn_implementation="course_sdpa"), tiny_llama(attn_implementation="sdpa")
    assert (ours(ids).logits - theirs(ids).logits).abs().max().item() < 1e-5


def test_packed_documents_get_the_logits_they_get_alone_in_a_llama(recipe):
    """The reader's padded batch, packed: each document's logits in the packed row equal its logits alone."""
    input_ids, attention_mask, _ = padded_tokens(4, 12, 128, seed=2)
    documents = [row[:length] for row, length in zip(input_ids, attention_mask.sum(dim=1).tolist())]
    tokens, positions, labels, mask = recipe["pack"](documents)
    assert positions.tolist() == [i for d in documents for i in range(len(d))]
    assert (labels[0] == -100).sum().item() == len(documents), "one target dropped per document: its last token"
    current = {}
    _register("course_packed", lambda q, k, v: recipe["masked_attention"](current["mask"])(q, k, v))
    packed_model, plain_model = tiny_llama(attn_implementation="course_packed"), tiny_llama(attn_implementation="sdpa")
    current["mask"] = mask
    packed_logits = packed_model(tokens, position_ids=positions[None]).logits[0]
    alone = torch.cat([plain_model(d[None]).logits[0] for d in documents])
    assert (packed_logits - alone).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="expected the packed size"):
        recipe["document_mask"]([len(d) for d in documents], tokens.shape[1] + 1, tokens.device)
