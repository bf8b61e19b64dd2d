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
    },
    "exercise_2": {
        "takes t.float() for a copy": '''
t_bytes = 64 * 128 * 4
predicted_bytes = {"t.reshape(128, 64)": 0, "t.t().reshape(-1)": t_bytes, "t.mul_(2)": 0, "t * 2": t_bytes,
                   "t.float()": t_bytes, "t.double()": 2 * t_bytes, "t[:, :64]": 0, "t[:, :64].clone()": t_bytes // 2}
''',
        "takes reshape of a transpose for a view": '''
t_bytes = 64 * 128 * 4
predicted_bytes = {"t.reshape(128, 64)": 0, "t.t().reshape(-1)": 0, "t.mul_(2)": 0, "t * 2": t_bytes,
                   "t.float()": 0, "t.double()": 2 * t_bytes, "t[:, :64]": 0, "t[:, :64].clone()": t_bytes // 2}
''',
        "clones the whole storage behind a slice": '''
t_bytes = 64 * 128 * 4
predicted_bytes = {"t.reshape(128, 64)": 0, "t.t().reshape(-1)": t_bytes, "t.mul_(2)": 0, "t * 2": t_bytes,
                   "t.float()": 0, "t.double()": 2 * t_bytes, "t[:, :64]": 0, "t[:, :64].clone()": t_bytes}
''',
        "forgets that fp64 takes 8 bytes": '''
t_bytes = 64 * 128 * 4
predicted_bytes = {"t.reshape(128, 64)": 0, "t.t().reshape(-1)": t_bytes, "t.mul_(2)": 0, "t * 2": t_bytes,
                   "t.float()": 0, "t.double()": t_bytes, "t[:, :64]": 0, "t[:, :64].clone()": t_bytes // 2}
''',
        "takes a reshape of a contiguous tensor for a copy": '''
t_bytes = 64 * 128 * 4
predicted_bytes = {"t.reshape(128, 64)": t_bytes, "t.t().reshape(-1)": t_bytes, "t.mul_(2)": 0, "t * 2": t_bytes,
                   "t.float()": 0, "t.double()": 2 * t_bytes, "t[:, :64]": 0, "t[:, :64].clone()": t_bytes // 2}
''',
        "takes the in-place t.mul_(2) for a new tensor": '''
t_bytes = 64 * 128 * 4
predicted_bytes = {"t.reshape(128, 64)": 0, "t.t().reshape(-1)": t_bytes, "t.mul_(2)": t_bytes, "t * 2": t_bytes,
                   "t.float()": 0, "t.double()": 2 * t_bytes, "t[:, :64]": 0, "t[:, :64].clone()": t_bytes // 2}
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
    },
}
