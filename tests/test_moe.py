"""utils/moe.py (notebook 14's instruments) and utils/expert_parallel_ranks.py (its launched script): a tiny
transformers MoE measured by category, the all-to-all counter and the saved-activation counter on a gloo group,
bad input, the notebook's recipe cells against the script's copy, and one launch of 3 expert-parallel ranks (another
layout than the notebook's: 6 experts, k = 3) checked against the formulas the notebook derives."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from recipe_models import notebook_path
from utils import expert_parallel_ranks as script
from utils import moe


# --- the notebook runs the script's code -------------------------------------------------------------------------

def _notebook_definitions() -> dict[str, str]:
    """name -> source of every top-level function and class defined in the notebook's code cells."""
    found = {}
    for cell in json.loads(notebook_path("14").read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                found[node.name] = "\n".join(source.splitlines()[node.lineno - 1:node.end_lineno])   # whole lines
    return found


@pytest.mark.parametrize("name", ["route", "dispatch", "run_experts", "combine", "AllToAll", "expert_parallel_forward",
                                  "shard_expert_parallel"])
def test_the_notebook_shows_the_code_the_ranks_run(name):
    ours = _notebook_definitions()[name]
    theirs = inspect.getsource(getattr(script, name))
    if name == "AllToAll":       # the class: compare its methods, as the notebook does
        ours, theirs = ours[ours.index("    @staticmethod"):], theirs[theirs.index("    @staticmethod"):]
    assert ours.strip() == theirs.strip()


# --- bad input ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, words", [
    ({"num_experts": 6}, "6 experts cannot be split over 4 ranks"),
    ({"world_size": 1}, "at least 2 ranks"),
    ({"top_k": 9}, "top_k = 9"),
    ({"width": 0}, "width must be a positive int"),
    ({"seed": -1}, "seed must be an int >= 0"),
    ({"tokens_per_rank": 2.5}, "tokens_per_rank must be a positive int"),
])
def test_a_layout_the_experts_cannot_take_is_refused_before_any_process(tmp_path, changes, words):
    config = dataclasses.replace(moe.ExpertParallelConfig(), **changes)
    with pytest.raises(ValueError, match=words):
        moe.launch_expert_parallel(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_bad_arguments_of_the_helpers():
    with pytest.raises(ValueError, match="unknown MoE family 'llama'"):
        moe.hf_moe_config("llama")
    with pytest.raises(ValueError, match="centres must be a \\(clusters, width\\) tensor"):
        moe.clustered_tokens(4, torch.randn(8))
    with pytest.raises(ValueError, match="num_tokens must be a positive int"):
        moe.clustered_tokens(0, torch.randn(2, 8))
    with pytest.raises(ValueError, match="batch must be a positive int"):
        moe.measure_hf_moe_step("mixtral", batch=0)


def test_clustered_tokens_are_unevenly_clustered():
    generator = torch.Generator().manual_seed(0)
    centres = moe.token_centres(4, 8, generator=generator)
    tokens = moe.clustered_tokens(4000, centres, spread=0.01, generator=generator)
    nearest = torch.cdist(tokens, centres).argmin(dim=1)
    shares = torch.bincount(nearest, minlength=4) / 4000
    expected = (1 / torch.arange(1, 5)) / (1 / torch.arange(1, 5)).sum()
    assert tokens.shape == (4000, 8) and (shares - expected).abs().max() < 0.03


def test_grouped_mm_support_says_why_or_runs():
    missing = moe.grouped_mm_support()
    assert missing is None or isinstance(missing, str) and missing
    if missing is None:
        x = torch.randn(5, 8)
        w = torch.randn(2, 8, 4)
        out = F.grouped_mm(x, w, offs=torch.tensor([2, 5], dtype=torch.int32))
        assert torch.allclose(out, torch.cat([x[:2] @ w[0], x[2:] @ w[1]]), atol=1e-5)


# --- the counters, in this process ------------------------------------------------------------------------------------

@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_all_to_all_log_counts_the_slices_handed_to_the_collective(one_rank):
    class Exchange(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x, [len(x)], [len(x)])
            return out

        @staticmethod
        def backward(ctx, grad):
            out = torch.empty_like(grad)
            dist.all_to_all_single(out, grad.contiguous(), [len(grad)], [len(grad)])
            return out

    x = torch.randn(5, 3, requires_grad=True)
    with moe.AllToAllLog() as log:
        counts = torch.tensor([7])
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts)
        out = Exchange.apply(x)
        log.phase = "backward"
        out.backward(torch.ones(5, 3))
    assert dist.all_to_all_single is not log._counted                  # the real collective is back
    assert [(c["phase"], c["dtype"], c["sent"], c["received"]) for c in log.calls] == [
        ("forward", "int64", [8], [8]), ("forward", "float32", [60], [60]), ("backward", "float32", [60], [60])]
    assert torch.equal(received, counts) and torch.equal(out, x)
    assert log.sent_bytes() == 0 and log.sent_bytes(to_self=True) == 128
    assert log.sent_bytes("backward", to_self=True) == 60


def test_saved_activation_bytes_leaves_parameters_out():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4))
    x = torch.randn(3, 6)
    with moe.SavedActivationBytes(model) as saved:
        model(x).sum()
    import utils
    with utils.track_saved_tensors(exclude=model) as reference:
        model(x).sum()
    # the input (the first Linear's), the ReLU's output (kept by ReLU and the second Linear: once)
    assert saved.bytes == reference.bytes == 3 * 6 * 4 + 3 * 10 * 4 and saved.storages == 2


