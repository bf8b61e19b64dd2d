"""The command line: ``python -m utils.calculator``."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import generate_cli, model_parallel, registry
from .config import (ATTENTIONS, BASE_QUANTS, BF16_ROUNDINGS, CHECKPOINTING, DEVICES, LORA_TARGETS, LOSSES, OPTIMIZER_IMPLS,
                     OPTIMIZERS, OUTPUTS, PRECISIONS, STRATEGIES, TrainingSetup)
from .from_transformers import SHIPPED_CONFIGS
from .predict import _gib, format_table, largest_micro_batch, predict
from .presets import PRESETS, model_from_args

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m utils.calculator",
        description="Predict the peak training memory per device, term by term (parameters, gradients, "
                    "optimizer state, activations, loss, temporaries), for a transformers config.json, a preset "
                    "or your own shape. --validate and --validate-hf measure grids of small models on the CPU "
                    "against the prediction.")
    shape = parser.add_argument_group("model (a transformers config, a preset, or your own shape)")
    shape.add_argument("--hf-config", metavar="PATH_OR_NAME",
                       help="a transformers config.json (model_type " + ", ".join(registry.model_types()) + ") or a "
                            "shipped one: " + ", ".join(SHIPPED_CONFIGS))
    shape.add_argument("--attn", choices=ATTENTIONS, default=None,
                       help="with --hf-config: attn_implementation (default: the config's, else sdpa)")
    shape.add_argument("--preset", choices=sorted(PRESETS, key=lambda k: float(k[:-1])),
                       help="; ".join(f"{key}: {cfg.name}" for key, cfg in PRESETS.items()))
    shape.add_argument("--arch", choices=registry.arches(transformers=False), default=None,
                       help="block design (default llama for a custom shape)")
    for flag, help_text in [("--layers", "transformer blocks"), ("--d-model", "residual width"),
                            ("--heads", "attention heads"), ("--kv-heads", "key/value heads (default: --heads)"),
                            ("--ffn", "MLP hidden width (default 4 x d-model)"), ("--vocab", "vocabulary size"),
                            ("--max-seq-len", "position table rows (gpt) / context length")]:
        shape.add_argument(flag, type=int, default=None, help=help_text)
    shape.add_argument("--tied", action="store_true", help="the head shares the embedding's weight (llama)")
    train = parser.add_argument_group("training set-up")
    train.add_argument("--micro-batch", type=int, default=1, help="sequences per device (default 1)")
    train.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    train.add_argument("--precision", choices=PRECISIONS, default="bf16-autocast")
    train.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    train.add_argument("--impl", choices=OPTIMIZER_IMPLS, default=None,
                       help="torch.optim implementation (default foreach, CUDA's default; for-loop with adamw8bit "
                            "and --bf16-rounding, which update one tensor at a time)")
    train.add_argument("--checkpointing", choices=CHECKPOINTING, default="none")
    train.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning")
    train.add_argument("--lora-targets", default="all",
                       help="all, attention, or (with --hf-config) peft's target_modules, comma-separated: q_proj,v_proj")
    train.add_argument("--lora-dropout", type=float, default=0.0, help="with --hf-config: peft's lora_dropout")
    train.add_argument("--padded", action="store_true",
                       help="with --hf-config: the batch is padded and passed with its attention_mask")
    train.add_argument("--loss", choices=LOSSES, default="labels",
                       help="with --hf-config: model(..., labels=) (default) or your own loss on the logits")
    train.add_argument("--outputs", choices=OUTPUTS, default=None,
                       help="with --hf-config: what your loop does with the model's output: kept in a variable until "
                            "the next forward replaces it (default, the usual loop), kept until the step function "
                            "returns, or dropped before backward (the Trainer)")
    train.add_argument("--use-reentrant", action="store_true",
                       help="with --checkpointing every_block: gradient_checkpointing_kwargs={'use_reentrant': True}")
    train.add_argument("--chunked-loss", type=int, default=0, help="tokens per chunk (0: the whole logits)")
    train.add_argument("--routing", choices=("balanced",), default=None,
                       help="a mixture of experts: every expert receives T·k / E of the (token, slot) pairs (default)")
    train.add_argument("--tokens-per-expert", default=None, metavar="N,N,...",
                       help="a mixture of experts: the pairs each expert receives in every MoE layer, comma-separated "
                            "(';' between layers), summing to micro-batch x seq-len x k")
    train.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    train.add_argument("--strategy", choices=STRATEGIES, default="single")
    train.add_argument("--ranks", type=int, default=1)
    train.add_argument("--device", choices=DEVICES, default="cuda", help="whose op-level details (default cuda)")
    bits = parser.add_argument_group("fewer bits (notebook 10)")
    bits.add_argument("--base-quant", choices=BASE_QUANTS, default="none",
                      help="a frozen 4-bit NF4 base under LoRA (QLoRA; needs --lora-rank and --precision bf16); "
                           "nf4-double quantises the absmaxes too")
    bits.add_argument("--quant-block", type=int, default=64, help="elements per NF4 absmax (default 64)")
    bits.add_argument("--kbit-prepared", action="store_true",
                      help="with --hf-config and --base-quant: peft's prepare_model_for_kbit_training upcast every "
                           "non-4-bit parameter to fp32")
    bits.add_argument("--bf16-rounding", choices=BF16_ROUNDINGS, default="nearest",
                      help="pure bf16 AdamW (--precision bf16, full fine-tuning): stochastic rounding or a Kahan "
                           "buffer (utils.lowbit.AdamWBF16)")
    bits.add_argument("--fp8", action="store_true",
                      help="dynamic FP8 training of the blocks' Linear layers (torchao's float8 recipe)")
    train.add_argument("--device-gb", type=float, default=80.0,
                       help="device memory in GB (10^9 bytes) for the fit verdict and the largest micro-batch "
                            "(default 80; 0 skips both)")
    parser.add_argument("--validate", action="store_true", help="measure the grid on the CPU against the prediction")
    parser.add_argument("--validate-hf", action="store_true",
                        help="measure real transformers models (tiny configs, random weights) on the CPU with torch's "
                             "MemTracker against the prediction")
    parser.add_argument("--check", action="store_true",
                        help="with --validate or --validate-hf: the quick representative subset")
    parser.add_argument("--on", default="cpu", choices=("cpu", "cuda"),
                        help="with --validate: the device to measure on (cuda: the allocator's figures; its first "
                             "GPU run found the cuBLAS workspaces in every peak, since left out)")
    model_parallel.add_arguments(parser)      # --tp, --pp, --cp, --dp, --zero, --schedule, --micro-batches
    generate_cli.add_arguments(parser)        # --generate, --rl (notebook 15)
    return parser


def _routing(args: argparse.Namespace, parser: argparse.ArgumentParser) -> object:
    """``--routing`` / ``--tokens-per-expert`` as ``TrainingSetup.routing``."""
    if args.tokens_per_expert is None:
        return args.routing
    if args.routing is not None:
        parser.error("--routing balanced and --tokens-per-expert both give the routing: expected one of them")
    try:
        layers = [tuple(int(n) for n in layer.split(",")) for layer in args.tokens_per_expert.split(";")]
    except ValueError:
        parser.error(f"--tokens-per-expert {args.tokens_per_expert!r}: expected integers separated by commas (and "
                     "';' between layers), such as 9,7,8,8")
    return layers[0] if len(layers) == 1 else tuple(layers)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.routing_value = _routing(args, parser)
    if args.validate_hf:
        from .validate_hf import HF_VALIDATION_HEADER, format_hf_validation_row, validate_hf, versions

        print(HF_VALIDATION_HEADER, flush=True)
        rows = validate_hf(check=args.check, progress=lambda row: print(format_hf_validation_row(row), flush=True))
        worst = max(rows, key=lambda row: abs(row.predicted_peak_bytes - row.measured.peak_bytes))
        off = worst.predicted_peak_bytes - worst.measured.peak_bytes
        agree = all(row.trackers_agree for row in rows)
        verdict = "every peak to the byte" if not off else f"worst peak error {off:+,} bytes ({worst.label})"
        print(f"{len(rows)} configurations on the CPU ({versions()}): {verdict}; MemTracker and the storage counter "
              f"{'agree to the byte' if agree else 'DISAGREE'} on the "
              f"{sum(row.measured.memtracker_peak_bytes is not None for row in rows)} it could run")
        return 0 if agree and not off else 1     # exact or refused: a byte off is a failure
    if args.validate:
        from .validate import VALIDATION_HEADER, format_validation_row, validate, worst_errors

        print(VALIDATION_HEADER, flush=True)
        rows = validate(check=args.check, device=args.on,
                        progress=lambda row: print(format_validation_row(row), flush=True))
        worst = worst_errors(rows)
        where = "on the CPU (exact tracker)" if args.on == "cpu" else "on CUDA (the caching allocator)"
        print(f"{len(rows)} configurations {where}; worst relative error per term: "
              + ", ".join(f"{term} {value:.2e}" for term, value in worst.items()))
        return 0 if args.on == "cuda" or not any(worst.values()) else 1
    if generate_cli.wants_generation(args):   # notebook 15: one generate call, or one GRPO step
        try:
            print(generate_cli.run(args, model_from_args(args, parser.error)))
        except ValueError as error:
            parser.error(str(error))
        return 0
    if model_parallel.wants_model_parallel(args):   # notebook 13's per-GPU bytes under TP / PP / CP with DP
        try:
            print(model_parallel.run(args))
        except ValueError as error:
            parser.error(str(error))
        return 0
    try:
        model = model_from_args(args, parser.error)
        targets = args.lora_targets if args.lora_targets in LORA_TARGETS else tuple(
            name.strip() for name in args.lora_targets.split(",") if name.strip())
        impl = args.impl or ("for-loop" if args.optimizer == "adamw8bit" or args.bf16_rounding != "nearest"
                             else "foreach")
        setup = TrainingSetup(micro_batch=args.micro_batch, seq_len=args.seq_len, precision=args.precision,
                              optimizer=args.optimizer, optimizer_impl=impl, checkpointing=args.checkpointing,
                              lora_rank=args.lora_rank, lora_targets=targets, chunked_loss=args.chunked_loss,
                              accumulation_steps=args.accumulation, strategy=args.strategy, ranks=args.ranks,
                              device=args.device, lora_dropout=args.lora_dropout, padded=args.padded, loss=args.loss,
                              base_quant=args.base_quant, quant_block=args.quant_block,
                              kbit_prepared=args.kbit_prepared, bf16_rounding=args.bf16_rounding, fp8=args.fp8,
                              outputs=args.outputs, reentrant=args.use_reentrant, routing=args.routing_value)
        breakdown = predict(model, setup)
    except ValueError as error:
        parser.error(str(error))
    if args.device_gb < 0:
        parser.error(f"--device-gb must be >= 0 (0 skips the verdict), got {args.device_gb}")
    device_bytes = int(args.device_gb * 10**9) or None
    print(format_table(breakdown, device_bytes=device_bytes))
    if device_bytes:
        largest = largest_micro_batch(model, setup, device_bytes)
        if largest:
            print(f"largest micro-batch of {setup.seq_len} tokens that fits: {largest}")
        else:
            state = breakdown.parameters + breakdown.gradients + breakdown.optimizer_state
            print(f"no micro-batch fits: at the peak, parameters, gradients and optimizer state alone take "
                  f"{_gib(state)} GiB of the {_gib(device_bytes)} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
