"""utils.lowbit's formulas for notebook 10 (fewer bits): formats from their bits, NF4 bytes, bytes per method; and the
notebook's sizing of its bf16 sections from a probe of the machine's bf16 (faked here: a CPU without native bf16)."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import torch

from utils import lowbit
from utils.formats import FAKE_SLOWDOWN_VARIABLE, FormatSpeed


@pytest.mark.parametrize("name", sorted(lowbit.FORMATS))
def test_float_format_matches_torch_finfo(name):
    spec = lowbit.float_format(name)
    info = torch.finfo(spec["dtype"])
    assert (spec["max"], spec["smallest_normal"], spec["eps"], spec["bits"]) == \
        (info.max, info.smallest_normal, info.eps, info.bits)


def test_unknown_format_names_the_known_ones():
    with pytest.raises(ValueError, match="e4m3"):
        lowbit.float_format("fp4")


def test_nf4_bytes_with_and_without_double_quantisation():
    assert lowbit.nf4_storage_bytes(4096, 64, double_quant=False) == 2048 + 4 * 64
    # 64 blocks: 64 int8 absmaxes, one fp32 scale for them (64 < 256), one fp32 offset
    assert lowbit.nf4_storage_bytes(4096, 64, double_quant=True) == 2048 + 64 + 4 + 4
    bits = 8 * lowbit.nf4_storage_bytes(4096 * 4096) / (4096 * 4096)
    assert math.isclose(bits, 4.127, abs_tol=2e-3)          # QLoRA's figure


@pytest.mark.parametrize("numel, block", [(100, 64), (128, 63), (128, 0), (128, 2.0)])
def test_nf4_bytes_refuse_a_block_size_that_does_not_divide(numel, block):
    with pytest.raises((ValueError, TypeError), match="block_size"):
        lowbit.nf4_storage_bytes(numel, block)


def test_llama_shapes_give_the_published_parameter_counts():
    for shape, expected in [((32, 4096, 11008, 32000, 32), 6_738_415_616),
                            ((80, 8192, 28672, 32000, 64, 8), 68_976_648_192)]:
        linears, other = lowbit.llama_shapes(*shape)
        assert sum(o * i for o, i in linears) + other == expected
    with pytest.raises(ValueError, match="num_heads"):
        lowbit.llama_shapes(2, 100, 200, 10, 3)


def test_training_state_bytes_per_method():
    shapes, other = [(128, 64), (64, 128)], 100
    linear = 2 * 128 * 64
    adapters = 16 * lowbit.lora_parameters(shapes, 4)
    assert lowbit.lora_parameters(shapes, 4) == 4 * (64 + 128) * 2
    assert lowbit.training_state_bytes("full", shapes, other) == 16 * (linear + other)
    assert lowbit.training_state_bytes("fp8", shapes, other) == 16 * (linear + other)
    assert lowbit.training_state_bytes("bf16-sr", shapes, other) == 8 * (linear + other)
    assert lowbit.training_state_bytes("bf16-kahan", shapes, other) == 10 * (linear + other)
    assert lowbit.training_state_bytes("lora", shapes, other, lora_rank=4) == 2 * (linear + other) + adapters
    nf4 = 2 * lowbit.nf4_storage_bytes(128 * 64)
    assert lowbit.training_state_bytes("qlora", shapes, other, lora_rank=4) == nf4 + 2 * other + adapters
    assert lowbit.training_state_bytes("qlora-prepared", shapes, other, lora_rank=4) == nf4 + 4 * other + adapters


def test_training_state_bytes_refuses_unknown_methods_and_counts():
    with pytest.raises(ValueError, match="qlora"):
        lowbit.training_state_bytes("int4", [], 10)
    with pytest.raises(ValueError, match="other_parameters"):
        lowbit.training_state_bytes("full", [], -1)


def test_bitsandbytes_table_is_sorted_and_symmetric_at_the_ends():
    table = lowbit.NF4_BITSANDBYTES
    assert len(table) == 16 and list(table) == sorted(table) and table[0] == -1 and table[-1] == 1 and 0.0 in table


def _to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Notebook 10's tensorwise cast: (x * scale) in e4m3 and the fp32 scale that put x's amax at 448."""
    scale = torch.finfo(torch.float8_e4m3fn).max / x.abs().amax().float()
    return (x.float() * scale).to(torch.float8_e4m3fn), scale


def test_scaled_mm_takes_dequantising_scales_and_a_column_major_second_operand():
    # notebook 10's conventions for torch._scaled_mm (its GPU timing relies on them): scale_a and scale_b are
    # 1 / the quantising scale, as fp32 tensors, and the (N, K) weight is passed transposed (column-major)
    torch.manual_seed(0)
    x, w = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(48, 64, dtype=torch.bfloat16)
    (x8, x_scale), (w8, w_scale) = _to_fp8(x), _to_fp8(w)
    assert w8.T.stride() == (1, 64)                                   # column-major (K, N)
    try:
        native = torch._scaled_mm(x8, w8.T, scale_a=x_scale.reciprocal(), scale_b=w_scale.reciprocal(),
                                  out_dtype=torch.bfloat16)
    except RuntimeError as error:       # oneDNN has no FP8 matmul for every CPU (none on AVX2 only)
        pytest.skip(f"torch._scaled_mm does not run on this {torch.backends.cpu.get_cpu_capability()} CPU: {error}")
    emulated = (x8.float() / x_scale) @ (w8.float() / w_scale).T
    assert native.shape == (32, 48) and native.dtype == torch.bfloat16
    assert ((native.float() - emulated).norm() / emulated.norm()).item() < 2 ** -8   # bf16 output rounding


