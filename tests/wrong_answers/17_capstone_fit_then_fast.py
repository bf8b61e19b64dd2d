"""Wrong answers to notebook 17's exercises: each replaces the solution cell, and the graded cell must fail on it."""

_MODEL_CHECKPOINTED = '''
def llama_model_and_optimizer():
    return build_recipe(build_llama, checkpointed=True, blocks=LLAMA_OPTIONS["blocks"])
'''

_MODEL_PLAIN = '''
def llama_model_and_optimizer():
    return build_recipe(build_llama, checkpointed=False)
'''


def _recipe_step(micro_batches="math.ceil(len(labels) / llama_fits)", dtype="AMP_DTYPE",
                 options="loss_sum=llama_loss_sum, count=llama_count"):
    return f'''
def llama_step(model, optimizer, scaler, inputs, labels):
    micro_batches = {micro_batches}
    return train_step(model, optimizer, scaler, inputs, labels, micro_batches, {dtype}, {options})
'''


def _own_loop(weight, scale="scaler.scale(loss).backward()", step="scaler.step(optimizer)\n    scaler.update()",
              free="    optimizer.zero_grad(set_to_none=True)\n"):
    return f'''
def llama_step(model, optimizer, scaler, inputs, labels):
    pieces = math.ceil(len(labels) / llama_fits)
    num_targets = llama_count(labels)
    for micro_inputs, micro_labels in zip(split_batch(inputs, pieces), split_batch(labels, pieces)):
        with torch.autocast(DEVICE.type, dtype=AMP_DTYPE):
            loss = {weight}
        {scale}
    {step}
{free}'''


_SUM_OVER_COUNT = "llama_loss_sum(model(**micro_inputs), micro_labels) / num_targets"

