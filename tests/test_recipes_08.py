"""Notebook 08's recipes, taken from the notebook's `recipe` cells, on models the notebook was not written for.

Recipes: ``train_with_budget`` (compile's memory budget), ``bf16_hooks`` (saved activations stored in bf16) and
``ChunkedCrossEntropy`` (the head and the loss, chunk by chunk). Models: an ``nn.Sequential``, a model with a fused
qkv weight that forward ``.split``s, the transformers families of ``recipe_models`` (Llama, Qwen2 with a tied head,
GPT-2 with Conv1D and dropout, a bf16 Mistral), an ``nn.TransformerEncoder`` classifier with a padding mask and a
BatchNorm conv net; cases: padded targets (-100), every target padding, bf16 autocast over fp32 weights, a bf16 model,
chunk sizes that do and do not divide the number of tokens, and inputs of the wrong shape (refused with a message).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import utils
from tests.recipe_models import (CAUSAL_LM_FAMILIES, EncoderClassifier, FusedQKVModel, batchnorm_convnet,
                                 padded_dict_batches, padded_tokens, run_recipe, sequential_mlp)


@pytest.fixture(scope="module")
def recipe() -> dict:
    return run_recipe("08")


def _param_storages(model: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def _hooked_forward(recipe: dict, model: torch.nn.Module, forward):
    """Run ``forward()`` under the recipe's hooks; return its output and, per saved tensor, (is a weight view, packed)."""
    pack, unpack = recipe["bf16_hooks"](model)
    storages, seen = _param_storages(model), []

    def watching_pack(tensor):
        packed = pack(tensor)
        seen.append((tensor.untyped_storage().data_ptr() in storages, packed[1] is not None))
        return packed

    with torch.autograd.graph.saved_tensors_hooks(watching_pack, unpack):
        output = forward()
    return output, seen


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_bf16_hooks_halve_a_sequential_models_activations_to_the_byte(recipe):
    model = sequential_mlp()
    inputs, classes = torch.randn(16, 16), torch.randint(0, 5, (16,))
    with utils.track_saved_tensors(exclude=(model, inputs)) as saved:
        model(inputs)
    kept = {}
    for label in ("plain", "hooks"):
        with utils.measure_memory("cpu", include=(model, inputs)) as mem:
            if label == "hooks":
                logits, _ = _hooked_forward(recipe, model, lambda: model(inputs))
            else:
                logits = model(inputs)
        kept[label] = mem.end_bytes
        F.cross_entropy(logits, classes).backward()
    assert kept["plain"] - kept["hooks"] == saved.bytes // 2            # the notebook's claim, GELU saves each once


@pytest.mark.parametrize("dtype_case", ["fp32", "bf16 autocast"])
def test_bf16_hooks_leave_the_slices_of_a_fused_qkv_weight_alone(recipe, dtype_case):
    model = FusedQKVModel()
    tokens, _, labels = padded_tokens(3, 12, 64)
    reference = copy.deepcopy(model)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=dtype_case == "bf16 autocast")
    with autocast:
        logits, seen = _hooked_forward(recipe, model, lambda: model(tokens))
        want_logits = reference(tokens)
    F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(want_logits.float().flatten(0, 1), labels.flatten()).backward()
    assert any(is_weight for is_weight, _ in seen), "the forward saves views of the fused weight"
    assert not any(is_weight and packed for is_weight, packed in seen), "a weight view was packed as a bf16 copy"
    assert any(packed for _, packed in seen)                           # fp32 activations remain, under autocast too
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert _relative(got.grad, want.grad) < 2 ** -6, name          # bf16's rounding of the activations only


def _family_forward(name: str):
    """(model, a function that runs one forward and returns a scalar loss) for a reader's model family."""
    if name in CAUSAL_LM_FAMILIES:
        pytest.importorskip("transformers")
        model = CAUSAL_LM_FAMILIES[name]()
        input_ids, attention_mask, labels = padded_tokens(2, 10, 128)
        return model, lambda net: net(input_ids, attention_mask=attention_mask, labels=labels).loss
    if name == "encoder classifier":
        model = EncoderClassifier()
        input_ids, attention_mask, _ = padded_tokens(3, 9, 64)
        classes = torch.tensor([0, 2, 1])
        return model, lambda net: F.cross_entropy(net(input_ids, attention_mask), classes)
    model = batchnorm_convnet()
    images, classes = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3])
    return model, lambda net: F.cross_entropy(net(images), classes)


