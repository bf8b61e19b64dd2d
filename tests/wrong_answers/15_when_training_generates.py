"""Wrong answers to notebook 15's exercises: each must make its graded cell fail (see README.md here)."""

_KV = '''
def kv_cache_bytes(config, batch, prompt_length, new_tokens, generations=1, cache="dynamic", dtype=torch.float32):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kinds = getattr(config, "layer_types", None) or config.num_hidden_layers * [
        "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"]
    held = prompt_length + new_tokens - 1
    total = 0
    for kind in kinds:
        if kind != "sliding_attention":
            tokens = held
        elif cache == "static" or new_tokens > 1:
            tokens = min(held, config.sliding_window)
        else:
            tokens = prompt_length
        total += 2 * batch * generations * config.num_key_value_heads * tokens * head_dim * dtype.itemsize
    return total
'''

_CHUNKED = '''
from torch.utils.checkpoint import checkpoint


def chunked_logprobs(hidden, head, targets, chunk):
    def piece_logprobs(piece, chosen):
        logits = head(piece).float()
        return logits.gather(-1, chosen.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)

    pieces = [checkpoint(piece_logprobs, piece, chosen, use_reentrant=False)
              for piece, chosen in zip(hidden.split(chunk, dim=1), targets.split(chunk, dim=1))]
    return torch.cat(pieces, dim=1)
'''


def _kv(old: str, new: str) -> str:
    """Exercise 1's solution with one piece replaced: one mistake."""
    assert old in _KV, old
    return _KV.replace(old, new)


def _chunked(old: str, new: str) -> str:
    """Exercise 2's solution with one piece replaced: one mistake."""
    assert old in _CHUNKED, old
    return _CHUNKED.replace(old, new)


