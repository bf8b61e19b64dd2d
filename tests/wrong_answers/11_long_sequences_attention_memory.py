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
    },
}
