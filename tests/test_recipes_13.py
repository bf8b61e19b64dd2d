"""Notebook 13's recipes (the cells tagged ``recipe``) on models the notebook was not written for: a transformers
Llama (grouped-query attention) split with the tensor-parallel plan renamed to its modules, its sequence-parallel
norms' partial gradients reduced in one bucket, a plain ``nn.Sequential`` through one-stage and two-stage pipelines
(every schedule torch ships), ring and all-gather attention on Llama-shaped heads. Everything runs in this process: a
``fake`` process group (collectives return at once, no data: shapes, placements and counts are real) for the
layouts, a one-rank gloo group for the values."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from recipe_models import run_recipe, sequential_mlp, tiny_llama

# the course's Block names -> transformers' LlamaDecoderLayer names
LLAMA_NAMES = {"attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "attention": "self_attn",
               "attention.q": "self_attn.q_proj", "attention.k": "self_attn.k_proj", "attention.v": "self_attn.v_proj",
               "attention.o": "self_attn.o_proj", "mlp": "mlp", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def recipe():
    return run_recipe("13")


@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world_size: int):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def llama_plan(recipe, sequence_parallel: bool = False) -> dict:
    """The notebook's plan with Llama's names; its gated MLP's gate_proj is column-parallel like up_proj."""
    plan = {LLAMA_NAMES[name]: style for name, style in recipe["tensor_parallel_plan"](sequence_parallel).items()}
    plan["mlp.gate_proj"] = plan["mlp.up_proj"]
    # transformers calls its attention with keyword arguments: name the input instead of its position
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput
    between = Shard(1) if sequence_parallel else Replicate()
    plan["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": between},
                                           desired_input_kwarg_layouts={"hidden_states": Replicate()})
    return plan


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_plan_splits_a_llama_layer(recipe, fake_group, sequence_parallel):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    fake_group(2)                                  # 2 key/value heads: tp = 2
    model = tiny_llama()
    layer = model.model.layers[0]
    full = {name: p.shape for name, p in layer.named_parameters()}
    parallelize_module(layer, init_device_mesh("cpu", (2,)), llama_plan(recipe, sequence_parallel))
    for name, parameter in layer.named_parameters():
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        divisor = 1 if "layernorm" in name else 2          # the norms stay whole (replicated DTensors under SP)
        assert local.numel() * divisor == full[name].numel(), name
    hidden = torch.randn(2, 8 // (2 if sequence_parallel else 1), 32)
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(8)[None].expand(2, 8))
    with CommDebugMode() as comm:
        out = layer(hidden, position_embeddings=position_embeddings, attention_mask=None)
    out = out[0] if isinstance(out, tuple) else out
    assert out.shape == hidden.shape
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    expected = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2} if sequence_parallel else {"all_reduce": 2}
    assert counts == expected


def test_two_d_sharding_on_a_fake_2x2_mesh(recipe, fake_group):
    from torch.distributed.device_mesh import init_device_mesh

    from utils.model_parallel import BlockStack

    fake_group(4)
    model = BlockStack(2, 32, 4, 128)
    full = {name: p.numel() for name, p in model.named_parameters()}
    recipe["shard_2d"](model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    for name, parameter in model.named_parameters():
        divisor = 2 if "norm" in name else 4            # the norms: FSDP's dimension only
        assert parameter.to_local().numel() * divisor == full[name], name


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_recipe_trains_a_sequential_like_one_process(recipe, one_rank, schedule):
    model, reference = sequential_mlp(), sequential_mlp()
    inputs, targets = torch.randn(8, 16), torch.randn(8, 5)
    pipeline = recipe["make_pipeline_schedule"](model, 0, 1, 4, F.mse_loss, schedule)
    losses = recipe["pipeline_step"](pipeline, 0, 1, inputs, targets)
    assert len(losses) == 4
    # the schedule averages the micro-batches' gradients: the mean loss over the whole batch
    F.mse_loss(reference(inputs), targets).backward()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)