@pytest.mark.parametrize("name", [*CAUSAL_LM_FAMILIES, "encoder classifier", "batchnorm convnet"])
def test_bf16_hooks_on_a_readers_model_pack_no_weight_and_round_like_bf16(recipe, name):
    """The notebook's claims on each family: no weight (or view of one) is packed, float32 activations are stored in
    bf16, and the gradients move by bf16's rounding only."""
    model, loss_of = _family_forward(name)
    reference = copy.deepcopy(model)
    torch.manual_seed(1)                                               # the same dropout masks in both forwards
    loss, seen = _hooked_forward(recipe, model, lambda: loss_of(model))
    loss.backward()
    torch.manual_seed(1)
    loss_of(reference).backward()
    assert not any(is_weight and packed for is_weight, packed in seen), "a weight or a view of one was packed"
    assert any(packed for _, packed in seen)          # float32 activations (a bf16 Mistral's RMSNorm upcasts too)
    for (param_name, got), want in zip(model.named_parameters(), reference.parameters()):
        if want.grad is None:
            assert got.grad is None, param_name
            continue
        assert _relative(got.grad.float(), want.grad.float()) < 2 ** -5, param_name


def _head_case(model_name: str, dtype: torch.dtype):
    """(hidden (N, d) requiring grad, head weight (V, d), targets (N,) with -100 padding) from a reader's model; for
    the transformers families the hidden states of positions 0..T-2 and the labels shifted by one (their convention),
    flattened as the recipe asks."""
    if model_name in CAUSAL_LM_FAMILIES:
        pytest.importorskip("transformers")
        model = CAUSAL_LM_FAMILIES[model_name](dtype=dtype)
        batch = padded_dict_batches(batch_size=3, max_length=11, seed=1)[0]       # a DataLoader's padded dict batch
        hidden = model.base_model(batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state[:, :-1]
        weight, targets = model.get_output_embeddings().weight, batch["labels"][:, 1:]
    elif model_name == "fused qkv":
        model = FusedQKVModel().to(dtype)
        tokens, _, labels = padded_tokens(3, 11, 64)
        hidden = model.embed(tokens)
        for layer in model.layers:
            hidden = layer(hidden)
        weight, targets = model.head.weight, labels
    else:
        model = sequential_mlp().to(dtype)
        inputs, targets = torch.randn(33, 16).to(dtype), torch.randint(0, 5, (33,))
        targets[::4] = -100
        hidden, weight = model[:-1](inputs), model[-1].weight          # the head without its bias (see the recipe)
    hidden = hidden.detach().flatten(0, -2).requires_grad_()
    return hidden, weight.detach().requires_grad_(), targets.flatten()


HEAD_CASES = [(model_name, case) for model_name in ["sequential", "fused qkv", "llama", "qwen2", "gpt2"]
              for case in ["fp32", "bf16 autocast over fp32", "bf16 model"]] + [("mistral-bf16-sliding", "bf16 model")]


@pytest.mark.parametrize("model_name, case", HEAD_CASES)
def test_chunked_cross_entropy_equals_f_cross_entropy(recipe, model_name, case):
    hidden, weight, targets = _head_case(model_name, torch.bfloat16 if case == "bf16 model" else torch.float32)
    assert (targets == -100).any() and len(targets) % 4 != 0
    with torch.autocast("cpu", torch.bfloat16, enabled=case == "bf16 autocast over fp32"):
        want = F.cross_entropy(F.linear(hidden, weight).float(), targets)
        got = recipe["ChunkedCrossEntropy"].apply(hidden, weight, targets, 4)      # 4 divides no case's N
    want_grads = torch.autograd.grad(want, (hidden, weight))
    got_grads = torch.autograd.grad(got, (hidden, weight))
    tolerance = 1e-5 if case == "fp32" else 2 ** -6
    assert abs(got.item() - want.item()) <= tolerance * abs(want.item())
    for got_grad, want_grad in zip(got_grads, want_grads):
        assert got_grad.dtype == want_grad.dtype
        assert _relative(got_grad.float(), want_grad.float()) < tolerance


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 4, 20, 21, 22, 1000])   # N = 21: divisors, a partial last chunk, C > N
def test_chunk_sizes_that_divide_or_not_and_a_last_chunk_of_real_tokens(recipe, chunk_size):
    hidden, weight, targets = _head_case("llama", torch.float32)
    assert len(targets) == 21
    targets = targets.clone()
    targets[-3:] = torch.tensor([5, 6, 7])                            # the last (partial) chunk holds real tokens
    want = F.cross_entropy(F.linear(hidden, weight), targets)
    got = recipe["ChunkedCrossEntropy"].apply(hidden, weight, targets, chunk_size)
    for got_grad, want_grad in zip(torch.autograd.grad(got, (hidden, weight)), torch.autograd.grad(want, (hidden, weight))):
        assert _relative(got_grad, want_grad) < 1e-5
    assert abs(got.item() - want.item()) <= 1e-5 * want.item()


