"""Every notebook's GPU sizes fit the reader's card: 8, 16, 24, 40 and 80 GB classes, at the notebook's peak.

How it works, without a GPU:

1. Each notebook's ``parameters`` cell runs in full mode with ``torch.cuda`` faked (``tests/fake_cuda.py``)
   to describe the *smallest* card of one memory class (``utils.MEMORY_CLASSES_GB``: a card gets class G
   from ``0.9 * G * 10**9`` bytes on, so that card is the tightest one that receives G's sizes), with that
   class's usual compute capability (a T4's 7.5 for 16 GB). ``utils.pick_device()`` then answers ``cuda``
   and ``utils.by_memory`` picks the class's sizes, exactly as on such a card.
2. The notebook's prediction function below turns those sizes into bytes with ``utils.footprint``'s formulas,
   on models built on the ``meta`` device (no memory): an upper bound of what the notebook keeps on the GPU
   at once, its parts named, each documented from what the notebook's cells keep alive.
3. The bound, plus 10 % for the caching allocator's rounding and fragmentation, must fit in the card less
   1 GiB for each process's CUDA context and cuBLAS workspaces.

These are predictions, not measurements: a GPU run (``tools/gpu_reference.sh``) is what confirms them. A
notebook without a prediction yet is skipped with a reason that says so (its sizes are not by memory class
yet, or the rewrite is in progress).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import pytest
import torch

import utils
from fake_cuda import FakeCuda
from tools.nbtools import list_notebooks

GIB = 2**30
CONTEXT_BYTES = GIB           # per process: the CUDA context, cuBLAS/cuDNN workspaces, what the allocator keeps
FRAGMENTATION = 1.10          # the caching allocator's 512-byte rounding, segment slack and fragmentation
# the usual compute capability of each class's cards: an 8 GB laptop RTX 3070, a T4, an RTX 4090, an A100, an H100
CAPABILITY = {8: (8, 6), 16: (7, 5), 24: (8, 9), 40: (8, 0), 80: (9, 0)}


def smallest_card_bytes(memory_class_gb: int) -> int:
    """The least total memory ``utils.memory_class_gb`` puts in this class (the tightest card that gets its sizes)."""
    return math.ceil(0.9 * memory_class_gb * 10**9)


def parameters_source(notebook: Path) -> str:
    """The source of the notebook's ``parameters`` cell."""
    cells = json.loads(notebook.read_text())["cells"]
    cell = next(c for c in cells if "parameters" in c.get("metadata", {}).get("tags", []))
    return "".join(cell["source"])


def gpu_parameters(notebook: Path, memory_class_gb: int, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The notebook's full-mode settings on the smallest card of a memory class (see the module's docstring)."""
    source = parameters_source(notebook)
    monkeypatch.setenv(utils.CHECK_MODE_VARIABLE, "0")
    exec(compile(source, f"{notebook.stem}:parameters", "exec"), {})   # imports what the cell needs, on the CPU
    with monkeypatch.context() as patch:
        FakeCuda(total_memory=smallest_card_bytes(memory_class_gb), capability=CAPABILITY[memory_class_gb],
                 name=f"smallest {memory_class_gb} GB card").install(patch)
        namespace: dict = {}
        exec(compile(source, f"{notebook.stem}:parameters", "exec"), namespace)
    assert namespace["DEVICE"].type == "cuda", "the parameters cell must take its device from utils.pick_device()"
    return namespace


def _meta(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """A model built on the meta device: its shapes and parameter count, no memory."""
    with torch.device("meta"):
        return build()


def _mlp(p: dict, in_features: str = "IN_FEATURES", hidden: str = "HIDDEN_FEATURES", out: int | None = None,
         layers: str = "NUM_HIDDEN_LAYERS") -> utils.MLP:
    return _meta(lambda: utils.MLP(p[in_features], p[hidden], out or p.get("NUM_CLASSES", 10), p[layers]))


def _state(model: torch.nn.Module, optimizer: str = "adamw") -> int:
    """Weights, gradients and optimizer state in fp32 (16 B per parameter with AdamW, 8 with plain SGD)."""
    return utils.predict_model_state(model, optimizer).total_bytes


def _weights(model: torch.nn.Module) -> int:
    return 4 * utils.count_parameters(model)


def _activations(model: utils.MLP, batch: int) -> int:
    """The MLP's saved activations at ``batch`` rows and, in backward, their gradients as large again."""
    return 2 * utils.predict_mlp_activation_bytes(model, batch)


