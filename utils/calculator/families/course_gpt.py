"""The course's ``"gpt"`` design (``utils.TinyTransformer``): learned positions, pre-norm LayerNorm with bias, a fused
qkv Linear, a GELU MLP, biases everywhere, an untied head with bias; attention through
``F.scaled_dot_product_attention``."""

from __future__ import annotations

from typing import Any, Callable

from ..config import ModelConfig, TrainingSetup
from ..registry import register
from ..replay import _T
from .course import CourseDesign


class CourseGpt(CourseDesign):
    """``utils.TinyTransformer``, replayed op by op."""

    arch = "gpt"
    block_prefix = "blocks."

    def check_model(self, model: ModelConfig) -> None:
        super().check_model(model)
        if model.kv_heads != model.num_heads:
            raise ValueError("arch 'gpt' (utils.TinyTransformer) has one key/value head per query head: expected "
                             f"num_kv_heads None or {model.num_heads}, got {model.num_kv_heads}")
        if model.tied_embeddings:
            raise ValueError("tied_embeddings is modelled for arch 'llama' only (utils.TinyTransformer's head is untied)")

    def check_setup(self, model: ModelConfig, setup: TrainingSetup) -> None:
        super().check_setup(model, setup)
        if setup.seq_len > model.max_seq_len:
            raise ValueError(f"seq_len {setup.seq_len} exceeds the model's position table (max_seq_len "
                             f"{model.max_seq_len}): expected seq_len <= {model.max_seq_len}")

    def linears(self, model: ModelConfig) -> list[tuple[str, int, int, bool]]:
        d, f = model.d_model, model.ffn
        return [("qkv", d, 3 * d, True), ("proj", d, d, True), ("mlp.0", d, f, False), ("mlp.2", f, d, False)]

    def parameter_shapes(self, model: ModelConfig, setup: TrainingSetup) -> list[tuple[str, tuple[int, ...], bool]]:
        frozen = setup.lora_rank > 0
        d, v = model.d_model, model.vocab_size
        out = [("token_embedding.weight", (v, d), not frozen), ("position_embedding.weight", (model.max_seq_len, d),
                                                               not frozen)]
        for layer in range(model.num_layers):
            prefix = f"blocks.{layer}."
            out += [(prefix + "norm1.weight", (d,), not frozen), (prefix + "norm1.bias", (d,), not frozen)]
            self.linear_parameters(out, model, setup, prefix, "qkv", True)
            self.linear_parameters(out, model, setup, prefix, "proj", True)
            out += [(prefix + "norm2.weight", (d,), not frozen), (prefix + "norm2.bias", (d,), not frozen)]
            self.linear_parameters(out, model, setup, prefix, "mlp.0", True)
            self.linear_parameters(out, model, setup, prefix, "mlp.2", True)
        return out + [("norm.weight", (d,), not frozen), ("norm.bias", (d,), not frozen),
                      ("head.weight", (v, d), not frozen), ("head.bias", (v,), not frozen)]

    def tensor_parallel_dim(self, name: str, shape: tuple[int, ...]) -> int | None:
        owner, _, kind = name.rpartition(".")
        if owner.endswith(("qkv", "mlp.0")) or owner.endswith(("token_embedding", "head")):
            return 0
        if owner.endswith(("proj", "mlp.2")):
            return 1 if kind == "weight" else None
        return None

    def activation_design(self) -> str:
        return "gpt"

    def layer_signature(self, model: ModelConfig, layer: int) -> str:
        return "block"

    def forward(self, r: Any, micro: int) -> _T:
        model, setup = r.model, r.setup
        n_tok, d = setup.tokens, model.d_model
        tok = r.embedding(r.p("token_embedding.weight"), n_tok * d, "token embedding")
        positions = r.new(setup.seq_len, 8, "activations", "positions")
        pos = r.embedding(r.p("position_embedding.weight"), setup.seq_len * d, "position embedding", positions)
        r.rel(positions)
        x = r.add(tok, pos, "embeddings", numel=n_tok * d)
        r.rel(tok, pos)
        x = r.run_layers(micro, x, lambda layer: self.block(r, layer), lambda layer: [])
        r.set_phase(f"m{micro}.head")
        final = r.layer_norm(x, r.p("norm.weight"), r.p("norm.bias"), d, "norm")
        loss = self.head_loss(r, final, r.p("head.weight"), r.p("head.bias"))
        r.rel(x)
        return loss

    def block(self, r: Any, layer: int) -> Callable:
        """The block of ``utils.TinyTransformer`` (pre-norm LayerNorm, fused qkv, GELU MLP)."""
        prefix = f"blocks.{layer}."
        model, setup = r.model, r.setup

        def block(r_: Any, x: _T) -> _T:
            n1 = r.layer_norm(x, r.p(prefix + "norm1.weight"), r.p(prefix + "norm1.bias"), model.d_model,
                              prefix + "norm1")
            qkv = self.lin(r, n1, prefix, "qkv", True, True)
            r.rel(n1)
            q, k, v = r.split3(qkv, prefix + "qkv")
            r.rel(qkv)
            attended = r.sdpa(q, k, v, setup.micro_batch * model.num_heads * setup.seq_len, prefix + "attention")
            x1_in = self.lin(r, attended, prefix, "proj", True, True)
            x1 = r.add(x, x1_in, prefix + "residual 1")
            r.rel(x1_in)
            n2 = r.layer_norm(x1, r.p(prefix + "norm2.weight"), r.p(prefix + "norm2.bias"), model.d_model,
                              prefix + "norm2")
            hidden = self.lin(r, n2, prefix, "mlp.0", False, True)
            act = r.gelu(hidden, prefix + "gelu")
            r.rel(hidden)
            out = self.lin(r, act, prefix, "mlp.2", False, True)
            r.rel(act)
            r.rel(n2)
            x2 = r.add(x1, out, prefix + "residual 2")
            r.rel(out)
            r.rel(x1, q, k, v, attended)      # the block's locals, as Python frees them on return
            return x2

        return block

    # -- the measured side ---------------------------------------------------------------------------------
    def build_reference_module(self, model: ModelConfig) -> Any:
        from ...models import TinyTransformer

        ratio, rest = divmod(model.ffn, model.d_model)   # TinyTransformer's MLP is mlp_ratio * d_model wide
        if rest:
            raise ValueError(f"arch 'gpt' builds utils.TinyTransformer, whose MLP is a multiple of d_model: expected "
                             f"ffn_width a multiple of {model.d_model}, got {model.ffn}")
        return TinyTransformer(model.vocab_size, model.d_model, model.num_heads, model.num_layers,
                               max_seq_len=model.max_seq_len, mlp_ratio=ratio)

    def reference_embed(self, net: Any, tokens: Any, seq_len: int) -> tuple[Any, tuple]:
        import torch

        return net.token_embedding(tokens) + net.position_embedding(torch.arange(seq_len, device=tokens.device)), ()

    def reference_parts(self, net: Any) -> tuple[Any, Any]:
        """The blocks and the head of the built module."""
        return net.blocks, net.head


register(CourseGpt())