@pytest.mark.parametrize("autocast_on", [False, True])
def test_every_target_padding_gives_a_zero_loss_and_zero_gradients_not_nan(recipe, autocast_on):
    """F.cross_entropy's mean over no real token is 0/0 = NaN, which one optimizer step spreads into every weight; the
    recipe says it returns a loss of 0 with zero gradients instead (a micro-batch of padding only)."""
    hidden, weight, targets = _head_case("qwen2", torch.float32)
    targets = torch.full_like(targets, -100)
    assert F.cross_entropy(F.linear(hidden, weight), targets).isnan()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast_on):
        loss = recipe["ChunkedCrossEntropy"].apply(hidden, weight, targets, 4)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert loss.item() == 0 and all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_inputs_of_the_wrong_shape_are_refused_with_the_shapes_it_expects(recipe):
    """(B, T, d) hidden states with (B, T) targets, and targets one shorter than the hidden states (labels shifted
    but not the hidden states): zip() would pair the chunks wrongly without an error; the recipe names the shapes."""
    hidden = torch.randn(3, 10, 8, requires_grad=True)
    weight, targets = torch.randn(50, 8, requires_grad=True), torch.randint(0, 50, (3, 10))
    with pytest.raises(ValueError, match=r"expected hidden \(N, d\) and targets \(N,\), got \[3, 10, 8\]"):
        recipe["ChunkedCrossEntropy"].apply(hidden, weight, targets, 4)
    with pytest.raises(ValueError, match=r"got \[30, 8\] and \[29\]"):
        recipe["ChunkedCrossEntropy"].apply(hidden.flatten(0, 1), weight, targets.flatten()[1:], 4)
    loss = recipe["ChunkedCrossEntropy"].apply(hidden.flatten(0, 1), weight, targets.flatten(), 4)    # flattened: fine
    loss.backward()
    assert hidden.grad.shape == hidden.shape


def test_chunked_cross_entropy_keeps_nothing_of_size_v_after_forward(recipe):
    hidden = torch.randn(37, 8, requires_grad=True)
    weight = torch.randn(1000, 8, requires_grad=True)
    targets = torch.randint(0, 1000, (37,))
    targets[30:] = -100
    with utils.measure_memory("cpu", include=(hidden, weight, targets)) as mem:
        loss = recipe["ChunkedCrossEntropy"].apply(hidden, weight, targets, 8)
    assert mem.end_bytes == 4 + 8                                      # the loss and the count of real tokens
    del loss


# "fused qkv" passes too; each compile costs seconds. The transformers families return a ModelOutput, not logits:
# the recipe's header says it expects a model that returns logits (..., V)
@pytest.mark.parametrize("model_name", ["sequential", "batchnorm convnet"])
def test_train_with_budget_matches_an_eager_step(recipe, model_name):
    torch._dynamo.reset()
    if model_name == "sequential":
        model = sequential_mlp()
        inputs, targets = torch.randn(12, 16), torch.randint(0, 5, (12,))
        targets[::3] = -100
    elif model_name == "batchnorm convnet":
        model = batchnorm_convnet()
        inputs, targets = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3])
    else:
        model = FusedQKVModel()
        inputs, _, targets = padded_tokens(2, 9, 64)
    eager = copy.deepcopy(model)
    compiled = recipe["train_with_budget"](model, [(inputs, targets)], 0.0, backend="aot_eager_decomp_partition")
    eager_stats = copy.deepcopy(eager)
    eager_stats(inputs)                                                # one training-mode forward: BatchNorm's update
    for (name, got), want in zip(model.named_buffers(), eager_stats.buffers()):
        torch.testing.assert_close(got, want, msg=f"{name}: budget 0 updated the running statistics differently")
    model.load_state_dict(eager.state_dict())                          # the same weights: compare one step's gradients
    for net in (compiled, eager):                                      # the compiled step, budget 0, and plain eager
        F.cross_entropy(net(inputs).flatten(0, -2), targets.flatten()).backward()
    for (name, got), want in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6, msg=name)
    torch._dynamo.reset()


@pytest.mark.parametrize("autocast_on", [False, True])
def test_the_utils_helper_is_the_recipe_with_a_bias(recipe, autocast_on):
    """utils.chunked_cross_entropy (notebook 08's text: 'this Function with an optional bias') agrees with the recipe
    on padded targets, under bf16 autocast over fp32 weights too."""
    hidden, weight, targets = _head_case("sequential", torch.float32)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast_on):
        want = recipe["ChunkedCrossEntropy"].apply(hidden, weight, targets, 4)
        got = utils.chunked_cross_entropy(hidden, weight, targets, chunk_size=4)
    want_grads = torch.autograd.grad(want, (hidden, weight))
    got_grads = torch.autograd.grad(got, (hidden, weight))
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    for got_grad, want_grad in zip(got_grads, want_grads):
        assert _relative(got_grad, want_grad) < 1e-4