def _rows(p: dict, rows: int, in_features: str = "IN_FEATURES") -> int:
    """A batch of fp32 features (rows, in_features) and int64 labels (rows,)."""
    return rows * (4 * p[in_features] + 8)


def predict_00(p: dict) -> dict[str, int]:
    """00 measuring: one MLP trained with AdamW (the recipe), then a second one built in its place.

    - the recipe's model state: weights, gradients and AdamW's two moments (16 B per parameter);
    - AdamW's default foreach step on CUDA makes one parameter-sized temporary (``exp_avg_sq.sqrt()``);
    - the second MLP (section "one step, phase by phase") is built while the first optimizer still holds the
      first model's weights and moments: one more copy of the weights;
    - the 1 GiB tensor of the caching-allocator cell;
    - ``NUM_STEPS`` batches made up front; the activations and their gradients in backward;
    - the 1024 x 1024 tensor of the views-and-copies table and one copy of it.
    """
    model = _mlp(p)
    return {
        "model state (16 B/parameter)": _state(model),
        "foreach AdamW temporary": _weights(model),
        "second MLP, built before the first optimizer goes": _weights(model),
        "the 1 GiB caching-allocator tensor": GIB,
        "batches": p["NUM_STEPS"] * _rows(p, p["BATCH_SIZE"]),
        "activations and their gradients": _activations(model, p["BATCH_SIZE"]),
        "the views-and-copies tensor and a copy": 2 * 4 * 1024 * 1024,
    }


def predict_01(p: dict) -> dict[str, int]:
    """01 footprint (its parameters cell: 16 N + 2 x activations at the largest batch).

    - the MLP's state with AdamW (16 B per parameter) and one more copy of its weights (a model rebuilt before
      the last one is dropped);
    - section 7's largest batch of ``BATCH_SIZES``: the inputs, the activations and their gradients.
    """
    model, batch = _mlp(p), max(p["BATCH_SIZES"])
    return {
        "model state (16 B/parameter)": _state(model),
        "a second copy of the weights": _weights(model),
        "the largest batch": _rows(p, batch),
        "activations and their gradients at the largest batch": _activations(model, batch),
    }


def predict_02(p: dict) -> dict[str, int]:
    """02 accumulation (its parameters cell: 2 x the activations of the whole batch, plus the small model).

    - the MLP's state with AdamW and the foreach step's temporary (20 B per parameter);
    - the whole ``EFFECTIVE_BATCH`` on the device, and its activations and their gradients in one micro-batch
      (the sweep's first point).
    """
    model, batch = _mlp(p), p["EFFECTIVE_BATCH"]
    return {
        "model state and foreach temporary": _state(model) + _weights(model),
        "the effective batch": _rows(p, batch),
        "activations and their gradients, one micro-batch": _activations(model, batch),
    }


def predict_03(p: dict) -> dict[str, int]:
    """03 checkpointing (its parameters cell: about 17 (B, T, C) fp32 tensors kept per block, no T x T matrix).

    - the recipe's blocks with AdamW and its foreach temporary (20 B per parameter), and the second model of the
      measurements (the blocks and a head, trained with SGD: weights and gradients, 8 B per parameter);
    - activations without checkpointing: ``NUM_BLOCKS x 17 x 4·B·T·C`` bytes, and two (B, T, C) gradients in flight;
    - the recipe's ``TRAIN_STEPS`` (input, target) batches and the measurements' inputs and targets.
    """
    blocks = _meta(lambda: torch.nn.Sequential(*[utils.TransformerBlock(p["D_MODEL"], p["NUM_HEADS"])
                                                 for _ in range(p["NUM_BLOCKS"])], torch.nn.Linear(p["D_MODEL"], p["D_MODEL"])))
    tensor = 4 * p["BATCH_SIZE"] * p["SEQ_LEN"] * p["D_MODEL"]    # one (B, T, C) fp32 tensor
    return {
        "recipe blocks with AdamW and foreach temporary": _state(blocks) + _weights(blocks),
        "second model with SGD (weights and gradients)": _state(blocks, "sgd"),
        "activations without checkpointing": p["NUM_BLOCKS"] * 17 * tensor,
        "activation gradients in flight": 2 * tensor,
        "batches": (2 * p["TRAIN_STEPS"] + 2) * tensor,
    }


