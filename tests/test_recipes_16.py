"""Notebook 16's recipe (``training_state``, ``save_atomically``, ``restore``), taken from the notebook's cells
tagged ``recipe`` and run on models it was not written for: a transformers Llama (bf16 autocast over fp32 weights,
and a bf16 base), an ``nn.Sequential`` and a model with a fused qkv weight, on padded targets, with a GradScaler
forced on. Each asserts the notebook's claims: the resumed run is the uninterrupted one bit for bit, the file
stores the state's tensors byte for byte, two writers at once both succeed, and a failed save leaves nothing.
"""
from __future__ import annotations

import threading
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import utils
from tests.recipe_models import FusedQKVModel, padded_tokens, run_recipe, sequential_mlp, tiny_llama

VOCAB, LENGTH, ROWS, BATCH = 64, 12, 16, 4


@pytest.fixture(scope="module")
def recipe() -> dict:
    return run_recipe("16")


def _llama(dtype):
    return lambda: tiny_llama(dtype, vocab_size=VOCAB)


def _data():
    """Padded token rows (labels -100 on the padding) and, for the MLP, features and classes."""
    input_ids, attention_mask, labels = padded_tokens(ROWS, LENGTH, VOCAB, seed=3)
    features = torch.randn(ROWS, 16, generator=torch.Generator().manual_seed(4))
    classes = torch.randint(0, 5, (ROWS,), generator=torch.Generator().manual_seed(5))
    return input_ids, attention_mask, labels, features, classes


def _loss(kind: str, model, rows, data) -> torch.Tensor:
    input_ids, attention_mask, labels, features, classes = data
    if kind == "llama":
        return model(input_ids=input_ids[rows], attention_mask=attention_mask[rows], labels=labels[rows],
                     use_cache=False).loss
    if kind == "fused_qkv":
        logits = model(input_ids[rows])
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[rows][:, 1:].flatten())   # -100 ignored
    return F.cross_entropy(model(features[rows]), classes[rows])


CASES = {   # name -> (model kind, build, autocast dtype or None, GradScaler forced on)
    "llama, bf16 autocast over fp32 weights": ("llama", _llama(torch.float32), torch.bfloat16, False),
    "llama, bf16 base": ("llama", _llama(torch.bfloat16), None, False),
    "sequential, GradScaler forced on": ("sequential", sequential_mlp, None, True),
    "fused qkv, bf16 autocast": ("fused_qkv", lambda: FusedQKVModel(vocab=VOCAB), torch.bfloat16, False),
}


def _make_run(build, scaler_on: bool, seed: int):
    torch.manual_seed(seed)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2, enabled=scaler_on)
    return model, optimizer, scheduler, scaler


def _train(run, position: dict, steps: int, kind: str, amp_dtype, data) -> None:
    model, optimizer, scheduler, scaler = run
    model.train()
    for _ in range(steps):
        rows = torch.randint(0, ROWS, (BATCH,))        # torch's RNG picks the batch: a resume must restore it
        with torch.autocast("cpu", dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            loss = _loss(kind, model, rows, data)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        position["step"] += 1


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_the_uninterrupted_run(recipe, tmp_path: Path, case: str) -> None:
    kind, build, amp_dtype, scaler_on = CASES[case]
    data = _data()
    run = _make_run(build, scaler_on, seed=0)
    position = {"step": 0, "epoch": 0, "batch": 0}
    _train(run, position, 2, kind, amp_dtype, data)
    state = recipe["training_state"](*run, position)
    path = tmp_path / "resume.pt"
    recipe["save_atomically"](state, path)
    _train(run, position, 2, kind, amp_dtype, data)                  # the uninterrupted run goes on
    uninterrupted = _weights(run[0])

    resumed_run = _make_run(build, scaler_on, seed=1)               # other initial weights: all must come back
    resumed_position = recipe["restore"](path, *resumed_run)
    assert resumed_position == {"step": 2, "epoch": 0, "batch": 0}
    _train(resumed_run, resumed_position, 2, kind, amp_dtype, data)
    assert torch.equal(_weights(resumed_run[0]), uninterrupted), f"{case}: the resumed run is not the same run"
    if scaler_on:
        assert resumed_run[3].get_scale() == run[3].get_scale(), "the GradScaler's scale was not restored"

    with zipfile.ZipFile(path) as archive:   # the notebook's claim: the tensors are stored byte for byte
        stored = sum(entry.file_size for entry in archive.infolist() if "/data/" in entry.filename)
    assert stored == utils.tensor_bytes(torch.load(path, weights_only=True))
    assert not list(tmp_path.glob(".*.tmp")), "a finished save leaves no temporary file"


class _WaitForTheOtherWriter:
    """Pickles as ``tensor`` once the other writer is mid-save too (as in the notebook)."""

    def __init__(self, tensor: torch.Tensor, barrier: threading.Barrier) -> None:
        self.tensor, self.barrier = tensor, barrier

    def __reduce_ex__(self, protocol):
        self.barrier.wait(timeout=30)
        return self.tensor.__reduce_ex__(protocol)


def _two_writers(save, path: Path) -> list[Exception]:
    barrier, errors = threading.Barrier(2), []

    def write(rank: int) -> None:
        try:
            save({"rank": rank, "weight": _WaitForTheOtherWriter(torch.full((4096,), float(rank)), barrier)}, path)
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=write, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_two_writers_at_once_both_succeed(recipe, tmp_path: Path) -> None:
    path = tmp_path / "shared.pt"
    assert _two_writers(recipe["save_atomically"], path) == []
    winner = torch.load(path, weights_only=True)
    assert torch.equal(winner["weight"], torch.full((4096,), float(winner["rank"])))
    assert not list(tmp_path.glob(".shared.pt.*"))


def test_the_two_writers_check_sees_a_fixed_temporary_name(tmp_path: Path) -> None:
    """The check above can fail: the recipe's former save, with one fixed temporary name, does."""
    def save_with_a_fixed_name(state: dict, path: Path) -> None:
        temporary = path.with_name(f".{path.name}.tmp")
        with open(temporary, "wb") as file:
            torch.save(state, file)
        temporary.replace(path)

    assert _two_writers(save_with_a_fixed_name, tmp_path / "shared.pt"), "both writers shared one temporary file"


def test_a_failed_save_changes_nothing(recipe, tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    recipe["save_atomically"]({"step": 1}, path)
    good = path.read_bytes()
    with pytest.raises(Exception):
        recipe["save_atomically"]({"step": 2, "note": lambda: None}, path)   # a lambda cannot be pickled
    assert path.read_bytes() == good
    assert not list(tmp_path.glob(".checkpoint.pt.*")), "the failed save's temporary file is still there"
