"""Held-out models for the recipe tests (issue 38's last "done when"): families that neither the issue nor
``tests/recipe_models.py`` names, each found to break a recipe silently when pasted as a reader would. Tiny, built
from configs with random weights, nothing downloaded.

* ``tiny_opt``: OPT scales the queries itself and hands its attention function ``scaling=1.0`` (biases everywhere);
* ``tiny_gemma2``: Gemma-2, sliding-window layers alternating with global ones, attention scaled by
  ``query_pre_attn_scalar`` (not the head size), soft-capped scores and logits, a tied head;
* ``tiny_phi3``, ``tiny_gpt_neox``: fused ``qkv_proj``/``gate_up_proj`` (Phi-3); parallel residual, partial rotary,
  a head named ``embed_out`` (GPT-NeoX);
* ``tiny_bert_mlm``: BERT's masked-LM head ``cls.predictions.decoder``, tied to the word embeddings but not named
  ``head`` or ``lm_head``;
* ``FrozenTiedLM``: a reader's small LM whose frozen input embedding is shared with its output layer ``out``;
* ``left_padded``: a left-padded batch with one row whose labels are all ``-100``.
"""
from __future__ import annotations

import torch
from torch import nn

VOCAB = 96


def _small(**fields) -> dict:
    return {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 128, **fields}


def tiny_opt(dtype: torch.dtype = torch.float32, *, seed: int = 0, **fields):
    """A transformers ``OPTForCausalLM`` (q scaled before its attention function, which gets ``scaling=1.0``)."""
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(seed)
    config = OPTConfig(**_small(ffn_dim=64, word_embed_proj_dim=32, dropout=0.0, pad_token_id=0, **fields))
    return OPTForCausalLM(config).to(dtype)


def tiny_gemma2(dtype: torch.dtype = torch.float32, *, seed: int = 0, sliding_window: int = 4, **fields):
    """A transformers ``Gemma2ForCausalLM``: layer 0 slides (window ``sliding_window``), layer 1 is global; scores
    scaled by ``query_pre_attn_scalar ** -0.5`` = 1/4 (the head size is 8), soft-capped at 5 (the logits at 3) unless
    ``attn_logit_softcapping=None`` (``final_logit_softcapping=None``) is passed."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(seed)
    config = Gemma2Config(**_small(num_key_value_heads=2, head_dim=8, sliding_window=sliding_window,
                                   query_pre_attn_scalar=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                   **{"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, **fields}))
    return Gemma2ForCausalLM(config).to(dtype)


def tiny_phi3(dtype: torch.dtype = torch.float32, *, seed: int = 0, **fields):
    """A transformers ``Phi3ForCausalLM``: one fused ``qkv_proj`` and one fused ``gate_up_proj`` per layer."""
    from transformers import Phi3Config, Phi3ForCausalLM
    torch.manual_seed(seed)
    config = Phi3Config(**_small(num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **fields))
    return Phi3ForCausalLM(config).to(dtype)


def tiny_gpt_neox(dtype: torch.dtype = torch.float32, *, seed: int = 0, **fields):
    """A transformers ``GPTNeoXForCausalLM``: parallel residual, rotary on half the head, biases, ``embed_out``."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    torch.manual_seed(seed)
    config = GPTNeoXConfig(**_small(use_parallel_residual=True, rotary_pct=0.5, **fields))
    return GPTNeoXForCausalLM(config).to(dtype)


# name -> (builder, the repeated blocks); every one takes input_ids, attention_mask, labels (shifted inside)
HELD_OUT_CAUSAL_LMS = {
    "opt": (tiny_opt, lambda model: model.model.decoder.layers),
    "gemma2": (tiny_gemma2, lambda model: model.model.layers),
    "phi3": (tiny_phi3, lambda model: model.model.layers),
    "gpt-neox": (tiny_gpt_neox, lambda model: model.gpt_neox.layers),
}


def tiny_bert_mlm(*, seed: int = 0):
    """A transformers ``BertForMaskedLM``: its decoder (``cls.predictions.decoder``) is the word-embedding matrix."""
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(seed)
    config = BertConfig(**_small(max_position_embeddings=64, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0))
    return BertForMaskedLM(config)


class FrozenTiedLM(nn.Module):
    """A reader's small LM: a frozen embedding shared with the output layer ``out`` (not named head or lm_head)."""

    def __init__(self, vocab: int = VOCAB, width: int = 32, *, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width),
                                  nn.LayerNorm(width))
        self.out = nn.Linear(width, vocab, bias=False)
        self.out.weight = self.embed.weight                     # tied
        self.embed.weight.requires_grad_(False)                 # and frozen

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.embed(input_ids)))       # (B, T, vocab)


def left_padded(batch: int = 5, length: int = 12, *, seed: int = 0, ignored_row: int | None = 2):
    """A left-padded batch ``(input_ids, attention_mask, labels)`` (pad 0, labels -100 on the padding): row 0 full,
    row ``ignored_row`` with every label -100."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, length + 1, (batch,), generator=generator)
    lengths[0] = length
    input_ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    attention_mask = (torch.arange(length)[None, :] >= (length - lengths)[:, None]).long()
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    if ignored_row is not None:
        labels[ignored_row] = -100
    return input_ids, attention_mask, labels


class RecurrentLM(nn.Module):
    """A reader's LSTM (or GRU) language model: (B, T) ids -> (B, T, vocab) logits; its output layer ``decoder`` has a
    bias (nn.Linear's default), and its recurrent weights are not nn.Linear."""

    def __init__(self, kind: str = "lstm", vocab: int = VOCAB, width: int = 32, layers: int = 2, *, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[kind](width, width, layers, batch_first=True)
        self.decoder = nn.Linear(width, vocab)

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.rnn(self.embed(input_ids))[0]               # (B, T, width): what the decoder reads

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.hidden(input_ids))
