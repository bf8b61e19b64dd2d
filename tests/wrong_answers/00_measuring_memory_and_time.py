"""Wrong answers to notebook 00's exercises: each must fail its graded cell (tests/wrong_answers/README.md)."""

WRONG = {
    "exercise_1": {
        "applies ReLU's rule: one saved tensor per hidden layer": '''
def predict_activation_bytes(batch_size, widths, dtype):
    bytes_per_element = torch.empty(0, dtype=dtype).element_size()
    return bytes_per_element * batch_size * (sum(widths[1:-1]) + widths[-1])
''',
        "assumes 4 bytes per element whatever the dtype": '''
def predict_activation_bytes(batch_size, widths, dtype):
    return 4 * batch_size * (2 * sum(widths[1:-1]) + widths[-1])
''',
        "forgets the output": '''
def predict_activation_bytes(batch_size, widths, dtype):
    bytes_per_element = torch.empty(0, dtype=dtype).element_size()
    return bytes_per_element * batch_size * 2 * sum(widths[1:-1])
''',
        "counts the input, which existed before the forward pass": '''
def predict_activation_bytes(batch_size, widths, dtype):
    bytes_per_element = torch.empty(0, dtype=dtype).element_size()
    return bytes_per_element * batch_size * (widths[0] + 2 * sum(widths[1:-1]) + widths[-1])
''',
        "counts the weights instead of the activations": '''
def predict_activation_bytes(batch_size, widths, dtype):
    bytes_per_element = torch.empty(0, dtype=dtype).element_size()
    return bytes_per_element * sum(a * b + b for a, b in zip(widths, widths[1:]))
''',
        "counts elements, not bytes": '''
def predict_activation_bytes(batch_size, widths, dtype):
    return batch_size * (2 * sum(widths[1:-1]) + widths[-1])
''',
        "takes every hidden layer as wide as the first": '''
def predict_activation_bytes(batch_size, widths, dtype):
    bytes_per_element = torch.empty(0, dtype=dtype).element_size()
    return bytes_per_element * batch_size * (2 * widths[1] * (len(widths) - 2) + widths[-1])
''',
        "counts the output twice, as if the last Linear were followed by GELU too": '''
def predict_activation_bytes(batch_size, widths, dtype):
    bytes_per_element = torch.empty(0, dtype=dtype).element_size()
    return bytes_per_element * batch_size * (2 * sum(widths[1:-1]) + 2 * widths[-1])
''',
        "looks the element size up in a table of the three dtypes it has seen (no fp16)": '''
def predict_activation_bytes(batch_size, widths, dtype):
    bytes_per_element = {torch.float32: 4, torch.bfloat16: 2, torch.float64: 8}[dtype]
    return bytes_per_element * batch_size * (2 * sum(widths[1:-1]) + widths[-1])
''',
        "assumes at least one GELU: a lone Linear is counted as if followed by one": '''
def predict_activation_bytes(batch_size, widths, dtype):
    bytes_per_element = torch.empty(0, dtype=dtype).element_size()
    return bytes_per_element * batch_size * (2 * sum(widths[1:-1]) + widths[-1] * (1 if len(widths) > 2 else 2))
''',
        "counts each hidden width once per layer pair, right only when the hidden widths are equal": '''
def predict_activation_bytes(batch_size, widths, dtype):
    bytes_per_element = torch.empty(0, dtype=dtype).element_size()
    hidden = widths[1:-1]
    return bytes_per_element * batch_size * (hidden[0] * 2 * len(hidden) + widths[-1]) if hidden else \
        bytes_per_element * batch_size * widths[-1]
''',
    },
    "exercise_2": {
        "takes t.float() for a copy whatever t's dtype": '''
def predict_allocated_bytes(expression, rows, cols, dtype):
    element = torch.empty(0, dtype=dtype).element_size()
    t_bytes = rows * cols * element
    return {
        "t.reshape(cols, rows)": 0,
        "t.t().reshape(-1)": 0 if rows == 1 or cols == 1 else t_bytes,
        "t.mul_(2)": 0,
        "t * 2": t_bytes,
        "t.float()": rows * cols * 4,
        "t.double()": 0 if dtype == torch.float64 else rows * cols * 8,
        "t[:, :cols // 2]": 0,
        "t[:, :cols // 2].clone()": rows * (cols // 2) * element,
    }[expression]
''',
        "takes t.float() for free whatever t's dtype (right only for fp32)": '''
def predict_allocated_bytes(expression, rows, cols, dtype):
    element = torch.empty(0, dtype=dtype).element_size()
    t_bytes = rows * cols * element
    return {
        "t.reshape(cols, rows)": 0,
        "t.t().reshape(-1)": 0 if rows == 1 or cols == 1 else t_bytes,
        "t.mul_(2)": 0,
        "t * 2": t_bytes,
        "t.float()": 0,
        "t.double()": 0 if dtype == torch.float64 else rows * cols * 8,
        "t[:, :cols // 2]": 0,
        "t[:, :cols // 2].clone()": rows * (cols // 2) * element,
    }[expression]
''',
        'takes t.double() for a copy even of an fp64 tensor': '''
def predict_allocated_bytes(expression, rows, cols, dtype):
    element = torch.empty(0, dtype=dtype).element_size()
    t_bytes = rows * cols * element
    return {
        "t.reshape(cols, rows)": 0,
        "t.t().reshape(-1)": 0 if rows == 1 or cols == 1 else t_bytes,
        "t.mul_(2)": 0,
        "t * 2": t_bytes,
        "t.float()": 0 if dtype == torch.float32 else rows * cols * 4,
        "t.double()": rows * cols * 8,
        "t[:, :cols // 2]": 0,
        "t[:, :cols // 2].clone()": rows * (cols // 2) * element,
    }[expression]
''',
        'takes the flattened transpose for a copy even when a dimension is 1': '''
def predict_allocated_bytes(expression, rows, cols, dtype):
    element = torch.empty(0, dtype=dtype).element_size()
    t_bytes = rows * cols * element
    return {
        "t.reshape(cols, rows)": 0,
        "t.t().reshape(-1)": t_bytes,
        "t.mul_(2)": 0,
        "t * 2": t_bytes,
        "t.float()": 0 if dtype == torch.float32 else rows * cols * 4,
        "t.double()": 0 if dtype == torch.float64 else rows * cols * 8,
        "t[:, :cols // 2]": 0,
        "t[:, :cols // 2].clone()": rows * (cols // 2) * element,
    }[expression]
''',
        'takes the flattened transpose for a view': '''
def predict_allocated_bytes(expression, rows, cols, dtype):
    element = torch.empty(0, dtype=dtype).element_size()
    t_bytes = rows * cols * element
    return {
        "t.reshape(cols, rows)": 0,
        "t.t().reshape(-1)": 0,
        "t.mul_(2)": 0,
        "t * 2": t_bytes,
        "t.float()": 0 if dtype == torch.float32 else rows * cols * 4,
        "t.double()": 0 if dtype == torch.float64 else rows * cols * 8,
        "t[:, :cols // 2]": 0,
        "t[:, :cols // 2].clone()": rows * (cols // 2) * element,
    }[expression]
''',
        'clones the whole storage behind a slice': '''
def predict_allocated_bytes(expression, rows, cols, dtype):
    element = torch.empty(0, dtype=dtype).element_size()
    t_bytes = rows * cols * element
    return {
        "t.reshape(cols, rows)": 0,
        "t.t().reshape(-1)": 0 if rows == 1 or cols == 1 else t_bytes,
        "t.mul_(2)": 0,
        "t * 2": t_bytes,
        "t.float()": 0 if dtype == torch.float32 else rows * cols * 4,
        "t.double()": 0 if dtype == torch.float64 else rows * cols * 8,
        "t[:, :cols // 2]": 0,
        "t[:, :cols // 2].clone()": t_bytes,
    }[expression]
''',
        "takes the half slice's clone as half the bytes, right only for an even number of columns": '''
def predict_allocated_bytes(expression, rows, cols, dtype):
    element = torch.empty(0, dtype=dtype).element_size()
    t_bytes = rows * cols * element
    return {
        "t.reshape(cols, rows)": 0,
        "t.t().reshape(-1)": 0 if rows == 1 or cols == 1 else t_bytes,
        "t.mul_(2)": 0,
        "t * 2": t_bytes,
        "t.float()": 0 if dtype == torch.float32 else rows * cols * 4,
        "t.double()": 0 if dtype == torch.float64 else rows * cols * 8,
        "t[:, :cols // 2]": 0,
        "t[:, :cols // 2].clone()": t_bytes // 2,
    }[expression]
''',
        'assumes 4 bytes per element in the clone': '''
def predict_allocated_bytes(expression, rows, cols, dtype):
    element = torch.empty(0, dtype=dtype).element_size()
    t_bytes = rows * cols * element
    return {
        "t.reshape(cols, rows)": 0,
        "t.t().reshape(-1)": 0 if rows == 1 or cols == 1 else t_bytes,
        "t.mul_(2)": 0,
        "t * 2": t_bytes,
        "t.float()": 0 if dtype == torch.float32 else rows * cols * 4,
        "t.double()": 0 if dtype == torch.float64 else rows * cols * 8,
        "t[:, :cols // 2]": 0,
        "t[:, :cols // 2].clone()": rows * (cols // 2) * 4,
    }[expression]
''',
        'takes a reshape of a contiguous tensor for a copy': '''
def predict_allocated_bytes(expression, rows, cols, dtype):
    element = torch.empty(0, dtype=dtype).element_size()
    t_bytes = rows * cols * element
    return {
        "t.reshape(cols, rows)": t_bytes,
        "t.t().reshape(-1)": 0 if rows == 1 or cols == 1 else t_bytes,
        "t.mul_(2)": 0,
        "t * 2": t_bytes,
        "t.float()": 0 if dtype == torch.float32 else rows * cols * 4,
        "t.double()": 0 if dtype == torch.float64 else rows * cols * 8,
        "t[:, :cols // 2]": 0,
        "t[:, :cols // 2].clone()": rows * (cols // 2) * element,
    }[expression]
''',
        'takes the in-place t.mul_(2) for a new tensor': '''
def predict_allocated_bytes(expression, rows, cols, dtype):
    element = torch.empty(0, dtype=dtype).element_size()
    t_bytes = rows * cols * element
    return {
        "t.reshape(cols, rows)": 0,
        "t.t().reshape(-1)": 0 if rows == 1 or cols == 1 else t_bytes,
        "t.mul_(2)": t_bytes,
        "t * 2": t_bytes,
        "t.float()": 0 if dtype == torch.float32 else rows * cols * 4,
        "t.double()": 0 if dtype == torch.float64 else rows * cols * 8,
        "t[:, :cols // 2]": 0,
        "t[:, :cols // 2].clone()": rows * (cols // 2) * element,
    }[expression]
''',
        "takes t.double() for twice t's bytes, right only from fp32": '''
def predict_allocated_bytes(expression, rows, cols, dtype):
    element = torch.empty(0, dtype=dtype).element_size()
    t_bytes = rows * cols * element
    return {
        "t.reshape(cols, rows)": 0,
        "t.t().reshape(-1)": 0 if rows == 1 or cols == 1 else t_bytes,
        "t.mul_(2)": 0,
        "t * 2": t_bytes,
        "t.float()": 0 if dtype == torch.float32 else rows * cols * 4,
        "t.double()": 2 * t_bytes,
        "t[:, :cols // 2]": 0,
        "t[:, :cols // 2].clone()": rows * (cols // 2) * element,
    }[expression]
''',
    },
    "exercise_3": {
        "returns the total of the repeats, not their median": '''
def median_time_ms(fn, device, warmup=2, repeats=10):
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) * 1e3
''',
        "returns the mean, which one slow repeat drags up": '''
def median_time_ms(fn, device, warmup=2, repeats=10):
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times_ms = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times_ms.append((time.perf_counter() - started) * 1e3)
    return sum(times_ms) / len(times_ms)
''',
        "no warm-up: times the first, slow calls": '''
def median_time_ms(fn, device, warmup=2, repeats=10):
    device = torch.device(device)
    times_ms = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times_ms.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times_ms)
''',
        "never synchronises: times the launches on CUDA": '''
def median_time_ms(fn, device, warmup=2, repeats=10):
    for _ in range(warmup):
        fn()
    times_ms = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times_ms.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times_ms)
''',
        "synchronises before starting the clock but not before stopping it": '''
def median_time_ms(fn, device, warmup=2, repeats=10):
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times_ms = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        times_ms.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times_ms)
''',
        "returns seconds, not milliseconds": '''
def median_time_ms(fn, device, warmup=2, repeats=10):
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times_s = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times_s.append(time.perf_counter() - started)
    return statistics.median(times_s)
''',
        "takes the upper middle repeat for the median: right only for an odd count": '''
def median_time_ms(fn, device, warmup=2, repeats=10):
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times_ms = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times_ms.append((time.perf_counter() - started) * 1e3)
    return sorted(times_ms)[len(times_ms) // 2]
''',
        "synchronises the current device, not the one timed": '''
def median_time_ms(fn, device, warmup=2, repeats=10):
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times_ms = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times_ms.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times_ms)
''',
        "recognises only the string 'cuda', not 'cuda:1'": '''
def median_time_ms(fn, device, warmup=2, repeats=10):
    on_cuda = str(device) == "cuda"
    for _ in range(warmup):
        fn()
    times_ms = []
    for _ in range(repeats):
        if on_cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if on_cuda:
            torch.cuda.synchronize(device)
        times_ms.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times_ms)
''',
        "drops the first timed repeat as well, right only when there are several": '''
def median_time_ms(fn, device, warmup=2, repeats=10):
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times_ms = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times_ms.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times_ms[1:] or times_ms)
''',
    },
}