WRONG = {
    "exercise_1": {
        "counts P + N tokens: the last sampled token is never fed back, so never cached":
            _kv("held = prompt_length + new_tokens - 1", "held = prompt_length + new_tokens"),
        "forgets the G answers per prompt":
            _kv("2 * batch * generations *", "2 * batch *"),
        "counts the query heads, not the key/value heads":
            _kv("config.num_key_value_heads", "config.num_attention_heads"),
        "a window holds window - 1 tokens (the positions used, not the storage held)":
            _kv("tokens = min(held, config.sliding_window)", "tokens = min(held, config.sliding_window - 1)"),
        "ignores sliding windows: every layer holds the whole sequence":
            _kv('if kind != "sliding_attention":', "if True:"),
        "applies the window to the prefill's keys too":
            _kv("tokens = prompt_length", "tokens = min(prompt_length, config.sliding_window)"),
        "every layer slides when the config sets a window, whatever layer_types says":
            _kv('kinds = getattr(config, "layer_types", None) or config.num_hidden_layers * [',
                'kinds = None or config.num_hidden_layers * ['),
        "assumes 4 bytes per element, whatever the dtype":
            _kv("head_dim * dtype.itemsize", "head_dim * 4"),
        "takes the head dimension as width / heads, ignoring the config's head_dim":
            _kv('head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads',
                "head_dim = config.hidden_size // config.num_attention_heads"),
        "the static cache holds P + N tokens":
            _kv('        if kind != "sliding_attention":\n            tokens = held',
                '        if kind != "sliding_attention":\n            tokens = held + (cache == "static")'),
        "a static cache's sliding layer allocated the whole window, however short the sequence": '''
def kv_cache_bytes(config, batch, prompt_length, new_tokens, generations=1, cache="dynamic", dtype=torch.float32):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kinds = getattr(config, "layer_types", None) or config.num_hidden_layers * [
        "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"]
    held = prompt_length + new_tokens - 1
    total = 0
    for kind in kinds:
        if kind != "sliding_attention":
            tokens = held
        elif cache == "static":
            tokens = config.sliding_window
        elif new_tokens > 1:
            tokens = min(held, config.sliding_window)
        else:
            tokens = prompt_length
        total += 2 * batch * generations * config.num_key_value_heads * tokens * head_dim * dtype.itemsize
    return total
''',
        "a sliding layer caps P + N tokens at the window (the last token's -1 on full layers only)": '''
def kv_cache_bytes(config, batch, prompt_length, new_tokens, generations=1, cache="dynamic", dtype=torch.float32):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kinds = getattr(config, "layer_types", None) or config.num_hidden_layers * [
        "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"]
    held = prompt_length + new_tokens - 1
    total = 0
    for kind in kinds:
        if kind != "sliding_attention":
            tokens = held
        elif cache == "static" or new_tokens > 1:
            tokens = min(prompt_length + new_tokens, config.sliding_window)
        else:
            tokens = prompt_length
        total += 2 * batch * generations * config.num_key_value_heads * tokens * head_dim * dtype.itemsize
    return total
''',
    },
    "exercise_2": {
        "computes the whole logits, then splits them: the (R, N, V) tensor exists":
            _chunked("    pieces = [checkpoint(piece_logprobs, piece, chosen, use_reentrant=False)\n"
                     "              for piece, chosen in zip(hidden.split(chunk, dim=1), targets.split(chunk, dim=1))]",
                     "    logits = head(hidden).float()\n"
                     "    pieces = [piece.gather(-1, chosen.unsqueeze(-1)).squeeze(-1) - piece.logsumexp(-1)\n"
                     "              for piece, chosen in zip(logits.split(chunk, dim=1),\n"
                     "                                       targets.split(chunk, dim=1))]"),
        "chunks without checkpointing: every chunk's logits are kept for backward":
            _chunked("checkpoint(piece_logprobs, piece, chosen, use_reentrant=False)", "piece_logprobs(piece, chosen)"),
        "the log-softmax in the input's dtype: bf16 rounds the log-probabilities":
            _chunked("logits = head(piece).float()", "logits = head(piece)")
            .replace("return torch.cat(pieces, dim=1)", "return torch.cat(pieces, dim=1).float()"),
        "drops the head's bias":
            _chunked("logits = head(piece).float()", "logits = torch.nn.functional.linear(piece, head.weight).float()"),
        "drops the last chunk when the chunk does not divide N":
            _chunked("zip(hidden.split(chunk, dim=1), targets.split(chunk, dim=1))",
                     "zip(hidden[:, :hidden.shape[1] // chunk * chunk].split(chunk, dim=1), "
                     "targets.split(chunk, dim=1))"),
        "the log-sum-exp over the positions, not the vocabulary":
            _chunked("logits.logsumexp(-1)", "logits.logsumexp(1, keepdim=True).mean(-1)"),
        "gathers each position's next target: off by one":
            _chunked("zip(hidden.split(chunk, dim=1), targets.split(chunk, dim=1))",
                     "zip(hidden.split(chunk, dim=1), targets.roll(-1, dims=1).split(chunk, dim=1))"),
        "detaches the hidden states: no gradient reaches the model below the head":
            _chunked("zip(hidden.split(chunk, dim=1)", "zip(hidden.detach().split(chunk, dim=1)"),
        "torch.chunk's argument is a number of pieces, not positions per piece": '''
from torch.utils.checkpoint import checkpoint


def chunked_logprobs(hidden, head, targets, chunk):
    def piece_logprobs(piece, chosen):
        logits = head(piece).float()
        return logits.gather(-1, chosen.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)

    pieces = [checkpoint(piece_logprobs, piece, chosen, use_reentrant=False)
              for piece, chosen in zip(hidden.chunk(chunk, dim=1), targets.chunk(chunk, dim=1))]
    return torch.cat(pieces, dim=1)
''',
        'reentrant checkpointing (use_reentrant=True): no gradient for the head when the hidden states need none': '''
from torch.utils.checkpoint import checkpoint


def chunked_logprobs(hidden, head, targets, chunk):
    def piece_logprobs(piece, chosen):
        logits = head(piece).float()
        return logits.gather(-1, chosen.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)

    pieces = [checkpoint(piece_logprobs, piece, chosen, use_reentrant=True)
              for piece, chosen in zip(hidden.split(chunk, dim=1), targets.split(chunk, dim=1))]
    return torch.cat(pieces, dim=1)
''',
    },
}
