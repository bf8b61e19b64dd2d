"""Wrong answers to notebook 11's exercises: each must make its graded cell fail (see README.md here)."""

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
        "plain causal: no document boundaries (the pitfall)": '''
def mask_from_positions(position_ids):
    size = len(position_ids)
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    return torch.zeros(size, size).masked_fill(~causal, float("-inf"))
''',
        "block-diagonal but not causal: a token sees its document's later tokens": '''
def mask_from_positions(position_ids):
    document = (position_ids == 0).cumsum(dim=0)
    allowed = document[:, None] == document[None, :]
    size = len(position_ids)
    return torch.zeros(size, size).masked_fill(~allowed, float("-inf"))
''',
        "a boundary where the position goes down misses a one-token document": '''
def mask_from_positions(position_ids):
    drops = (position_ids[1:] < position_ids[:-1]).long()
    document = torch.cat([torch.zeros(1, dtype=torch.long), drops.cumsum(dim=0)])
    size = len(position_ids)
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    allowed = (document[:, None] == document[None, :]) & causal
    return torch.zeros(size, size).masked_fill(~allowed, float("-inf"))
''',
        "a boolean mask with True where attention is forbidden (SDPA reads True as allowed)": '''
def mask_from_positions(position_ids):
    document = (position_ids == 0).cumsum(dim=0)
    size = len(position_ids)
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    return ~((document[:, None] == document[None, :]) & causal)
''',
        "causal by position inside the document, compared across documents": '''
def mask_from_positions(position_ids):
    allowed = position_ids[None, :] <= position_ids[:, None]
    size = len(position_ids)
    return torch.zeros(size, size).masked_fill(~allowed, float("-inf"))
''',
        "a boolean mask, True where attention is allowed (the graded cell asks for SDPA's float mask)": '''
def mask_from_positions(position_ids):
    document = (position_ids == 0).cumsum(dim=0)
    size = len(position_ids)
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    return (document[:, None] == document[None, :]) & causal
''',
        "1 where allowed and 0 elsewhere (an additive mask needs 0 and -inf)": '''
def mask_from_positions(position_ids):
    document = (position_ids == 0).cumsum(dim=0)
    size = len(position_ids)
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    return ((document[:, None] == document[None, :]) & causal).float()
''',
        "triu instead of tril: a token sees the later tokens of its document, not the earlier": '''
def mask_from_positions(position_ids):
    document = (position_ids == 0).cumsum(dim=0)
    size = len(position_ids)
    causal = torch.ones(size, size, dtype=torch.bool).triu()
    allowed = (document[:, None] == document[None, :]) & causal
    return torch.zeros(size, size).masked_fill(~allowed, float("-inf"))
''',
        "documents compared with >=: a token also sees every earlier document": '''
def mask_from_positions(position_ids):
    document = (position_ids == 0).cumsum(dim=0)
    size = len(position_ids)
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    allowed = (document[:, None] >= document[None, :]) & causal
    return torch.zeros(size, size).masked_fill(~allowed, float("-inf"))
''',
    },
}