WRONG = {
    "exercise_1": {
        "weights each piece's mean loss by its share of the sequences (wrong with padding and unequal pieces)":
            _MODEL_CHECKPOINTED + _own_loop("llama_loss_sum(model(**micro_inputs), micro_labels) / llama_count(micro_labels)"
                                            " * len(micro_labels) / len(labels)"),
        "counts every label that is not padding, the first of each row too (the model shifts them)":
            _MODEL_CHECKPOINTED + _recipe_step(
                options="loss_sum=llama_loss_sum, count=lambda labels: (labels != IGNORE_INDEX).sum()"),
        "uses the recipe's default loss, which does not shift the labels":
            _MODEL_CHECKPOINTED + _recipe_step(
                options="loss_sum=lambda outputs, labels: token_loss_sum(outputs.logits, labels), count=count_targets"),
        "backward on the unscaled loss: scaler.step then divides the gradients by the scale":
            _MODEL_CHECKPOINTED + _own_loop(_SUM_OVER_COUNT, scale="loss.backward()"),
        "steps the optimizer directly: an overflowing step is not skipped":
            _MODEL_CHECKPOINTED + _own_loop(_SUM_OVER_COUNT, scale="loss.backward()",
                                            step="optimizer.step()"),
        "the gradients are not freed after the update":
            _MODEL_CHECKPOINTED + _own_loop(_SUM_OVER_COUNT, free=""),
        "autocast without checkpointing: the pieces do not fit the budget":
            _MODEL_PLAIN + _recipe_step(),
        "checkpointing in fp32, no autocast: the pieces do not fit the budget":
            _MODEL_CHECKPOINTED + _recipe_step(dtype="torch.float32"),
        "always LLAMA_PIECES micro-batches (right for the target, too large for a bigger batch)":
            _MODEL_CHECKPOINTED + _recipe_step(micro_batches="LLAMA_PIECES"),
        "one piece more than the rows need (len // fits + 1): a batch of exactly llama_fits takes two passes":
            _MODEL_CHECKPOINTED + _recipe_step(micro_batches="len(labels) // llama_fits + 1"),
        "freezes the embeddings to save memory (changes which parameters train)": '''
def llama_model_and_optimizer():
    return build_recipe(build_llama, checkpointed=True, blocks=LLAMA_OPTIONS["blocks"])
''' + '''
def llama_step(model, optimizer, scaler, inputs, labels):
    model.model.embed_tokens.weight.requires_grad_(False)
    micro_batches = math.ceil(len(labels) / llama_fits)
    return train_step(model, optimizer, scaler, inputs, labels, micro_batches, AMP_DTYPE,
                      loss_sum=llama_loss_sum, count=llama_count)
''',
        'its own loop through the scaler without scaler.update(): an overflow never lowers the scale': '''
def llama_model_and_optimizer():
    return build_recipe(build_llama, checkpointed=True, blocks=LLAMA_OPTIONS["blocks"])

def llama_step(model, optimizer, scaler, inputs, labels):
    pieces = math.ceil(len(labels) / llama_fits)
    num_targets = llama_count(labels)
    total = 0.0
    for micro_inputs, micro_labels in zip(split_batch(inputs, pieces), split_batch(labels, pieces)):
        with torch.autocast(DEVICE.type, dtype=AMP_DTYPE):
            loss = llama_loss_sum(model(**micro_inputs), micro_labels) / num_targets
        scaler.scale(loss).backward()
        total += loss.item()
    scaler.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return total
''',
        "the model cast to bf16 instead of autocast (weights and AdamW's state in 16-bit)": '''
def llama_model_and_optimizer():
    model, _ = build_recipe(build_llama, checkpointed=True, blocks=LLAMA_OPTIONS["blocks"])
    model.to(AMP_DTYPE)
    return model, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)


def llama_step(model, optimizer, scaler, inputs, labels):
    micro_batches = math.ceil(len(labels) / llama_fits)
    return train_step(model, optimizer, scaler, inputs, labels, micro_batches, torch.float32,
                      loss_sum=llama_loss_sum, count=llama_count)
''',
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
        "keeps the gradients a failed backward left: the next try adds to them": '''
def find_executable_batch_size(step, model, start):
    size = start
    while size >= 1:
        try:
            step(size)
            return size
        except torch.OutOfMemoryError:
            pass
        gc.collect()
        size //= 2
    raise RuntimeError("nothing fits")
''',
        "catches every exception: a bug in the step is retried as if it were out of memory": '''
def find_executable_batch_size(step, model, start):
    size = start
    while size >= 1:
        try:
            step(size)
            return size
        except Exception:
            pass
        model.zero_grad(set_to_none=True)
        gc.collect()
        size //= 2
    raise RuntimeError("nothing fits")
''',
        "returns 0 when not even batch size 1 fits, as if 0 were a batch size": '''
def find_executable_batch_size(step, model, start):
    size = start
    while size >= 1:
        try:
            step(size)
            return size
        except torch.OutOfMemoryError:
            pass
        model.zero_grad(set_to_none=True)
        gc.collect()
        size //= 2
    return size
''',
        "stops above batch size 1 (while size > 1): from 1 it never tries": '''
def find_executable_batch_size(step, model, start):
    size = start
    while size > 1:
        try:
            step(size)
            return size
        except torch.OutOfMemoryError:
            pass
        model.zero_grad(set_to_none=True)
        gc.collect()
        size //= 2
    raise RuntimeError("nothing fits")
''',
        "steps down by one instead of halving (returns the largest that fits, not accelerate's halving)": '''
def find_executable_batch_size(step, model, start):
    size = start
    while size >= 1:
        try:
            step(size)
            return size
        except torch.OutOfMemoryError:
            pass
        model.zero_grad(set_to_none=True)
        gc.collect()
        size -= 1
    raise RuntimeError("nothing fits")
''',
        "resets the gradients to zeros after the size that runs (allocated zeros, not freed)": '''
def find_executable_batch_size(step, model, start):
    size = start
    while size >= 1:
        try:
            step(size)
            for parameter in model.parameters():
                parameter.grad = torch.zeros_like(parameter)
            return size
        except torch.OutOfMemoryError:
            pass
        model.zero_grad(set_to_none=True)
        gc.collect()
        size //= 2
    raise RuntimeError("nothing fits")
''',
        'no gc.collect() after a failure: tensors caught in reference cycles stay allocated': '''
def find_executable_batch_size(step, model, start):
    size = start
    while size >= 1:
        try:
            step(size)
            return size
        except torch.OutOfMemoryError:
            pass
        model.zero_grad(set_to_none=True)
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
        size //= 2
    raise RuntimeError(f"not even batch size 1 fits (started from {start})")
''',
        'zero_grad(set_to_none=False) after a failure: the next try starts with zero-filled gradients': '''
def find_executable_batch_size(step, model, start):
    size = start
    while size >= 1:
        try:
            step(size)
            return size
        except torch.OutOfMemoryError:
            pass
        model.zero_grad(set_to_none=False)
        gc.collect()
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
        size //= 2
    raise RuntimeError(f"not even batch size 1 fits (started from {start})")
''',
    },
}