def predict_04(p: dict) -> dict[str, int]:
    """04 mixed precision (its parameters cell: an fp32 backward, 2 x 6 layers x 4·B·H + 8·(5·H²) bytes).

    - the measured MLP's weights, gradients and an AdamW state (16 B per parameter, more than the notebook keeps)
      and its 16-bit weight copies under autocast (2 B per parameter);
    - its inputs, activations and their gradients in fp32;
    - the speed test's ``MATMUL_SIZE`` square matmul: two inputs and the output in fp32;
    - the trainings' small MLP (``TRAIN_HIDDEN`` wide) with AdamW at ``TRAIN_BATCH_SIZE`` rows.
    """
    model = _mlp(p, out=1)
    small = _meta(lambda: utils.MLP(p["IN_FEATURES"], p["TRAIN_HIDDEN"], 10, 2))
    return {
        "measured MLP: state and 16-bit copies": _state(model) + _weights(model) // 2,
        "inputs, activations and their gradients": _rows(p, p["BATCH_SIZE"]) + _activations(model, p["BATCH_SIZE"]),
        "the speed test's matmul": 3 * 4 * p["MATMUL_SIZE"] ** 2,
        "the trainings' small MLP": _state(small) + _rows(p, p["TRAIN_BATCH_SIZE"])
                                    + _activations(small, p["TRAIN_BATCH_SIZE"]),
    }


def predict_05(p: dict) -> dict[str, int]:
    """05 compile (its parameters cell: two MLPs with AdamW state, and section 6's large elementwise tensors).

    - the eager and the compiled MLP, each with AdamW (16 B per parameter), and a foreach step's temporary;
    - both models' activations and their gradients at ``BATCH_SIZE`` rows, and the batch;
    - six ``ELEMENTWISE_SHAPE`` fp32 tensors: the chain's input and output, and the gradient section's input,
      output and their gradients;
    - section 1's bf16-autocast transformer, eager and compiled: one copy's model state, and the other's whole
      training step as the course's calculator predicts it (AdamW, bf16 autocast, on CUDA).
    """
    from utils import calculator

    model = _mlp(p)
    elementwise = 4 * math.prod(p["ELEMENTWISE_SHAPE"])
    lm = calculator.ModelConfig(p["LM_LAYERS"], p["LM_WIDTH"], 4, p["LM_VOCAB"], max_seq_len=p["LM_SEQ"], arch="gpt",
                                name="05's TinyTransformer")
    step = calculator.predict(lm, calculator.TrainingSetup(seq_len=p["LM_SEQ"], micro_batch=p["LM_BATCH"],
                                                          precision="bf16-autocast", optimizer="adamw",
                                                          optimizer_impl="foreach", device="cuda"))
    return {
        "two MLPs with AdamW and a foreach temporary": 2 * _state(model) + _weights(model),
        "both models' activations and their gradients": 2 * _activations(model, p["BATCH_SIZE"]),
        "the batch": _rows(p, p["BATCH_SIZE"]),
        "six elementwise tensors": 6 * elementwise,
        "the transformer: one copy's state, the other's training step": 16 * step.num_parameters + step.total,
    }


def predict_06(p: dict) -> dict[str, int]:
    """06 profiling (its parameters cell: about 2 GB on every card).

    - the MLP on flattened crops (``3·CROP_SIZE²`` inputs, two hidden layers) with SGD: weights and gradients;
    - section 6's ``LARGE_BATCH`` crops, their activations and gradients;
    - the peak-FLOP/s matmul (two ``MATMUL_SIZE`` squares and the product), the bandwidth copy's two
      ``COPY_MIB`` buffers, and the overlap cell's 4096 x 4096 weight and its product.
    """
    in_features = 3 * p["CROP_SIZE"] ** 2
    model = _meta(lambda: utils.MLP(in_features, p["HIDDEN_FEATURES"], 10, 2))
    batch = p["LARGE_BATCH"]
    return {
        "MLP with SGD (weights and gradients)": _state(model, "sgd"),
        "large batch: crops, activations and their gradients": batch * 4 * in_features + _activations(model, batch),
        "the peak-FLOP/s matmul": 3 * 4 * p["MATMUL_SIZE"] ** 2,
        "the bandwidth copy's buffers": 2 * p["COPY_MIB"] * 2**20,
        "the overlap cell's weight and product": 2 * 4 * 4096**2,
    }


