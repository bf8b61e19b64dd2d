"""Wrong answers to notebook 13's exercises: each replaces the solution cell, and the graded cell must fail on it."""


def _plan(body: str) -> str:
    return ("def attention_plan():\n"
            "    from torch.distributed.tensor import Shard\n"
            "    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel\n"
            f"    return {body}\n")


def _peak(expression: str) -> str:
    return ("def predict_1f1b_peak_bytes(stage, stages, micro_batches, one_micro_batch_bytes):\n"
            f"    return {expression}\n")


WRONG = {
    "exercise_1": {
        "o column-parallel too: the heads are never combined":
            _plan('{"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": ColwiseParallel()}'),
        "everything row-parallel: q, k, v split their inputs, not their heads":
            _plan('{"q": RowwiseParallel(), "k": RowwiseParallel(), "v": RowwiseParallel(), "o": RowwiseParallel()}'),
        "the two styles swapped":
            _plan('{"q": RowwiseParallel(), "k": RowwiseParallel(), "v": RowwiseParallel(), "o": ColwiseParallel()}'),
        "o left out: every rank keeps all of it":
            _plan('{"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel()}'),
        "v left out: its heads do not match q's and k's":
            _plan('{"q": ColwiseParallel(), "k": ColwiseParallel(), "o": RowwiseParallel()}'),
        "o returns a DTensor, not the plain tensor an unsplit Attention returns":
            _plan('{"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), '
                  '"o": RowwiseParallel(use_local_output=False)}'),
        "o's output split along the sequence (sequence parallelism without its input side)":
            _plan('{"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), '
                  '"o": RowwiseParallel(output_layouts=Shard(1))}'),
    },
    "exercise_2": {
        "GPipe's peak: every micro-batch in flight": _peak("micro_batches * one_micro_batch_bytes"),
        "as many micro-batches as stages on every stage": _peak("stages * one_micro_batch_bytes"),
        "the warm-up forwards only, without the one in the steady state": _peak(
            "(stages - stage - 1) * one_micro_batch_bytes"),
        "stages counted from the wrong end": _peak("(stage + 1) * one_micro_batch_bytes"),
        "one micro-batch at a time on every stage": _peak("one_micro_batch_bytes"),
        "the micro-batches left, not the stages left": _peak("(micro_batches - stage) * one_micro_batch_bytes"),
        "the number in flight, not bytes": _peak("min(micro_batches, stages - stage)"),
    },
}
