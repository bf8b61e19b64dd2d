"""The reader's models and data, for the recipe portability tests (tests/test_recipes_*.py).

Each notebook's recipe cells carry the cell tag ``recipe``; a portability test takes them from the notebook
itself (``recipe_source``), never from a copy, runs them in a fresh namespace, and applies them to models the
notebook was not written for: a transformers Llama built from a config (random weights, nothing downloaded),
an ``nn.Sequential``, and a block with one fused qkv weight that is ``.split`` in forward. The data has the
ordinary cases a reader meets: padded targets (``-100``), an uneven last batch.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
RECIPE_TAG = "recipe"


def notebook_path(prefix: str) -> Path:
    """The notebook whose file name starts with ``prefix`` ("08" or "08_memory_budget...")."""
    found = sorted(NOTEBOOKS.glob(f"{prefix}*.ipynb"))
    if len(found) != 1:
        raise FileNotFoundError(f"expected one notebook starting with {prefix!r}, found {[p.name for p in found]}")
    return found[0]


def recipe_cells(prefix: str, tag: str = RECIPE_TAG) -> list[str]:
    """The sources of the notebook's code cells tagged ``tag``, in order (the recipe a reader copies)."""
    notebook = json.loads(notebook_path(prefix).read_text())
    cells = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
             for c in notebook["cells"]
             if c["cell_type"] == "code" and tag in c.get("metadata", {}).get("tags", [])]
    if not cells:
        raise LookupError(f"{notebook_path(prefix).name} has no code cell tagged {tag!r}")
    return cells


def run_recipe(prefix: str, tag: str = RECIPE_TAG, namespace: dict | None = None) -> dict:
    """Execute the tagged cells in a fresh namespace (with ``torch``, ``nn``, ``F`` imported, as a script
    would have) and return it, so a test can call the recipe's functions on its own model."""
    namespace = {} if namespace is None else namespace
    exec("import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n", namespace)
    for index, source in enumerate(recipe_cells(prefix, tag)):
        exec(compile(source, f"<{notebook_path(prefix).stem} recipe cell {index}>", "exec"), namespace)
    return namespace


def tiny_llama(dtype: torch.dtype = torch.float32, *, seed: int = 0, attn_implementation: str = "sdpa",
               vocab_size: int = 128, hidden_size: int = 32, num_layers: int = 2, tie: bool = False):
    """A transformers ``LlamaForCausalLM`` from a config: grouped-query attention (4 heads, 2 key/value
    heads), random weights, in ``dtype``. Nothing is downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=tie,
                         attn_implementation=attn_implementation)
    return LlamaForCausalLM(config).to(dtype)


def sequential_mlp(in_features: int = 16, hidden: int = 32, classes: int = 5, *, seed: int = 0) -> nn.Sequential:
    """A plain ``nn.Sequential`` classifier, the smallest model a reader has."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, classes))


class FusedQKVBlock(nn.Module):
    """Self-attention with one fused qkv weight that forward ``.split``s (as GPT-2 and many readers' models do),
    then an MLP; the slices of that weight are views of one parameter, not parameters themselves."""

    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q_weight, k_weight, v_weight = self.qkv.weight.split(width)                       # views of one weight
        q_bias, k_bias, v_bias = self.qkv.bias.split(width)
        h = self.norm1(x)
        q, k, v = (nn.functional.linear(h, w, b).view(batch, length, self.heads, -1).transpose(1, 2)
                   for w, b in ((q_weight, q_bias), (k_weight, k_bias), (v_weight, v_bias)))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class FusedQKVModel(nn.Module):
    """A tiny language model of ``FusedQKVBlock``s: (B, T) token ids -> (B, T, vocab) logits."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2, *, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(FusedQKVBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def padded_tokens(batch: int, length: int, vocab: int, *, seed: int = 0, min_length: int = 2):
    """A right-padded batch as a reader's collator makes it: ``(input_ids, attention_mask, labels)`` with
    ``labels == -100`` on the padding (the ignore index of ``F.cross_entropy`` and transformers' loss)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_length, length + 1, (batch,), generator=generator)
    lengths[0] = length                                       # one full row, so the batch is `length` long
    input_ids = torch.randint(0, vocab, (batch, length), generator=generator)
    attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return input_ids, attention_mask, labels
