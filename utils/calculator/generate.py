"""Generation (notebook 15): transformers' ``generate``, replayed allocation by allocation: the KV cache, the prefill
and each decode step's peak.

``predict_generate(model, GenerateSetup(...))`` (``--generate`` on the command
line) replays one ``model.generate(prompts, attention_mask=ones, max_new_tokens=N, num_return_sequences=G, ...)`` of
transformers 5.24 on a model in eval mode, as ``utils.generation.measure_generate`` measures it: the phases
``"set-up"`` (generate's own preparation: the special tokens, the position ids from the attention mask, the prompts
copied G times, the cache object), ``"prefill"`` (the forward over the prompt, the choice of the first token, and
the inputs of the next forward) and ``"decode i"`` (the forward of one token, and the same), with the cache's
key/value bytes after every forward and the logits each forward returned. Every byte is relative to what exists
before the call: the model's parameters and buffers and the prompt ids (``baseline_bytes``).

What the replay does, each as transformers does it (``_Generating``):

* set-up: the pad token as a tensor, the right-padding check (batch > 1), ``position_ids`` from the all-ones
  attention mask (``cumsum - 1``, ``masked_fill``), the check that drops the mask (no padding: sdpa runs
  ``is_causal``), ``repeat_interleave`` of the prompts and the position ids for G generations, the cache (a
  dynamic sliding layer keeps its window as an 8-byte tensor), the logits processors' check of the prompt ids,
  ``unfinished_sequences``;
* each forward: the model's (its family's ``generating_forward``: embeddings, the masks a sliding layer needs,
  the rotary tables of the (rows, length) positions, each decoder layer with the cache's update, the last norm,
  ``logits_to_keep`` and the head), then ``_update_model_kwargs_for_generation`` (the position ids grown by one),
  the last position's logits copied to fp32, the token chosen (``argmax``, or ``softmax`` and ``multinomial``),
  the ids grown by one, the stopping criteria, and the next forward's inputs cloned;
* the cache: ``DynamicCache`` (a full layer's keys and values grow by concatenation, the old storage freed; a
  sliding layer keeps the last ``window - 1`` positions as a view of the ``window``-token concatenation, and the
  prompt's whole until the first decode step) or ``StaticCache`` (``P + N - 1`` positions, ``min(that, window)``
  for a sliding layer, zeroed at the prefill and written in place, plus an 8-byte length per layer).

Long generations: every decode step replays the same ops on tensors whose sizes grow by the same bytes per step
(the cache, the ids, the position ids), so each point of a step's memory is an affine function of the step, and a
step's peak is the highest of them: a convex function, whose largest over a run of steps lies at its ends. Up to
``REPLAYED_STEPS`` decode steps are all replayed; past that, the first few, the last few and those around the
sliding window's edge, with the steps in between jumped over by growing the kept tensors to their sizes there
(``_jump``); ``tests/test_calculator_generate.py`` holds both equal on every step of a long generation.

What is refused (``check_generate``): a family other than transformers' Llama, Mistral and Qwen2 (their decoder is
the one replayed and measured); eager attention; ``bf16-autocast`` (generate runs the model in its own dtype);
padding; sampling with logits processors (``top_k``, ``top_p``, a temperature other than 1: not replayed);
beam search. An end-of-sequence token adds a few bytes per row and step of bookkeeping that the replay leaves out
(``notes`` says so); the answers are taken to run to ``new_tokens``, the longest they can be.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..checks import positive_int
from . import registry
from .config import KINDS, ModelConfig, TrainingSetup
from .generate_cache import _GenCache, cache_bytes_after
from .replay import _T

CACHES = ("dynamic", "static")             # generate's cache_implementation: None (DynamicCache) or "static"
SAMPLINGS = ("greedy", "sample")           # do_sample=False, or multinomial sampling with no logits processor
PREFILL_LOGITS = ("last", "all")           # logits_to_keep=1 (generate's default) or 0 (every prompt position)
GENERATE_PRECISIONS = ("fp32", "bf16")     # the model's dtype
REPLAYED_STEPS = 24                        # decode steps replayed one by one; longer generations jump (see above)
EDGE_STEPS = 3                             # steps replayed at each end of a jump


@dataclass(frozen=True)
class GenerateSetup:
    """One ``model.generate(...)`` call, as the calculator replays it.

    Attributes:
        batch: prompts (B).
        prompt_length: tokens per prompt (P), unpadded, one length.
        new_tokens: tokens generated per answer (N, ``max_new_tokens``); every answer runs to N.
        generations: answers per prompt (G, ``num_return_sequences``): the prompts are copied G times before the
            prefill, so B·G rows run through it.
        cache: ``"dynamic"`` (``DynamicCache``, the default) or ``"static"`` (``cache_implementation="static"``).
        precision: the model's dtype, ``"fp32"`` or ``"bf16"`` (``model.to(torch.bfloat16)``).
        sampling: ``"greedy"`` (``do_sample=False``) or ``"sample"`` (``do_sample=True, top_k=0``: multinomial
            sampling from the whole distribution, temperature 1, no logits processor).
        prefill_logits: ``"last"`` (``logits_to_keep=1``, what generate passes) or ``"all"`` (``logits_to_keep=0``:
            the prefill's logits at every prompt position).
        return_cache: ``return_dict_in_generate=True``: generate returns the cache with the sequences, so it
            outlives the call.
        lora_rank, lora_targets: a peft LoRA model (adapters on ``lora_targets``, ``TrainingSetup``'s meaning).
        device: ``"cpu"`` or ``"cuda"``: whose op-level details (the same code path in transformers 5.24).

    Raises:
        ValueError: a non-positive size, an unknown choice (each named).

    Example:
        >>> GenerateSetup(batch=1, prompt_length=4096, new_tokens=512, generations=8, precision="bf16")
    """

    batch: int = 1
    prompt_length: int = 512
    new_tokens: int = 512
    generations: int = 1
    cache: str = "dynamic"
    precision: str = "bf16"
    sampling: str = "greedy"
    prefill_logits: str = "last"
    return_cache: bool = False
    lora_rank: int = 0
    lora_targets: str | tuple[str, ...] = "all"
    device: str = "cuda"

    def __post_init__(self) -> None:
        for name, unit in (("batch", "prompts"), ("prompt_length", "tokens per prompt"),
                           ("new_tokens", "tokens per answer"), ("generations", "answers per prompt")):
            positive_int(name, getattr(self, name), unit)
        for name, allowed in (("cache", CACHES), ("precision", GENERATE_PRECISIONS), ("sampling", SAMPLINGS),
                              ("prefill_logits", PREFILL_LOGITS), ("device", ("cpu", "cuda"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.return_cache, bool):
            raise ValueError(f"return_cache must be True or False, got {self.return_cache!r}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"lora_rank must be an int >= 0 (0: no adapters), got {self.lora_rank!r}")

    @property
    def rows(self) -> int:
        """Rows generated at once: B·G."""
        return self.batch * self.generations

    def weights(self) -> TrainingSetup:
        """The ``TrainingSetup`` that describes the model's tensors (dtype, adapters) to the family."""
        return TrainingSetup(micro_batch=self.rows, seq_len=self.prompt_length, precision=self.precision,
                             optimizer="sgd", optimizer_impl="for-loop", lora_rank=self.lora_rank,
                             lora_targets=self.lora_targets, device=self.device, outputs="dropped")


@dataclass(frozen=True)
class GenerationBreakdown:
    """What ``predict_generate`` returns: one ``generate`` call's bytes, phase by phase, above what exists before it.

    The fields mirror ``utils.generation.GenerateMemory`` (what notebook 15 measures), so that the two compare
    field by field.

    Attributes:
        model, setup: what was predicted.
        baseline_bytes: the model's parameters and buffers and the prompt ids.
        peak_bytes: the highest level above the baseline.
        end_bytes: what generate leaves alive (the sequences; the cache too with ``return_cache``).
        phase_peak_bytes, phase_end_bytes: each replayed phase's highest level and its level at its end (``"set-up"``,
            ``"prefill"``, ``"decode 1"``, ...: every step up to ``REPLAYED_STEPS`` of them, else those replayed).
        decode_peak_bytes: the highest level of any decode step (every step, replayed or jumped over).
        cache_bytes: the cache's key/value bytes after each forward (prefill first; every forward).
        cache_other_bytes: the cache's bookkeeping tensors (8 bytes per static or dynamic sliding layer).
        logits_bytes: the logits each forward returned (prefill first).
        sequences_shape: (B·G, P + N).
        notes: what the replay leaves out for this set-up.
    """

    model: ModelConfig
    setup: GenerateSetup
    baseline_bytes: int
    peak_bytes: int
    end_bytes: int
    phase_peak_bytes: dict[str, int]
    phase_end_bytes: dict[str, int]
    decode_peak_bytes: int
    cache_bytes: tuple[int, ...]
    cache_other_bytes: int
    logits_bytes: tuple[int, ...]
    sequences_shape: tuple[int, int]
    notes: tuple[str, ...] = ()

    @property
    def final_cache_bytes(self) -> int:
        """The cache's key/value bytes after the last forward."""
        return self.cache_bytes[-1]

    @property
    def prefill_peak_bytes(self) -> int:
        """The prefill's highest level above the baseline."""
        return self.phase_peak_bytes["prefill"]


# --- generate, replayed ------------------------------------------------------------------------------------------

class _Generating:
    """Mixin of a replayed step (``step._Step``, or ``fewer_bits._LowBitStep``): transformers' ``generate``."""

    rows = 1
    generating: _GenCache | None = None
    position_rows = 1

    def shaped(self, rows: int, length: int) -> None:
        """The family's functions read the micro-batch's shape from ``setup``: (rows, length) from now on."""
        if (self.setup.micro_batch, self.setup.seq_len) != (rows, length):
            self.setup = replace(self.setup, micro_batch=rows, seq_len=length)

    def generate(self, gen: GenerateSetup, prompts: _T, phase: Any = None) -> tuple[_T, dict[str, Any]]:
        """``model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=N, ...)``: returns the
        sequences and what the replay observed (``cache_bytes``, ``logits_bytes`` after each forward; the cache).

        ``phase(name)`` starts each phase (``set-up``, ``prefill``, ``decode i``); None: the replay's own."""
        phase = phase or self.set_phase
        family = self.family
        b, p, n, g = gen.batch, gen.prompt_length, gen.new_tokens, gen.generations
        rows = self.rows = b * g
        item = 2 if gen.precision == "bf16" else 4
        seen: dict[str, Any] = {"cache_bytes": [], "logits_bytes": [], "steps": []}
        grad_was, self.grad_enabled = self.grad_enabled, False          # generate is decorated with no_grad
        phase("set-up")
        pad = self.new(1, 8, "temporaries", "pad_token_id as a tensor")   # _prepare_special_tokens
        if b > 1:                                                         # right padding? attention_mask[:, -1] == 0
            self.rel(self.new(b, 1, "temporaries", "mask[:, -1] == 0"), self.new(1, 1, "temporaries", ".any()"))
        total = self.new(b * p, 8, "temporaries", "attention_mask.cumsum(-1)")   # position ids from the mask
        minus = self.new(b * p, 8, "temporaries", "cumsum - 1")
        self.rel(total)
        zero = self.new(b * p, 1, "temporaries", "attention_mask == 0")
        positions = self.new(b * p, 8, "inputs", "position_ids (masked_fill)")
        self.rel(zero, minus)
        ones = self.new(b * p, 1, "temporaries", "attention_mask == 1")   # all ones: the mask is dropped
        every = self.new(1, 1, "temporaries", ".all()")
        self.rel(ones, every)
        ids = prompts
        kept_ids = None
        if g > 1:                                                         # _expand_inputs_for_generation
            ids = kept_ids = self.repeat_rows(prompts, g, "input_ids.repeat_interleave(G)")
            expanded = self.repeat_rows(positions, g, "position_ids.repeat_interleave(G)")
            self.rel(positions)
            positions = expanded
        self.position_rows = rows
        cache = self.generating = _GenCache(self, gen.cache, p + n - 1)
        self.rel(self.new(b * p, 1, "temporaries", "input_ids < 0"), self.new(1, 1, "temporaries", ".any()"))
        unfinished = self.new(rows, 8, "temporaries", "unfinished_sequences")
        inputs = self.new(rows * p, 8, "temporaries", "input_ids.clone()")      # prepare_inputs_for_generation
        step_inputs: list[_T] = [inputs] + self.prepared_masks(gen, p)
        phase("prefill")
        scores = probs = tokens = None
        length = p
        keep = 1 if gen.prefill_logits == "last" else 0
        plan = replayed_steps(self.model, gen)
        step = 0
        while step < n:
            q_len = p if step == 0 else 1
            self.shaped(rows, q_len)
            logits = family.generating_forward(self, q_len, keep if step == 0 else 1)
            seen["steps"].append(step)
            seen["logits_bytes"].append(logits.buf.nbytes)
            seen["cache_bytes"].append(cache.key_value_bytes())
            if step == 0:
                self.rel(*step_inputs)                   # _prefill's model_inputs go when it returns
                step_inputs = []
            # _update_model_kwargs_for_generation: position_ids = cat([position_ids, position_ids[..., -1:] + 1])
            arange = self.new(1, 8, "temporaries", "arange(1)")
            plus = self.new(rows, 8, "temporaries", "arange + position_ids[..., -1:]")
            self.rel(arange)
            plus_one = self.new(rows, 8, "temporaries", "+ 1")
            self.rel(plus)
            grown = self.new(rows * (length + 1), 8, "inputs", "position_ids (cat)")
            self.rel(plus_one)
            if step:
                self.rel(positions)
            else:
                first_positions = positions               # generate's model_kwargs keep the first until it returns
            positions = grown
            # next_token_logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)
            last = self.new(rows * self.model.vocab_size, 4, "temporaries", "next_token_logits (fp32 copy)")
            self.rel(scores)
            scores = last                                 # no logits processor: the scores are the logits
            if gen.sampling == "sample":
                new_probs = self.new(rows * self.model.vocab_size, 4, "temporaries", "softmax(next_token_scores)")
                self.rel(probs)
                probs = new_probs
                chosen = self.new(rows, 8, "temporaries", "multinomial")
            else:
                chosen = self.new(rows, 8, "temporaries", "argmax")
            self.rel(tokens)
            tokens = chosen
            grown_ids = self.new(rows * (length + 1), 8, "inputs", "input_ids (cat)")
            if ids is not prompts and (ids is not kept_ids):
                self.rel(ids)
            ids = grown_ids
            length += 1
            self.stopping_criteria(rows)
            new_unfinished = self.new(rows, 8, "temporaries", "unfinished & ~done")
            self.rel(self._not_done, unfinished)
            unfinished = new_unfinished
            self.rel(self.new(1, 8, "temporaries", "unfinished.max()"), self.new(1, 1, "temporaries", "== 0"))
            self.rel(logits)                              # del outputs
            if step + 1 < n:                              # the next forward's inputs; the previous ones go
                previous = step_inputs
                step_inputs = [self.new(rows, 8, "temporaries", "input_ids[:, -1:].clone()"),
                               self.new(rows, 8, "temporaries", "position_ids[..., -1:].clone()")]
                step_inputs += self.prepared_masks(gen, 1)
                self.rel(*previous)
                following = min(i for i in plan if i > step)
                if following > step + 1:                  # jump: the kept tensors grow to their sizes there
                    self.set_phase("jump")
                    skipped = following - step - 1
                    for t in (positions, ids):
                        self._resize(t, t.numel + rows * skipped)
                    cache.grow(self, skipped)
                    length += skipped
                phase(f"decode {following}")
                step = following
                continue
            step += 1
        # generate returns: its locals go
        self.rel(positions, unfinished, *step_inputs, scores, probs, tokens)   # _sample's frame, in its order
        self.rel(pad, first_positions)                                         # then generate's
        seen["cache_other_bytes"] = cache.other_bytes()
        if not gen.return_cache:
            cache.release(self)
        self.rel(kept_ids)
        self.generating = None
        self.position_rows = 1
        self.grad_enabled = grad_was
        seen["cache"] = cache
        return ids, seen

    def _resize(self, t: _T, numel: int) -> None:
        """A kept tensor takes the size it would have after the steps a jump passes over."""
        delta = (numel - t.numel) * t.item
        t.numel = numel
        t.buf.nbytes += delta
        self.current += delta
        self.by_kind[t.buf.kind] += delta

    def prepared_masks(self, gen: GenerateSetup, q_len: int) -> list[_T]:
        """A static cache's masks, made by ``prepare_inputs_for_generation`` and kept in ``model_inputs``."""
        cache = self.generating
        if cache.kind != "static":
            return []
        self.shaped(self.rows, q_len)
        cache.premade = self.family.prepared_masks(self, q_len)
        return [mask for mask in cache.premade.values() if mask is not None]

    def stopping_criteria(self, rows: int) -> None:
        """``StoppingCriteriaList(MaxLengthCriteria)``: ``is_done`` or'ed with the criterion's, then ``~``."""
        start = self.new(rows, 1, "temporaries", "is_done = full(False)")
        criterion = self.new(rows, 1, "temporaries", "MaxLengthCriteria: full(cur_len >= max_length)")
        done = self.new(rows, 1, "temporaries", "is_done | criterion")
        self.rel(criterion, start)
        self._not_done = self.new(rows, 1, "temporaries", "~is_done")
        self.rel(done)

    def repeat_rows(self, x: _T, times: int, label: str) -> _T:
        """``x.repeat_interleave(times, dim=0)`` of int64 rows."""
        return self.new(x.numel * times, x.item, "inputs", label)


def replayed_steps(model: ModelConfig, gen: GenerateSetup) -> list[int]:
    """The decode steps the replay runs (the prefill is step 0): all of them up to ``REPLAYED_STEPS``, else the
    first and last ``EDGE_STEPS``, and those around the sliding window's edge, where a step's ops change."""
    n, p = gen.new_tokens, gen.prompt_length
    if n - 1 <= REPLAYED_STEPS:
        return list(range(n))
    steps = set(range(EDGE_STEPS + 1)) | set(range(n - EDGE_STEPS, n))
    if model.sliding_window is not None:
        edge = model.sliding_window - p
        steps |= {i for i in range(edge - EDGE_STEPS, edge + EDGE_STEPS + 1) if 0 < i < n}
    return sorted(steps)


def _replay_class(setup: TrainingSetup) -> type:
    from .fewer_bits import _LowBitStep, lowbit_on
    from .step import _Step

    base = _LowBitStep if lowbit_on(setup) else _Step
    return type(f"_Generating{base.__name__}", (_Generating, base), {})


def check_generate(model: ModelConfig, gen: GenerateSetup) -> None:
    """Refuse, before any work, what the generation replay does not model (each message names it)."""
    if not isinstance(model, ModelConfig):
        raise TypeError(f"model must be a ModelConfig, got {type(model).__name__}")
    if not isinstance(gen, GenerateSetup):
        raise TypeError(f"gen must be a GenerateSetup, got {type(gen).__name__}")
    family = registry.family_of(model.arch)
    check = getattr(family, "check_generation", None)
    if check is None:
        raise ValueError(f"generation is replayed for transformers' Llama, Mistral and Qwen2: {model.name} "
                         f"({model.arch}) is not modelled")
    check(model)
    if gen.cache == "static" and model.layer_types is not None and len(set(model.layer_types)) > 1:
        raise ValueError(f"a static cache on a model whose layers mix full and sliding attention ({model.name}'s "
                         "layer_types) is not modelled (generate then prepares a mask of each kind): expected "
                         "cache='dynamic'")
    family.check_setup(model, gen.weights())           # LoRA targets that name no module


def generation_model(model: ModelConfig) -> ModelConfig:
    """The model as ``generate`` runs it: eval mode, so its dropouts are off."""
    return replace(model, dropout=(0.0, 0.0, 0.0)) if any(model.dropout) else model


def predict_generate(model: ModelConfig, gen: GenerateSetup, *, trace: bool = False) -> GenerationBreakdown:
    """Predict one ``model.generate(...)`` call's memory, phase by phase, above the model and the prompts.

    Why: a training run that generates (evaluation by sampling, RL rollouts) holds generate's working set beside
    the model: the KV cache, times G answers per prompt, a prefill over the whole prompt, a row of logits per
    answer. This replays generate allocation by allocation (see the module's docstring); on the CPU
    ``utils.generation.measure_generate`` measures the same call to the byte (``tests/test_calculator_generate.py``).

    Args:
        model: a transformers model's ``ModelConfig`` (``model_config_from_hf``) of the Llama family.
        gen: the call (``GenerateSetup``).
        trace: keep every allocation and free (``.trace`` of the replay; for debugging).

    Returns:
        A ``GenerationBreakdown``.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: a model or call the replay does not model (named), before any work.

    Example:
        >>> predict_generate(model_config_from_hf("llama-3.2-1b"), GenerateSetup(prompt_length=4096,
        ...                  new_tokens=256, generations=8)).peak_bytes / 2**30
    """
    check_generate(model, gen)
    model = generation_model(model)
    weights = gen.weights()
    r = _replay_class(weights)(model, weights, trace)
    r.grad_enabled = False
    for leaf in r.leaves.values():
        r.param(leaf)
    r.family.buffers(r)
    prompts = r.new(gen.batch * gen.prompt_length, 8, "inputs", "prompt ids")
    baseline = r.current
    names: list[str] = []

    def phase(name: str) -> None:
        names.append(name)
        r.set_phase(name)

    sequences, seen = r.generate(gen, prompts, phase)
    r.finish()
    phases = {ph.name: ph for ph in r.phases if ph.name in names}
    peaks = {name: sum(ph.start.values()) + max(0, ph.top or 0) - baseline for name, ph in phases.items()}
    ends = {name: sum(ph.end.values()) - baseline for name, ph in phases.items()}
    decode = [value for name, value in peaks.items() if name.startswith("decode")]
    caches = tuple(cache_bytes_after(model, gen, step) for step in range(gen.new_tokens))
    for step, replayed in zip(seen["steps"], seen["cache_bytes"]):
        if caches[step] != replayed:  # pragma: no cover - the formula and the replay are two accounts of one cache
            raise AssertionError(f"step {step}: the cache's formula says {caches[step]:,} B, its replay {replayed:,}")
    item = 2 if gen.precision == "bf16" else 4
    kept = 1 if gen.prefill_logits == "last" else gen.prompt_length
    logits = (gen.rows * kept * model.vocab_size * item,) + (gen.rows * model.vocab_size * item,) * (gen.new_tokens - 1)
    breakdown = GenerationBreakdown(
        model=model, setup=gen, baseline_bytes=baseline, peak_bytes=max(peaks.values()),
        end_bytes=r.current - baseline, phase_peak_bytes=peaks, phase_end_bytes=ends,
        decode_peak_bytes=max(decode) if decode else 0, cache_bytes=caches,
        cache_other_bytes=seen["cache_other_bytes"], logits_bytes=logits,
        sequences_shape=(gen.rows, gen.prompt_length + gen.new_tokens),
        notes=("every answer runs to new_tokens (no end-of-sequence token): an end token's bookkeeping, a few bytes per "
               "row and step, is left out",))
    if trace:
        object.__setattr__(breakdown, "_trace", r.trace)
    return breakdown
