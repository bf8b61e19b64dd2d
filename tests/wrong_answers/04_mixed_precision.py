"""Wrong answers to notebook 04's exercises: each must fail its graded cell (tests/wrong_answers/README.md)."""

WRONG = {
    "exercise_1": {
        'overflows only strictly above max (values within half a step of it round to inf too)': '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    sub = info.tiny * info.eps
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value > info.max:
        return "overflow"
    if value <= sub / 2:
        return "underflow"
    return "subnormal" if value < info.tiny - sub / 2 else "normal"
''',
        "overflows only strictly past the halfway tie (the tie rounds to inf: max's last mantissa bit is odd)": '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    sub = info.tiny * info.eps
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value > top * (1 - info.eps / 4):
        return "overflow"
    if value <= sub / 2:
        return "underflow"
    return "subnormal" if value < info.tiny - sub / 2 else "normal"
''',
        'underflows below the smallest subnormal (values above half of it round up to it)': '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    sub = info.tiny * info.eps
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= top * (1 - info.eps / 4):
        return "overflow"
    if value < sub:
        return "underflow"
    return "subnormal" if value < info.tiny - sub / 2 else "normal"
''',
        'keeps half the smallest subnormal (a tie goes to the even neighbour: 0)': '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    sub = info.tiny * info.eps
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= top * (1 - info.eps / 4):
        return "overflow"
    if value < sub / 2:
        return "underflow"
    return "subnormal" if value < info.tiny - sub / 2 else "normal"
''',
        'takes epsilon for the smallest number': '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    sub = info.tiny * info.eps
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= top * (1 - info.eps / 4):
        return "overflow"
    if value < info.eps:
        return "underflow"
    return "subnormal" if value < info.tiny - sub / 2 else "normal"
''',
        "reads fp32's limits whatever the dtype": '''
def classify(value, dtype):
    info = torch.finfo(torch.float32)
    sub = info.tiny * info.eps
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= top * (1 - info.eps / 4):
        return "overflow"
    if value <= sub / 2:
        return "underflow"
    return "subnormal" if value < info.tiny - sub / 2 else "normal"
''',
        'subnormal up to the smallest normal (within half a subnormal step of it, a value rounds up to it)': '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    sub = info.tiny * info.eps
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= top * (1 - info.eps / 4):
        return "overflow"
    if value <= sub / 2:
        return "underflow"
    return "subnormal" if value < info.tiny else "normal"
''',
        'the tie below the smallest normal counted as subnormal (<= instead of <)': '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    sub = info.tiny * info.eps
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= top * (1 - info.eps / 4):
        return "overflow"
    if value <= sub / 2:
        return "underflow"
    return "subnormal" if value <= info.tiny - sub / 2 else "normal"
''',
        'no subnormals: everything below the smallest normal flushes to zero': '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    sub = info.tiny * info.eps
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= top * (1 - info.eps / 4):
        return "overflow"
    if value < info.tiny - sub / 2:
        return "underflow"
    return "normal"
''',
        'takes finfo.min (the most negative value) for the smallest positive one': '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    sub = info.tiny * info.eps
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= top * (1 - info.eps / 4):
        return "overflow"
    if value <= abs(info.min) * info.eps / 2 and value < info.tiny:
        return "underflow"
    return "subnormal" if value < info.tiny - sub / 2 else "normal"
''',
        'halfway cut with a relative step everywhere: max * (1 + eps / 2) is past the tie, a bit late': '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    sub = info.tiny * info.eps
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= info.max * (1 + info.eps / 2):
        return "overflow"
    if value <= sub / 2:
        return "underflow"
    return "subnormal" if value < info.tiny - sub / 2 else "normal"
''',
        "overflow from max * (1 + eps / 4): half a step measured from max, not from the power of two above it": '''
def classify(value, dtype):
    info = torch.finfo(dtype)
    smallest_subnormal = info.tiny * info.eps
    top = 2.0 ** (math.floor(math.log2(info.max)) + 1)
    if value >= info.max * (1 + info.eps / 4):
        return "overflow"
    if value <= smallest_subnormal / 2:
        return "underflow"
    return "subnormal" if value < info.tiny - smallest_subnormal / 2 else "normal"
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
        "hard-codes the example's 4 : 3 : 1 weights: right only on that split": '''
def accumulated_scaled_step(model, optimizer, scaler, micro_batches, max_norm):
    total_rows = sum(len(labels) for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        scaler.scale(loss * [4 / 8, 3 / 8, 1 / 8][[len(l) for _, l in micro_batches].index(len(labels))]).backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        'scales every gradient to max_norm, even one already shorter (a clip only shrinks)': '''
def accumulated_scaled_step(model, optimizer, scaler, micro_batches, max_norm):
    total_rows = sum(len(labels) for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        scaler.scale(loss * len(labels) / total_rows).backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), float('inf'))
    for p in model.parameters():
        p.grad.mul_(max_norm / norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        'pins the scale after each step (scaler.update(2.0 ** 10)): a back-off is undone': '''
def accumulated_scaled_step(model, optimizer, scaler, micro_batches, max_norm):
    total_rows = sum(len(labels) for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        scaler.scale(loss * len(labels) / total_rows).backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update(2.0 ** 10)
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        'rebinds each parameter to a fresh fp32 copy after the step, to be sure it stays fp32': '''
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
    for p in model.parameters():
        p.data = p.data.to(torch.float32, copy=True)
    return norm
''',
        "the loss outside autocast: cross-entropy runs in fp16 on the fp16 logits": '''
def accumulated_scaled_step(model, optimizer, scaler, micro_batches, max_norm):
    total_rows = sum(len(labels) for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            logits = model(inputs)
        loss = nn.functional.cross_entropy(logits, labels)
        scaler.scale(loss * len(labels) / total_rows).backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        "one backward of the summed scaled losses: every micro-batch's graph kept until the end": '''
def accumulated_scaled_step(model, optimizer, scaler, micro_batches, max_norm):
    total_rows = sum(len(labels) for _, labels in micro_batches)
    scaled = []
    for inputs, labels in micro_batches:
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        scaled.append(scaler.scale(loss * len(labels) / total_rows))
    torch.stack(scaled).sum().backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
    },
}
