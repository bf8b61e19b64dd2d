"""Wrong answers to notebook 09's exercises: each must make its graded cell fail (see README.md here)."""

_EMBEDDING_FORWARD = '''
    def forward(self, ids):
        return self.base(ids) + F.embedding(ids, self.A.T) @ self.B.T * self.scale
'''

_EMBEDDING_CHECK = '''
        largest = min(base.num_embeddings, base.embedding_dim)
        if not isinstance(rank, int) or not 0 < rank <= largest:
            raise ValueError(f"rank must be an int in 1..{largest}, got {rank!r}")
'''

_LORA8 = '''
def lora_8bit_training_bytes(model, rank, block_size=256):
    total = 0
    for name, linear in model.named_modules():
        if isinstance(linear, nn.Linear) and name.rsplit(".", 1)[-1] not in ("head", "lm_head"):
            size = linear.weight.element_size()
            for numel in (rank * linear.in_features, linear.out_features * rank):
                total += 2 * size * numel
                total += 2 * numel + 2 * 4 * math.ceil(numel / block_size)
    return total
'''


def _lora8(old: str, new: str) -> str:
    """The solution with one piece replaced: one mistake."""
    assert old in _LORA8, old
    return _LORA8.replace(old, new)


WRONG = {
    "exercise_1": {
        "both A and B random: the adapted table does not start as the pretrained one": '''
class LoRAEmbedding(nn.Module):
    def __init__(self, base, rank, alpha=16.0):
        super().__init__()''' + _EMBEDDING_CHECK + '''
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(rank, base.num_embeddings, device=base.weight.device))
        self.B = nn.Parameter(torch.randn(base.embedding_dim, rank, device=base.weight.device))
        self.scale = alpha / rank
''' + _EMBEDDING_FORWARD,
        "the pretrained table is not frozen": '''
class LoRAEmbedding(nn.Module):
    def __init__(self, base, rank, alpha=16.0):
        super().__init__()''' + _EMBEDDING_CHECK + '''
        self.base = base
        self.A = nn.Parameter(torch.zeros(rank, base.num_embeddings, device=base.weight.device))
        self.B = nn.Parameter(torch.randn(base.embedding_dim, rank, device=base.weight.device))
        self.scale = alpha / rank
''' + _EMBEDDING_FORWARD,
        "scales by alpha, not alpha / rank": '''
class LoRAEmbedding(nn.Module):
    def __init__(self, base, rank, alpha=16.0):
        super().__init__()''' + _EMBEDDING_CHECK + '''
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.zeros(rank, base.num_embeddings, device=base.weight.device))
        self.B = nn.Parameter(torch.randn(base.embedding_dim, rank, device=base.weight.device))
        self.scale = alpha
''' + _EMBEDDING_FORWARD,
        "no check of the rank": '''
class LoRAEmbedding(nn.Module):
    def __init__(self, base, rank, alpha=16.0):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.zeros(rank, base.num_embeddings, device=base.weight.device))
        self.B = nn.Parameter(torch.randn(base.embedding_dim, rank, device=base.weight.device))
        self.scale = alpha / rank
''' + _EMBEDDING_FORWARD,
        "A and B in nn.Linear's layout: A (num, r), B (r, dim)": '''
class LoRAEmbedding(nn.Module):
    def __init__(self, base, rank, alpha=16.0):
        super().__init__()''' + _EMBEDDING_CHECK + '''
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.zeros(base.num_embeddings, rank, device=base.weight.device))
        self.B = nn.Parameter(torch.randn(rank, base.embedding_dim, device=base.weight.device))
        self.scale = alpha / rank

    def forward(self, ids):
        return self.base(ids) + F.embedding(ids, self.A) @ self.B * self.scale
''',
        "forgets the scale": '''
class LoRAEmbedding(nn.Module):
    def __init__(self, base, rank, alpha=16.0):
        super().__init__()''' + _EMBEDDING_CHECK + '''
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.zeros(rank, base.num_embeddings, device=base.weight.device))
        self.B = nn.Parameter(torch.randn(base.embedding_dim, rank, device=base.weight.device))
        self.scale = alpha / rank

    def forward(self, ids):
        return self.base(ids) + F.embedding(ids, self.A.T) @ self.B.T
''',
        "A and B both start at zero: the right start, but no gradient ever reaches them": '''
class LoRAEmbedding(nn.Module):
    def __init__(self, base, rank, alpha=16.0):
        super().__init__()''' + _EMBEDDING_CHECK + '''
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.zeros(rank, base.num_embeddings, device=base.weight.device))
        self.B = nn.Parameter(torch.zeros(base.embedding_dim, rank, device=base.weight.device))
        self.scale = alpha / rank
''' + _EMBEDDING_FORWARD,
        "builds the whole merged table in every forward: right values, a table-sized allocation per step": '''
class LoRAEmbedding(nn.Module):
    def __init__(self, base, rank, alpha=16.0):
        super().__init__()''' + _EMBEDDING_CHECK + '''
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.zeros(rank, base.num_embeddings, device=base.weight.device))
        self.B = nn.Parameter(torch.randn(base.embedding_dim, rank, device=base.weight.device))
        self.scale = alpha / rank

    def forward(self, ids):
        return F.embedding(ids, self.base.weight + self.scale * (self.B @ self.A).T)
''',
        "keeps a copy of the pretrained table, not the table it was given": '''
class LoRAEmbedding(nn.Module):
    def __init__(self, base, rank, alpha=16.0):
        super().__init__()''' + _EMBEDDING_CHECK + '''
        self.base = nn.Embedding.from_pretrained(base.weight.detach().clone(), freeze=True)
        self.A = nn.Parameter(torch.zeros(rank, base.num_embeddings, device=base.weight.device))
        self.B = nn.Parameter(torch.randn(base.embedding_dim, rank, device=base.weight.device))
        self.scale = alpha / rank
''' + _EMBEDDING_FORWARD,
        "freezes the whole adapter, A and B included: nothing trains": '''
class LoRAEmbedding(nn.Module):
    def __init__(self, base, rank, alpha=16.0):
        super().__init__()''' + _EMBEDDING_CHECK + '''
        self.base = base
        self.A = nn.Parameter(torch.zeros(rank, base.num_embeddings, device=base.weight.device))
        self.B = nn.Parameter(torch.randn(base.embedding_dim, rank, device=base.weight.device))
        self.scale = alpha / rank
        self.requires_grad_(False)
''' + _EMBEDDING_FORWARD,
        "freezes the table by giving it a new, frozen weight parameter (another storage)": '''
class LoRAEmbedding(nn.Module):
    def __init__(self, base, rank, alpha=16.0):
        super().__init__()''' + _EMBEDDING_CHECK + '''
        base.weight = nn.Parameter(base.weight.detach().clone(), requires_grad=False)
        self.base = base
        self.A = nn.Parameter(torch.zeros(rank, base.num_embeddings, device=base.weight.device))
        self.B = nn.Parameter(torch.randn(base.embedding_dim, rank, device=base.weight.device))
        self.scale = alpha / rank
''' + _EMBEDDING_FORWARD,
        "A and B made on the default device, not the table's: a CUDA table's forward fails": '''
class LoRAEmbedding(nn.Module):
    def __init__(self, base, rank, alpha=16.0):
        super().__init__()
        largest = min(base.num_embeddings, base.embedding_dim)
        if not isinstance(rank, int) or not 0 < rank <= largest:
            raise ValueError(f"rank must be an int in 1..{largest}, got {rank!r}")
        self.base = base.requires_grad_(False)
        device = torch.device('cpu')
        self.A = nn.Parameter(torch.zeros(rank, base.num_embeddings, device=device))
        self.B = nn.Parameter(torch.randn(base.embedding_dim, rank, device=device))
        self.scale = alpha / rank

    def forward(self, ids):
        return self.base(ids) + F.embedding(ids, self.A.T) @ self.B.T * self.scale
''',
    },
    "exercise_2": {
        "fp32 AdamW's 8 bytes per element instead of the 8-bit codes and scales": _lora8(
            "total += 2 * numel + 2 * 4 * math.ceil(numel / block_size)", "total += 8 * numel"),
        "forgets the per-block scales": _lora8(
            "total += 2 * numel + 2 * 4 * math.ceil(numel / block_size)", "total += 2 * numel"),
        "one scale per tensor, not per block": _lora8(
            "2 * 4 * math.ceil(numel / block_size)", "2 * 4"),
        "counts whole blocks only (floor instead of ceil)": _lora8(
            "math.ceil(numel / block_size)", "(numel // block_size)"),
        "forgets the gradients": _lora8("total += 2 * size * numel", "total += size * numel"),
        "adapters the size of the whole weight (in * out) instead of r * (in + out)": _lora8(
            "for numel in (rank * linear.in_features, linear.out_features * rank):",
            "for numel in (linear.in_features * linear.out_features,):"),
        "4-byte parameters and gradients whatever the base's dtype": _lora8(
            "size = linear.weight.element_size()", "size = 4"),
        "a block size of 256 whatever it is given": _lora8(
            "math.ceil(numel / block_size)", "math.ceil(numel / 256)"),
        "counts the head's adapters too": _lora8(
            ' and name.rsplit(".", 1)[-1] not in ("head", "lm_head")', ""),
        "counts AdamW's 4-byte step tensor per parameter (AdamW8bit keeps a Python int)": _lora8(
            "total += 2 * size * numel", "total += 2 * size * numel + 4"),
        "one dtype for every layer, the model's first parameter's": _lora8(
            "size = linear.weight.element_size()", "size = next(model.parameters()).element_size()"),
        "freezes the model while it counts: the reader's model no longer trains": _lora8(
            "    total = 0\n", "    total = 0\n    model.requires_grad_(False)\n"),
        "asks utils.predict_optimizer_state_bytes for the state (the exercise forbids it)": _lora8(
            "total += 2 * numel + 2 * 4 * math.ceil(numel / block_size)",
            "total += utils.predict_optimizer_state_bytes([(numel,)], 'adamw8bit', block_size=block_size)"),
        "skips every Linear whose path contains 'head' (a substring test)": '''
def lora_8bit_training_bytes(model, rank, block_size=256):
    total = 0
    for name, linear in model.named_modules():
        if isinstance(linear, nn.Linear) and "head" not in name:
            size = linear.weight.element_size()
            for numel in (rank * linear.in_features, linear.out_features * rank):
                total += 2 * size * numel
                total += 2 * numel + 2 * 4 * math.ceil(numel / block_size)
    return total
''',
        "compares the full dotted name with 'head': a nested head is counted": '''
def lora_8bit_training_bytes(model, rank, block_size=256):
    total = 0
    for name, linear in model.named_modules():
        if isinstance(linear, nn.Linear) and name not in ("head", "lm_head"):
            size = linear.weight.element_size()
            for numel in (rank * linear.in_features, linear.out_features * rank):
                total += 2 * size * numel
                total += 2 * numel + 2 * 4 * math.ceil(numel / block_size)
    return total
''',
    },
}
