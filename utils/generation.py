"""Measuring the memory of generation inside training: ``generate`` phase by phase, its KV cache, an RL step.

Introduced in notebook 15 (when training generates). The techniques are plain torch and transformers in that
notebook; this module measures them, to the byte on a CPU, with the exact storage tracker of ``utils.memory``:

* :func:`cache_bytes`: what a transformers ``Cache`` holds (its key/value storages and its bookkeeping tensors);
* :func:`measure_generate`: transformers' ``generate`` phase by phase (the set-up, the prefill, each decode step),
  with the cache after every forward and the logits every forward returned;
* :func:`measure_phases`: any step written as ``step(phase)`` (it calls ``phase("name")`` as each phase starts),
  measured phase by phase; :func:`grpo_step` is notebook 15's GRPO-shaped step written that way (a copy of the
  notebook's recipe, which ``tests/test_generation.py`` holds equal to it), and :func:`measure_grpo_step` builds a
  policy (and a reference) from a transformers config and measures one such step: generate, score, reference,
  policy forward, policy backward, optimizer step. These two are the measurements that the memory calculator's
  replays of generation and of an RL step are to be validated against, to the byte on a CPU.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .checks import non_negative_int, positive_int
from .memory import MemorySample, measure_memory, tensor_bytes

RL_PHASES = ("generate", "score", "reference", "policy forward", "policy backward", "optimizer step")
REFERENCES = ("copy", "adapters", "none")


# --- the KV cache ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CacheBytes:
    """What a transformers ``Cache`` holds.

    Attributes:
        key_value_bytes: bytes of the distinct storages behind every layer's keys and values. A storage counts
            whole even where the layer keeps a view of part of it (the dynamic sliding-window layer keeps the last
            ``window - 1`` tokens as a view of a ``window``-token storage).
        other_bytes: the layers' other tensors (a static layer's length counter, a sliding layer's window as a
            tensor): 8 bytes each.
        layers: the number of cache layers (one per decoder layer).
    """

    key_value_bytes: int
    other_bytes: int
    layers: int

    @property
    def total_bytes(self) -> int:
        """``key_value_bytes + other_bytes``."""
        return self.key_value_bytes + self.other_bytes


def cache_bytes(cache: Any) -> CacheBytes:
    """The bytes a transformers cache (``DynamicCache``, ``StaticCache``) holds, read from its layers' tensors.

    Why it exists: ``generate`` keeps the cache inside; the formula ``2 · layers · batch · kv-heads · length ·
    head-dim · bytes`` predicts it, and this reads what it really holds, storage by storage, to compare.

    Args:
        cache: a ``transformers.Cache`` (transformers 5: it has ``.layers``), e.g. ``generate(...,
            return_dict_in_generate=True).cache`` or a forward's ``outputs.cache``.

    Returns:
        A :class:`CacheBytes`.

    Raises:
        TypeError: ``cache`` is not a cache with ``.layers`` (a legacy tuple of tensors, None).

    Example:
        >>> out = model.generate(ids, max_new_tokens=8, return_dict_in_generate=True)
        >>> cache_bytes(out.cache).key_value_bytes
    """
    layers = getattr(cache, "layers", None)
    if layers is None or isinstance(cache, (tuple, list, torch.Tensor)):
        raise TypeError(f"expected a transformers Cache with .layers (DynamicCache, StaticCache), got "
                        f"{type(cache).__name__}: pass generate(..., return_dict_in_generate=True).cache")
    key_values, others = [], []
    for layer in layers:
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                (key_values if name in ("keys", "values") else others).append(value)
    return CacheBytes(tensor_bytes(key_values), tensor_bytes(others), len(layers))


# --- generate, phase by phase ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GenerateMemory:
    """The bytes of one ``generate`` call, phase by phase (exact storage tracker).

    Phases: ``"set-up"`` (before the first forward: the cache object, the attention mask), ``"prefill"`` (the
    first forward, over the whole prompt, and the sampling after it), then ``"decode 1"``, ``"decode 2"``, ...
    (each later forward, one token, and its sampling). With ``use_cache=False`` every forward runs over the whole
    sequence so far; the phases keep these names.

    Attributes:
        device: the device's human name.
        baseline_bytes: followed bytes when generate started (the model, the input ids, ``include``).
        peak_bytes: the highest level above the baseline.
        end_bytes: what generate left alive above the baseline (the sequences; the cache too if returned).
        phase_peak_bytes: each phase's highest level above the baseline, in order.
        phase_end_bytes: each phase's level when it handed over to the next.
        cache_bytes: the cache's key/value bytes right after each forward (prefill first); zeros without a cache.
        cache_other_bytes: the cache's bookkeeping tensors after the last forward.
        logits_bytes: the bytes of the logits each forward returned (prefill first).
        sequences_shape: the shape of the generated sequences, prompt included.
        timeline: every allocation and free, labelled by phase (``utils.plot_memory_timeline`` draws it via
            :meth:`as_measurement`).
    """

    device: str
    baseline_bytes: int
    peak_bytes: int
    end_bytes: int
    phase_peak_bytes: dict[str, int]
    phase_end_bytes: dict[str, int]
    cache_bytes: tuple[int, ...]
    cache_other_bytes: int
    logits_bytes: tuple[int, ...]
    sequences_shape: tuple[int, ...]
    timeline: list[MemorySample] = field(default_factory=list, repr=False)

    @property
    def decode_steps(self) -> int:
        """Forwards after the prefill."""
        return len(self.cache_bytes) - 1

    @property
    def prefill_logits_bytes(self) -> int:
        """The logits the prefill returned: ``batch × kept positions × vocabulary × bytes``."""
        return self.logits_bytes[0]

    @property
    def final_cache_bytes(self) -> int:
        """The cache's key/value bytes after the last forward."""
        return self.cache_bytes[-1]

    def as_measurement(self) -> "Any":
        """This call as a ``utils.MemoryMeasurement`` (for ``utils.plot_memory_timeline``)."""
        from .memory import MemoryMeasurement
        return MemoryMeasurement(device=self.device, backend="tracker", baseline_bytes=self.baseline_bytes,
                                 peak_bytes=self.peak_bytes, end_bytes=self.end_bytes, timeline=list(self.timeline))