@pytest.mark.parametrize("slowdown, sized_down", [("bfloat16=40,float16=40", True), ("bfloat16=0.5,float16=0.5", False)])
def test_section_4_is_sized_from_the_head_format_probe(monkeypatch, tmp_path, slowdown, sized_down):
    """Issue 45: full mode's parameters and set-up cells, with the format probe faked slow (an emulated bf16, e.g. an
    AVX2-only CPU) or fast, size section 4 from it and print what they found and changed."""
    import contextlib
    import io
    import json

    from tests.recipe_models import notebook_path
    monkeypatch.setenv("PYTORCH_INTRO_CHECK_MODE", "0")
    monkeypatch.setenv("PYTORCH_INTRO_FORMAT_SLOWDOWN", slowdown)
    monkeypatch.setenv("PYTORCH_INTRO_BUILD_DIR", str(tmp_path))
    cells = [c for c in json.loads(notebook_path("08").read_text())["cells"] if c["cell_type"] == "code"]
    first = next(i for i, c in enumerate(cells) if "parameters" in c["metadata"].get("tags", []))
    namespace, printed = {}, io.StringIO()
    with contextlib.redirect_stdout(printed):
        for cell in cells[first:first + 2]:                       # parameters, then the set-up cell
            exec("".join(cell["source"]), namespace)
    sizes = (namespace["LOSS_TOKENS"], namespace["LOSS_D_MODEL"], namespace["CHUNK_SIZES"],
             namespace["LOSS_TIMING_REPEATS"])
    if sized_down:
        assert sizes == (64, 32, (8, 16, 32), 5) and "section 4 scaled down" in printed.getvalue()
    else:
        assert sizes == (256, 128, (32, 64, 128), 9) and "section 4 keeps its size" in printed.getvalue()
    assert "faked by PYTORCH_INTRO_FORMAT_SLOWDOWN" in printed.getvalue()


# --- held-out models (issue 38's paste test): heads the Function cannot see from their weight -----------------------

def test_a_head_with_a_bias_takes_the_utils_helper_as_the_text_says(recipe):
    """An LSTM language model's decoder has a bias: the recipe given its weight alone computes another loss (the
    paste test found 4.5732 against 4.5906), silently, since a weight cannot tell; the text names the case and
    ``utils.chunked_cross_entropy(..., bias=)``, which gives F.cross_entropy's loss and gradients."""
    from tests.recipe_models_heldout import RecurrentLM, left_padded
    model = RecurrentLM()
    input_ids, _, labels = left_padded()
    hidden = model.hidden(input_ids)[:, :-1].flatten(0, 1).detach().requires_grad_()
    targets = labels[:, 1:].flatten()
    head = model.decoder
    want = F.cross_entropy(head(hidden), targets)
    with_bias = utils.chunked_cross_entropy(hidden, head.weight, targets, bias=head.bias, chunk_size=7)
    for got, expected in zip(torch.autograd.grad(with_bias, (hidden, head.weight, head.bias)),
                             torch.autograd.grad(want, (hidden, head.weight, head.bias))):
        assert _relative(got, expected) < 1e-5
    assert abs(with_bias.item() - want.item()) <= 1e-5 * want.item()
    weight_only = recipe["ChunkedCrossEntropy"].apply(hidden, head.weight, targets, 7)
    assert abs(weight_only.item() - want.item()) > 1e-3, "the bias must matter here, or the text's case is untested"
    from tests.recipe_models import notebook_path
    assert "bias=head.bias" in notebook_path("08").read_text(), "the text beside the recipe names the bias case"


def test_gemma2s_soft_capped_logits_are_not_this_loss_as_the_text_says(recipe):
    """Gemma-2 caps its logits after the head (``final_logit_softcapping``): the recipe on the head's weight equals
    the model's own loss only without the cap; with it (the head's weight x 40, so that the cap bites) it does not,
    which the text states beside the recipe (keep the model's own loss there)."""
    pytest.importorskip("transformers")
    from tests.recipe_models_heldout import left_padded, tiny_gemma2
    input_ids, attention_mask, labels = left_padded()
    losses = {}
    for cap in (None, 3.0):
        model = tiny_gemma2(final_logit_softcapping=cap, attn_implementation="eager")
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(40)
        output = model(input_ids, attention_mask=attention_mask, labels=labels, output_hidden_states=True)
        hidden = output.hidden_states[-1][:, :-1].flatten(0, 1)
        chunked = recipe["ChunkedCrossEntropy"].apply(hidden, model.get_output_embeddings().weight,
                                                      labels[:, 1:].flatten(), 5)
        losses[cap] = abs(chunked.item() - output.loss.item()) / output.loss.item()
    assert losses[None] < 1e-5 and losses[3.0] > 1e-2, losses
    from tests.recipe_models import notebook_path
    assert "final_logit_softcapping" in notebook_path("08").read_text(), "the text beside the recipe names the cap"
