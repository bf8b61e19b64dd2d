"""Wrong answers to notebook 06's exercises: each must make its graded cell fail (tests/wrong_answers/README.md)."""

_SLOWEST_BY_TOTAL = '''

def slowest_part(prof, names):
    totals = {entry.key: entry.cpu_time_total for entry in prof.key_averages() if entry.key in names}
    return max(totals, key=totals.get)
'''

_PROFILE_WITH_WARMUP = '''
def profile_parts(parts, active_steps):
    part_schedule = schedule(wait=0, warmup=1, active=active_steps, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=part_schedule) as part_prof:
        for _ in range(1 + active_steps):
            for name, part in parts.items():
                with record_function(name):
                    part()
            part_prof.step()
    return part_prof
'''

WRONG = {
    "exercise_1": {
        "no warm-up step: the schedule records the slow first call too": '''
def profile_parts(parts, active_steps):
    part_schedule = schedule(wait=0, warmup=0, active=1 + active_steps, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=part_schedule) as part_prof:
        for _ in range(1 + active_steps):
            for name, part in parts.items():
                with record_function(name):
                    part()
            part_prof.step()
    return part_prof
''' + _SLOWEST_BY_TOTAL,
        "never calls prof.step(): the schedule never leaves its first step, nothing is recorded": '''
def profile_parts(parts, active_steps):
    part_schedule = schedule(wait=0, warmup=1, active=active_steps, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=part_schedule) as part_prof:
        for _ in range(1 + active_steps):
            for name, part in parts.items():
                with record_function(name):
                    part()
    return part_prof
''' + _SLOWEST_BY_TOTAL,
        "no record_function ranges: the profile has the ops but not the parts": '''
def profile_parts(parts, active_steps):
    part_schedule = schedule(wait=0, warmup=1, active=active_steps, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=part_schedule) as part_prof:
        for _ in range(1 + active_steps):
            for part in parts.values():
                part()
            part_prof.step()
    return part_prof
''' + _SLOWEST_BY_TOTAL,
        "ranks the parts by self time, which leaves out the library range a part calls": _PROFILE_WITH_WARMUP + '''

def slowest_part(prof, names):
    totals = {entry.key: entry.self_cpu_time_total for entry in prof.key_averages() if entry.key in names}
    return max(totals, key=totals.get)
''',
        "records only one active step": '''
def profile_parts(parts, active_steps):
    part_schedule = schedule(wait=0, warmup=1, active=1, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=part_schedule) as part_prof:
        for _ in range(1 + active_steps):
            for name, part in parts.items():
                with record_function(name):
                    part()
            part_prof.step()
    return part_prof
''' + _SLOWEST_BY_TOTAL,
        "runs only active_steps steps, so the warm-up takes one of them": '''
def profile_parts(parts, active_steps):
    part_schedule = schedule(wait=0, warmup=1, active=active_steps, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=part_schedule) as part_prof:
        for _ in range(active_steps):
            for name, part in parts.items():
                with record_function(name):
                    part()
            part_prof.step()
    return part_prof
''' + _SLOWEST_BY_TOTAL,
        "takes the largest row of the whole table, not only the parts": _PROFILE_WITH_WARMUP + '''

def slowest_part(prof, names):
    totals = {entry.key: entry.cpu_time_total for entry in prof.key_averages()}
    return max(totals, key=totals.get)
''',
        "returns the fastest part": _PROFILE_WITH_WARMUP + '''

def slowest_part(prof, names):
    totals = {entry.key: entry.cpu_time_total for entry in prof.key_averages() if entry.key in names}
    return min(totals, key=totals.get)
''',
        "schedules two active steps whatever active_steps says: right only on the example": '''
def profile_parts(parts, active_steps):
    part_schedule = schedule(wait=0, warmup=1, active=2, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=part_schedule) as part_prof:
        for _ in range(1 + active_steps):
            for name, part in parts.items():
                with record_function(name):
                    part()
            part_prof.step()
    return part_prof
''' + _SLOWEST_BY_TOTAL,
        "ranks the parts by device time, as on a GPU: all zero on a CPU, so the first part wins":
            _PROFILE_WITH_WARMUP + '''

def slowest_part(prof, names):
    totals = {entry.key: entry.device_time_total for entry in prof.key_averages() if entry.key in names}
    return max(totals, key=totals.get)
''',
    },
    "exercise_2": {
        "ignores the frozen layers: section 1's count, backward = 2 x forward less the first layer's input gradient": '''
def predict_step_flops(widths, batch, frozen):
    matmuls = [2 * batch * a * b for a, b in zip(widths, widths[1:])]
    return 3 * sum(matmuls) - matmuls[0]
''',
        "a frozen layer skips its whole backward, though a trainable layer before it needs its input gradient": '''
def predict_step_flops(widths, batch, frozen):
    total = 0
    for index, (a, b) in enumerate(zip(widths, widths[1:])):
        matmul = 2 * batch * a * b
        total += matmul
        if index not in frozen:
            total += matmul + (matmul if index > 0 else 0)
    return total
''',
        "frozen layers skip only their weight gradient; every layer but the first computes its input gradient": '''
def predict_step_flops(widths, batch, frozen):
    total = 0
    for index, (a, b) in enumerate(zip(widths, widths[1:])):
        matmul = 2 * batch * a * b
        total += matmul
        if index not in frozen:
            total += matmul
        if index > 0:
            total += matmul
    return total
''',
        "counts a multiply-add as one FLOP": '''
def predict_step_flops(widths, batch, frozen):
    total = 0
    for index, (a, b) in enumerate(zip(widths, widths[1:])):
        matmul = batch * a * b
        total += matmul
        if index not in frozen:
            total += matmul
        if any(earlier not in frozen for earlier in range(index)):
            total += matmul
    return total
''',
        "counts the forward pass only": '''
def predict_step_flops(widths, batch, frozen):
    return sum(2 * batch * a * b for a, b in zip(widths, widths[1:]))
''',
        "adds the bias additions to each addmm": '''
def predict_step_flops(widths, batch, frozen):
    total = 0
    for index, (a, b) in enumerate(zip(widths, widths[1:])):
        matmul = 2 * batch * a * b
        total += matmul + batch * b
        if index not in frozen:
            total += matmul
        if any(earlier not in frozen for earlier in range(index)):
            total += matmul
    return total
''',
        "gives the first layer an input gradient too, though the input needs none": '''
def predict_step_flops(widths, batch, frozen):
    total = 0
    for index, (a, b) in enumerate(zip(widths, widths[1:])):
        matmul = 2 * batch * a * b
        total += matmul
        if index not in frozen:
            total += 2 * matmul
    return total
''',
        "an input gradient only after a trainable layer right before it, not any earlier one": '''
def predict_step_flops(widths, batch, frozen):
    total = 0
    for index, (a, b) in enumerate(zip(widths, widths[1:])):
        matmul = 2 * batch * a * b
        total += matmul
        if index not in frozen:
            total += matmul
        if index > 0 and index - 1 not in frozen:
            total += matmul
    return total
''',
        "drops the last Linear (an off-by-one in the loop over the layers)": '''
def predict_step_flops(widths, batch, frozen):
    total = 0
    for index, (a, b) in enumerate(zip(widths[:-1], widths[1:-1])):
        matmul = 2 * batch * a * b
        total += matmul
        if index not in frozen:
            total += matmul
        if any(earlier not in frozen for earlier in range(index)):
            total += matmul
    return total
''',
    },
}
