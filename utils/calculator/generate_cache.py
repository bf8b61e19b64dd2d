"""generate's cache (notebook 15), replayed layer by layer: ``DynamicCache`` and ``StaticCache``, full and sliding
layers, as transformers 5.24 allocates them; and the formula of its key/value bytes after each forward
(``cache_bytes_after``), which ``generate.predict_generate`` holds equal to the replay at every replayed step.

Kept apart from ``generate.py`` (the call itself) so that each module is one sitting.
"""

from __future__ import annotations

from typing import Any

from .config import ModelConfig
from .replay import _T


class _GenCache:
    """generate's cache, layer by layer: each layer's keys and values (tensors of the replay) and what it has seen.

    ``update`` is ``DynamicLayer.update`` / ``DynamicSlidingWindowLayer.update`` / ``StaticLayer.update`` /
    ``StaticSlidingWindowLayer.update``: what the layer's attention receives, allocation by allocation.
    """

    def __init__(self, r: Any, kind: str, max_len: int) -> None:
        model = r.model
        self.kind, self.max_len = kind, max_len
        self.window = model.sliding_window
        self.sliding = [model.layer_type(i) == "sliding_attention" for i in range(model.num_layers)]
        self.seen = [0] * model.num_layers              # tokens each layer has cached so far (cumulative)
        self.keys: list[_T | None] = [None] * model.num_layers
        self.values: list[_T | None] = [None] * model.num_layers
        # 8-byte bookkeeping tensors, per layer: DynamicSlidingWindowLayer's torch.tensor(window), StaticLayer's
        # cumulative_length = torch.tensor(0)
        self.premade: dict[str, _T | None] = {}          # a static cache's masks, made before each forward
        self.others: list[_T | None] = [
            (r.new(1, 8, "activations", "static layer's length") if kind == "static" else
             r.new(1, 8, "activations", "sliding layer's window") if sliding else None) for sliding in self.sliding]

    def length(self, layer: int) -> int:
        """Tokens of storage a static layer allocates."""
        return min(self.max_len, self.window) if self.sliding[layer] else self.max_len

    def past(self, layer: int) -> int:
        return self.seen[layer]

    def mask_sizes(self, layer: int, q_len: int) -> tuple[int, int]:
        """``get_mask_sizes``: (kv length, kv offset) the mask of this layer's kind is built for."""
        seen = self.seen[layer]
        if self.kind == "static":
            if not self.sliding[layer]:
                return self.max_len, 0
            length = self.length(layer)
            if seen >= length:
                return length + q_len - 1, seen - length + 1
            return (seen + q_len if seen + q_len > length else length), 0
        if not self.sliding[layer]:
            return seen + q_len, 0
        full = seen >= self.window
        return (self.window - 1 + q_len if full else seen + q_len), max(seen - self.window + 1, 0)

    def update(self, r: Any, layer: int, k: _T, v: _T) -> tuple[_T, _T]:
        """The layer's ``update(key_states, value_states)``: the keys and values attention then runs on."""
        q_len = k.numel // self.token_numel(r)
        if self.kind == "static":
            return self._static_update(r, layer, k, v, q_len)
        seen = self.seen[layer]
        self.seen[layer] = seen + q_len
        full_k = r.new(k.numel + (self.keys[layer].numel if self.keys[layer] is not None else 0), k.item,
                       "activations", f"cache keys {layer}")           # torch.cat([self.keys, key_states], -2)
        old_k, self.keys[layer] = self.keys[layer], full_k
        if not self.sliding[layer]:
            r.rel(old_k)
        full_v = r.new(full_k.numel, v.item, "activations", f"cache values {layer}")
        old_v, self.values[layer] = self.values[layer], full_v
        r.rel(old_k, old_v) if self.sliding[layer] else r.rel(old_v)   # sliding: both cats, then both rebinds
        if self.sliding[layer]:                          # self.keys = full[:, :, -window + 1:]: a view of the cat
            self.keys[layer] = r.view(full_k, self.kept_numel(r, layer))
            self.values[layer] = r.view(full_v, self.kept_numel(r, layer))
            r.rel(full_k, full_v)
            return r.view(full_k), r.view(full_v)
        return r.view(full_k), r.view(full_v)

    def _static_update(self, r: Any, layer: int, k: _T, v: _T, q_len: int) -> tuple[_T, _T]:
        if self.keys[layer] is None:                     # lazy_initialization: zeros of the whole length
            numel = self.length(layer) * self.token_numel(r)
            self.keys[layer] = r.new(numel, k.item, "activations", f"static cache keys {layer}")
            self.values[layer] = r.new(numel, v.item, "activations", f"static cache values {layer}")
        seen = self.seen[layer]
        self.seen[layer] += q_len
        if self.sliding[layer]:                          # StaticSlidingWindowLayer.update
            length = self.length(layer)
            if seen >= length:                           # full: roll by one, write the last position, copy back
                rolled = [r.new(t.numel, t.item, "temporaries", "keys.roll(-1)") for t in (self.keys[layer],
                                                                                          self.values[layer])]
                index = r.new(1, 8, "temporaries", "torch.tensor([-1])")
                r.rel(*rolled, index)
                return r.view(self.keys[layer]), r.view(self.values[layer])
            if seen + q_len > length:                    # a prompt longer than the window: attention on all of it
                return r.view(k), r.view(v)
        arange = r.new(q_len, 8, "temporaries", "arange(kv_length)")
        position = r.new(q_len, 8, "temporaries", "cache_position")   # + cumulative_length; index_copy_ in place
        r.rel(arange, position)
        return r.view(self.keys[layer]), r.view(self.values[layer])

    def grow(self, r: Any, steps: int) -> None:
        """The cache after ``steps`` more one-token updates (a jump): the dynamic layers' storages grow (a sliding
        layer's up to its window), a static one's stays."""
        token = self.token_numel(r)
        for layer in range(len(self.seen)):
            self.seen[layer] += steps
            if self.kind == "static":
                continue
            if self.sliding[layer]:
                stored = min(self.seen[layer], self.window) * token
                for t in (self.keys[layer], self.values[layer]):
                    r._resize(_T(t.buf, t.buf.nbytes // t.item, t.item), stored)
                    t.numel = self.kept_numel(r, layer)
            else:
                for t in (self.keys[layer], self.values[layer]):
                    r._resize(t, self.seen[layer] * token)

    def kept_numel(self, r: Any, layer: int) -> int:
        """Elements a dynamic sliding layer keeps viewing: the last ``window - 1`` positions (or all it has)."""
        return min(self.seen[layer], self.window - 1) * self.token_numel(r)

    def token_numel(self, r: Any) -> int:
        """Elements of one token's keys (or values) for all rows: rows · kv-heads · head-dim."""
        return r.rows * r.model.kv_heads * r.model.head_dim

    def key_value_bytes(self) -> int:
        """Bytes of the distinct storages behind every layer's keys and values."""
        bufs = {id(t.buf): t.buf.nbytes for t in self.keys + self.values if t is not None}
        return sum(bufs.values())

    def other_bytes(self) -> int:
        return 8 * sum(t is not None for t in self.others)

    def release(self, r: Any) -> None:
        """The cache object goes (generate returns without it): layer by layer, its keys, values and bookkeeping."""
        for layer in range(len(self.keys)):
            r.rel(self.keys[layer], self.values[layer], self.others[layer])
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)
        self.others = [None] * len(self.others)


def cache_bytes_after(model: ModelConfig, gen: Any, step: int) -> int:
    """The cache's key/value bytes after forward ``step`` (0: the prefill): full layers hold ``P + step`` tokens
    (static: ``P + N - 1`` from the start); a dynamic sliding layer the prompt's ``P`` after the prefill, then
    a ``min(P + step, window)``-token storage; a static sliding one ``min(P + N - 1, window)``. ``gen``: a
    ``generate.GenerateSetup``."""
    p, n = gen.prompt_length, gen.new_tokens
    token = 2 * gen.rows * model.kv_heads * model.head_dim * (2 if gen.precision == "bf16" else 4)
    total = 0
    for layer in range(model.num_layers):
        sliding = model.layer_type(layer) == "sliding_attention"
        if gen.cache == "static":
            tokens = min(p + n - 1, model.sliding_window) if sliding else p + n - 1
        elif sliding and step:
            tokens = min(p + step, model.sliding_window)
        else:
            tokens = p + step
        total += token * tokens
    return total
