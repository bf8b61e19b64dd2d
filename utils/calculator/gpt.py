"""The ``"gpt"`` design (``utils.TinyTransformer``): its block, replayed op by op."""

from __future__ import annotations

from typing import Callable

from .replay import _Replay, _T


class _GptBlock:
    """Mixin of ``_Step``: the block of ``utils.TinyTransformer`` (pre-norm LayerNorm, fused qkv, GELU MLP)."""

    def gpt_block(self, layer: int) -> Callable[[_Replay, _T], _T]:
        prefix = f"blocks.{layer}."
        setup, model = self.setup, self.model

        def block(r: _Replay, x: _T) -> _T:
            n1 = self.layer_norm(x, self.p(prefix + "norm1.weight"), self.p(prefix + "norm1.bias"), model.d_model,
                                 prefix + "norm1")
            qkv = self.lin(n1, prefix, "qkv", True)
            self.rel(n1)
            q, k, v = self.split3(qkv, prefix + "qkv")
            self.rel(qkv)
            attended = self.sdpa(q, k, v, setup.micro_batch * model.num_heads * setup.seq_len, prefix + "attention")
            x1_in = self.lin(attended, prefix, "proj", True)
            x1 = self.add(x, x1_in, prefix + "residual 1")
            self.rel(x1_in)
            n2 = self.layer_norm(x1, self.p(prefix + "norm2.weight"), self.p(prefix + "norm2.bias"), model.d_model,
                                 prefix + "norm2")
            hidden = self.lin(n2, prefix, "mlp.0", False)
            act = self.gelu(hidden, prefix + "gelu")
            self.rel(hidden)
            out = self.lin(act, prefix, "mlp.2", False)
            self.rel(act)
            self.rel(n2)
            x2 = self.add(x1, out, prefix + "residual 2")
            self.rel(out)
            self.rel(x1, q, k, v, attended)      # the block's locals, as Python frees them on return
            return x2

        return block