def predict_07(p: dict) -> dict[str, int]:
    """07 what frees memory: four MLPs of the same size that all stay alive, and a second process.

    - section 1's normal model (fused AdamW) and its hooked twin (one fused AdamW per parameter), section 2's
      model (trained with AdamW in section 5) and section 6's category model with AdamW: none is freed before
      the notebook ends, so four copies of weights, gradients and moments (16 B per parameter each);
    - one parameter-sized temporary of a foreach AdamW step (sections 5 and 6 use the default);
    - batches: ``OPTIMIZER_STEPS + 1`` of them, plus section 2's inputs and targets; activations and their
      gradients in backward, and the leaking evaluation loop's ``LEAK_STEPS`` graphs at once;
    - the fragmentation runs: a second process on the same GPU while the kernel holds the above, training
      ``Linear(w, 4w), ReLU, Linear(4w, w)`` with ``w = HIDDEN_FEATURES // 4`` and AdamW at batches up to 4096,
      with a CUDA context of its own.
    """
    model = _mlp(p)
    width = p["HIDDEN_FEATURES"] // 4
    fragmentation_parameters = 2 * (4 * width * width) + 5 * width
    fragmentation_activations = 4096 * 4 * (4 * width + 4 * width + width)   # the hidden pre-/post-ReLU and output
    return {
        "four MLPs with AdamW state (16 B/parameter each)": 4 * _state(model),
        "foreach AdamW temporary": _weights(model),
        "batches": (p["OPTIMIZER_STEPS"] + 2) * _rows(p, p["BATCH_SIZE"]),
        "activations and their gradients": _activations(model, p["BATCH_SIZE"]),
        "the leaking evaluation loop's graphs": p["LEAK_STEPS"] * utils.predict_mlp_activation_bytes(
            model, p["BATCH_SIZE"]),
        "fragmentation process: model state": 16 * fragmentation_parameters,
        "fragmentation process: activations and gradients at batch 4096": 2 * fragmentation_activations,
        "fragmentation process: its CUDA context": CONTEXT_BYTES,
    }


def predict_08(p: dict) -> dict[str, int]:
    """08 past checkpointing: its three sections' peaks added up, as if none were freed (their parameters cell).

    - section 2's language model: 68 bytes of activations per token per block per unit of width, ``12·B·T·V``
      for its loss, and 24 B per parameter (the model with gradients, a copy with AdamW);
    - section 3's GELU MLP: ``16·B·W`` of saved activations and 16 B per parameter (AdamW);
    - section 4's LM head: ``12·N·V`` for the plain loss at the largest vocabulary, and the head's weight and
      its gradient (``V·d`` each, in 16 bits).
    """
    model = _meta(lambda: utils.TinyTransformer(p["VOCAB"], p["D_MODEL"], p["NUM_HEADS"], p["NUM_BLOCKS"],
                                                max_seq_len=p["SEQ_LEN"]))
    tokens = p["BATCH_SIZE"] * p["SEQ_LEN"]
    width = p["HOOK_WIDTH"]
    mlp_parameters = 2 * (width * width + width) + 10 * width + 10
    vocab = max(p["VOCAB_SIZES"])
    return {
        "section 2: activations": 68 * tokens * p["NUM_BLOCKS"] * p["D_MODEL"],
        "section 2: loss": 12 * tokens * p["VOCAB"],
        "section 2: model with gradients and a copy with AdamW": 24 * utils.count_parameters(model),
        "section 3: saved activations": 16 * p["HOOK_BATCH"] * width,
        "section 3: MLP with AdamW": 16 * mlp_parameters,
        "section 4: plain loss at the largest vocabulary": 12 * p["LOSS_TOKENS"] * vocab,
        "section 4: the head's weight and gradient in 16 bits": 2 * 2 * vocab * p["LOSS_D_MODEL"],
    }


def predict_09(p: dict) -> dict[str, int]:
    """09 fine-tuning: full fine-tuning of its TinyTransformer in fp32 with AdamW at the sweep's largest batch (the
    memory calculator's replay of that step), two more copies of the weights alive beside it (the frozen base and
    a merged copy), and section 5's searches, each under ``SEARCH_BUDGET_MIB``.
    """
    from utils import calculator as calc

    model = calc.ModelConfig(p["NUM_LAYERS"], p["D_MODEL"], p["NUM_HEADS"], p["VOCAB"], max_seq_len=p["SEQ_LEN"])
    batch = max((*p["BATCH_SIZES"], p["BATCH_SIZE"]))
    step = calc.predict(model, calc.TrainingSetup(micro_batch=batch, seq_len=p["SEQ_LEN"], precision="fp32",
                                                  optimizer="adamw", optimizer_impl="foreach", device="cuda"))
    return {
        "full fine-tuning step, fp32 AdamW, the largest batch (calculator)": step.total,
        "two more fp32 copies of the weights": 2 * 4 * step.num_parameters,
        "section 5's search budget": p["SEARCH_BUDGET_MIB"] * 2**20,
    }


