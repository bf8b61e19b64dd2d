"""Wrong answers to notebook 13's exercises: each replaces the solution cell, and the graded cell must fail on it.

Each is the whole solution cell with one mistake a learner makes: a plan that leaves a module whole or gathers the
wrong way, a prediction that forgets the optimizer's all-reduces, rounds the uneven split down, counts LayerNorm's
bias on an RMSNorm, or a schedule formula right only when the micro-batches fill the pipeline."""

_IMPORTS = ("    from torch.distributed.tensor import Replicate, Shard\n"
            "    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, "
            "SequenceParallel\n")

_PLAN_ENTRIES = {
    "input_layernorm": "SequenceParallel()", "post_attention_layernorm": "SequenceParallel()",
    "self_attn": "into_sublayer", "mlp": "into_sublayer", "self_attn.q_proj": "ColwiseParallel()",
    "self_attn.k_proj": "ColwiseParallel()", "self_attn.v_proj": "ColwiseParallel()",
    "self_attn.o_proj": "RowwiseParallel(output_layouts=Shard(1))", "mlp.gate_proj": "ColwiseParallel()",
    "mlp.up_proj": "ColwiseParallel()", "mlp.down_proj": "RowwiseParallel(output_layouts=Shard(1))",
}

_PREDICTION = {
    "shard": "batch * -(-seq // tp) * width * 4",
    "scatter_in": "tp * shard",
    "norms": "2",
    "bucketed": 'steps + [("bucketed reduce", "all_reduce", partial_norms * width * 4)]',
    "optimizer": ('steps + [("optimizer", "all_reduce", width * 4)] * '
                  '(partial_norms * (sp_step_reduces // len(partial)))'),
}


def _exercise_1(plan: dict | None = None, **prediction: str) -> str:
    entries = dict(_PLAN_ENTRIES) if plan is None else plan
    body = ", ".join(f'"{name}": {style}' for name, style in entries.items())
    p = _PREDICTION | prediction
    return ("def llama_sequence_parallel_plan() -> dict:\n" + _IMPORTS +
            "    into_sublayer = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))\n"
            f"    return {{{body}}}\n\n\n"
            "def predict_step_collectives(batch, seq, width, tp, bucketed):\n"
            f"    shard = {p['shard']}\n"
            "    steps = []\n"
            '    for phase in ("forward", "backward"):\n'
            '        steps += [(phase, "all_gather", shard)] * 2 + '
            f'[(phase, "reduce_scatter", {p["scatter_in"]})] * 2\n'
            f"    partial_norms = {p['norms']}\n"
            "    if bucketed:\n"
            f"        return {p['bucketed']}\n"
            f"    return {p['optimizer']}\n")


def _without(*names: str) -> dict:
    return {name: style for name, style in _PLAN_ENTRIES.items() if name not in names}


def _with(**styles: str) -> dict:
    return _PLAN_ENTRIES | {name.replace("__", "."): style for name, style in styles.items()}


def _exercise_2(bubble: str | None = None, in_flight: str | None = None, body: str = "") -> str:
    bubble = bubble or ("(p - 1) / (v * m + p - 1) if m >= p else 1 - v * m / (v * p + m - 1)")
    in_flight = in_flight or "[min(v * m, (v - 1) * per_round + 2 * (p - 1 - r) + 1) for r in range(p)]"
    return ("def predict_interleaved_1f1b(ranks, chunks, micro_batches):\n"
            "    p, v, m = ranks, chunks, micro_batches\n" + body +
            f"    bubble = {bubble}\n"
            "    rounds = max(1, m // p)\n"
            "    per_round = m // rounds\n"
            f"    return bubble, {in_flight}\n")


WRONG = {
    "exercise_1": {
        "the gate projection left out of the plan: every rank keeps all of it":
            _exercise_1(_without("mlp.gate_proj")),
        "the norms left out: they run on the whole sequence, not this rank's tokens":
            _exercise_1(_without("input_layernorm", "post_attention_layernorm")),
        "o_proj row-parallel without the sequence split: an all-reduce, and a whole sequence back":
            _exercise_1(_with(self_attn__o_proj="RowwiseParallel()")),
        "the MLP's input not gathered first: gate and up see only this rank's tokens":
            _exercise_1(_without("mlp")),
        "the MLP's projections the other way round: gate and up row-parallel, down column-parallel":
            _exercise_1(_with(mlp__gate_proj="RowwiseParallel()", mlp__up_proj="RowwiseParallel()",
                              mlp__down_proj="ColwiseParallel(output_layouts=Shard(1))")),
        "an uneven split rounded down: the shards are padded up to ceil(seq / tp)":
            _exercise_1(shard="batch * (seq // tp) * width * 4"),
        "the optimizer step forgotten: AdamW reduces the partial norm gradients":
            _exercise_1(optimizer="steps"),
        "four partial norm tensors, as with LayerNorm's bias: an RMSNorm has a weight only":
            _exercise_1(norms="4"),
        "the reduce-scatter sized by what it returns, not what it takes":
            _exercise_1(scatter_in="shard"),
        "the bucket sized as one norm's gradient, not all of them":
            _exercise_1(bucketed='steps + [("bucketed reduce", "all_reduce", width * 4)]'),
        "bucketed, yet the optimizer still reduces every partial gradient":
            _exercise_1(bucketed='steps + [("bucketed reduce", "all_reduce", partial_norms * width * 4)] + '
                                 '[("optimizer", "all_reduce", width * 4)] * '
                                 '(partial_norms * (sp_step_reduces // len(partial)))'),
    },
    "exercise_2": {
        "Narayanan's idle over ideal time, (p - 1) / (v m), not a share of the step":
            _exercise_2(bubble="(p - 1) / (v * m)"),
        "1F1B's bubble: the stages per rank forgotten":
            _exercise_2(bubble="(p - 1) / (m + p - 1)"),
        "fewer micro-batches than ranks not handled: the pipeline never fills":
            _exercise_2(bubble="(p - 1) / (v * m + p - 1)"),
        "the in-flight count not capped by the v m forwards there are":
            _exercise_2(in_flight="[(v - 1) * per_round + 2 * (p - 1 - r) + 1 for r in range(p)]"),
        "Megatron's warm-up, (v - 1) p: torch warms up a round of m / rounds micro-batches":
            _exercise_2(in_flight="[min(v * m, (v - 1) * p + 2 * (p - 1 - r) + 1) for r in range(p)]"),
        "the warm-up forwards only, without the one the steady state adds":
            _exercise_2(in_flight="[min(v * m, (v - 1) * per_round + 2 * (p - 1 - r)) for r in range(p)]"),
        "ranks counted from the wrong end":
            _exercise_2(in_flight="[min(v * m, (v - 1) * per_round + 2 * r + 1) for r in range(p)]"),
        "1F1B's p - rank micro-batches, one stage per rank":
            _exercise_2(in_flight="[min(m, p - r) for r in range(p)]"),
        "torch's schedule built and replayed instead of predicted":
            ("def predict_interleaved_1f1b(ranks, chunks, micro_batches):\n"
             "    orders = pipeline_schedules.schedule_orders('interleaved-1f1b', ranks, micro_batches, chunks)\n"
             "    bubble = pipeline_schedules.simulate_schedule(orders).bubble\n"
             "    return bubble, [pipeline_schedules.in_flight(orders[r]) for r in range(ranks)]\n"),
    },
}
