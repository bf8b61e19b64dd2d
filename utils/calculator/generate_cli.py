"""The command line of generation and the RL step (notebook 15): ``python -m utils.calculator --generate`` / ``--rl``.

``--generate`` predicts one ``model.generate(...)`` call (``generate.predict_generate``) and ``--rl`` one GRPO step of
notebook 15's recipe (``rl.predict_rl_step``), on the model the calculator's own flags give (``--hf-config``: the
Llama family: Llama, Mistral, Qwen2), with ``--micro-batch`` prompts, ``--lora-rank``, ``--base-quant``, ``--device``
and ``--device-gb`` shared with the training prediction. Both run the model in its own dtype (``--dtype``), not
under autocast.
"""

from __future__ import annotations

import argparse

from .config import BASE_QUANTS
from .generate import CACHES, PREFILL_LOGITS, SAMPLINGS, GenerateSetup, predict_generate
from .rl import REFERENCES, RL_PRECISIONS, RLSetup, predict_rl_step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--generate``, ``--rl`` and their options to the calculator's parser."""
    group = parser.add_argument_group("generation and the RL step (notebook 15; --micro-batch is the prompts)")
    group.add_argument("--generate", action="store_true", help="predict one model.generate(...) call")
    group.add_argument("--rl", action="store_true", help="predict one GRPO step (generate, score, reference, policy "
                                                         "forward and backward, optimizer step)")
    group.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (default 512)")
    group.add_argument("--new-tokens", type=int, default=512, help="tokens generated per answer (default 512)")
    group.add_argument("--generations", type=int, default=None,
                       help="answers per prompt, num_return_sequences (default 1; with --rl: G, default 8)")
    group.add_argument("--cache", choices=CACHES, default="dynamic", help="with --generate: cache_implementation")
    group.add_argument("--sampling", choices=SAMPLINGS, default="greedy",
                       help="with --generate: greedy, or multinomial sampling with top_k=0")
    group.add_argument("--prefill-logits", choices=PREFILL_LOGITS, default="last",
                       help="with --generate: logits_to_keep=1 (generate's default) or 0 (every prompt position)")
    group.add_argument("--dtype", choices=RL_PRECISIONS, default="bf16", help="the model's dtype (default bf16)")
    group.add_argument("--reference", choices=REFERENCES, default=None,
                       help="with --rl: a frozen copy, the LoRA base with its adapters disabled, or none (--beta 0); "
                            "default: adapters with --lora-rank, else copy")
    group.add_argument("--reference-dtype", choices=RL_PRECISIONS, default=None,
                       help="with --rl --reference copy: the copy's dtype (default: the policy's)")
    group.add_argument("--beta", type=float, default=None, help="with --rl: the KL coefficient (default 0.04; "
                                                                "0 with --reference none)")
    group.add_argument("--chunk", type=int, default=0, help="with --rl: completion positions per chunk of the "
                                                            "log-softmax (0: one whole log-softmax)")
    group.add_argument("--policy-micro-batches", type=int, default=1,
                       help="with --rl: pieces of the policy's forward and backward over the B x G answers")


def wants_generation(args: argparse.Namespace) -> bool:
    """Whether the command line asked for ``--generate`` or ``--rl`` (``cli.main`` then calls ``run``)."""
    return bool(args.generate or args.rl)


def _row(label: str, peak: int, end: int) -> str:
    return f"{label:<16} {peak / 2**30:>12,.2f} {end / 2**30:>12,.2f}"


def _verdict(total: int, device_gb: float) -> str:
    if not device_gb:
        return ""
    fits = total <= device_gb * 10**9
    return f"\n{total / 1e9:,.1f} GB at the peak: {'fits' if fits else 'does not fit'} a {device_gb:g} GB device"


def run(args: argparse.Namespace, model: object) -> str:
    """The report of ``--generate`` or ``--rl`` for ``model`` (a ``ModelConfig``).

    Raises:
        ValueError: both flags, or a set-up the replays refuse (each message names it).
    """
    if args.generate and args.rl:
        raise ValueError("--generate and --rl are two predictions: expected one of them")
    targets = args.lora_targets if args.lora_targets in ("all", "attention") else tuple(
        name.strip() for name in args.lora_targets.split(",") if name.strip())
    if args.generate:
        gen = GenerateSetup(batch=args.micro_batch, prompt_length=args.prompt_len, new_tokens=args.new_tokens,
                            generations=args.generations or 1, cache=args.cache, precision=args.dtype,
                            sampling=args.sampling, prefill_logits=args.prefill_logits, lora_rank=args.lora_rank,
                            lora_targets=targets, device=args.device)
        out = predict_generate(model, gen)
        lines = [f"generate on {model.name}: {gen.batch} prompt(s) x {gen.generations} answer(s), "
                 f"{gen.prompt_length} + {gen.new_tokens} tokens, {gen.cache} cache, {gen.precision}",
                 f"{'phase':<16} {'peak GiB':>12} {'end GiB':>12}   (above the weights and the prompts: "
                 f"{out.baseline_bytes / 2**30:,.2f} GiB)"]
        lines += [_row(name, out.phase_peak_bytes[name], out.phase_end_bytes[name]) for name in out.phase_peak_bytes]
        lines.append(f"KV cache at the end {out.final_cache_bytes / 2**30:,.2f} GiB; prefill logits "
                     f"{out.logits_bytes[0] / 2**30:,.2f} GiB; peak {out.peak_bytes / 2**30:,.2f} GiB above the "
                     f"baseline" + _verdict(out.baseline_bytes + out.peak_bytes, args.device_gb))
        return "\n".join(lines)
    if args.base_quant not in BASE_QUANTS:
        raise ValueError(f"--base-quant must be one of {BASE_QUANTS}")
    reference = args.reference or ("adapters" if args.lora_rank else "copy")
    beta = args.beta if args.beta is not None else (0.0 if reference == "none" else 0.04)
    rl = RLSetup(batch=args.micro_batch, prompt_length=args.prompt_len, new_tokens=args.new_tokens,
                 group_size=args.generations or 8, beta=beta, reference=reference,
                 reference_precision=args.reference_dtype, lora_rank=args.lora_rank, base_quant=args.base_quant,
                 chunk=args.chunk, micro_batches=args.policy_micro_batches, precision=args.dtype, device=args.device)
    out = predict_rl_step(model, rl)
    lines = [f"GRPO step on {model.name}: {rl.batch} prompt(s) x G = {rl.group_size}, {rl.prompt_length} + "
             f"{rl.new_tokens} tokens, {'LoRA r=' + str(rl.lora_rank) if rl.lora_rank else 'full fine-tuning'}, "
             f"reference {rl.reference}, chunk {rl.chunk or 'none'}, {rl.micro_batches} policy micro-batch(es)",
             f"resident {out.resident_bytes / 2**30:,.2f} GiB: policy {out.policy_bytes / 2**30:,.2f}, reference "
             f"{out.reference_bytes / 2**30:,.2f}, AdamW state {out.optimizer_state_bytes / 2**30:,.2f}",
             f"{'phase':<16} {'peak GiB':>12} {'end GiB':>12}   (above the resident bytes)"]
    lines += [_row(name, out.phase_peak_bytes[name], out.phase_end_bytes[name]) for name in out.phase_peak_bytes]
    lines.append(f"the step peaks during '{out.peak_phase}': {out.total_bytes / 2**30:,.2f} GiB in all"
                 + _verdict(out.total_bytes, args.device_gb))
    lines += [f"note: {note}" for note in out.notes]
    return "\n".join(lines)
