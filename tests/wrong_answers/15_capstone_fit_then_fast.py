"""Wrong answers to notebook 15's exercises: each replaces the solution cell, and the graded cell must fail on it."""

_MODEL_CHECKPOINTED = '''
def my_model_and_optimizer():
    model = build_transformer()
    model.blocks = nn.Sequential(*(CheckpointedBlock(block) for block in model.blocks))
    return model, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)
'''

_MODEL_PLAIN = '''
def my_model_and_optimizer():
    model = build_transformer()
    return model, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)
'''


def _step(micro_batches="ACCUMULATION_STEPS", dtype="AMP_DTYPE", weight="* len(micro_inputs) / len(inputs)",
          zero_inside="", zero_after="    optimizer.zero_grad(set_to_none=True)\n"):
    return f'''
def my_step(model, optimizer, scaler, inputs, targets):
    for micro_inputs, micro_targets in zip(inputs.chunk({micro_batches}), targets.chunk({micro_batches})):
{zero_inside}        with torch.autocast(DEVICE.type, dtype={dtype}, enabled={dtype} != torch.float32):
            loss = token_loss(model(micro_inputs), micro_targets) {weight}
        scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
{zero_after}'''


WRONG = {
    "exercise_1": {
        "the loss of each micro-batch is not divided (the gradients add up to ACCUMULATION_STEPS times the batch's)":
            _MODEL_CHECKPOINTED + _step(weight=""),
        "zero_grad inside the micro-batch loop (only the last micro-batch's gradient reaches the optimizer)":
            _MODEL_CHECKPOINTED + _step(zero_inside="        optimizer.zero_grad(set_to_none=True)\n"),
        "the gradients are not freed after the update":
            _MODEL_CHECKPOINTED + _step(zero_after=""),
        "autocast without checkpointing (the micro-batch does not fit)":
            _MODEL_PLAIN + _step(),
        "checkpointing in fp32, no autocast (the micro-batch does not fit)":
            _MODEL_CHECKPOINTED + _step(dtype="torch.float32"),
        "fp32 in four times as many micro-batches (fits, but not in ACCUMULATION_STEPS passes)":
            _MODEL_PLAIN + _step(micro_batches="4 * ACCUMULATION_STEPS", dtype="torch.float32"),
    },
    "exercise_2": {
        "keeps the last error to report it (its traceback holds the failed step's tensors)": '''
def find_executable_batch_size(step, model, start):
    size, last_error = start, None
    while size >= 1:
        try:
            step(size)
            return size
        except torch.OutOfMemoryError as error:
            last_error = error
        model.zero_grad(set_to_none=True)
        gc.collect()
        size //= 2
    raise RuntimeError(f"nothing fits: {last_error}")
''',
        "collects every error in a list (each traceback holds its step's tensors)": '''
def find_executable_batch_size(step, model, start):
    size, errors = start, []
    while size >= 1:
        try:
            step(size)
            return size
        except torch.OutOfMemoryError as error:
            errors.append(error)
        model.zero_grad(set_to_none=True)
        gc.collect()
        size //= 2
    raise RuntimeError(f"nothing fits: {errors}")
''',
        "no try/except: the first out-of-memory error escapes": '''
def find_executable_batch_size(step, model, start):
    size = start
    while size >= 1:
        if step(size) is not None:
            return size
        size //= 2
    raise RuntimeError("nothing fits")
''',
        "halves before the first try (start itself is never tried)": '''
def find_executable_batch_size(step, model, start):
    size = start
    while size > 1:
        size //= 2
        try:
            step(size)
            return size
        except torch.OutOfMemoryError:
            pass
        model.zero_grad(set_to_none=True)
        gc.collect()
    raise RuntimeError("nothing fits")
''',
    },
}
