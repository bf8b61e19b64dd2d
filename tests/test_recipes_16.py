"""Notebook 16's recipe (``epoch_batches``, ``training_state``, ``save_atomically``, ``restore``), taken from the
notebook's cells tagged ``recipe`` and run on models it was not written for, each asserting the notebook's claims:
the resumed run is the uninterrupted one bit for bit, the file stores the state's tensors byte for byte, two writers
at once both succeed, and a failed save leaves nothing.

The families (``tests/recipe_models.py``): transformers Llama (bf16 autocast over fp32 weights, and a bf16 base),
Qwen2 (biases, tied head), GPT-2 (Conv1D, dropout on: the RNG matters), a bf16 Mistral with a sliding window, an
``nn.TransformerEncoder`` classifier with a padding mask, a BatchNorm conv net (running statistics in the state), an
``nn.Sequential`` with a GradScaler forced on and a fused-qkv toy. The data comes from a ``DataLoader`` made by the
recipe's ``epoch_batches`` (right-padded dict batches through a collator, an uneven last batch), and every step also
draws from Python's ``random`` and numpy, as augmentation libraries do; each run resumes mid-epoch. Issue 38's two
gaps each have a test that fails on the recipe before the fix: numpy's RNG was not saved, and a ``DataLoader``
without a generator of its own draws its base seed from the global RNG when the resumed epoch's iterator is made.
"""
from __future__ import annotations

import random
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import utils
from tests.recipe_models import (CAUSAL_LM_FAMILIES, EncoderClassifier, FusedQKVModel, PaddedTextDataset,
                                 batchnorm_convnet, pad_collate, run_recipe, sequential_mlp)

VOCAB, BATCH, SEED = 64, 4, 5
STEPS, RESUME_AT = 8, 4            # 11 rows in batches of 4: 3 per epoch (the last one of 3 rows); resumed mid-epoch


@pytest.fixture(scope="module")
def recipe() -> dict:
    return run_recipe("16")


def test_every_recipe_cell_names_what_it_expects() -> None:
    from tests.recipe_models import recipe_cells
    for cell in recipe_cells("16"):
        assert cell.startswith("# Expects: "), cell.splitlines()[0]


class _Rows(Dataset):
    """Feature rows and classes, or images: a plain (tensor, label) dataset."""

    def __init__(self, shape: tuple[int, ...], classes: int, size: int = 11) -> None:
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(size, *shape, generator=generator)
        self.y = torch.randint(0, classes, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


class _ClassifiedText(Dataset):
    """Padded text with a class per row, for the encoder classifier (a dict batch through a collator)."""

    def __init__(self) -> None:
        self.text = PaddedTextDataset(11, VOCAB, max_length=12, seed=4)

    def __len__(self) -> int:
        return len(self.text)

    def __getitem__(self, index: int):
        return self.text[index], index % 3


def _text_collate(rows):
    batch = pad_collate([text for text, _ in rows])
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, \
        torch.tensor([label for _, label in rows])


def _causal_lm(name: str, dtype: torch.dtype):
    return lambda: CAUSAL_LM_FAMILIES[name](dtype=dtype, vocab_size=VOCAB)


CASES = {   # name -> (build, dataset, loader options, kind, autocast dtype or None, GradScaler forced on)
    "llama, bf16 autocast over fp32 weights": (_causal_lm("llama", torch.float32), "text", "lm", torch.bfloat16, False),
    "llama, bf16 base": (_causal_lm("llama", torch.bfloat16), "text", "lm", None, False),
    "qwen2 (biases, tied head)": (_causal_lm("qwen2", torch.float32), "text", "lm", None, False),
    "gpt2 (Conv1D, dropout on)": (_causal_lm("gpt2", torch.float32), "text", "lm", None, False),
    "mistral bf16, sliding window": (_causal_lm("mistral-bf16-sliding", torch.bfloat16), "text", "lm", None, False),
    "encoder classifier, padding mask": (lambda: EncoderClassifier(vocab=VOCAB), "classified", "dict", None, False),
    "batchnorm conv net": (batchnorm_convnet, "images", "plain", None, False),
    "sequential, GradScaler forced on": (sequential_mlp, "rows", "plain", None, True),
    "fused qkv, bf16 autocast": (lambda: FusedQKVModel(vocab=VOCAB), "text", "fused", torch.bfloat16, False),
}
DATASETS = {"text": (lambda: PaddedTextDataset(11, VOCAB, max_length=12, seed=2), {"collate_fn": pad_collate}),
            "classified": (_ClassifiedText, {"collate_fn": _text_collate}),
            "images": (lambda: _Rows((3, 8, 8), 5), {}), "rows": (lambda: _Rows((16,), 5), {})}


def _make_run(build, scaler_on: bool, seed: int):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2, enabled=scaler_on)
    return model, optimizer, scheduler, scaler


def _loss(kind: str, model, batch) -> torch.Tensor:
    """The step's loss, with a draw from Python's random and one from numpy in it (augmentation does that)."""
    noise = random.random() * float(np.random.uniform(0.5, 1.5))     # a loss scale: any change shows in the weights
    if kind == "lm":
        return noise * model(**batch, use_cache=False).loss
    if kind == "fused":
        logits = model(batch["input_ids"])
        return noise * F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten())
    inputs, labels = batch
    logits = model(**inputs) if kind == "dict" else model(inputs)
    return noise * F.cross_entropy(logits, labels)