def test_state_bytes_by_part_reads_the_tensors():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 4))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    model(torch.randn(2, 6)).sum().backward()
    optimizer.step()
    parts = moe.state_bytes_by_part({"first": list(model[0].parameters()), "second": list(model[1].parameters())},
                                    optimizer)
    assert parts["first"] == {"parameters": 4 * 70, "gradients": 4 * 70, "optimizer": 8 * 70 + 4 * 2}
    assert parts["second"] == {"parameters": 4 * 44, "gradients": 4 * 44, "optimizer": 8 * 44 + 4 * 2}


# --- a tiny transformers MoE, one step, by category -------------------------------------------------------------------

@pytest.mark.parametrize("family, overrides", [("mixtral", {}), ("qwen3_moe", {"num_experts_per_tok": 3}),
                                               ("olmoe", {"num_experts": 4})])
def test_measure_hf_moe_step_holds_every_expert_and_the_routing(family, overrides):
    step = moe.measure_hf_moe_step(family, batch=2, seq=8, **overrides)
    p, k = step.num_parameters, step.config["num_experts_per_tok"]
    assert step.state_bytes == {"parameters": 4 * p, "gradients": 4 * p, "optimizer": 8 * p + 4 * step.num_tensors}
    after_step = step.marks["step"]
    assert (after_step["Parameter"], after_step["Gradient"], after_step["Optstate"]) == tuple(step.state_bytes.values())
    assert step.marks["end"]["Gradient"] == 0                          # zero_grad(set_to_none=True)
    assert step.peak_bytes == sum(step.peak_by_category.values()) >= sum(step.state_bytes.values())
    assert step.marks["forward"]["Activation"] > 0
    experts = step.config.get("num_local_experts") or step.config["num_experts"]
    assert len(step.tokens_per_expert) == 2 and all(len(layer) == experts and sum(layer) == 2 * 8 * k
                                                    for layer in step.tokens_per_expert)
    assert 0 < step.num_expert_parameters < p


def test_measure_hf_moe_step_with_padding_and_the_auxiliary_loss():
    plain = moe.measure_hf_moe_step("mixtral", batch=2, seq=8)
    padded = moe.measure_hf_moe_step("mixtral", batch=2, seq=8, padded=True, output_router_logits=True)
    assert padded.state_bytes == plain.state_bytes
    assert padded.marks["forward"] != plain.marks["forward"]            # the mask and the aux loss's tensors


# --- one launch: 3 ranks, 6 experts, k = 3 ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    config = moe.ExpertParallelConfig(world_size=3, width=8, ffn=12, num_experts=6, top_k=3, tokens_per_rank=10,
                                      clusters=3, seed=5)
    return config, moe.launch_expert_parallel(config, tmp_path_factory.mktemp("ep") / "run", timeout_s=240)


def test_three_ranks_equal_one_process(three_ranks):
    config, run = three_ranks
    assert [r["rank"] for r in run.ranks] == [0, 1, 2] and run.seconds > 0
    for r in run.ranks:
        assert r["same_routing_as_one_process"] and len(r["routing"]) == config.tokens_per_rank
        assert max(r["max_output_error"], r["max_expert_grad_error"], r["max_rest_grad_error"]) < 1e-5


def test_three_ranks_hold_and_send_what_the_notebook_predicts(three_ranks):
    config, run = three_ranks
    c, f, e, k = config.width, config.ffn, config.num_experts, config.top_k
    n, t = config.world_size, config.tokens_per_rank
    local = e // n
    reference = script.TinyMoEModel(config)
    rest = [p for name, p in reference.named_parameters() if name not in ("gate_up", "down")]
    shard = sum(math.ceil(p.shape[0] / n) * math.prod(p.shape[1:]) for p in rest)      # stored, padded
    assert shard * n > sum(p.numel() for p in rest), "width 8 over 3 ranks: FSDP2 pads"

    def own(rank: int) -> int:      # the rows a rank's piece really has: AdamW's moments are made from those
        return sum(max(0, min(math.ceil(p.shape[0] / n), p.shape[0] - rank * math.ceil(p.shape[0] / n)))
                   * math.prod(p.shape[1:]) for p in rest)
    assert own(n - 1) < own(0) == shard
    routing = torch.tensor([r["routing"] for r in run.ranks])           # (N, T, k)
    destination = routing // local
    pairs_to = torch.stack([torch.bincount(destination[r].flatten(), minlength=n) for r in range(n)])
    for r in run.ranks:
        me = r["rank"]
        assert r["state_bytes"]["experts"] == {"parameters": 4 * local * 3 * c * f, "gradients": 4 * local * 3 * c * f,
                                               "optimizer": 8 * local * 3 * c * f + 8}
        assert r["state_bytes"]["rest"] == {"parameters": 4 * shard, "gradients": 4 * shard,
                                            "optimizer": 8 * own(me) + 4 * len(rest)}
        received = int(pairs_to[:, me].sum())
        assert r["activation_bytes"] == (t * (12 * c + 4 * e + 12 * k + 4) + t * k * (8 * c + 20)
                                         + received * (4 * c + 16 * f + 16))
        sent, got = (pairs_to[me] * 4 * c).tolist(), (pairs_to[:, me] * 4 * c).tolist()
        assert [(x["phase"], x["sent"], x["received"]) for x in r["all_to_all"]] == [
            ("forward", [8 * local] * n, [8 * local] * n), ("forward", sent, got), ("forward", got, sent),
            ("backward", sent, got), ("backward", got, sent)]