def _model_output_cache(output: Any) -> Any:
    """The cache a forward returned (transformers 5 names it ``cache``), or None."""
    return output.get("cache") if isinstance(output, dict) else getattr(output, "cache", None)


def measure_generate(model: nn.Module, input_ids: torch.Tensor, *, include: Any = None, timeline: bool = True,
                     **generate_kwargs: Any) -> tuple[Any, GenerateMemory]:
    """Run ``model.generate(input_ids, **generate_kwargs)`` under the exact tracker and split its bytes by phase.

    Why it exists: a training run that generates (evaluation by sampling, RL rollouts) holds generate's working set
    beside the model and the optimizer; the parts to predict are the prefill (a forward over the whole prompt), the
    KV cache growing by one token per decode step, and the logits. Forward hooks on the model label each forward
    and read the cache and the logits it returns.

    Args:
        model: a transformers generative model (a peft model is measured through ``get_base_model()``).
        input_ids: the prompts, ``(batch, prompt length)`` token ids.
        include: more tensors that exist before the call and should count in the baseline (a tensor, module,
            optimizer, or lists of them, as ``utils.measure_memory`` takes).
        timeline: keep every sample (False keeps the first and last: for long generations).
        **generate_kwargs: passed to ``generate`` (``max_new_tokens``, ``do_sample``, ``num_return_sequences``,
            ``cache_implementation``, ``logits_to_keep``, ``use_cache``, ``attention_mask``, ...).

    Returns:
        ``(output, memory)``: what generate returned, and a :class:`GenerateMemory`.

    Raises:
        TypeError: ``model`` has no ``generate``, or ``input_ids`` is not an integer tensor of shape (batch, length).

    Example:
        >>> output, memory = measure_generate(model, prompts, max_new_tokens=16, do_sample=False)
        >>> memory.cache_bytes[-1], memory.phase_peak_bytes["prefill"]

    Known limitations:
        * Tensor storage only (the tracker's limits, ``utils.measure_memory``). On CUDA it still counts storages
          exactly, but kernels may keep workspaces the tracker does not see.
        * A model that runs several forwards per token (assisted decoding, beam search's reorder) gets one phase
          per forward.
    """
    if not callable(getattr(model, "generate", None)):
        raise TypeError(f"model must have a generate method (a transformers generative model), got "
                        f"{type(model).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise TypeError("input_ids must be an integer tensor of shape (batch, prompt length), got "
                        f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    target = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    caches: list[int] = []
    logits: list[int] = []
    others: list[int] = []
    measurement_box: list[Any] = []

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        measurement_box[0].phase("prefill" if not logits else f"decode {len(logits)}")

    def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        cache = _model_output_cache(output)
        held = cache_bytes(cache) if cache is not None else CacheBytes(0, 0, 0)
        caches.append(held.key_value_bytes)
        others.append(held.other_bytes)
        logits.append(output.logits.untyped_storage().nbytes())

    hooks = [target.register_forward_pre_hook(before, with_kwargs=True),
             target.register_forward_hook(after, with_kwargs=True)]
    device = input_ids.device
    try:
        with measure_memory(device, backend="tracker", phase="set-up", timeline=timeline,
                            include=[model, input_ids, include]) as mem:
            measurement_box.append(mem)
            output = model.generate(input_ids, **generate_kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    memory = GenerateMemory(device=mem.device, baseline_bytes=mem.baseline_bytes, peak_bytes=mem.peak_bytes,
                            end_bytes=mem.end_bytes, phase_peak_bytes=mem.phase_peak_bytes(),
                            phase_end_bytes=mem.phase_end_bytes(), cache_bytes=tuple(caches),
                            cache_other_bytes=others[-1] if others else 0, logits_bytes=tuple(logits),
                            sequences_shape=tuple(sequences.shape), timeline=list(mem.timeline))
    return output, memory


# --- a step measured phase by phase --------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepMemory:
    """A step's bytes phase by phase (exact storage tracker).

    Attributes:
        device: the device's human name.
        baseline_bytes: followed bytes when the step started (what ``include`` holds: models, optimizer, data).
        peak_bytes: the step's highest level above the baseline.
        end_bytes: what the step left alive above the baseline.
        phase_peak_bytes: each phase's highest level above the baseline (a phase entered several times, as the
            micro-batches' forwards and backwards are, gets its highest over all its visits).
        phase_end_bytes: each phase's level when it last handed over.
        timeline: every allocation and free, labelled by phase.
    """

    device: str
    baseline_bytes: int
    peak_bytes: int
    end_bytes: int
    phase_peak_bytes: dict[str, int]
    phase_end_bytes: dict[str, int]
    timeline: list[MemorySample] = field(default_factory=list, repr=False)

    def as_measurement(self) -> "Any":
        """This step as a ``utils.MemoryMeasurement`` (for ``utils.plot_memory_timeline``)."""
        from .memory import MemoryMeasurement
        return MemoryMeasurement(device=self.device, backend="tracker", baseline_bytes=self.baseline_bytes,
                                 peak_bytes=self.peak_bytes, end_bytes=self.end_bytes, timeline=list(self.timeline))


def measure_phases(step: Callable[[Callable[[str], None]], Any], *, include: Any, device: torch.device | str,
                   timeline: bool = True) -> tuple[Any, StepMemory]:
    """Run ``step(phase)`` under the exact tracker; ``step`` calls ``phase("name")`` as each of its phases starts.

    Why it exists: an RL step has phases of very different shapes (generation, scoring, a frozen reference's
    forward, the policy's forward and backward, the optimizer step); what each leaves alive is what the next one
    starts from, and each is predicted on its own.

    Args:
        step: a function of one argument, ``phase``; it returns whatever it likes (returned here).
        include: what exists before the step and counts in the baseline (models, optimizer, prompts).
        device: the device whose tensors to follow.
        timeline: keep every sample (False keeps the first and last).

    Returns:
        ``(what step returned, StepMemory)``.

    Raises:
        TypeError: ``step`` is not callable.

    Example:
        >>> rewards, memory = measure_phases(lambda phase: grpo_step(..., phase=phase), include=[policy, optimizer],
        ...                                  device="cpu")
        >>> memory.phase_end_bytes["reference"]
    """
    if not callable(step):
        raise TypeError(f"step must be callable (it receives `phase`), got {type(step).__name__}")
    with measure_memory(device, backend="tracker", phase="start", timeline=timeline, include=include) as mem:
        result = step(mem.phase)
    return result, StepMemory(device=mem.device, baseline_bytes=mem.baseline_bytes, peak_bytes=mem.peak_bytes,
                              end_bytes=mem.end_bytes, phase_peak_bytes=mem.phase_peak_bytes(),
                              phase_end_bytes=mem.phase_end_bytes(), timeline=list(mem.timeline))


# --- notebook 15's GRPO step (a copy of its recipe cells, held equal to them by tests/test_generation.py) ----------

def completion_logprobs(model: nn.Module, sequences: torch.Tensor, prompt_length: int,
                        chunk: int | None = None) -> torch.Tensor:
    """Log-probability of each completion token, ``(rows, length - prompt_length)``: one forward, no KV cache.

    Notebook 15's recipe. The logits at position ``t`` predict the token at ``t + 1``, so ``logits_to_keep = N + 1``
    gives the answer's ``N`` positions (and one more, dropped); ``use_cache=False`` because nothing decodes next (a
    cache would hold every layer's keys and values under ``no_grad``).

    Args:
        model: a transformers causal LM (or a peft one).
        sequences: ``(rows, P + N)`` token ids, prompts (unpadded, one length ``P``) then answers.
        prompt_length: ``P``.
        chunk: positions per chunk of the log-softmax, or None for one ``(rows, N, V)`` log-softmax. With chunks,
            each position's chosen logit is gathered and the log-sum-exp subtracted piece by piece.

    Returns:
        ``(rows, N)`` fp32 log-probabilities (with gradient unless called under ``no_grad``).

    Example:
        >>> logprobs = completion_logprobs(policy, sequences, prompts.shape[1], chunk=64)
    """
    completions = sequences[:, prompt_length:]                                        # (BG, N)
    logits = model(input_ids=sequences, use_cache=False,                              # no cache: nothing decodes next
                   logits_to_keep=completions.shape[1] + 1).logits[:, :-1]            # (BG, N, V): t predicts t + 1
    if chunk is None:                                                                 # a whole (BG, N, V) log-softmax
        return logits.float().log_softmax(-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    pieces = []
    for piece, chosen in zip(logits.split(chunk, dim=1), completions.split(chunk, dim=1)):
        piece = piece.float()                                                         # (BG, chunk, V)
        pieces.append(piece.gather(-1, chosen.unsqueeze(-1)).squeeze(-1) - piece.logsumexp(-1))
    return torch.cat(pieces, dim=1)


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each answer's reward against its group's: ``(r - mean) / (std + 1e-4)`` over the G answers to one prompt.

    Notebook 15's recipe (GRPO's group-normalised advantage; ``std`` is torch's default, unbiased).

    Args:
        rewards: ``(B·G,)`` rewards, the G answers to one prompt next to each other (``num_return_sequences`` order).
        group_size: G, at least 2.

    Returns:
        ``(B·G,)`` advantages.

    Raises:
        ValueError: ``group_size < 2`` (one answer has nothing to be compared with).

    Example:
        >>> group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 2)
    """
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 (GRPO compares the answers to one prompt), got {group_size}")
    grouped = rewards.view(-1, group_size)                                            # (B, G)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)


def completion_mask(completions: torch.Tensor, eos_token_id: int | list[int] | None) -> torch.Tensor:
    """1.0 on each completion token up to and including the first end-of-sequence token, 0.0 after it.

    Notebook 15's recipe: after an answer's end-of-sequence token ``generate`` pads, and the padding must not count.

    Args:
        completions: ``(rows, N)`` generated token ids.
        eos_token_id: the generation config's end-of-sequence id (an int, a list of ints, or None: no end token).

    Returns:
        ``(rows, N)`` fp32 mask.

    Example:
        >>> completion_mask(torch.tensor([[5, 2, 0, 0]]), 2)     # tensor([[1., 1., 0., 0.]])
    """
    if eos_token_id is None:
        return torch.ones(completions.shape, device=completions.device)
    ended = torch.isin(completions, torch.tensor(eos_token_id, device=completions.device))
    return ((ended.cumsum(1) - ended.long()) == 0).float()                            # no EOS before this token


def grpo_loss(logprobs: torch.Tensor, reference_logprobs: torch.Tensor | None, advantages: torch.Tensor,
              mask: torch.Tensor, beta: float, total_rows: int) -> torch.Tensor:
    """GRPO's loss on some rows (the original per-answer normalisation), as a share of ``total_rows``.

    Notebook 15's recipe, TRL's ``GRPOTrainer`` loss shape with ``loss_type="grpo"`` and one update per batch of
    answers: ``exp(logp - logp.detach())`` is 1 with the gradient of ``logp``; the KL penalty is Schulman's k3
    estimator against the reference. Micro-batches' losses, each divided by the whole batch's ``total_rows``, add up
    to the whole batch's loss.

    Args:
        logprobs: ``(rows, N)`` the policy's log-probabilities, with gradient.
        reference_logprobs: ``(rows, N)`` the reference's, or None (no KL term).
        advantages: ``(rows,)``.
        mask: ``(rows, N)`` 1.0 on the tokens that count.
        beta: the KL coefficient.
        total_rows: the number of answers in the whole batch.

    Returns:
        A scalar loss.

    Example:
        >>> grpo_loss(logprobs, reference, advantages, mask, beta=0.04, total_rows=len(logprobs)).backward()
    """
    per_token = torch.exp(logprobs - logprobs.detach()) * advantages.unsqueeze(1)    # 1, with the gradient of log p
    if reference_logprobs is not None and beta:
        delta = reference_logprobs - logprobs
        per_token = per_token - beta * (torch.exp(delta) - delta - 1)                 # the k3 estimate of the KL
    return -((per_token * mask).sum(1) / mask.sum(1)).sum() / total_rows


def sample_answers(policy: nn.Module, prompts: torch.Tensor, group_size: int, new_tokens: int) -> torch.Tensor:
    """G answers per prompt from the policy's own distribution: ``(B·G, P + N)`` token ids (``generate``: no gradient).

    Notebook 15's recipe: ``top_k=0``, ``top_p=1``, temperature 1 sample from the distribution whose log-probabilities
    the loss uses; ``policy.eval()`` turns dropout off (autograd is untouched).

    Args:
        policy: a transformers causal LM (or a peft one).
        prompts: ``(B, P)`` unpadded token ids of one length.
        group_size: G.
        new_tokens: N, the most tokens per answer.

    Returns:
        ``(B·G, P + N')`` token ids, ``N' <= N`` (shorter when every answer ended).

    Example:
        >>> sequences = sample_answers(policy, prompts, group_size=8, new_tokens=256)
    """
    policy.eval()                                         # dropout off (TRL's disable_dropout); autograd stays on
    return policy.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0, top_p=1.0,
                           temperature=1.0, max_new_tokens=new_tokens, num_return_sequences=group_size)


def reference_logprobs(policy: nn.Module, reference: nn.Module | None, sequences: torch.Tensor, prompt_length: int,
                       chunk: int | None = None) -> torch.Tensor:
    """The frozen reference's log-probabilities, without gradient: a separate copy, or a peft policy's base.

    Notebook 15's recipe: with ``reference=None`` the peft policy's adapters are disabled for the forward
    (``policy.disable_adapter()``), so that its base weights, which never train, serve as the reference.

    Args:
        policy: the policy (a peft model when ``reference`` is None).
        reference: a frozen copy of the starting policy, or None.
        sequences, prompt_length, chunk: as :func:`completion_logprobs`.

    Returns:
        ``(rows, N)`` fp32 log-probabilities, no gradient.

    Raises:
        ValueError: ``reference`` is None and the policy is not a peft model.

    Example:
        >>> frozen = reference_logprobs(lora_policy, None, sequences, prompts.shape[1])
    """
    with torch.no_grad():
        if reference is not None:                         # eval(): its dropout off, as the policy's
            return completion_logprobs(reference.eval(), sequences, prompt_length, chunk)
        if not hasattr(policy, "disable_adapter"):
            raise ValueError("beta > 0 needs a reference: pass a frozen copy, or a peft policy (its base is one)")
        with policy.disable_adapter():                    # peft: the base weights alone
            return completion_logprobs(policy, sequences, prompt_length, chunk)


def grpo_step(policy: nn.Module, reference: nn.Module | None, optimizer: torch.optim.Optimizer,
              prompts: torch.Tensor, reward_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
              group_size: int, new_tokens: int, beta: float = 0.04, chunk: int | None = None,
              micro_batches: int = 1, phase: Callable[[str], None] = lambda name: None) -> torch.Tensor:
    """One GRPO step (notebook 15's recipe): G answers per prompt, rule rewards, group advantages, one update.

    Args:
        policy: the transformers causal LM being trained (or a peft one).
        reference: a frozen copy of the starting policy, or None (a peft policy's base; or no KL when ``beta=0``).
        optimizer: over the policy's trainable parameters.
        prompts: ``(B, P)`` unpadded token ids of one length.
        reward_fn: ``reward_fn(prompts repeated G times, answers) -> (B·G,)`` rewards.
        group_size: G >= 2.
        new_tokens: N.
        beta: the KL coefficient (0: no reference forward).
        chunk: see :func:`completion_logprobs`.
        micro_batches: pieces of the policy's forward and backward over the B·G answers.
        phase: called with each phase's name as it starts (``RL_PHASES``); a no-op by default.

    Returns:
        The ``(B·G,)`` rewards.

    Example:
        >>> rewards = grpo_step(policy, reference, optimizer, prompts, reward_fn, group_size=8, new_tokens=256)
    """
    phase("generate")
    sequences = sample_answers(policy, prompts, group_size, new_tokens)                # (BG, P + N)
    length, rows = prompts.shape[1], sequences.shape[0]
    phase("score")
    completions = sequences[:, length:]
    rewards = reward_fn(prompts.repeat_interleave(group_size, 0), completions)         # (BG,)
    advantages = group_advantages(rewards, group_size)
    mask = completion_mask(completions, policy.generation_config.eos_token_id)
    phase("reference")
    frozen = reference_logprobs(policy, reference, sequences, length, chunk) if beta else None
    size = (rows + micro_batches - 1) // micro_batches                                # answers per micro-batch
    for start in range(0, rows, size):
        part = slice(start, start + size)
        phase("policy forward")
        loss = grpo_loss(completion_logprobs(policy, sequences[part], length, chunk),
                         None if frozen is None else frozen[part], advantages[part], mask[part], beta, rows)
        phase("policy backward")
        loss.backward()
    phase("optimizer step")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return rewards


def low_vocabulary_reward(prompts: torch.Tensor, completions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A rule reward (notebook 15's): the share of an answer's tokens in the first eighth of the vocabulary.

    Args:
        prompts: ``(B·G, P)`` the prompts, repeated G times (unused: the rule reads the answers only).
        completions: ``(B·G, N)`` the answers' token ids.
        vocab_size: the vocabulary's size.

    Returns:
        ``(B·G,)`` fp32 rewards in [0, 1] (about 1/8 for a random model).
    """
    return (completions < vocab_size // 8).float().mean(1)


def measure_grpo_step(config: Any, *, batch: int, prompt_length: int, new_tokens: int, group_size: int,
                      beta: float = 0.04, reference: str = "copy", lora_rank: int | None = None,
                      reference_dtype: torch.dtype | None = None, chunk: int | None = None, micro_batches: int = 1,
                      dtype: torch.dtype = torch.float32, learning_rate: float = 1e-3, warmup_steps: int = 1,
                      seed: int = 0, device: torch.device | str = "cpu") -> StepMemory:
    """Build a policy from a transformers config, run :func:`grpo_step` and measure it phase by phase.

    What the memory calculator's RL step replays: the policy (fully trained with AdamW, or LoRA adapters on every
    linear layer but the head), a reference (a frozen copy, the LoRA base with the adapters off, or none),
    ``batch`` prompts of ``prompt_length`` tokens answered ``group_size`` times with ``new_tokens`` tokens each.
    The policy's generation config gets no end-of-sequence token, so every answer has ``new_tokens`` tokens and
    the shapes are the ones asked for.

    Args:
        config: a transformers config of a causal LM (``LlamaConfig(...)``); the models are built from it with
            random weights (nothing downloaded).
        batch: prompts per step (B).
        prompt_length: tokens per prompt (P).
        new_tokens: tokens generated per answer (N).
        group_size: answers per prompt (G >= 2).
        beta: the KL coefficient; 0 computes no reference log-probabilities.
        reference: ``"copy"`` (a frozen copy of the policy), ``"adapters"`` (the policy with its LoRA adapters
            disabled; needs ``lora_rank``) or ``"none"``.
        lora_rank: LoRA's rank on every linear layer but the head (peft), or None for full fine-tuning.
        reference_dtype: the reference copy's dtype (``torch.bfloat16`` for a bf16 reference), default the
            policy's.
        chunk: completion positions per chunk of the log-softmax, or None for one whole log-softmax.
        micro_batches: pieces the policy's forward and backward over the B·G answers are split into.
        dtype: the policy's dtype.
        learning_rate: AdamW's learning rate.
        warmup_steps: unmeasured steps first, so that AdamW's state exists (0 measures the first step, which
            creates it inside "optimizer step").
        seed: seeds the weights, the prompts and the sampling.
        device: where to build and run.

    Returns:
        The measured step's :class:`StepMemory` (phases ``RL_PHASES``; baseline: the models, the optimizer and its
        state, the prompts).

    Raises:
        ValueError: an argument out of range, an unknown ``reference``, ``"adapters"`` without ``lora_rank``.

    Example:
        >>> from transformers import LlamaConfig
        >>> memory = measure_grpo_step(LlamaConfig(...), batch=2, prompt_length=8, new_tokens=8, group_size=4)
        >>> memory.phase_peak_bytes["policy backward"]
    """
    for name, value in (("batch", batch), ("prompt_length", prompt_length), ("new_tokens", new_tokens),
                        ("micro_batches", micro_batches)):
        positive_int(name, value)
    non_negative_int("warmup_steps", warmup_steps)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2 (GRPO compares the answers to one prompt), "
                         f"got {group_size!r}")
    if chunk is not None:
        positive_int("chunk", chunk)
    if lora_rank is not None:
        positive_int("lora_rank", lora_rank)
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}, got {reference!r}")
    if reference == "adapters" and lora_rank is None:
        raise ValueError("reference='adapters' disables LoRA adapters: give lora_rank")
    if reference == "none" and beta:
        raise ValueError(f"beta={beta} needs a reference: reference='copy' or 'adapters', or beta=0")
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    torch.manual_seed(seed)
    with torch.device(device):
        policy = AutoModelForCausalLM.from_config(config).to(dtype)
    policy.generation_config.eos_token_id = None           # every answer new_tokens long: the asked-for shapes
    policy.generation_config.pad_token_id = 0
    reference_model = None
    if reference == "copy":
        reference_model = copy.deepcopy(policy).requires_grad_(False).eval()
        if reference_dtype is not None:
            reference_model.to(reference_dtype)
    if lora_rank is not None:
        from peft import LoraConfig, get_peft_model
        policy = get_peft_model(policy, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                                                   target_modules="all-linear"))
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=learning_rate)
    vocab = policy.get_output_embeddings().weight.shape[0]
    prompts = torch.randint(0, vocab, (batch, prompt_length), device=device,
                            generator=torch.Generator(device).manual_seed(seed))

    def step(phase: Callable[[str], None]) -> torch.Tensor:
        return grpo_step(policy, reference_model, optimizer, prompts,
                         lambda p, c: low_vocabulary_reward(p, c, vocab), group_size=group_size,
                         new_tokens=new_tokens, beta=beta, chunk=chunk, micro_batches=micro_batches, phase=phase)

    for _ in range(warmup_steps):
        step(lambda name: None)
    _, memory = measure_phases(step, include=[policy, reference_model, optimizer, prompts], device=device)
    return memory
