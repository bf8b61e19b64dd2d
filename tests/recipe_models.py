"""The reader's models and data, for the recipe portability tests (tests/test_recipes_*.py).

Each notebook's recipe cells carry the cell tag ``recipe``; a portability test takes them from the notebook
itself (``recipe_source``), never from a copy, runs them in a fresh namespace, and applies them to models the
notebook was not written for: transformers decoders built from configs (random weights, nothing downloaded) of
four families (a Llama; a Qwen2 with q/k/v biases and a tied head; GPT-2 with its ``Conv1D`` layers and dropout;
a bf16 Mistral with a sliding window), an ``nn.TransformerEncoder`` classifier with a padding mask, a conv net with
BatchNorm, an ``nn.Sequential``, and a block with one fused qkv weight that is ``.split`` in forward. The data has
the ordinary cases a reader meets: padded targets (``-100``), an uneven last batch, dict batches from a
``DataLoader`` with a padding collator.
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


# --- the families issue 38 adds: the models readers bring beyond a Llama ------------------------------------------
# Each is tiny (a few thousand parameters), built from a config with random weights, nothing downloaded. A test takes
# the families its recipe applies to from ``CAUSAL_LM_FAMILIES`` (decoders trained on next-token loss) or uses the
# encoder classifier and the BatchNorm conv net directly.

def tiny_qwen2(dtype: torch.dtype = torch.float32, *, seed: int = 0, vocab_size: int = 128, hidden_size: int = 32,
               num_layers: int = 2, attn_implementation: str = "sdpa"):
    """A transformers ``Qwen2ForCausalLM``: biases on q, k and v, a tied head (``lm_head.weight`` is the embedding),
    grouped-query attention."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         attn_implementation=attn_implementation)
    return Qwen2ForCausalLM(config).to(dtype)


def tiny_gpt2(dtype: torch.dtype = torch.float32, *, seed: int = 0, vocab_size: int = 128, hidden_size: int = 32,
              num_layers: int = 2, dropout: float = 0.1, attn_implementation: str = "eager"):
    """A transformers ``GPT2LMHeadModel``: ``Conv1D`` layers (weights stored (in, out), not ``nn.Linear``), one fused
    ``c_attn`` for q, k and v, learned positions, dropout on (``dropout`` for every dropout field), a tied head."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_embd=hidden_size, n_layer=num_layers, n_head=4, n_positions=256,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1,
                        attn_implementation=attn_implementation)
    return GPT2LMHeadModel(config).to(dtype)


def tiny_mistral(dtype: torch.dtype = torch.bfloat16, *, seed: int = 0, vocab_size: int = 128, hidden_size: int = 32,
                 num_layers: int = 2, sliding_window: int = 8, attn_implementation: str = "sdpa"):
    """A transformers ``MistralForCausalLM`` in bf16 with a sliding window of ``sliding_window`` tokens (shorter than
    the sequences the tests use, so the window changes the result)."""
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                           num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, sliding_window=sliding_window,
                           attn_implementation=attn_implementation)
    return MistralForCausalLM(config).to(dtype)


# name -> builder(dtype=..., seed=...) of a causal LM that takes input_ids, attention_mask, labels (shifted inside)
CAUSAL_LM_FAMILIES = {
    "llama": lambda **kw: tiny_llama(**kw),
    "qwen2": lambda **kw: tiny_qwen2(**kw),
    "gpt2": lambda **kw: tiny_gpt2(**kw),
    "mistral-bf16-sliding": lambda **kw: tiny_mistral(**{"dtype": torch.bfloat16, **kw}),
}


class EncoderClassifier(nn.Module):
    """An ``nn.TransformerEncoder`` sequence classifier with a padding mask, as a reader writes one: token ids and a
    ``(B, T)`` attention mask (1 = real token) -> ``(B, classes)`` logits, mean-pooled over the real tokens.
    ``batch_first=True``, so ``model.eval()`` takes the encoder's fast path (which reads ``linear1.weight`` and
    ``self_attn.in_proj_weight`` directly)."""

    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 4, layers: int = 2, classes: int = 3, *,
                 seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)   # (B, T, width)
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * weights).sum(1) / weights.sum(1))                            # (B, classes)


def batchnorm_convnet(channels: int = 8, classes: int = 5, *, seed: int = 0) -> nn.Sequential:
    """A small conv net with BatchNorm (running statistics updated in every training-mode forward), as a ResNet
    stage has: (B, 3, H, W) -> (B, classes). ``model[0]`` and ``model[1]`` are the two conv-BN-ReLU stages."""
    torch.manual_seed(seed)

    def stage(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

    return nn.Sequential(stage(3, channels), stage(channels, channels), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(channels, classes))


class PaddedTextDataset(torch.utils.data.Dataset):
    """Token sequences of different lengths (``min_length``..``max_length``), one per index, seeded."""

    def __init__(self, size: int = 12, vocab: int = 128, min_length: int = 3, max_length: int = 16, *, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(min_length, max_length + 1, (size,), generator=generator)
        self.sequences = [torch.randint(1, vocab, (int(n),), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.sequences[index]


def pad_collate(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A reader's collator: right-pads to the longest sequence of the batch and returns transformers' dict batch,
    ``input_ids`` (pad 0), ``attention_mask`` (1 = real) and ``labels`` (-100 on the padding; the model shifts)."""
    length = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), length, dtype=torch.long)
    attention_mask = torch.zeros(len(sequences), length, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, :len(sequence)] = sequence
        attention_mask[row, :len(sequence)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": input_ids.masked_fill(attention_mask == 0, -100)}


def padded_dict_batches(batch_size: int = 4, *, size: int = 12, vocab: int = 128, max_length: int = 16,
                        seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The dict batches a ``DataLoader(dataset, batch_size, collate_fn=pad_collate)`` yields, in order: rows of
    different lengths, each batch padded to its own longest row, the last batch shorter when ``size`` does not
    divide."""
    loader = torch.utils.data.DataLoader(PaddedTextDataset(size, vocab, max_length=max_length, seed=seed),
                                         batch_size=batch_size, shuffle=False, collate_fn=pad_collate)
    return list(loader)
