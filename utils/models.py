"""Small models written here (torchvision does not install with this torch), plus synthetic data.

Introduced in notebook 00; every notebook builds its subject from these so that sizes are set by
the parameters cell and nothing is downloaded.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .checks import positive_int


class MLP(nn.Module):
    """A multilayer perceptron: ``num_hidden_layers`` blocks of Linear + ReLU (+ Dropout), then a Linear.

    Args:
        in_features: input width.
        hidden_features: width of every hidden layer.
        out_features: output width (classes).
        num_hidden_layers: how many Linear + ReLU blocks come before the output layer.
        dropout: dropout probability after each ReLU (0 turns it off).

    Shapes: (batch, in_features) -> (batch, out_features).
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: int,
                 num_hidden_layers: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        for name, value in [("in_features", in_features), ("hidden_features", hidden_features),
                            ("out_features", out_features), ("num_hidden_layers", num_hidden_layers)]:
            positive_int(name, value)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.in_features = in_features
        self.hidden_features = hidden_features
        self.out_features = out_features
        self.num_hidden_layers = num_hidden_layers
        self.dropout = dropout
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(num_hidden_layers):
            layers += [nn.Linear(width, hidden_features), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = hidden_features
        layers.append(nn.Linear(width, out_features))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class SmallConvNet(nn.Module):
    """A small image classifier: conv blocks (Conv3x3 + BatchNorm + ReLU, stride 2), pooling, Linear.

    Args:
        in_channels: image channels (3 for RGB).
        num_classes: output classes.
        width: channels of the first block; each block doubles it.
        num_blocks: how many stride-2 conv blocks.
        batchnorm: use BatchNorm2d after each conv (notebook 02 shows how it breaks gradient
            accumulation's equivalence).

    Shapes: (batch, in_channels, H, W) -> (batch, num_classes).
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 16,
                 num_blocks: int = 3, batchnorm: bool = True) -> None:
        super().__init__()
        for name, value in [("in_channels", in_channels), ("num_classes", num_classes),
                            ("width", width), ("num_blocks", num_blocks)]:
            positive_int(name, value)
        blocks: list[nn.Module] = []
        channels = in_channels
        for index in range(num_blocks):
            out_channels = width * 2**index
            blocks.append(nn.Sequential(
                nn.Conv2d(channels, out_channels, 3, stride=2, padding=1, bias=not batchnorm),
                nn.BatchNorm2d(out_channels) if batchnorm else nn.Identity(),
                nn.ReLU(),
            ))
            channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.blocks(images)              # (B, C, H', W')
        pooled = features.mean(dim=(2, 3))          # (B, C)
        return self.head(pooled)


class TransformerBlock(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP, each with a residual.

    Shapes: (batch, seq, d_model) -> (batch, seq, d_model).
    """

    def __init__(self, d_model: int, num_heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        positive_int("d_model", d_model)
        positive_int("num_heads", num_heads)
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d_model, dim=-1)   # 3 x (B, T, C)
        # (B, T, C) -> (B, heads, T, C/heads) so that each head attends separately
        q, k, v = (t.view(batch, seq, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attended = attended.transpose(1, 2).reshape(batch, seq, d_model)
        x = x + self.dropout(self.proj(attended))
        return x + self.dropout(self.mlp(self.norm2(x)))


class TinyTransformer(nn.Module):
    """A small decoder-only language model: embeddings, ``num_layers`` blocks, a final norm and head.

    ``self.blocks`` is an ``nn.ModuleList`` so that notebooks can checkpoint blocks one by one.

    Args:
        vocab_size: tokens in the vocabulary.
        d_model: width of the residual stream.
        num_heads: attention heads per block.
        num_layers: transformer blocks.
        max_seq_len: longest sequence the position embedding covers.
        mlp_ratio: hidden width of each block's MLP, as a multiple of ``d_model``.
        dropout: dropout probability inside blocks.

    Shapes: tokens (batch, seq) of int64 -> logits (batch, seq, vocab_size).
    """

    def __init__(self, vocab_size: int = 256, d_model: int = 64, num_heads: int = 4, num_layers: int = 2,
                 max_seq_len: int = 128, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        for name, value in [("vocab_size", vocab_size), ("num_layers", num_layers),
                            ("max_seq_len", max_seq_len), ("mlp_ratio", mlp_ratio)]:
            positive_int(name, value)
        self.max_seq_len = max_seq_len
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, num_heads, mlp_ratio, dropout)
                                    for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq), got shape {tuple(tokens.shape)}")
        seq = tokens.shape[1]
        if seq > self.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.max_seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_classification_data(num_samples: int, in_features: int, num_classes: int, *,
                             seed: int = 0, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic classification set: labels come from a fixed random linear teacher.

    Returns:
        ``(features, labels)`` of shapes (num_samples, in_features) float32 and (num_samples,) int64.
    """
    for name, value in [("num_samples", num_samples), ("in_features", in_features), ("num_classes", num_classes)]:
        positive_int(name, value)
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(num_samples, in_features, generator=generator)
    teacher = torch.randn(in_features, num_classes, generator=generator) / math.sqrt(in_features)
    labels = (features @ teacher).argmax(dim=1)
    return features.to(device), labels.to(device)


def make_token_data(num_sequences: int, seq_len: int, vocab_size: int, *, seed: int = 0,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic next-token data with structure a small model can learn (a noisy counting pattern).

    Returns:
        ``(inputs, targets)``, both (num_sequences, seq_len) int64; targets are inputs shifted by one.
    """
    for name, value in [("num_sequences", num_sequences), ("seq_len", seq_len), ("vocab_size", vocab_size)]:
        positive_int(name, value)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab_size, (num_sequences, 1), generator=generator)
    steps = torch.randint(1, 4, (num_sequences, 1), generator=generator)
    sequence = (starts + steps * torch.arange(seq_len + 1)) % vocab_size  # (N, T+1)
    return sequence[:, :-1].to(device), sequence[:, 1:].to(device)
