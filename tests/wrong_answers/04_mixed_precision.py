"""Wrong answers to notebook 04's exercises: each must fail its graded cell (tests/wrong_answers/README.md)."""

WRONG = {
    "exercise_1": {
        "overflows only strictly above max (values within half a step of it round to inf too)": '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    if value > info.max:
        return "overflow"
    if value <= info.tiny * info.eps / 2:
        return "underflow"
    return "subnormal" if value < info.tiny else "normal"
''',
        "underflows below the smallest subnormal (values above half of it round up to it)": '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= top * (1 - info.eps / 4):
        return "overflow"
    if value < info.tiny * info.eps:
        return "underflow"
    return "subnormal" if value < info.tiny else "normal"
''',
        "takes epsilon for the smallest number": '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= top * (1 - info.eps / 4):
        return "overflow"
    if value < info.eps:
        return "underflow"
    return "subnormal" if value < info.tiny else "normal"
''',
        "reads fp32's limits whatever the dtype": '''
def classify(value, dtype):
    info = torch.finfo(torch.float32)
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= top * (1 - info.eps / 4):
        return "overflow"
    if value <= info.tiny * info.eps / 2:
        return "underflow"
    return "subnormal" if value < info.tiny else "normal"
''',
            "the smallest normal itself counted as subnormal (<= instead of <)": '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= top * (1 - info.eps / 4):
        return "overflow"
    if value <= info.tiny * info.eps / 2:
        return "underflow"
    return "subnormal" if value <= info.tiny else "normal"
''',
        "no subnormals: everything below the smallest normal flushes to zero": '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= top * (1 - info.eps / 4):
        return "overflow"
    if value < info.tiny:
        return "underflow"
    return "normal"
''',
        "takes finfo.min (the most negative value) for the smallest positive one": '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= top * (1 - info.eps / 4):
        return "overflow"
    if value <= abs(info.min) * info.eps / 2 and value < info.tiny:
        return "underflow"
    return "subnormal" if value < info.tiny else "normal"
''',
    },
    "exercise_2": {
        "divides each micro-batch's loss by the number of micro-batches: wrong for uneven ones": '''
def accumulated_scaled_step(model, optimizer, scaler, micro_batches, max_norm):
    for inputs, labels in micro_batches:
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        scaler.scale(loss / len(micro_batches)).backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        "adds the micro-batch losses up without weighting them": '''
def accumulated_scaled_step(model, optimizer, scaler, micro_batches, max_norm):
    for inputs, labels in micro_batches:
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        "unscale_ after every micro-batch": '''
def accumulated_scaled_step(model, optimizer, scaler, micro_batches, max_norm):
    total_rows = sum(len(labels) for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        scaler.scale(loss * len(labels) / total_rows).backward()
        scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        "update() after every micro-batch": '''
def accumulated_scaled_step(model, optimizer, scaler, micro_batches, max_norm):
    total_rows = sum(len(labels) for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        scaler.scale(loss * len(labels) / total_rows).backward()
        scaler.update()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        "clips before unscale_: the threshold meets the scaled gradients": '''
def accumulated_scaled_step(model, optimizer, scaler, micro_batches, max_norm):
    total_rows = sum(len(labels) for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        scaler.scale(loss * len(labels) / total_rows).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        "optimizer.step() instead of scaler.step(): an overflowing step is taken": '''
def accumulated_scaled_step(model, optimizer, scaler, micro_batches, max_norm):
    total_rows = sum(len(labels) for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        scaler.scale(loss * len(labels) / total_rows).backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        "zero_grad inside the loop: only the last micro-batch's gradient is left": '''
def accumulated_scaled_step(model, optimizer, scaler, micro_batches, max_norm):
    total_rows = sum(len(labels) for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        scaler.scale(loss * len(labels) / total_rows).backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        "no autocast: the scaler alone does not make the forward fp16": '''
def accumulated_scaled_step(model, optimizer, scaler, micro_batches, max_norm):
    total_rows = sum(len(labels) for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        loss = nn.functional.cross_entropy(model(inputs), labels)
        scaler.scale(loss * len(labels) / total_rows).backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        "returns the norm after clipping": '''
def accumulated_scaled_step(model, optimizer, scaler, micro_batches, max_norm):
    total_rows = sum(len(labels) for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        scaler.scale(loss * len(labels) / total_rows).backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
    },
}
