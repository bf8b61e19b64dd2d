"""The transformers grid ``validate_hf`` measures: tiny models of every family, each with the options readers set
(``hf_validation_grid``), and the config dicts they are written as (``tiny_config``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any


def _tiny(**changes: Any) -> Any:
    from .config import ModelConfig

    fields = dict(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, ffn_width=48, vocab_size=64, max_seq_len=16,
                  arch="hf-llama", name="tiny LlamaForCausalLM")
    fields.update(changes)
    return ModelConfig(**fields)


def _tiny_gpt2(**changes: Any) -> Any:
    """A tiny ``GPT2LMHeadModel``: GPT-2's own dropouts (0.1 each) and ``gelu_new`` unless changed."""
    from .config import ModelConfig

    fields = dict(num_layers=2, d_model=32, num_heads=4, ffn_width=48, vocab_size=64, max_seq_len=16,
                  arch="hf-gpt2", tied_embeddings=True, dropout=(0.1, 0.1, 0.1), name="tiny GPT2LMHeadModel")
    fields.update(changes)
    return ModelConfig(**fields)


MOE_TINY = {"mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
            "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=8),
            "olmoe": dict(num_experts=8, num_experts_per_tok=2)}


def tiny_config(model_type: str, **fields: Any) -> dict[str, Any]:
    """A tiny transformers config as a reader's config.json gives it (2 layers, width 32, 4 heads, 2 kv heads, 16
    positions, a vocabulary of 64), read by ``model_config_from_hf`` and built by transformers from the same dict."""
    if model_type == "gpt2":
        return dict(model_type="gpt2", n_layer=2, n_embd=32, n_head=4, n_inner=48, vocab_size=64, n_positions=16,
                    bos_token_id=1, eos_token_id=2, _name_or_path="tiny gpt2", **fields)
    out = dict(model_type=model_type, num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=48, vocab_size=64, max_position_embeddings=16, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, _name_or_path=f"tiny {model_type}")
    if model_type in ("qwen3", "gemma2", "gemma3_text"):
        out["head_dim"] = 8
    if model_type in ("gemma2", "gemma3_text"):
        out["sliding_window"] = 8
    if model_type in MOE_TINY:                        # 8 experts, 2 per token (Qwen3-MoE: experts 24 wide)
        out.update(MOE_TINY[model_type])
    out.update(fields)
    return out


