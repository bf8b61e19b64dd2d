"""utils.attention: the saved-bytes formulas against what autograd keeps (exact on the CPU), padding, lengths."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import utils
from utils.attention import KERNELS


def naive_attention(q, k, v):
    """Notebook 11's written-out causal attention (the formula's "naive" kernel)."""
    seq = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v


def run_attention(kernel, q, k, v):
    if kernel == "naive":
        return naive_attention(q, k, v)
    backend = SDPBackend.MATH if kernel == "math" else SDPBackend.FLASH_ATTENTION
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def block_forward(block, x, kernel):
    """utils.TransformerBlock's forward with the attention chosen (what notebook 11's block_forward does)."""
    batch, seq, width = x.shape
    q, k, v = block.qkv(block.norm1(x)).split(width, dim=-1)
    q, k, v = (t.view(batch, seq, block.num_heads, -1).transpose(1, 2) for t in (q, k, v))
    x = x + block.proj(run_attention(kernel, q, k, v).transpose(1, 2).reshape(batch, seq, width))
    return x + block.mlp(block.norm2(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", [(1, 2, 8, 4), (2, 3, 17, 8), (3, 1, 5, 2), (1, 1, 1, 1)])
def test_attention_saved_bytes_equal_the_measurement(dtype, kernel, shape):
    q, k, v = (torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(3))
    with utils.track_saved_tensors() as saved:
        run_attention(kernel, q, k, v)
    assert utils.attention_saved_bytes(*shape, dtype=dtype, kernel=kernel) == saved.bytes


def test_attention_saved_bytes_by_hand():
    # B=1, H=2, L=256, D=16 in fp32: q, k, v are 32 KiB each, the probabilities 512 KiB
    assert utils.attention_saved_bytes(1, 2, 256, 16, kernel="flash") == 4 * 32768 + 2 * 256 * 4
    assert utils.attention_saved_bytes(1, 2, 256, 16, kernel="math") == 3 * 32768 + 524288
    assert utils.attention_saved_bytes(1, 2, 256, 16, kernel="naive") == 3 * 32768 + 524288 + 256 * 256
    assert utils.attention_saved_bytes(1, 2, 256, 16, kernel="naive", causal=False) == 3 * 32768 + 524288
    # 16-bit: the math backend computes in fp32, the flash kernel keeps an fp32 log-sum-exp
    assert utils.attention_saved_bytes(1, 2, 256, 16, dtype=torch.bfloat16, kernel="math") == 3 * 32768 + 524288
    assert utils.attention_saved_bytes(1, 2, 256, 16, dtype=torch.bfloat16, kernel="flash") == 4 * 16384 + 2048


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("batch,seq,width,heads,ratio", [(2, 64, 32, 4, 4), (1, 33, 24, 3, 2), (3, 16, 16, 1, 4),
                                                         (1, 16, 16, 1, 1), (2, 40, 48, 6, 3)])
def test_layer_activation_bytes_equal_the_measurement(dtype, kernel, batch, seq, width, heads, ratio):
    torch.manual_seed(0)
    block = utils.TransformerBlock(width, heads, mlp_ratio=ratio).to(dtype)
    x = torch.randn(batch, seq, width, dtype=dtype, requires_grad=True)
    with utils.track_saved_tensors(exclude=block) as saved:
        block_forward(block, x, kernel)
    predicted = utils.layer_activation_bytes(batch, seq, width, heads, dtype=dtype, attention=kernel, mlp_ratio=ratio)
    assert predicted.total_bytes == saved.bytes


def test_transformer_block_forward_is_the_flash_formula_on_the_cpu():
    # utils.TransformerBlock's own forward calls SDPA, which picks the flash kernel on a CPU
    block = utils.TransformerBlock(32, 4)
    x = torch.randn(2, 64, 32, requires_grad=True)
    with utils.track_saved_tensors(exclude=block) as saved:
        block(x)
    assert utils.layer_activation_bytes(2, 64, 32, 4).total_bytes == saved.bytes == 266240


def test_layer_activations_split_and_crossover():
    layer = utils.layer_activation_bytes(1, 1024, 64, 4, attention="naive")
    per_token = 16 * 64 * 4 + 4 * 4                              # 16 vectors of fp32, four norm statistics
    assert layer.linear_bytes == 1024 * per_token
    assert layer.quadratic_bytes == 4 * 1024**2 * 4 + 1024**2     # probabilities and the boolean mask
    assert layer.total_bytes == layer.linear_bytes + layer.quadratic_bytes
    assert layer.crossover_length == pytest.approx(per_token / 17)
    assert utils.layer_activation_bytes(1, 99, 64, 4, attention="naive").crossover_length == \
        pytest.approx(layer.crossover_length)                     # independent of the length
    fused = utils.layer_activation_bytes(1, 1024, 64, 4, attention="flash")
    assert fused.quadratic_bytes == 0 and fused.crossover_length == math.inf
    assert fused.linear_bytes == 1024 * (per_token + 4 * 4)      # plus an fp32 log-sum-exp per head


def test_layer_statistics_are_fp32_on_cuda_for_16_bit():
    cpu = utils.layer_activation_bytes(2, 8, 16, 2, dtype=torch.bfloat16, device="cpu")
    cuda = utils.layer_activation_bytes(2, 8, 16, 2, dtype=torch.bfloat16, device="cuda")
    assert cuda.total_bytes - cpu.total_bytes == 2 * 8 * 4 * (4 - 2)     # four statistics per token, 2 bytes more each
    fp32 = torch.float32
    assert utils.layer_activation_bytes(2, 8, 16, 2, dtype=fp32, device="cuda") == \
        utils.layer_activation_bytes(2, 8, 16, 2, dtype=fp32, device="cpu")


def test_playbook_formula_and_its_difference_from_the_block():
    s, b, h, a = 2048, 1, 4096, 32
    assert utils.playbook_layer_activation_bytes(s, b, h, a) == s * b * h * 34 + 5 * a * s * s * b
    ours = utils.layer_activation_bytes(b, s, h, a, dtype=torch.bfloat16, attention="naive")
    # the block lacks dropout (2·s·b·h masks, 3·a·s²·b for attention's) and keeps the statistics and the mask
    extra = 4 * s * b * 2 + s * s
    dropout = 2 * s * b * h + 3 * a * s * s * b
    assert ours.total_bytes + dropout - extra == utils.playbook_layer_activation_bytes(s, b, h, a)


def test_padding_fraction():
    assert utils.padding_fraction([3, 1, 4]) == pytest.approx(1 / 3)
    assert utils.padding_fraction([5, 5]) == 0
    assert utils.padding_fraction([2, 2], pad_to=4) == 0.5
    assert utils.padding_fraction(torch.tensor([1, 3])) == pytest.approx(1 / 3)


def test_sample_document_lengths():
    lengths = utils.sample_document_lengths(2000, mean_length=100, max_length=10_000, seed=3)
    assert lengths == utils.sample_document_lengths(2000, mean_length=100, max_length=10_000, seed=3)
    assert all(isinstance(n, int) and 1 <= n <= 10_000 for n in lengths)
    assert 85 < sum(lengths) / len(lengths) < 115                 # the log-normal's mean
    assert sorted(lengths)[len(lengths) // 2] < 80                 # heavy-tailed: the median is below the mean
    clipped = utils.sample_document_lengths(200, mean_length=100, max_length=64, min_length=2, seed=0)
    assert max(clipped) == 64 and min(clipped) >= 2
    state = torch.random.get_rng_state()
    utils.sample_document_lengths(5, mean_length=10, max_length=20)
    assert torch.equal(state, torch.random.get_rng_state()), "the global random state is untouched"


@pytest.mark.parametrize("call,message", [
    (lambda: utils.attention_saved_bytes(1, 2, 0, 16), "seq_len must be a positive int"),
    (lambda: utils.attention_saved_bytes(1, 2, -5, 16), "seq_len must be a positive int"),
    (lambda: utils.attention_saved_bytes(1, 2, 8, 16, kernel="xformers"), "kernel must be one of"),
    (lambda: utils.attention_saved_bytes(1.0, 2, 8, 16), "batch must be a positive int"),
    (lambda: utils.layer_activation_bytes(1, 128, 64, 6), r"num_heads \(6\) must divide d_model \(64\)"),
    (lambda: utils.layer_activation_bytes(1, 0, 64, 4), "seq_len must be a positive int"),
    (lambda: utils.layer_activation_bytes(1, 8, 64, 4, attention="sdpa"), "must be one of"),
    (lambda: utils.layer_activation_bytes(1, 8, 64, 4, mlp_ratio=0), "mlp_ratio must be a positive int"),
    (lambda: utils.playbook_layer_activation_bytes(0, 1, 64, 4), "seq_len must be a positive int"),
    (lambda: utils.padding_fraction([]), "non-empty sequence of positive ints"),
    (lambda: utils.padding_fraction([3, 0]), r"lengths\[1\] must be a positive int"),
    (lambda: utils.padding_fraction([3, True]), r"lengths\[1\] must be a positive int"),
    (lambda: utils.padding_fraction("abc"), "non-empty sequence of positive ints"),
    (lambda: utils.padding_fraction([3, 5], pad_to=4), r"pad_to \(4\) must be at least the longest document \(5"),
    (lambda: utils.sample_document_lengths(0, mean_length=10, max_length=20), "num_documents must be a positive int"),
    (lambda: utils.sample_document_lengths(4, mean_length=0, max_length=20), "mean_length must be a finite number > 0"),
    (lambda: utils.sample_document_lengths(4, mean_length=10, max_length=2, min_length=3),
     r"min_length \(3\) must not"),
])
def test_bad_input_gets_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_dtype_must_be_a_floating_torch_dtype():
    with pytest.raises(TypeError, match="floating-point torch.dtype"):
        utils.attention_saved_bytes(1, 2, 8, 16, dtype=torch.int64)
    with pytest.raises(TypeError, match="floating-point torch.dtype"):
        utils.layer_activation_bytes(1, 8, 64, 4, dtype="float32")