def predict_11(p: dict) -> dict[str, int]:
    """11 long sequences: its sections run one after another and free what they measured (each builds a fresh
    model), so the peak is the largest section's, plus the documents and model kept throughout (small):

    - section 1: the attention calls, kept inside ``ATTENTION_BUDGET_MIB`` by their prediction, with inputs and
      gradients (O(L), far smaller than the saved bytes; half the budget again covers them);
    - section 3: one naive layer at ``LAYER_SEQ_LEN``, its saved bytes twice over during backward;
    - section 4: the padded batch's blocks or the packed row's blocks with its dense float mask (``S²·4``; S from the
      notebook's own seeded lengths), fused-kernel bytes (``utils.layer_activation_bytes``) twice over during
      backward, plus the logits and their gradient;
    - section 5: the search budget ``FIT_BUDGET_MIB``.
    """
    heads, width, layers, vocab = p["NUM_HEADS"], p["D_MODEL"], p["NUM_LAYERS"], p["VOCAB_SIZE"]
    lengths = utils.sample_document_lengths(p["NUM_DOCUMENTS"], mean_length=p["MEAN_DOC_LEN"],
                                            max_length=p["MAX_DOC_LEN"], min_length=2, seed=p["SEED"])
    longest, total = max(lengths), sum(lengths)

    def blocks(batch: int, seq: int) -> int:
        return 2 * layers * utils.layer_activation_bytes(batch, seq, width, heads).total_bytes

    sections = {
        "section 1: attention calls, inputs and gradients": 3 * p["ATTENTION_BUDGET_MIB"] * 2**20 // 2,
        "section 3: one naive layer": 2 * utils.layer_activation_bytes(
            p["LAYER_BATCH"], p["LAYER_SEQ_LEN"], width, heads, attention="naive").total_bytes,
        "section 4: padded or packed blocks, the dense mask, the logits": (
            max(blocks(p["NUM_DOCUMENTS"], longest), blocks(1, total) + 4 * total * total)
            + 3 * 4 * max(p["NUM_DOCUMENTS"] * longest, total) * vocab),
        "section 5: the search budget": p["FIT_BUDGET_MIB"] * 2**20,
    }
    largest = max(sections, key=sections.get)
    model = _meta(lambda: utils.TinyTransformer(vocab, width, heads, layers, max_seq_len=p["MAX_SEQ_LEN"]))
    return {largest: sections[largest],
            "kept throughout: a model with AdamW, the documents": _state(model) + 8 * total}


def predict_12(p: dict) -> dict[str, int]:
    """12 distributed: with one GPU per rank (NCCL), each rank holds DDP's 20 bytes per parameter (weights,
    gradients, buckets, AdamW's two moments) of the 4-layer MLP, ``HIDDEN`` wide, and a micro-batch's activations;
    with fewer GPUs than ranks the ranks run on the CPU and the GPU holds nothing of theirs.
    """
    if p["LAUNCH_DEVICE"] != "cuda":
        return {"ranks on the CPU: nothing on the GPU": 0}
    hidden = p["HIDDEN"]
    parameters = p["LAYERS"] * (hidden * hidden + hidden)
    return {"DDP per rank, 20 B per parameter": 20 * parameters,
            "a micro-batch's activations and their gradients": 2 * 4 * p["GLOBAL_BATCH"] * hidden * p["LAYERS"]}


