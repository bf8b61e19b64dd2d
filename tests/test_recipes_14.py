"""Notebook 14's recipes (the cells tagged ``recipe``) on models the notebook was not written for: the MoE layer
swapped into whole transformers Mixtral, Qwen3-MoE (with and without ``norm_topk_prob``, with a dense layer among
the sparse ones) and OLMoE models, trained on the reader's padded dict batches from a DataLoader; in bf16; the
blocks it must refuse (Qwen2-MoE's and DeepSeek-V3's shared experts, gpt-oss's biased experts, router jitter, another
activation); the load-balancing loss against transformers' own for k = 1, 2, 3 with and without padding; the padded
and grouped experts against the loop on uneven routings; the expert-parallel layer on a one-rank gloo group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from recipe_models import padded_dict_batches, run_recipe
from utils import moe

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def recipe():
    return run_recipe("14")


def build(family: str, dtype: torch.dtype = torch.float32, **overrides):
    import transformers

    torch.manual_seed(0)
    config = moe.hf_moe_config(family, vocab_size=128, **overrides)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype)


def swap(recipe, model) -> list:
    """What a reader does: every decoder layer whose mlp is a supported sparse block gets the notebook's layer."""
    swapped = []
    for layer in model.model.layers:
        if type(layer.mlp).__name__ in recipe["SUPPORTED_BLOCKS"]:
            layer.mlp = recipe["moe_from_transformers"](layer.mlp)
            swapped.append(layer.mlp)
    return swapped


def expert_grads(model) -> list[torch.Tensor]:
    """The router's and the experts' gradients of every sparse layer, whichever layer holds them."""
    grads = []
    for layer in model.model.layers:
        mlp = layer.mlp
        if hasattr(mlp, "gate_up") and not hasattr(mlp, "experts"):          # the notebook's layer
            grads += [mlp.router.grad, mlp.gate_up.grad, mlp.down.grad]
        elif hasattr(mlp, "experts"):                                      # transformers' block
            grads += [mlp.gate.weight.grad, mlp.experts.gate_up_proj.grad, mlp.experts.down_proj.grad]
    return grads


@pytest.mark.parametrize("family, overrides", [
    ("mixtral", {}),
    ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": True, "num_experts_per_tok": 3}),
    ("qwen3_moe", {"mlp_only_layers": [1]}),          # layer 1 is a dense MLP: left as it is
    ("olmoe", {"num_experts_per_tok": 1}),
])
def test_swapped_layer_trains_like_the_transformers_block_on_padded_batches(recipe, family, overrides):
    batch = padded_dict_batches(batch_size=3, size=6, vocab=128)[0]
    assert (batch["attention_mask"] == 0).any(), "the batch must hold padding"
    original, ours = build(family, **overrides), build(family, **overrides)
    swapped = swap(recipe, ours)
    assert len(swapped) == (1 if overrides.get("mlp_only_layers") else 2)
    theirs_out = original(**batch, output_router_logits=True)
    ours_out = ours(**batch)
    assert (ours_out.logits - theirs_out.logits).abs().max() < TOLERANCE
    aux = recipe["load_balancing_loss"]([m.router_logits for m in swapped], original.config.num_experts_per_tok,
                                        batch["attention_mask"])
    assert abs(aux - theirs_out.aux_loss) < TOLERANCE                  # padding left out, layers pooled
    theirs_loss = F.cross_entropy(theirs_out.logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
    theirs_loss.backward()
    ours_out.loss.backward()
    for a, b in zip(expert_grads(ours), expert_grads(original), strict=True):
        assert (a - b).abs().max() < TOLERANCE


def test_swapped_layer_in_bf16(recipe):
    original, ours = build("mixtral", torch.bfloat16), build("mixtral", torch.bfloat16)
    swapped = swap(recipe, ours)
    assert all(m.gate_up.dtype == torch.bfloat16 for m in swapped)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    theirs, mine = original(input_ids=ids).logits.float(), ours(input_ids=ids).logits.float()
    # Mixtral weights its experts' bf16 outputs by fp32 router weights, the layer by bf16 ones: bf16 rounding apart
    assert (mine - theirs).abs().max() <= 2e-2 * theirs.abs().max()
    assert mine.dtype == torch.float32 and ours.model.layers[0].mlp.router_logits.dtype == torch.bfloat16


def _qwen2_moe_block():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    return Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(hidden_size=16, moe_intermediate_size=8,
                                                 shared_expert_intermediate_size=8, num_experts=4))


def _deepseek_v3_block():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    return DeepseekV3MoE(DeepseekV3Config(hidden_size=16, moe_intermediate_size=8, n_routed_experts=4,
                                          num_experts_per_tok=2, n_group=1, topk_group=1))