def test_round_to_nearest_keeps_exactly_the_weights_whose_first_update_was_lost():
    # notebook 10, section 4: same-sign updates in bf16 either never move a weight or move it every so often
    torch.manual_seed(0)
    weights = (torch.randn(20000) * 0.05).to(torch.bfloat16)
    signs = torch.randint(0, 2, weights.shape) * 2.0 - 1
    step = 1e-4
    lost = (weights.float() + step * signs).to(torch.bfloat16) == weights
    current = weights.clone()
    for _ in range(32):
        current = (current.float() + step * signs).to(torch.bfloat16)
    assert 0 < lost.float().mean() < 1
    assert torch.equal(current == weights, lost)


def test_adamw_bf16_refuses_fp32_parameters_before_updating_any():
    bf16, fp32 = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)), torch.nn.Parameter(torch.ones(3))
    bf16.grad, fp32.grad = torch.ones_like(bf16), torch.ones_like(fp32)
    optimizer = lowbit.AdamWBF16([bf16, fp32], lr=0.1)
    with pytest.raises(TypeError, match=r"expects torch.bfloat16 parameters .*torch.float32.*torch.optim.AdamW"):
        optimizer.step()
    assert torch.equal(bf16.detach(), torch.ones(3, dtype=torch.bfloat16)) and not optimizer.state


# --- issue 45: the notebook sizes its bf16 sections from a probe of this machine's bf16 -----------------------------

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "10_fewer_bits_4bit_bf16_fp8.ipynb"


def _cell_source(cell_id: str) -> str:
    cell = next(c for c in json.loads(NOTEBOOK.read_text())["cells"] if c.get("id") == cell_id)
    return "".join(cell["source"])


def _sizes(monkeypatch, slowdown: str) -> tuple[dict, str]:
    """The notebook's parameters and probe cells, run in full mode on a CPU with the probe faked to ``slowdown``."""
    monkeypatch.setenv("PYTORCH_INTRO_CHECK_MODE", "0")
    monkeypatch.setenv(FAKE_SLOWDOWN_VARIABLE, slowdown)
    namespace: dict = {}
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        for cell_id in ("c01-parameters", "c02c-bf16-probe"):
            exec(compile(_cell_source(cell_id), f"notebook 10, {cell_id}", "exec"), namespace)
    return namespace, output.getvalue()


def test_a_slow_bf16_probe_scales_the_bf16_sections(monkeypatch):
    p, printed = _sizes(monkeypatch, "bfloat16=40")
    speed = FormatSpeed(torch.bfloat16, "cpu", 40.0, faked=True)
    assert p["DEVICE"].type == "cpu" and speed.slow
    # 60 steps -> 12, 8 sequences -> 2, 64 tokens -> 16, 512 timed tokens -> 64: the bf16 work cut about 80 times
    assert (p["BF16_TRAIN_STEPS"], p["BF16_TRAIN_BATCH"], p["BF16_TRAIN_SEQ_LEN"], p["DEQUANT_TIMING_TOKENS"]) == \
        (speed.scale(p["TRAIN_STEPS"], minimum=p["MIN_TRAIN_STEPS"]), speed.scale(p["BATCH_SIZE"], minimum=2),
         speed.scale(p["SEQ_LEN"], minimum=16), speed.scale(p["BATCH_SIZE"] * p["SEQ_LEN"], minimum=64)) == \
        (12, 2, 16, 64)
    assert "40.0x fp32's time" in printed and "faked" in printed
    assert "section 4's training steps 60 -> 12" in printed and "section 2's timed tokens 512 -> 64" in printed


def test_a_native_bf16_probe_keeps_every_size(monkeypatch):
    p, printed = _sizes(monkeypatch, "bfloat16=0.5")
    assert (p["BF16_TRAIN_STEPS"], p["BF16_TRAIN_BATCH"], p["BF16_TRAIN_SEQ_LEN"], p["DEQUANT_TIMING_TOKENS"]) == \
        (p["TRAIN_STEPS"], p["BATCH_SIZE"], p["SEQ_LEN"], p["BATCH_SIZE"] * p["SEQ_LEN"])
    assert "nothing, every section keeps its size" in printed


def test_the_bf16_sections_use_the_sizes_the_probe_derives():
    training = _cell_source("c44-curves")
    assert "range(BF16_TRAIN_STEPS)" in training and "16 * BF16_TRAIN_BATCH, BF16_TRAIN_SEQ_LEN" in training
    assert "range(TRAIN_STEPS)" not in training and "BATCH_SIZE" not in training.replace("BF16_TRAIN_BATCH", "")
    assert "DEQUANT_TIMING_TOKENS" in _cell_source("c25e-dequant-time")
