"""An RL step (notebook 15): one GRPO step of a transformers policy, replayed phase by phase.

``predict_rl_step(model, RLSetup(...))`` (``--rl`` on the command line) replays
notebook 15's recipe, ``utils.generation.grpo_step``, as ``utils.generation.measure_grpo_step`` runs and measures
it: a policy (fully trained with AdamW, or LoRA adapters on every linear layer of the blocks, on a bf16 or an NF4
base), a reference (a frozen copy, in the policy's dtype or another; the LoRA base with its adapters disabled; or
none, with ``beta=0``), ``B`` prompts of ``P`` tokens answered ``G`` times with ``N`` tokens each. Its phases
(``utils.generation.RL_PHASES``), each relative to what the step starts with (the resident bytes: the policy, the
reference, AdamW's state, the prompts):

* ``generate``: ``policy.eval()``; ``policy.generate(prompts, attention_mask=ones, do_sample=True, top_k=0,
  num_return_sequences=G, max_new_tokens=N)``, replayed by ``generate.py`` (the cache of B·G answers, the
  prefill, each decode step); it leaves the ``(B·G, P + N)`` token ids;
* ``score``: the prompts repeated G times, the rule reward (notebook 15's: the share of an answer's tokens in the
  first eighth of the vocabulary), the group-normalised advantages and the completion mask;
* ``reference``: the reference's log-probabilities under ``no_grad``: one forward over the B·G sequences without a
  cache, ``logits_to_keep = N + 1``, then ``logits.float().log_softmax(-1).gather(...)``, or, with ``chunk``, each
  chunk's gathered logit minus its ``logsumexp``;
* ``policy forward`` / ``policy backward``, once per micro-batch: the same forward with autograd, GRPO's loss
  (``utils.generation.grpo_loss``), and ``loss.backward()`` through all of it (the transformers decoder's backward
  is ``step.py``'s, validated on the training grid);
* ``optimizer step``: ``optimizer.step()`` (AdamW, its state existing since an earlier step),
  ``zero_grad(set_to_none=True)``, and the step returning (its tensors go; the rewards are returned).

Exactness: on the CPU the exact tracker measures the same step (``measure_grpo_step``), and every phase's peak and
end equal the replay's to the byte (``tests/test_calculator_generate.py``, a grid of families and options). What
is not replayed is refused (``check_rl``): another reward (a reward model's forward is a forward of its own), an
end-of-sequence token (answers run to N), PPO's value model, several updates per batch of answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..checks import positive_int
from . import registry
from .config import BASE_QUANTS, KINDS, ModelConfig, TrainingSetup
from .generate import GenerateSetup, _Generating, check_generate, generation_model
from .replay import _Leaf, _T
from .rl_ops import _RLOps

RL_PHASES = ("generate", "score", "reference", "policy forward", "policy backward", "optimizer step")
REFERENCES = ("copy", "adapters", "none")
RL_PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class RLSetup:
    """One GRPO step, as notebook 15's recipe (``utils.generation.grpo_step``) runs it.

    Attributes:
        batch: prompts per step (B).
        prompt_length: tokens per prompt (P), unpadded, one length.
        new_tokens: tokens per answer (N); every answer runs to N.
        group_size: answers per prompt (G >= 2).
        beta: the KL coefficient; 0 computes no reference log-probabilities (``reference="none"``).
        reference: ``"copy"`` (a frozen copy of the policy as it started), ``"adapters"`` (the LoRA policy's base,
            its adapters disabled: peft's ``disable_adapter``), ``"none"`` (needs ``beta=0``).
        reference_precision: the reference copy's dtype, ``"fp32"`` or ``"bf16"`` (None: the policy's).
        lora_rank: LoRA's rank on every linear layer of the blocks (peft's ``target_modules="all-linear"``); 0
            trains every parameter.
        base_quant: ``"nf4"`` / ``"nf4-double"``: the policy's base in 4-bit NF4 (QLoRA: needs ``lora_rank`` and
            ``precision="bf16"``), as ``TrainingSetup.base_quant``.
        chunk: completion positions per chunk of the log-softmax (0: one whole log-softmax).
        micro_batches: pieces of the policy's forward and backward over the B·G answers.
        precision: the policy's dtype, ``"fp32"`` or ``"bf16"`` (pure bf16: ``model.to(torch.bfloat16)``, AdamW's
            state in bf16 too).
        optimizer_impl: torch.optim AdamW's implementation: ``"for-loop"`` (the CPU's default), ``"foreach"``
            (CUDA's) or ``"fused"``; None: the device's default.
        device: ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: a non-positive size, an unknown choice, ``"adapters"`` without LoRA, a reference with
            ``beta=0`` or none with ``beta > 0`` (each named).

    Example:
        >>> RLSetup(batch=1, prompt_length=512, new_tokens=3584, group_size=8, lora_rank=16, reference="adapters")
    """

    batch: int = 1
    prompt_length: int = 512
    new_tokens: int = 512
    group_size: int = 8
    beta: float = 0.04
    reference: str = "copy"
    reference_precision: str | None = None
    lora_rank: int = 0
    base_quant: str = "none"
    chunk: int = 0
    micro_batches: int = 1
    precision: str = "bf16"
    optimizer_impl: str | None = None
    device: str = "cuda"

    def __post_init__(self) -> None:
        for name, unit in (("batch", "prompts"), ("prompt_length", "tokens per prompt"),
                           ("new_tokens", "tokens per answer"), ("micro_batches", "pieces of the policy's pass")):
            positive_int(name, getattr(self, name), unit)
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"group_size must be an int >= 2 (GRPO compares the answers to one prompt), got "
                             f"{self.group_size!r}")
        for name, allowed in (("reference", REFERENCES), ("precision", RL_PRECISIONS), ("device", ("cpu", "cuda")),
                              ("base_quant", BASE_QUANTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.reference_precision not in (None, *RL_PRECISIONS):
            raise ValueError(f"reference_precision must be None (the policy's) or one of {RL_PRECISIONS}, got "
                             f"{self.reference_precision!r}")
        if self.optimizer_impl not in (None, "for-loop", "foreach", "fused"):
            raise ValueError(f"optimizer_impl must be None, 'for-loop', 'foreach' or 'fused', got "
                             f"{self.optimizer_impl!r}")
        for name in ("lora_rank", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0: off), got {value!r}")
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or self.beta < 0:
            raise ValueError(f"beta must be a number >= 0 (the KL coefficient), got {self.beta!r}")
        if self.reference == "adapters" and not self.lora_rank:
            raise ValueError("reference='adapters' is the LoRA policy's base with its adapters disabled: expected "
                             "lora_rank > 0")
        if self.reference == "none" and self.beta:
            raise ValueError(f"beta={self.beta} needs a reference's log-probabilities: expected reference 'copy' or "
                             "'adapters', or beta=0")
        if self.reference != "none" and not self.beta:
            raise ValueError("beta=0 computes no reference log-probabilities: expected reference='none' (a "
                             "reference model kept for nothing is not what the recipe does)")
        if self.reference_precision is not None and self.reference != "copy":
            raise ValueError("reference_precision is the dtype of a reference copy: expected reference='copy'")
        if self.micro_batches > self.rows:
            raise ValueError(f"micro_batches ({self.micro_batches}) must be at most the B·G = {self.rows} answers")

    @property
    def rows(self) -> int:
        """Answers per step: B·G."""
        return self.batch * self.group_size

    @property
    def impl(self) -> str:
        """AdamW's implementation: the one given, else the device's default."""
        return self.optimizer_impl or ("for-loop" if self.device == "cpu" else "foreach")

    def policy_setup(self) -> TrainingSetup:
        """The policy's tensors and optimizer, as a ``TrainingSetup``."""
        return TrainingSetup(micro_batch=self.rows, seq_len=self.prompt_length + self.new_tokens,
                             precision=self.precision, optimizer="adamw", optimizer_impl=self.impl,
                             lora_rank=self.lora_rank, lora_targets="all", base_quant=self.base_quant,
                             device=self.device, outputs="dropped")

    def generate_setup(self) -> GenerateSetup:
        """The rollouts: ``generate`` with multinomial sampling, G answers per prompt."""
        return GenerateSetup(batch=self.batch, prompt_length=self.prompt_length, new_tokens=self.new_tokens,
                             generations=self.group_size, precision=self.precision, sampling="sample",
                             lora_rank=self.lora_rank, device=self.device)


@dataclass(frozen=True)
class RLBreakdown:
    """What ``predict_rl_step`` returns: one GRPO step's bytes, phase by phase.

    The phase fields mirror ``utils.generation.StepMemory`` (what ``measure_grpo_step`` measures), relative to the
    resident bytes.

    Attributes:
        model, setup: what was predicted.
        resident_bytes: what exists between steps: the policy's parameters and buffers, the reference's, AdamW's
            state, the prompts (the measurement's ``baseline_bytes``).
        policy_bytes, reference_bytes, optimizer_state_bytes, prompt_bytes: its parts.
        peak_bytes: the step's highest level above the resident bytes.
        end_bytes: what the step leaves (the rewards it returns).
        phase_peak_bytes, phase_end_bytes: each phase's highest level and its level when it last handed over.
        generation: the ``generate`` call's own breakdown (``generate.py``), for its cache and phases.
    """

    model: ModelConfig
    setup: RLSetup
    resident_bytes: int
    policy_bytes: int
    reference_bytes: int
    optimizer_state_bytes: int
    prompt_bytes: int
    peak_bytes: int
    end_bytes: int
    phase_peak_bytes: dict[str, int]
    phase_end_bytes: dict[str, int]
    cache_bytes: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total_bytes(self) -> int:
        """What the device must hold at the step's peak: resident + peak."""
        return self.resident_bytes + self.peak_bytes

    @property
    def peak_phase(self) -> str:
        """The phase whose peak is the step's."""
        return max(self.phase_peak_bytes, key=self.phase_peak_bytes.get)


# --- the step, replayed ------------------------------------------------------------------------------------------

class _GRPO(_RLOps, _Generating):
    """Mixin of a replayed step (``step._Step`` or ``fewer_bits._LowBitStep``): notebook 15's GRPO step.

    The family's code names its phases (``m0.f3``, ``m0.head``, a decode step); each is kept as a sub-phase of the
    recipe's phase running then (``"policy forward|m0.f3"``), so that the recipe's phases add up as measured."""

    rl_phase: str | None = None

    def set_phase(self, phase: str) -> None:
        if self.rl_phase is not None and "|" not in phase:
            phase = f"{self.rl_phase}|{phase}"
        super().set_phase(phase)

    def begin(self, name: str) -> None:
        """``phase(name)`` in the recipe: one of ``RL_PHASES`` starts."""
        self.rl_phase = name
        super().set_phase(name)

    # -- set-up ------------------------------------------------------------------------------------------------
    def resident(self, rl: RLSetup) -> dict[str, int]:
        """What exists before the step: the policy, the reference, AdamW's state, the prompts; bytes of each."""
        start = self.current
        for leaf in self.leaves.values():
            self.param(leaf)
        self.family.buffers(self)
        policy = self.current - start
        self.reference_leaves = None
        if rl.reference == "copy":                      # copy.deepcopy(policy) before peft; .to(reference dtype)
            precision = rl.reference_precision or rl.precision
            self.reference_setup = replace(self.setup, precision=precision, lora_rank=0, base_quant="none")
            self.reference_leaves = {name: _Leaf(name, shape, self.family.leaf_item(name, self.reference_setup),
                                                 False)
                                     for name, shape, _ in self.family.parameter_shapes(self.model,
                                                                                        self.reference_setup)}
            mark = self.current
            with self.as_reference():
                for leaf in self.leaves.values():
                    self.param(leaf)
                self.family.buffers(self)
            reference = self.current - mark
        else:
            reference = 0
        from .optimizers import _optimizer_state_per_rank
        state = _optimizer_state_per_rank(self.model, self.setup)
        self.incref(self._alloc(state, "optimizer_state", "AdamW's state"))
        self.prompts = self.new(rl.batch * rl.prompt_length, 8, "inputs", "prompts")
        return {"policy": policy, "reference": reference, "optimizer": state, "prompts": self.prompts.buf.nbytes}

    class _Swap:
        def __init__(self, r: Any, leaves: dict, setup: TrainingSetup, lora: set, disabled: bool) -> None:
            self.r, self.state = r, (leaves, setup, lora, disabled)

        def __enter__(self) -> None:
            r = self.r
            self.saved = (r.leaves, r.setup, getattr(r, "_lora_paths", None), getattr(r, "adapters_disabled", False))
            r.leaves, setup, r._lora_paths, r.adapters_disabled = self.state
            r.setup = replace(setup, micro_batch=r.setup.micro_batch, seq_len=r.setup.seq_len)

        def __exit__(self, *exc: object) -> None:
            r = self.r
            leaves, setup, lora, disabled = self.saved
            r.leaves, r._lora_paths, r.adapters_disabled = leaves, lora, disabled
            r.setup = replace(setup, micro_batch=r.setup.micro_batch, seq_len=r.setup.seq_len)
            if lora is None:
                del r._lora_paths

    def as_reference(self) -> "_GRPO._Swap":
        """The reference copy's parameters and dtype (no adapters) while its forward runs."""
        return self._Swap(self, self.reference_leaves, self.reference_setup, set(), False)

    def adapters_off(self) -> "_GRPO._Swap":
        """peft's ``disable_adapter()``: the base layers alone."""
        return self._Swap(self, self.leaves, self.setup, self.family.lora_targets(self.model, self.setup), True)

    # -- the step ------------------------------------------------------------------------------------------------
    def grpo(self, rl: RLSetup) -> dict[str, Any]:
        """``grpo_step(policy, reference, optimizer, prompts, reward, ...)``, phase by phase."""
        b, p, n, g = rl.batch, rl.prompt_length, rl.new_tokens, rl.group_size
        rows, v = rl.rows, self.model.vocab_size
        self.begin("generate")
        mask_ones = self.new(b * p, 8, "temporaries", "torch.ones_like(prompts)")
        sequences, seen = self.generate(rl.generate_setup(), self.prompts, self.set_phase)
        self.rel(mask_ones)                              # generate's argument goes when it returns
        self.begin("score")
        repeated = self.new(rows * p, 8, "temporaries", "prompts.repeat_interleave(G, 0)")
        low = self.new(rows * n, 1, "temporaries", "completions < vocab // 8")
        as_float = self.new(rows * n, 4, "temporaries", ".float()")
        self.rel(low)
        rewards = self.new(rows, 4, "loss", "rewards (.mean(1))")
        self.rel(as_float, repeated)
        mean = self.new(b, 4, "temporaries", "grouped.mean(1)")
        centred = self.new(rows, 4, "temporaries", "grouped - mean")
        self.rel(mean)
        spread = self.new(b, 4, "temporaries", "grouped.std(1)")
        shifted = self.new(b, 4, "temporaries", "std + 1e-4")
        self.rel(spread)
        advantages = self.new(rows, 4, "loss", "advantages")
        self.rel(shifted, centred)
        mask = self.new(rows * n, 4, "loss", "completion mask (torch.ones)")
        self.begin("reference")
        frozen = None
        if rl.beta:
            grad_was, self.grad_enabled = self.grad_enabled, False
            swap = self.as_reference() if rl.reference == "copy" else self.adapters_off()
            with swap:
                frozen = self.completion_logprobs(rows, rl, 0)
            self.grad_enabled = grad_was
        size = -(-rows // rl.micro_batches)
        loss = None
        for micro, start in enumerate(range(0, rows, size)):
            part = min(size, rows - start)
            self.begin("policy forward")
            logprobs = self.completion_logprobs(part, rl, micro)
            parts = [self.view(frozen, part * n) if frozen is not None else None, self.view(advantages, part),
                     self.view(mask, part * n)]                  # frozen[part], advantages[part], mask[part]
            new_loss = self.grpo_loss(logprobs, *parts, rl)
            self.rel(logprobs, *parts)
            self.rel(loss)                               # `loss = ...` replaces the previous micro-batch's
            loss = new_loss
            self.begin("policy backward")
            self.backward(loss)
            self.family.after_backward(self, micro)
            self.free_graph()
        self.begin("optimizer step")
        self.optimizer_temporaries()
        for leaf in self.leaves.values():                # zero_grad(set_to_none=True)
            if leaf.trainable and leaf.grad is not None:
                self.decref(leaf.grad)
                leaf.grad = None
        self.rel(sequences, advantages, mask, frozen, loss)   # grpo_step returns its rewards; the rest goes
        self.rl_phase = None
        return {"rewards": rewards, "generation": seen}


def check_rl(model: ModelConfig, rl: RLSetup) -> None:
    """Refuse, before any work, what the RL replay does not model (each message names it)."""
    if not isinstance(rl, RLSetup):
        raise TypeError(f"rl must be an RLSetup, got {type(rl).__name__}")
    check_generate(model, rl.generate_setup())
    if rl.base_quant != "none" and rl.reference == "copy":
        raise ValueError("a reference copy of a 4-bit base is not modelled: expected reference='adapters' (the NF4 "
                         "base with the adapters disabled is the reference) or 'none'")
    from .predict import check
    check(model, rl.policy_setup())


def _rl_class(setup: TrainingSetup) -> type:
    from .fewer_bits import _LowBitStep, lowbit_on
    from .step import _Step

    base = _LowBitStep if lowbit_on(setup) else _Step
    return type(f"_GRPO{base.__name__}", (_GRPO, base), {})


def rl_model(model: ModelConfig) -> ModelConfig:
    """The policy as the recipe runs it: eval mode (``sample_answers`` calls ``policy.eval()``: no dropout), and
    ``use_cache=False`` in its scoring forwards (``generate`` keeps its own cache)."""
    return replace(generation_model(model), use_cache=False)


def predict_rl_step(model: ModelConfig, rl: RLSetup, *, trace: bool = False) -> RLBreakdown:
    """Predict one GRPO step's memory, phase by phase (notebook 15's recipe; see the module's docstring).

    Why: an RL step holds a generation (the KV cache of B·G answers), a frozen reference's forward, and a training
    step's forward and backward, one after another, beside the policy, the reference and AdamW's state; which
    phase sets the peak, and which lever lowers it (the reference as the LoRA base, chunked log-probabilities,
    micro-batches, a bf16 reference), depends on the model and the lengths. On the CPU
    ``utils.generation.measure_grpo_step`` measures the same step to the byte.

    Args:
        model: a transformers model's ``ModelConfig`` (``model_config_from_hf``) of the Llama family.
        rl: the step (``RLSetup``).
        trace: keep every allocation and free (for debugging).

    Returns:
        An ``RLBreakdown``: ``.total_bytes`` is what the device must hold at the step's peak.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: a model or set-up the replay does not model (named), before any work.

    Example:
        >>> step = predict_rl_step(model_config_from_hf("qwen2.5-7b"), RLSetup(prompt_length=512, new_tokens=3584,
        ...                                                                   group_size=8, lora_rank=16,
        ...                                                                   reference="adapters"))
        >>> step.total_bytes / 1e9, step.peak_phase
    """
    check_rl(model, rl)
    model = rl_model(model)
    setup = rl.policy_setup()
    r = _rl_class(setup)(model, setup, trace)
    parts = r.resident(rl)
    baseline = r.current
    r.set_phase("start")
    out = r.grpo(rl)
    r.finish()
    peaks: dict[str, int] = {}
    ends: dict[str, int] = {}
    for ph in r.phases:
        name, _, sub = ph.name.partition("|")
        if name not in RL_PHASES or sub.endswith("jump") or sub == "jump":
            continue
        if name == "reference" and not rl.beta:         # nothing runs in it: the tracker records no such phase
            continue
        top = sum(ph.start.values()) + max(0, ph.top or 0) - baseline
        peaks[name] = max(peaks.get(name, top), top)
        ends[name] = sum(ph.end.values()) - baseline
    notes = ()
    from .fewer_bits import lowbit_notes
    notes = lowbit_notes(setup)
    seen = out["generation"]
    return RLBreakdown(model=model, setup=rl, resident_bytes=baseline, policy_bytes=parts["policy"],
                       reference_bytes=parts["reference"], optimizer_state_bytes=parts["optimizer"],
                       prompt_bytes=parts["prompts"], peak_bytes=max(peaks.values()), end_bytes=r.current - baseline,
                       phase_peak_bytes={k: peaks[k] for k in RL_PHASES if k in peaks},
                       phase_end_bytes={k: ends[k] for k in RL_PHASES if k in ends},
                       cache_bytes=max(seen["cache_bytes"]), notes=notes)