def predict_15(p: dict) -> dict[str, int]:
    """15 when training generates: an upper bound that adds up what its sections keep, as if all were alive at once.

    - the transformers Llama (``HIDDEN`` wide, a ``32 x HIDDEN`` vocabulary, untied head) four times with AdamW's
      state: the policy, the reference copy, and the LoRA and bf16 levers' models (16 B per parameter each);
    - the GRPO batch's logits (``BATCH x GROUP`` answers of ``PROMPT_LEN + NEW_TOKENS`` tokens) in fp32, ten times:
      the policy's and the reference's, their log-softmax, the gradients and the chunked copies;
    - section 2's training batch and an evaluation's answers, six fp32 logits tensors of the larger.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=p["VOCAB"], hidden_size=p["HIDDEN"], intermediate_size=2 * p["HIDDEN"],
                         num_hidden_layers=p["LAYERS"], num_attention_heads=p["HEADS"],
                         num_key_value_heads=p["KV_HEADS"], max_position_embeddings=512, tie_word_embeddings=False)
    model = _meta(lambda: LlamaForCausalLM(config))
    answer = p["PROMPT_LEN"] + p["NEW_TOKENS"]
    rows = max(p["TRAIN_BATCH"] * p["TRAIN_LEN"], p["EVAL_BATCH"] * answer)
    return {
        "four Llamas with AdamW's state": 4 * _state(model),
        "the GRPO batch's logits, log-probabilities and gradients": 10 * 4 * p["BATCH"] * p["GROUP"] * answer * p["VOCAB"],
        "section 2's training batch or an evaluation's logits": 6 * 4 * rows * p["VOCAB"],
    }


def predict_16(p: dict) -> dict[str, int]:
    """16 checkpoint and resume: section 5's timed model (4 layers ``TIMED_HIDDEN`` wide with AdamW's state, 16 B per
    parameter), a CPU copy aside, and the resumed MLP with its state (``HIDDEN_FEATURES`` wide)."""
    timed = 4 * (p["TIMED_HIDDEN"] ** 2 + p["TIMED_HIDDEN"])
    resumed = (p["IN_FEATURES"] * p["HIDDEN_FEATURES"] + 2 * p["HIDDEN_FEATURES"] ** 2
               + p["HIDDEN_FEATURES"] * p["NUM_CLASSES"] + 4 * p["HIDDEN_FEATURES"])
    return {"the timed model with AdamW": 16 * timed,
            "its activations at the timed batch": 4 * 4 * p["BATCH_SIZE"] * p["TIMED_HIDDEN"],
            "the resumed MLP with AdamW": 16 * resumed}


def predict_17(p: dict) -> dict[str, int]:
    """17 capstone. Every search runs under ``BUDGET_MIB`` or the Llama's ``LLAMA_BUDGET_MIB`` (a limit on the caching
    allocator's reserved bytes, cache included). Outside them, at other moments: the gradient checks' plain fp32 steps
    on whole batches, predicted by the course's calculator (section 2's ``RECIPE_BATCH`` rows of the TinyTransformer;
    the Llama's ``RECIPE_BATCH`` rows under MemTracker and exercise 1's largest batch, twice the micro-batch its
    accumulated configuration fits); and beside either, the MFU's peak matmul (three ``MFU_MATMUL_SIZE``² 16-bit
    tensors) and a quarter GiB for the models and optimizers a cell keeps alive.
    """
    from transformers import LlamaConfig

    from utils import calculator

    seq = p["SEQ_LEN"]

    def plain_fp32_step(shape, rows: int, **options) -> int:
        setup = calculator.TrainingSetup(seq_len=seq, micro_batch=rows, precision="fp32", optimizer="adamw",
                                         optimizer_impl="fused", device="cuda", **options)
        return calculator.predict(shape, setup).total

    tiny = calculator.ModelConfig(p["NUM_LAYERS"], p["D_MODEL"], p["NUM_HEADS"], p["VOCAB_SIZE"], max_seq_len=seq,
                                  arch="gpt", name="17's TinyTransformer")
    llama = calculator.model_config_from_hf(LlamaConfig(
        vocab_size=p["LLAMA_VOCAB"], hidden_size=p["LLAMA_HIDDEN"], intermediate_size=4 * p["LLAMA_HIDDEN"],
        num_hidden_layers=p["LLAMA_LAYERS"], num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
        use_cache=False, attn_implementation="sdpa"))
    accumulated = calculator.TrainingSetup(seq_len=seq, precision="bf16-autocast", optimizer="adamw",
                                           optimizer_impl="fused", accumulation_steps=p["LLAMA_PIECES"],
                                           checkpointing="every_block", device="cuda", padded=True, loss="shifted-sum")
    fits = calculator.largest_micro_batch(llama, accumulated, p["LLAMA_BUDGET_MIB"] * 2**20)
    whole_batches = max(plain_fp32_step(tiny, p["RECIPE_BATCH"]),
                        plain_fp32_step(llama, max(p["RECIPE_BATCH"], 2 * fits), padded=True, loss="shifted-sum"))
    budgets = max(p["BUDGET_MIB"], p["LLAMA_BUDGET_MIB"]) * 2**20
    return {
        "the larger of the search budgets and the whole-batch gradient checks": max(budgets, whole_batches),
        "the MFU's peak matmul (three 16-bit tensors)": 3 * 2 * p["MFU_MATMUL_SIZE"] ** 2,
        "the models and optimizers a cell keeps alive": GIB // 4,
    }


def predict_10(p: dict) -> dict[str, int]:
    """10 fewer bits: what stays alive from section to section, plus the largest of the sections' own peaks.

    Alive once made (upper bounds):
    - section 1's fp32 base model (4 B per parameter of the TinyTransformer) and section 4's four trained models,
      kept for section 5 (one fp32, three bf16: 10 B per parameter);
    - section 2's QLoRA models (the dequantisation count's, the paged-optimizer measurement's) and section 3's three
      Llamas (prepared, not, and bf16 LoRA): each at most 4 B per TinyTransformer parameter (its bf16 or 4-bit
      weights, fp32 upcast embeddings and head, adapters and their AdamW state; the Llama's FFN is half as wide);
    - section 5's captured activations and gradients (4 C wide, one of each per block, fp32).

    The largest of the sections' transient peaks (one runs at a time):
    - section 2's full fine-tuning step of the TinyTransformer in fp32 with AdamW (16 B per parameter) and its
      activations, bounded by 40 fp32 (B, T, C) tensors per block plus three fp32 (B, T, V) tensors;
    - section 3's two wide-vocabulary Llamas, alive together until their cell deletes them: embeddings and heads in
      fp32, Linear weights in bf16 at most, and six fp32 (B, T, V) tensors of logits, their copies and gradients;
    - section 4's fp32 and bf16 copies of every weight (the lost-update counts, the repeated updates): 6 fp32 copies;
    - section 5's capture step on the fp32 model (the activations bound above) and eight (B T, 4 C) fp32 copies in
      the scaling table; section 1's NF4, INT4 and FP4 comparison (40 B per element of its two weights) is smaller.
    """
    model = _meta(lambda: utils.TinyTransformer(p["VOCAB"], p["D_MODEL"], p["NUM_HEADS"], p["NUM_LAYERS"],
                                                max_seq_len=p["SEQ_LEN"]))
    tokens = p["BATCH_SIZE"] * p["SEQ_LEN"]
    width, heads, layers = p["D_MODEL"], p["NUM_HEADS"], p["NUM_LAYERS"]
    kv_width = width // heads * (heads // 2)                                 # the notebook's Llama: half the kv heads
    shapes = [(width, width), (kv_width, width), (kv_width, width), (width, width),
              (2 * width, width), (2 * width, width), (width, 2 * width)] * layers
    saving = sum(2 * o * i - utils.lowbit.nf4_storage_bytes(o * i, p["NF4_BLOCK"]) for o, i in shapes)
    wide_vocab = 64 * math.ceil(2 * math.ceil((saving / 2 - (2 * layers + 1) * width) / (2 * width)) / 64)
    activations = 4 * tokens * (40 * layers * width + 3 * p["VOCAB"])
    hidden_row = 4 * tokens * 4 * width                                      # one fp32 (B T, 4 C) tensor
    transient = {
        "section 2's full fine-tuning step": _state(model) + activations,
        "section 3's wide-vocabulary Llamas": 2 * (4 * 2 * wide_vocab * width + 2 * sum(o * i for o, i in shapes))
                                              + 6 * 4 * tokens * wide_vocab,
        "section 4's copies of the weights": 6 * _weights(model),
        "section 5's capture step and scaling table": activations + 8 * hidden_row,
        "section 1's NF4, INT4 and FP4 comparison": 2 * 40 * p["NF4_COMPARE_ROWS"] * 1024,
    }
    largest = max(transient, key=transient.get)
    return {
        "section 1's base model and section 4's trained models": 14 * utils.count_parameters(model),
        "section 2's two QLoRA models and section 3's three Llamas": 5 * _weights(model),
        "section 5's captured activations and gradients": 2 * layers * hidden_row,
        f"the largest transient peak: {largest}": transient[largest],
    }


PREDICTIONS: dict[str, Callable[[dict], dict[str, int]]] = {
    "00_measuring_memory_and_time": predict_00,
    "01_parameter_footprint": predict_01,
    "02_gradient_accumulation": predict_02,
    "03_activation_checkpointing": predict_03,
    "04_mixed_precision": predict_04,
    "05_torch_compile": predict_05,
    "06_profiling_where_the_time_goes": predict_06,
    "07_what_frees_memory": predict_07,
    "08_memory_budget_offloading_chunked_loss": predict_08,
    "09_fine_tuning_lora_and_optimizer_memory": predict_09,
    "10_fewer_bits_4bit_bf16_fp8": predict_10,
    "11_long_sequences_attention_memory": predict_11,
    "12_distributed_ddp_zero_fsdp": predict_12,
    "15_when_training_generates": predict_15,
    "16_checkpoint_and_resume": predict_16,
    "17_capstone_fit_then_fast": predict_17,
}
NOTEBOOKS = {path.stem: path for path in list_notebooks()}
# notebooks that never allocate GPU memory, with the reason (their sizes cannot outgrow a card)
CPU_ONLY = {"13_model_parallel_tp_sp_pp_cp": "its ranks run on the CPU with gloo (speed is the only GPU-only "
                                            "figure, and the notebook measures none)",
            "14_mixture_of_experts": "every measurement runs on the CPU: the exact tracker's bytes, gloo ranks, "
                                     "and the grouped GEMM timed on the CPU (its parameters cell sets DEVICE = 'cpu')"}


@pytest.mark.parametrize("memory_class_gb", utils.MEMORY_CLASSES_GB)
@pytest.mark.parametrize("stem", sorted(NOTEBOOKS))
def test_gpu_sizes_fit_the_smallest_card_of_each_class(stem, memory_class_gb, monkeypatch):
    if stem in CPU_ONLY:
        assert "utils.by_memory" not in parameters_source(NOTEBOOKS[stem]), f"{stem} sizes itself by GPU memory now"
        pytest.skip(f"{stem}: CPU only: {CPU_ONLY[stem]}")
    if stem not in PREDICTIONS:
        uses = "utils.by_memory" in parameters_source(NOTEBOOKS[stem])
        pytest.skip(f"{stem}: pending, no size prediction in tests/test_gpu_sizes.py yet "
                    f"({'its parameters cell uses utils.by_memory' if uses else 'its GPU sizes are not by memory class yet'})")
    settings = gpu_parameters(NOTEBOOKS[stem], memory_class_gb, monkeypatch)
    parts = PREDICTIONS[stem](settings)
    card = smallest_card_bytes(memory_class_gb)
    usable = card - CONTEXT_BYTES
    needed = FRAGMENTATION * sum(parts.values())
    breakdown = "\n".join(f"  {name}: {value / 10**9:.3f} GB" for name, value in parts.items())
    assert needed <= usable, (f"{stem} on a {memory_class_gb} GB-class card ({card / 10**9:.2f} GB): predicted peak "
                              f"{needed / 10**9:.2f} GB with {FRAGMENTATION - 1:.0%} for fragmentation, over the "
                              f"{usable / 10**9:.2f} GB left after the CUDA context:\n{breakdown}")


@pytest.mark.parametrize("stem", sorted(PREDICTIONS))
def test_predicted_notebooks_take_their_sizes_from_the_card(stem, monkeypatch):
    """A notebook with a prediction sizes itself by memory class: its settings are not the CPU's, and grow with the card."""
    assert "utils.by_memory" in parameters_source(NOTEBOOKS[stem])
    peaks = [sum(PREDICTIONS[stem](gpu_parameters(NOTEBOOKS[stem], gb, monkeypatch)).values())
             for gb in utils.MEMORY_CLASSES_GB]
    assert peaks == sorted(peaks), f"{stem}: a larger card should never get a smaller configuration: {peaks}"


def test_the_parameters_cell_sees_each_class(monkeypatch, tmp_path):
    """The mechanism itself, on a made-up notebook: each class gets its own entry, the CPU its own."""
    source = ("import utils\nCHECK_MODE = utils.check_mode()\nDEVICE = utils.pick_device()\n"
              "WIDTH = 8 if CHECK_MODE else utils.by_memory(DEVICE, cpu=1, gpu={8: 2, 16: 3, 80: 5})\n"
              "DTYPE = utils.autocast_dtype(DEVICE)\n")
    notebook = tmp_path / "99_made_up.ipynb"
    notebook.write_text(json.dumps({"cells": [{"cell_type": "code", "metadata": {"tags": ["parameters"]},
                                               "source": [source]}]}))
    seen = {gb: gpu_parameters(notebook, gb, monkeypatch) for gb in utils.MEMORY_CLASSES_GB}
    assert {gb: s["WIDTH"] for gb, s in seen.items()} == {8: 2, 16: 3, 24: 3, 40: 3, 80: 5}
    assert seen[16]["DTYPE"] == torch.float16 and seen[80]["DTYPE"] == torch.bfloat16   # a T4 has no native bf16
    assert torch.cuda.is_available.__module__ == "torch.cuda"                             # the fake is gone again