def _train(recipe, run, position: dict, steps: int, case: str, batches=None) -> None:
    """The reader's loop: batches from the recipe's epoch_batches, the position moved on as the notebook's loop does."""
    build, data, kind, amp_dtype, _ = CASES[case]
    make_dataset, options = DATASETS[data]
    dataset, per_epoch = make_dataset(), -(-11 // BATCH)
    model, optimizer, scheduler, scaler = run
    model.train()
    done = 0
    while done < steps:
        for batch in (batches or recipe["epoch_batches"])(dataset, position, BATCH, SEED, **options):
            with torch.autocast("cpu", dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                loss = _loss(kind, model, batch)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            position["step"], position["batch"], done = position["step"] + 1, (position["batch"] + 1) % per_epoch, done + 1
            if position["batch"] == 0:
                position["epoch"] += 1
            if done == steps or position["batch"] == 0:
                break


def _weights(model) -> torch.Tensor:
    return torch.cat([t.detach().float().flatten() for t in model.state_dict().values()])   # buffers too


def _resume(recipe, case: str, tmp_path: Path, *, save=None, restore=None, batches=None):
    """Uninterrupted STEPS steps, against RESUME_AT steps, a save, a restore into a freshly built run (other initial
    weights, other RNG states) and the rest: the two final states."""
    build, _, _, _, scaler_on = CASES[case]
    straight = _make_run(build, scaler_on, seed=0)
    _train(recipe, straight, {"step": 0, "epoch": 0, "batch": 0}, STEPS, case, batches)
    first, position = _make_run(build, scaler_on, seed=0), {"step": 0, "epoch": 0, "batch": 0}
    _train(recipe, first, position, RESUME_AT, case, batches)
    path = tmp_path / "resume.pt"
    (save or recipe["save_atomically"])(recipe["training_state"](*first, position), path)
    resumed = _make_run(build, scaler_on, seed=1)
    resumed_position = (restore or recipe["restore"])(path, *resumed)
    assert resumed_position == {"step": RESUME_AT, "epoch": 1, "batch": 1}, resumed_position    # mid-epoch
    _train(recipe, resumed, resumed_position, STEPS - RESUME_AT, case, batches)
    return straight, resumed, path


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_the_uninterrupted_run(recipe, tmp_path: Path, case: str) -> None:
    straight, resumed, path = _resume(recipe, case, tmp_path)
    assert torch.equal(_weights(resumed[0]), _weights(straight[0])), f"{case}: the resumed run is not the same run"
    if CASES[case][4]:
        assert resumed[3].get_scale() == straight[3].get_scale(), "the GradScaler's scale was not restored"
    with zipfile.ZipFile(path) as archive:   # the notebook's claim: the tensors are stored byte for byte
        stored = sum(entry.file_size for entry in archive.infolist() if "/data/" in entry.filename)
    assert stored == utils.tensor_bytes(torch.load(path, weights_only=True))
    assert not list(tmp_path.glob(".*.tmp")), "a finished save leaves no temporary file"


def test_a_loader_with_workers_resumes_too(recipe, tmp_path: Path) -> None:
    """Worker processes draw from their own RNGs, seeded from the loader's base seed: epoch_batches's generator."""
    class Jittered(_Rows):
        def __getitem__(self, index: int):
            x, y = super().__getitem__(index)
            return x + 0.1 * torch.randn(x.shape), y                  # drawn in the worker

    DATASETS["jittered"] = (lambda: Jittered((16,), 5), {"num_workers": 1})
    CASES["sequential, a worker that draws"] = (sequential_mlp, "jittered", "plain", None, False)
    try:
        straight, resumed, _ = _resume(recipe, "sequential, a worker that draws", tmp_path)
    finally:
        del CASES["sequential, a worker that draws"], DATASETS["jittered"]
    assert torch.equal(_weights(resumed[0]), _weights(straight[0]))


# --- issue 38's two gaps: each fails on the recipe as it was --------------------------------------------------

def test_numpys_rng_is_saved_and_restored(recipe, tmp_path: Path) -> None:
    """The step draws from numpy: a state without numpy's RNG (the recipe before issue 38) resumes another run."""
    state = recipe["training_state"](*_make_run(sequential_mlp, False, 0), {"step": 0, "epoch": 0, "batch": 0})
    assert "numpy" in state["rng"] and "python" in state["rng"], "the recipe saves every RNG: Python's and numpy's too"
    np.random.seed(11)
    recipe["save_atomically"](recipe["training_state"](*_make_run(sequential_mlp, False, 0), {}), tmp_path / "n.pt")
    expected = np.random.uniform(size=5)
    np.random.seed(12)
    recipe["restore"](tmp_path / "n.pt", *_make_run(sequential_mlp, False, 0))
    assert np.array_equal(np.random.uniform(size=5), expected), "numpy draws after a restore differ"


def _plain_loader(dataset, position: dict, batch_size: int, seed: int, **options):
    """What most scripts write: DataLoader(shuffle=False), no generator of its own."""
    import itertools
    return itertools.islice(DataLoader(dataset, batch_size=batch_size, shuffle=False, **options), position["batch"], None)


def test_a_loader_without_a_generator_breaks_the_resume_and_epoch_batches_does_not(recipe, tmp_path: Path) -> None:
    """Even with shuffle=False, a new iterator draws its base seed from torch's global RNG: the resumed run makes one
    mid-epoch that the uninterrupted run did not, and dropout then draws other masks (GPT-2's dropout is on)."""
    case = "gpt2 (Conv1D, dropout on)"
    straight, resumed, _ = _resume(recipe, case, tmp_path, batches=_plain_loader)
    assert not torch.equal(_weights(resumed[0]), _weights(straight[0])), "the plain loader's draw went unseen"
    straight, resumed, _ = _resume(recipe, case, tmp_path)
    assert torch.equal(_weights(resumed[0]), _weights(straight[0]))


# --- the atomic save ------------------------------------------------------------------------------------------

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
