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
    },
    "exercise_2": {
        "fp32 AdamW's 8 bytes per element instead of the 8-bit codes and scales": '''
def lora_8bit_training_bytes(model, rank, block_size=256):
    total = 0
    for block in model.blocks:
        for linear in (block.qkv, block.proj, block.mlp[0], block.mlp[2]):
            for numel in (rank * linear.in_features, linear.out_features * rank):
                total += 4 * numel + 4 * numel + 8 * numel
    return total
''',
        "forgets the per-block scales": '''
def lora_8bit_training_bytes(model, rank, block_size=256):
    total = 0
    for block in model.blocks:
        for linear in (block.qkv, block.proj, block.mlp[0], block.mlp[2]):
            for numel in (rank * linear.in_features, linear.out_features * rank):
                total += 4 * numel + 4 * numel + 2 * numel
    return total
''',
        "one scale per tensor, not per block": '''
def lora_8bit_training_bytes(model, rank, block_size=256):
    total = 0
    for block in model.blocks:
        for linear in (block.qkv, block.proj, block.mlp[0], block.mlp[2]):
            for numel in (rank * linear.in_features, linear.out_features * rank):
                total += 4 * numel + 4 * numel + 2 * numel + 2 * 4
    return total
''',
        "counts whole blocks only (floor instead of ceil)": '''
def lora_8bit_training_bytes(model, rank, block_size=256):
    total = 0
    for block in model.blocks:
        for linear in (block.qkv, block.proj, block.mlp[0], block.mlp[2]):
            for numel in (rank * linear.in_features, linear.out_features * rank):
                total += 4 * numel + 4 * numel + 2 * numel + 2 * 4 * (numel // block_size)
    return total
''',
        "forgets the gradients": '''
def lora_8bit_training_bytes(model, rank, block_size=256):
    total = 0
    for block in model.blocks:
        for linear in (block.qkv, block.proj, block.mlp[0], block.mlp[2]):
            for numel in (rank * linear.in_features, linear.out_features * rank):
                total += 4 * numel + 2 * numel + 2 * 4 * math.ceil(numel / block_size)
    return total
''',
        "adapters the size of the whole weight (in * out) instead of r * (in + out)": '''
def lora_8bit_training_bytes(model, rank, block_size=256):
    total = 0
    for block in model.blocks:
        for linear in (block.qkv, block.proj, block.mlp[0], block.mlp[2]):
            numel = linear.in_features * linear.out_features
            total += 4 * numel + 4 * numel + 2 * numel + 2 * 4 * math.ceil(numel / block_size)
    return total
''',
    },
}
