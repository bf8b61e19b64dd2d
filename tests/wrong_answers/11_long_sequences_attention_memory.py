"""Wrong answers to notebook 11's exercises: each must make its graded cell fail (see README.md here)."""

_MASK = '''
def mask_from_positions(position_ids, window=None):
    positions = position_ids.reshape(-1)
    document = (positions == 0).cumsum(dim=0)
    allowed = (document[:, None] == document[None, :]) & causal_mask(len(positions), positions.device, window)
    return torch.zeros(allowed.shape, device=positions.device).masked_fill(~allowed, float("-inf"))
'''


def _mask(old: str, new: str) -> str:
    """The solution with one piece replaced: one mistake."""
    assert _MASK.count(old) == 1, old
    return _MASK.replace(old, new)


WRONG = {
    "exercise_1": {
        "the math backend kept in bf16 (it computes 16-bit inputs in fp32)": '''
def predict_bf16_saved_bytes(batch, heads, seq_len, head_dim, kernel):
    vectors = batch * heads * seq_len * head_dim
    scores = batch * heads * seq_len * seq_len
    if kernel == "naive":
        return 3 * vectors * 2 + scores * 2 + seq_len * seq_len
    if kernel == "math":
        return 3 * vectors * 2 + scores * 2
    return 4 * vectors * 2 + batch * heads * seq_len * 4
''',
        "the log-sum-exp counted in bf16 (it is fp32)": '''
def predict_bf16_saved_bytes(batch, heads, seq_len, head_dim, kernel):
    vectors = batch * heads * seq_len * head_dim
    scores = batch * heads * seq_len * seq_len
    if kernel == "naive":
        return 3 * vectors * 2 + scores * 2 + seq_len * seq_len
    if kernel == "math":
        return 3 * vectors * 4 + scores * 4
    return 4 * vectors * 2 + batch * heads * seq_len * 2
''',
        "the naive attention's boolean mask forgotten": '''
def predict_bf16_saved_bytes(batch, heads, seq_len, head_dim, kernel):
    vectors = batch * heads * seq_len * head_dim
    scores = batch * heads * seq_len * seq_len
    if kernel == "naive":
        return 3 * vectors * 2 + scores * 2
    if kernel == "math":
        return 3 * vectors * 4 + scores * 4
    return 4 * vectors * 2 + batch * heads * seq_len * 4
''',
        "fp32 sizes everywhere (4 bytes per element)": '''
def predict_bf16_saved_bytes(batch, heads, seq_len, head_dim, kernel):
    vectors = batch * heads * seq_len * head_dim
    scores = batch * heads * seq_len * seq_len
    if kernel == "naive":
        return 3 * vectors * 4 + scores * 4 + seq_len * seq_len
    if kernel == "math":
        return 3 * vectors * 4 + scores * 4
    return 4 * vectors * 4 + batch * heads * seq_len * 4
''',
        "one probability matrix per batch, not per head": '''
def predict_bf16_saved_bytes(batch, heads, seq_len, head_dim, kernel):
    vectors = batch * heads * seq_len * head_dim
    scores = batch * seq_len * seq_len
    if kernel == "naive":
        return 3 * vectors * 2 + scores * 2 + seq_len * seq_len
    if kernel == "math":
        return 3 * vectors * 4 + scores * 4
    return 4 * vectors * 2 + batch * heads * seq_len * 4
''',
        "calls utils.attention_saved_bytes (the helper that computes the answer)": '''
def predict_bf16_saved_bytes(batch, heads, seq_len, head_dim, kernel):
    return utils.attention_saved_bytes(batch, heads, seq_len, head_dim, dtype=torch.bfloat16, kernel=kernel)
''',
        "measures a call with utils.track_saved_tensors instead of predicting": '''
def predict_bf16_saved_bytes(batch, heads, seq_len, head_dim, kernel):
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    with utils.track_saved_tensors() as saved:
        if kernel == "naive":
            naive_attention(q, k, v)
        else:
            with sdpa_kernel(SDPBackend.MATH if kernel == "math" else SDPBackend.FLASH_ATTENTION):
                sdpa_attention(q, k, v)
    return saved.bytes
''',
        "flash: one log-sum-exp per head, not one per query row": '''
def predict_bf16_saved_bytes(batch, heads, seq_len, head_dim, kernel):
    vectors = batch * heads * seq_len * head_dim
    scores = batch * heads * seq_len * seq_len
    if kernel == "naive":
        return 3 * vectors * 2 + scores * 2 + seq_len * seq_len
    if kernel == "math":
        return 3 * vectors * 4 + scores * 4
    return 4 * vectors * 2 + batch * heads * 4
''',
        "the naive attention's boolean mask counted at 2 bytes per element, like the bf16 scores": '''
def predict_bf16_saved_bytes(batch, heads, seq_len, head_dim, kernel):
    vectors = batch * heads * seq_len * head_dim
    scores = batch * heads * seq_len * seq_len
    if kernel == "naive":
        return 3 * vectors * 2 + scores * 2 + seq_len * seq_len * 2
    if kernel == "math":
        return 3 * vectors * 4 + scores * 4
    return 4 * vectors * 2 + batch * heads * seq_len * 4
''',
        "math: only the probabilities upcast to fp32, q, k and v kept in bf16": '''
def predict_bf16_saved_bytes(batch, heads, seq_len, head_dim, kernel):
    vectors = batch * heads * seq_len * head_dim
    scores = batch * heads * seq_len * seq_len
    if kernel == "naive":
        return 3 * vectors * 2 + scores * 2 + seq_len * seq_len
    if kernel == "math":
        return 3 * vectors * 2 + scores * 4
    return 4 * vectors * 2 + batch * heads * seq_len * 4
''',
    },
    "exercise_2": {
        "plain causal: no document boundaries (the pitfall)": _mask(
            "allowed = (document[:, None] == document[None, :]) & causal_mask(",
            "allowed = causal_mask("),
        "block-diagonal but not causal: a token sees its document's later tokens": _mask(
            "allowed = (document[:, None] == document[None, :]) & causal_mask(len(positions), positions.device, window)",
            "allowed = (document[:, None] == document[None, :])"),
        "a boundary where the position goes down misses a one-token document after another": _mask(
            "document = (positions == 0).cumsum(dim=0)",
            "document = torch.cat([positions.new_zeros(1), (positions[1:] < positions[:-1]).cumsum(dim=0)])"),
        "the sliding window left out: every earlier token of the document is seen": _mask(
            "causal_mask(len(positions), positions.device, window)", "causal_mask(len(positions), positions.device)"),
        "the window one token too wide (window + 1 keys)": _mask(
            "causal_mask(len(positions), positions.device, window)",
            "causal_mask(len(positions), positions.device, None if window is None else window + 1)"),
        "a boolean mask with True where attention is forbidden (SDPA reads True as allowed)": _mask(
            'return torch.zeros(allowed.shape, device=positions.device).masked_fill(~allowed, float("-inf"))',
            "return ~allowed"),
        "1 where allowed and 0 elsewhere (an additive mask needs 0 and -inf)": _mask(
            'return torch.zeros(allowed.shape, device=positions.device).masked_fill(~allowed, float("-inf"))',
            "return allowed.float()"),
        "documents compared with >=: a token also sees every earlier document": _mask(
            "(document[:, None] == document[None, :])", "(document[:, None] >= document[None, :])"),
        "reads 1-D position ids only: the collator's (1, S) row is not flattened": _mask(
            "positions = position_ids.reshape(-1)", "positions = position_ids"),
        "the causal part built on the CPU whatever the position ids' device": '''
def mask_from_positions(position_ids, window=None):
    positions = position_ids.reshape(-1)
    document = (positions == 0).cumsum(dim=0)
    allowed = (document[:, None] == document[None, :]) & causal_mask(len(positions), torch.device("cpu"), window)
    return torch.zeros(allowed.shape, device=positions.device).masked_fill(~allowed, float("-inf"))
''',
    },
}