def _llama_heads(dtype: torch.dtype = torch.float32, seq: int = 16):
    """q, k, v as a transformers Llama hands them to attention: (B, heads, T, d) and (B, kv-heads, T, d), its
    grouped-query ratio (tests/recipe_models.tiny_llama: 4 heads, 2 key/value heads)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, seq, 8, generator=generator)
    k, v = (torch.randn(2, 2, seq, 8, generator=generator) for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype)


# (dtype, scale, tolerance): SDPA's default scale and another (Gemma's query_pre_attn_scalar kind), fp32 and bf16 inputs
ATTENTION_CASES = [(torch.float32, None, 1e-6), (torch.float32, 0.05, 1e-6), (torch.bfloat16, None, 2 ** -7),
                   (torch.bfloat16, 0.05, 2 ** -7)]


@pytest.mark.parametrize("dtype,scale,tolerance", ATTENTION_CASES)
def test_ring_attention_on_llama_shaped_heads(recipe, one_rank, dtype, scale, tolerance):
    # one rank: the ring has one chunk, and the causal mask by positions must still be exact
    q, k, v = _llama_heads(dtype)
    positions = recipe["sequence_chunks"](16, 1, 0, True)
    out, blocks = recipe["ring_attention"](q[:, :, positions], k[:, :, positions], v[:, :, positions], positions,
                                           positions.clone(), scale=scale)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=scale,
                                              enable_gqa=True)[:, :, positions]
    assert out.dtype == dtype and blocks == 1
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_context_parallel_recipes_refuse_heads_that_do_not_group(recipe, one_rank):
    q, k, v = torch.randn(1, 4, 8, 8), torch.randn(1, 3, 8, 8), torch.randn(1, 3, 8, 8)
    positions = torch.arange(8)
    with pytest.raises(RuntimeError, match="unflatten"):                    # 4 query heads over 3 k/v heads
        recipe["ring_attention"](q, k, v, positions, positions.clone())
    with pytest.raises(RuntimeError):
        recipe["all_gather_attention"](q, k, v, positions, positions.clone())


def test_sequence_chunks_cover_the_sequence_once(recipe):
    for cp in (1, 2, 4):
        for balanced in (False, True):
            chunks = torch.cat([recipe["sequence_chunks"](32, cp, rank, balanced) for rank in range(cp)])
            assert sorted(chunks.tolist()) == list(range(32))


def test_bucketed_reduce_of_a_llama_layers_partial_norm_gradients(recipe, fake_group):
    """Sequence parallelism leaves a transformers Llama layer's two RMSNorm gradients partial; the recipe reduces them
    in one all-reduce of both, and leaves nothing partial for the optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from utils.model_parallel import CollectiveLog

    fake_group(2)
    model = tiny_llama()
    layer = model.model.layers[0]
    parallelize_module(layer, init_device_mesh("cpu", (2,)), llama_plan(recipe, sequence_parallel=True))
    hidden = torch.randn(2, 4, 32, requires_grad=True)                      # this rank's half of 8 tokens
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(8)[None].expand(2, 8))
    out = layer(hidden, position_embeddings=position_embeddings, attention_mask=None)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    partial = [n for n, p in layer.named_parameters()
               if isinstance(p.grad, DTensor) and p.grad.placements[0].is_partial()]
    assert partial == ["input_layernorm.weight", "post_attention_layernorm.weight"]
    with CollectiveLog("reduce") as log:
        reduced = recipe["reduce_partial_gradients"](layer)
    assert reduced == partial
    assert [(r["op"], r["in_bytes"]) for r in log.records] == [("all_reduce", 2 * 32 * 4)]
    assert not any(isinstance(p.grad, DTensor) and p.grad.placements[0].is_partial() for p in layer.parameters())
    assert recipe["reduce_partial_gradients"](layer) == []                  # nothing left: no collective


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "interleaved-zero-bubble", "zbv", "dualpipev"])
def test_multi_stage_recipe_trains_a_sequential_like_one_process(recipe, one_rank, schedule):
    """Two stages on one rank (looped or V), four micro-batches: the same gradients as the whole batch at once."""
    from utils.pipeline_schedules import available_schedules

    cls = available_schedules()[schedule]
    if cls is None:
        pytest.skip(f"this torch has no {schedule} schedule")
    model, reference = sequential_mlp(), sequential_mlp()
    inputs, targets = torch.randn(8, 16), torch.randn(8, 5)
    pipeline = recipe["make_multi_stage_schedule"]({0: model[:2], 1: model[2:]}, 2, 4, F.mse_loss, cls)
    losses = recipe["pipeline_step"](pipeline, [0, 1], 2, inputs, targets)
    assert len(losses) == 4
    F.mse_loss(reference(inputs), targets).backward()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,scale,tolerance", ATTENTION_CASES)
def test_all_gather_attention_on_llama_shaped_heads(recipe, one_rank, dtype, scale, tolerance):
    q, k, v = _llama_heads(dtype)
    positions = recipe["sequence_chunks"](16, 1, 0, True)
    out = recipe["all_gather_attention"](q, k, v, positions, positions.clone(), scale=scale)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=scale,
                                              enable_gqa=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)