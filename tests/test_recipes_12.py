"""Notebook 12's recipe (the training script, its three cells tagged ``recipe``) on models it was not written for.

The cells are taken from the notebook itself (``recipe_models.run_recipe``), never from a copy, and run in one
process as a one-rank gloo job: ``wrap_model`` with a transformers Llama (its blocks ``model.model.layers``), an
``nn.Sequential`` and a model with a fused qkv weight; ``train_step`` with an uneven last micro-batch and with
padded (-100) token targets must train exactly as one plain step on the whole batch does, and leave no gradient
alive; the loop's checkpoint must resume to the same weights as an uninterrupted run; a bf16 base trains.
Cases that do not apply: autocast (the script has none; a reader adds it around the forward).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import utils.distributed
from recipe_models import FusedQKVModel, padded_tokens, recipe_cells, run_recipe, sequential_mlp, tiny_llama


@pytest.fixture(scope="module")
def script():
    """The notebook's script cells in a fresh namespace, inside a one-rank gloo process group."""
    namespace = run_recipe("12")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    namespace["mesh"] = init_device_mesh("cpu", (1,))
    yield namespace
    dist.destroy_process_group()


def test_the_recipe_cells_are_the_launched_script():
    assert "\n\n\n".join(cell.rstrip() for cell in recipe_cells("12")) + "\n" == utils.distributed.script_source()


def _cases():
    """(name, model factory, its blocks, inputs, targets, micro-batch): readers' models and their data."""
    def mlp():
        model = sequential_mlp()
        return model, [m for m in model if isinstance(m, nn.Linear)]

    def fused():
        model = FusedQKVModel()
        return model, list(model.layers)

    def llama():
        model = tiny_llama()
        return model, list(model.model.layers)

    generator = torch.Generator().manual_seed(1)
    features, classes = torch.randn(7, 16, generator=generator), torch.randint(0, 5, (7,), generator=generator)
    ids, _, labels = padded_tokens(5, 12, 64, seed=2)
    llama_ids, _, llama_labels = padded_tokens(5, 12, 128, seed=3)
    return [("sequential, 7 samples in pieces of 3", mlp, features, classes, 3),                 # uneven last piece
            ("fused qkv, padded targets", fused, ids[:, :-1], labels[:, 1:], 2),
            ("transformers llama, padded targets", llama, llama_ids[:, :-1], llama_labels[:, 1:], 2)]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("case", _cases(), ids=lambda case: case[0])
def test_train_step_equals_one_plain_step_and_frees_the_gradients(script, case, strategy):
    _, make, inputs, targets, micro_batch = case
    model, blocks = make()
    plain = copy.deepcopy(model)
    wrapped = script["wrap_model"](model, blocks, strategy, torch.device("cpu"), script["mesh"])
    # SGD with lr 1: the update is the gradient itself (AdamW would magnify rounding where a gradient is ~0)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1.0)
    loss = script["train_step"](wrapped, optimizer, inputs, targets, micro_batch, strategy)

    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=1.0)
    logits = script["logits_of"](plain(inputs))
    plain_loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())    # the mean over the real targets
    plain_loss.backward()
    plain_optimizer.step()
    assert abs(loss.item() - plain_loss.item()) < 1e-5, (loss.item(), plain_loss.item())
    module = wrapped.module if strategy == "ddp" else wrapped
    trained = {name: _full(p).detach() for name, p in module.named_parameters()}
    difference = max((trained[name] - p).abs().max().item() for name, p in plain.named_parameters())
    assert difference < 1e-5, f"{strategy}: {difference:.2e} from one plain step on the whole batch"
    assert all(p.grad is None for p in wrapped.parameters()), "the step must free the gradients"


def test_a_bf16_base_trains(script):
    model = tiny_llama(torch.bfloat16)
    ids, _, labels = padded_tokens(4, 10, 128, seed=4)
    wrapped = script["wrap_model"](model, list(model.model.layers), "ddp", torch.device("cpu"), script["mesh"])
    optimizer = script["make_optimizer"](wrapped, "ddp", 1e-2)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    losses = [script["train_step"](wrapped, optimizer, ids[:, :-1], labels[:, 1:], 2, "ddp").item() for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert any(not torch.equal(before[name], p) for name, p in model.named_parameters())


def test_the_loop_resumes_a_sharded_llama_from_its_checkpoint(script, tmp_path):
    """Three FSDP steps in one go, against two steps, a restart (the model rebuilt from scratch) and one more: the
    script's loop finds its newest checkpoint (DCP, sharded) and ends with the same weights."""
    ids, _, labels = padded_tokens(8, 10, 128, seed=5)
    dataset = torch.utils.data.TensorDataset(ids[:, :-1], labels[:, 1:])

    def run(steps: int, folder) -> tuple[dict[str, torch.Tensor], int]:
        model = tiny_llama()
        argv = ["--strategy", "fsdp", "--micro-batch", "2", "--accumulation-steps", "2", "--steps", str(steps)]
        args = script["parse_args"](argv + (["--checkpoint-dir", str(folder)] if folder else []))
        wrapped, losses = script["train"](model, list(model.model.layers), dataset, torch.device("cpu"),
                                          script["mesh"], args)
        return {name: _full(p).detach().clone() for name, p in wrapped.named_parameters()}, len(losses)

    uninterrupted, _ = run(3, None)
    run(2, tmp_path)
    resumed, steps_run = run(3, tmp_path)
    assert steps_run == 1, "the restarted run must resume after step 2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003"]
    difference = max((resumed[k] - uninterrupted[k]).abs().max().item() for k in uninterrupted)
    assert difference == 0.0, f"resumed {difference:.2e} away from the uninterrupted run"


def test_zero1_with_a_checkpoint_folder_is_refused(script, tmp_path):
    model = sequential_mlp()
    args = script["parse_args"](["--strategy", "zero1", "--checkpoint-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="consolidate_state_dict"):
        script["train"](model, [], None, torch.device("cpu"), script["mesh"], args)
