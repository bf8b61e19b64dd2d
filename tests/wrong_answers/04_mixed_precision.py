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
    },
    "exercise_2": {
        "no autocast and no scaler: a plain fp32 step with clipping": '''
def scaled_step(model, optimizer, scaler, features, classes, max_norm):
    loss = nn.functional.cross_entropy(model(features), classes)
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        "clips before unscale_: the threshold meets the scaled gradients": '''
def scaled_step(model, optimizer, scaler, features, classes, max_norm):
    with torch.autocast(DEVICE.type, dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(features), classes)
    scaler.scale(loss).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        "never unscales: scaler.step unscales after the clipping": '''
def scaled_step(model, optimizer, scaler, features, classes, max_norm):
    with torch.autocast(DEVICE.type, dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(features), classes)
    scaler.scale(loss).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        "measures the norm but never clips": '''
def scaled_step(model, optimizer, scaler, features, classes, max_norm):
    with torch.autocast(DEVICE.type, dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(features), classes)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        "autocast without the scaler": '''
def scaled_step(model, optimizer, scaler, features, classes, max_norm):
    with torch.autocast(DEVICE.type, dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(features), classes)
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        "forgets scaler.update()": '''
def scaled_step(model, optimizer, scaler, features, classes, max_norm):
    with torch.autocast(DEVICE.type, dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(features), classes)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
        "returns the norm after clipping": '''
def scaled_step(model, optimizer, scaler, features, classes, max_norm):
    with torch.autocast(DEVICE.type, dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(features), classes)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
''',
    },
}