def _gpt_oss_block():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    return GptOssMLP(GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2))


@pytest.mark.parametrize("make_block, words", [
    (_qwen2_moe_block, "Qwen2MoeSparseMoeBlock is not a router with SwiGLU experts alone"),
    (_deepseek_v3_block, "DeepseekV3MoE is not a router with SwiGLU experts alone"),
    (_gpt_oss_block, "GptOssMLP is not a router with SwiGLU experts alone"),
    (lambda: build("mixtral", router_jitter_noise=0.01).model.layers[0].mlp, "router jitter 0.01"),
    (lambda: build("qwen3_moe", hidden_act="gelu").model.layers[0].mlp, "activation 'gelu' (expected 'silu')"),
])
def test_blocks_it_does_not_model_are_refused(recipe, make_block, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        recipe["moe_from_transformers"](make_block())


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_load_balancing_loss_is_transformers(recipe, top_k, padded):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    generator = torch.Generator().manual_seed(top_k)
    logits = tuple(torch.randn(2 * 7, 6, generator=generator) * 3 for _ in range(3))    # 3 layers, B = 2, L = 7
    mask = None
    if padded:
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[0, 4:] = 0
    ours = recipe["load_balancing_loss"](logits, top_k, mask)
    assert abs(ours - load_balancing_loss_func(logits, 6, top_k, mask)) < 1e-6
    one_layer = recipe["load_balancing_loss"](logits[0], top_k, mask)        # a bare tensor is one layer
    assert abs(one_layer - load_balancing_loss_func(logits[:1], 6, top_k, mask)) < 1e-6


def uneven_routing(tokens: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    """k distinct experts per token, most tokens on the first experts, some experts with none."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=generator) + torch.linspace(2, 0, num_experts)
    scores[:, -1] = -1                                                   # the last expert gets nothing
    return scores.topk(top_k, dim=-1).indices


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_padded_and_grouped_experts_equal_the_loop(recipe, top_k):
    torch.manual_seed(0)
    width, ffn, num_experts, tokens = 8, 12, 6, 20
    gate_up = torch.randn(num_experts, 2 * ffn, width, requires_grad=True)
    down = torch.randn(num_experts, width, ffn, requires_grad=True)
    x = torch.randn(tokens, width)
    order, token_index, counts = recipe["dispatch"](uneven_routing(tokens, num_experts, top_k, top_k), num_experts)
    assert counts[-1] == 0 and counts.sum() == tokens * top_k
    xs = x[token_index]
    grad = torch.randn(tokens * top_k, width)
    loop = recipe["run_experts"](xs, counts, gate_up, down)
    reference = torch.autograd.grad(loop, [gate_up, down], grad)
    variants = [recipe["run_experts_padded"]]
    if moe.grouped_mm_support() is None:
        variants.append(recipe["run_experts_grouped"])
    for experts_fn in variants:
        out = experts_fn(xs, counts, gate_up, down)
        assert (out - loop).abs().max() < TOLERANCE
        for a, b in zip(torch.autograd.grad(out, [gate_up, down], grad), reference):
            assert (a - b).abs().max() < 1e-4


def test_capacity_drops_the_rows_beyond_it_in_token_order(recipe):
    torch.manual_seed(0)
    num_experts, width, ffn = 4, 8, 8
    gate_up, down = torch.randn(num_experts, 2 * ffn, width), torch.randn(num_experts, width, ffn)
    routing = torch.tensor([[0], [0], [1], [0], [2], [0], [1]])          # expert 0: tokens 0, 1, 3, 5
    order, token_index, counts = recipe["dispatch"](routing, num_experts)
    xs = torch.randn(7, width)[token_index]
    capped = recipe["run_experts_padded"](xs, counts, gate_up, down, capacity=2)
    full = recipe["run_experts"](xs, counts, gate_up, down)
    dropped = (capped == 0).all(dim=1)
    assert token_index[dropped].tolist() == [3, 5]                     # expert 0's third and fourth tokens
    assert torch.allclose(capped[~dropped], full[~dropped], atol=TOLERANCE)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_expert_parallel_forward_on_one_rank_is_the_layer(recipe, one_rank):
    torch.manual_seed(0)
    layer = recipe["MoE"](8, 16, 4, 2)
    x = torch.randn(10, 8, requires_grad=True)
    expected = layer(x)
    got, logits = recipe["expert_parallel_forward"](x, layer.router, layer.gate_up, layer.down, 2)
    assert torch.allclose(got, expected, atol=TOLERANCE) and torch.equal(logits, layer.router_logits)
    grads = torch.autograd.grad(got.square().sum(), [x, layer.gate_up])
    reference = torch.autograd.grad(expected.square().sum(), [x, layer.gate_up])
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(grads, reference))