def hf_validation_grid(check: bool = False) -> list[tuple[str, Any, Any]]:
    """The configurations ``validate_hf`` measures: tiny transformers models, micro-batch 2 x 16 (a model is a
    calculator ``ModelConfig``, or a config dict the way a reader's config.json gives it).

    Covered: the Llama family (sdpa and eager attention; grouped-query, multi-head and multi-query attention; tied
    embeddings; Qwen2's q/k/v biases and its sliding layers from ``max_window_layers`` on; ``MistralForCausalLM``
    with a sliding window longer and shorter than the sequence; attention dropout, through sdpa's math kernel or
    eager's), Qwen3 (q/k norms), Phi-3 (fused qkv and gate_up, residual dropout), Gemma 2 (soft-capped scores and
    logits, alternating sliding and global layers, four norms, the scaled embedding) and Gemma 3 (q/k norms, a
    rotary embedding per kind of layer), GPT-2 (its dropouts at 0.1 (sdpa's math kernel) and at 0 (the flash
    kernel), eager attention, untied head, ``gelu_new`` and ``gelu_pytorch_tanh``, LoRA on its ``Conv1D``); fp32,
    bf16 autocast and pure bf16; peft LoRA (all linear layers, or named ones with dropout) with and without
    checkpointing, non-reentrant and reentrant; ``labels=``, your own loss on the logits, notebook 17's summed loss;
    the loop that keeps the output object (the default), keeps it in a step function, or drops it; a padded batch;
    a model without cache; micro-batch 1; accumulation; AdamW (for-loop, foreach, fused), SGD with momentum,
    Adafactor. ``check=True`` gives the subset the tests run.
    """
    from .config import TrainingSetup

    base = TrainingSetup(micro_batch=2, seq_len=16, precision="fp32", optimizer="adamw", optimizer_impl="for-loop",
                         device="cpu")
    gqa, mha, mqa_tied = _tiny(), _tiny(num_kv_heads=4, name="tiny, 4 kv heads"), \
        _tiny(num_kv_heads=1, tied_embeddings=True, name="tiny, 1 kv head, tied")
    eager, qwen = _tiny(attention="eager", name="tiny, eager"), _tiny(qkv_bias=True, name="tiny, q/k/v bias (Qwen2)")
    gpt2, gpt2_plain = _tiny_gpt2(), _tiny_gpt2(dropout=(0.0, 0.0, 0.0), name="tiny GPT-2, no dropout")
    gpt2_eager = _tiny_gpt2(attention="eager", name="tiny GPT-2, eager")
    gpt2_untied = _tiny_gpt2(attention="eager", tied_embeddings=False, name="tiny GPT-2, eager, untied")
    gpt2_tanh = _tiny_gpt2(activation="gelu_pytorch_tanh", use_cache=False, name="tiny GPT-2, gelu_pytorch_tanh")
    t = tiny_config
    qwen2_sliding = t("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    gemma3 = t("gemma3_text", sliding_window_pattern=2)

    def s(**changes: Any) -> Any:
        return replace(base, **changes)

    ac, bf, ck, drop = "bf16-autocast", "bf16", "every_block", "dropped"
    grid = [
        ("sdpa gqa fp32 adamw", gqa, s()),
        ("sdpa gqa autocast", gqa, s(precision=ac)),
        ("sdpa gqa bf16 dropped", gqa, s(precision=bf, outputs=drop)),
        ("sdpa gqa own loss on logits", gqa, s(loss="logits")),
        ("sdpa mha fp32 dropped", mha, s(outputs=drop)),
        ("sdpa mqa tied fp32", mqa_tied, s()),
        ("sdpa gqa checkpointing", gqa, s(checkpointing=ck)),
        ("sdpa gqa padded batch", gqa, s(padded=True)),
        ("sdpa gqa lora all-linear", gqa, s(lora_rank=4)),
        ("sdpa gqa lora checkpointing", gqa, s(lora_rank=4, checkpointing=ck)),
        ("sdpa gqa lora autocast dropped", gqa, s(lora_rank=4, precision=ac, outputs=drop)),
        ("sdpa gqa lora bf16", gqa, s(lora_rank=4, precision=bf)),
        ("sdpa gqa lora q,v dropout 0.1", gqa, s(lora_rank=4, lora_dropout=0.1, lora_targets=("q_proj", "v_proj"))),
        ("sdpa gqa padded autocast lora", gqa, s(padded=True, precision=ac, lora_rank=4)),
        ("sdpa gqa accumulation 2", gqa, s(accumulation_steps=2)),
        ("sdpa qwen2 bias fp32", qwen, s()),
        ("sdpa gqa sgd momentum", gqa, s(optimizer="sgd_momentum")),
        ("sdpa gqa adafactor foreach", gqa, s(optimizer="adafactor", optimizer_impl="foreach")),
        ("sdpa gqa bf16 adamw foreach", gqa, s(optimizer_impl="foreach", precision=bf)),
        ("sdpa gqa no cache", _tiny(use_cache=False, name="tiny, use_cache=False"), s()),
        ("sdpa gqa batch 1 autocast ckpt", gqa, s(micro_batch=1, precision=ac, checkpointing=ck)),
        ("eager gqa fp32", eager, s()),
        ("eager batch 1", eager, s(micro_batch=1)),
        ("eager mha checkpointing", _tiny(attention="eager", num_kv_heads=4, name="tiny, eager, 4 kv heads"),
         s(checkpointing=ck)),
        ("eager mqa autocast", _tiny(attention="eager", num_kv_heads=1, name="tiny, eager, 1 kv head"),
         s(precision=ac)),
        ("eager bf16 padded checkpointing", eager, s(precision=bf, padded=True, checkpointing=ck)),
        ("mistral window 4096 fp32", _tiny(sliding_window=4096, name="tiny MistralForCausalLM"), s()),
        ("mistral window 8 < 16 tokens", _tiny(sliding_window=8, name="tiny Mistral, window 8"), s()),
        ("mistral 4 layers window 8 padded", t("mistral", num_hidden_layers=4, sliding_window=8), s(padded=True)),
        ("sdpa gqa autocast own loss", gqa, s(precision=ac, loss="logits")),
        ("notebook 17: padded shifted-sum fused", _tiny(use_cache=False, name="tiny, use_cache=False"),
         s(padded=True, loss="shifted-sum", optimizer_impl="fused")),
        ("shifted-sum autocast accumulation 2", gqa, s(loss="shifted-sum", precision=ac, accumulation_steps=2)),
        ("shifted-sum bf16 checkpointing", gqa, s(loss="shifted-sum", precision=bf, checkpointing=ck)),
        ("llama attn dropout sdpa gqa, logits kept", t("llama", attention_dropout=0.1), s(loss="logits")),
        ("llama attn dropout eager autocast", t("llama", attention_dropout=0.1, attn_implementation="eager"),
         s(precision=ac, outputs=drop)),
        ("llama attn dropout sdpa mqa bf16 ckpt", t("llama", attention_dropout=0.1, num_key_value_heads=1),
         s(precision=bf, checkpointing=ck)),
        ("qwen2 sliding from max_window_layers", qwen2_sliding, s()),
        ("qwen2 sliding eager kept-in-step", {**qwen2_sliding, "attn_implementation": "eager"},
         s(outputs="kept-in-step", accumulation_steps=2)),
        ("qwen2 sliding window 32 padded autocast", {**qwen2_sliding, "sliding_window": 32}, s(padded=True, precision=ac)),
        ("qwen2 sliding eager reentrant lora, step", {**qwen2_sliding, "attn_implementation": "eager"},
         s(checkpointing=ck, reentrant=True, lora_rank=4, outputs="kept-in-step", accumulation_steps=2)),
        ("llama reentrant", t("llama"), s(checkpointing=ck, reentrant=True)),
        ("llama reentrant lora autocast", t("llama"), s(checkpointing=ck, reentrant=True, lora_rank=4, precision=ac)),
        ("llama reentrant eager bf16 accumulation 2", t("llama", attn_implementation="eager"),
         s(checkpointing=ck, reentrant=True, precision=bf, accumulation_steps=2)),
        ("qwen3 fp32", t("qwen3"), s()),
        ("qwen3 autocast lora checkpointing", t("qwen3"), s(precision=ac, lora_rank=4, checkpointing=ck)),
        ("qwen3 eager bf16 bias padded", t("qwen3", attn_implementation="eager", attention_bias=True),
         s(precision=bf, padded=True)),
        ("qwen3 sliding attn dropout", t("qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                         attention_dropout=0.1), s(outputs=drop)),
        ("phi3 fp32", t("phi3"), s()),
        ("phi3 autocast resid and attn dropout", t("phi3", resid_pdrop=0.1, attention_dropout=0.1), s(precision=ac)),
        ("phi3 bf16 eager window 8", t("phi3", attn_implementation="eager", sliding_window=8), s(precision=bf)),
        ("phi3 lora checkpointing", t("phi3"), s(lora_rank=4, lora_targets=("qkv_proj", "gate_up_proj"),
                                                 checkpointing=ck)),
        ("phi3 mha padded logits", t("phi3", num_key_value_heads=4), s(padded=True, loss="logits")),
        ("gemma2 fp32", t("gemma2"), s()),
        ("gemma2 autocast", t("gemma2"), s(precision=ac)),
        ("gemma2 bf16 lora checkpointing", t("gemma2"), s(precision=bf, lora_rank=4, checkpointing=ck)),
        ("gemma2 padded no softcaps window 32", t("gemma2", final_logit_softcapping=None,
                                                  attn_logit_softcapping=None, sliding_window=32), s(padded=True)),
        ("gemma2 untied own loss", t("gemma2", tie_word_embeddings=False), s(loss="logits")),
        ("gemma3 fp32", gemma3, s()),
        ("gemma3 eager autocast", {**gemma3, "attn_implementation": "eager"}, s(precision=ac)),
        ("gemma3 bf16 checkpointing logit softcap", {**gemma3, "final_logit_softcapping": 30.0},
         s(precision=bf, checkpointing=ck)),
        ("gemma3 padded lora autocast", gemma3, s(padded=True, lora_rank=4, precision=ac)),
        ("gemma3 reentrant accumulation 2", gemma3, s(checkpointing=ck, reentrant=True, accumulation_steps=2)),
        ("gemma3 attn dropout, all sliding", t("gemma3_text", attention_dropout=0.1), s()),
        ("gpt2 sdpa dropout 0.1 fp32", gpt2, s()),
        ("gpt2 sdpa dropout 0.1 autocast", gpt2, s(precision=ac)),
        ("gpt2 sdpa dropout 0.1 bf16 padded", gpt2, s(precision=bf, padded=True)),
        ("gpt2 sdpa no dropout autocast ckpt", gpt2_plain, s(precision=ac, checkpointing=ck)),
        ("gpt2 eager dropout 0.1 padded", gpt2_eager, s(padded=True)),
        ("gpt2 eager untied bf16 checkpointing", gpt2_untied, s(precision=bf, checkpointing=ck)),
        ("gpt2 lora c_attn,c_fc checkpointing", gpt2, s(lora_rank=4, lora_targets=("c_attn", "c_fc"), checkpointing=ck)),
        ("gpt2 lora all autocast dropout 0.1", gpt2, s(lora_rank=4, lora_dropout=0.1, precision=ac)),
        ("gpt2 tanh gelu own loss batch 1", gpt2_tanh, s(micro_batch=1, loss="logits", optimizer="sgd_momentum")),
        ("gpt2 shifted-sum accumulation 2", gpt2, s(loss="shifted-sum", accumulation_steps=2, padded=True,
                                                    optimizer_impl="foreach")),
        ("gpt2 reentrant lora autocast", gpt2, s(checkpointing=ck, reentrant=True, lora_rank=4, precision=ac)),
        # mixtures of experts (notebook 14): 8 experts, 2 per token unless said; LoRA on the experts is peft's
        ("mixtral fp32", t("mixtral"), s()),
        ("mixtral autocast lora experts ckpt", t("mixtral"), s(precision=ac, lora_rank=4, lora_targets=("w1", "w2", "w3"),
                                                             checkpointing=ck)),
        ("mixtral bf16 window 8 padded", t("mixtral", sliding_window=8), s(precision=bf, padded=True)),
        ("mixtral eager dropout top-4 accum 2", t("mixtral", attention_dropout=0.1, num_experts_per_tok=4,
                                                       attn_implementation="eager"), s(accumulation_steps=2)),
        ("qwen3_moe fp32 norm_topk 32 tokens", t("qwen3_moe", norm_topk_prob=True), s(seq_len=32)),
        ("qwen3_moe bf16 lora q+experts dense", t("qwen3_moe", mlp_only_layers=[1]),
         s(precision=bf, lora_rank=4, lora_targets=("q_proj", "gate_proj", "up_proj", "down_proj"))),
        ("qwen3_moe autocast reentrant step 2", t("qwen3_moe", decoder_sparse_step=2, attention_dropout=0.1),
         s(precision=ac, checkpointing=ck, reentrant=True)),
        ("qwen3_moe window 8 lora attention", t("qwen3_moe", use_sliding_window=True, sliding_window=8),
         s(lora_rank=4, lora_targets="attention", outputs=drop)),
        ("olmoe fp32 top-1", t("olmoe", num_experts_per_tok=1), s()),
        ("olmoe autocast lora down,k ckpt", t("olmoe"), s(precision=ac, lora_rank=4, lora_targets=("down_proj", "k_proj"),
                                                          checkpointing=ck)),
        ("olmoe bf16 norm_topk padded dropout", t("olmoe", norm_topk_prob=True, attention_dropout=0.1),
         s(precision=bf, padded=True)),
    ]
    if not check:
        return grid
    subset = ("notebook 17: padded shifted-sum fused", "llama attn dropout sdpa gqa, logits kept",
              "phi3 autocast resid and attn dropout", "gpt2 lora c_attn,c_fc checkpointing",
              "qwen2 sliding eager reentrant lora, step", "qwen3 autocast lora checkpointing",
              "gemma2 bf16 lora checkpointing", "gemma3 padded lora autocast", "mixtral autocast lora experts ckpt",
              "qwen3_moe bf16 lora q+experts dense", "olmoe bf16 norm_topk padded dropout")
    return [row for row in grid if row[0] in subset]
