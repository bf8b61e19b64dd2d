"""Wrong answers to notebook 03's exercises: each must fail its graded cell (tests/wrong_answers/README.md)."""

WRONG = {
    "exercise_1": {
        'checkpoints the last segment too': '''
def predict_sequential_kept_bytes(plain_block_bytes, output_bytes, segments):
    return segments * output_bytes if segments > 1 else sum(plain_block_bytes)
''',
        'cuts the segments with a ceiling, n / k rounded up': '''
def predict_sequential_kept_bytes(plain_block_bytes, output_bytes, segments):
    per_segment = -(-len(plain_block_bytes) // segments)
    checkpointed = min((segments - 1) * per_segment, len(plain_block_bytes))
    return (segments - 1) * output_bytes + sum(plain_block_bytes[checkpointed:])
''',
        'takes the plain tail for the first blocks, right only when blocks are equal': '''
def predict_sequential_kept_bytes(plain_block_bytes, output_bytes, segments):
    per_segment = len(plain_block_bytes) // segments
    tail = len(plain_block_bytes) - (segments - 1) * per_segment
    return (segments - 1) * output_bytes + sum(plain_block_bytes[:tail])
''',
        'puts n // k blocks in the last segment too, forgetting the leftover blocks': '''
def predict_sequential_kept_bytes(plain_block_bytes, output_bytes, segments):
    per_segment = len(plain_block_bytes) // segments
    checkpointed = (segments - 1) * per_segment
    return (segments - 1) * output_bytes + sum(plain_block_bytes[checkpointed:checkpointed + per_segment])
''',
        'counts one output per segment, the plain last one included': '''
def predict_sequential_kept_bytes(plain_block_bytes, output_bytes, segments):
    per_segment = len(plain_block_bytes) // segments
    checkpointed = (segments - 1) * per_segment
    return segments * output_bytes + sum(plain_block_bytes[checkpointed:])
''',
        "forgets the checkpointed segments' outputs": '''
def predict_sequential_kept_bytes(plain_block_bytes, output_bytes, segments):
    per_segment = len(plain_block_bytes) // segments
    return sum(plain_block_bytes[(segments - 1) * per_segment:])
''',
        'scales the plain forward by the fraction of blocks left plain (the average block)': '''
def predict_sequential_kept_bytes(plain_block_bytes, output_bytes, segments):
    n = len(plain_block_bytes)
    tail = n - (segments - 1) * (n // segments)
    return (segments - 1) * output_bytes + sum(plain_block_bytes) * tail // n
''',
        'special-cases one segment as checkpointing everything': '''
def predict_sequential_kept_bytes(plain_block_bytes, output_bytes, segments):
    if segments == 1:
        return output_bytes
    per_segment = len(plain_block_bytes) // segments
    return (segments - 1) * output_bytes + sum(plain_block_bytes[(segments - 1) * per_segment:])
''',
    },
    "exercise_2": {
        'checkpoints blocks in order from the first: more blocks than needed when they differ': '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    if budget_bytes < len(blocks) * checkpointed_block_bytes:
        raise ValueError("too small")
    excess = sum(plain_block_bytes) - budget_bytes
    chosen = set()
    for index in range(len(blocks)):
        if excess <= 0:
            break
        chosen.add(index)
        excess -= plain_block_bytes[index] - checkpointed_block_bytes
    for index, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if index in chosen else block(x)
    return x
''',
        'checkpoints the blocks that save the least first': '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    if budget_bytes < len(blocks) * checkpointed_block_bytes:
        raise ValueError("too small")
    excess = sum(plain_block_bytes) - budget_bytes
    chosen = set()
    for index in sorted(range(len(blocks)), key=lambda i: plain_block_bytes[i]):
        if excess <= 0:
            break
        chosen.add(index)
        excess -= plain_block_bytes[index] - checkpointed_block_bytes
    for index, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if index in chosen else block(x)
    return x
''',
        'counts with the average block, right only when blocks are equal': '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    if budget_bytes < len(blocks) * checkpointed_block_bytes:
        raise ValueError("too small")
    average = sum(plain_block_bytes) / len(blocks)
    excess = sum(plain_block_bytes) - budget_bytes
    to_checkpoint = max(0, -(-int(excess) // int(average - checkpointed_block_bytes)))
    for index, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if index < to_checkpoint else block(x)
    return x
''',
        'a budget met exactly counts as exceeded: one block too many at the boundary': '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    if budget_bytes < len(blocks) * checkpointed_block_bytes:
        raise ValueError("too small")
    excess = sum(plain_block_bytes) - budget_bytes
    chosen = set()
    for index in sorted(range(len(blocks)), key=lambda i: plain_block_bytes[i], reverse=True):
        if excess < 0:
            break
        chosen.add(index)
        excess -= plain_block_bytes[index] - checkpointed_block_bytes
    for index, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if index in chosen else block(x)
    return x
''',
        'counts a checkpointed block as saving everything it kept: too few blocks': '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    if budget_bytes < len(blocks) * checkpointed_block_bytes:
        raise ValueError("too small")
    excess = sum(plain_block_bytes) - budget_bytes
    chosen = set()
    for index in sorted(range(len(blocks)), key=lambda i: plain_block_bytes[i], reverse=True):
        if excess <= 0:
            break
        chosen.add(index)
        excess -= plain_block_bytes[index]
    for index, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if index in chosen else block(x)
    return x
''',
        'never raises: checkpoints everything and goes over the budget silently': '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    excess = sum(plain_block_bytes) - budget_bytes
    chosen = set()
    for index in sorted(range(len(blocks)), key=lambda i: plain_block_bytes[i], reverse=True):
        if excess <= 0:
            break
        chosen.add(index)
        excess -= plain_block_bytes[index] - checkpointed_block_bytes
    for index, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if index in chosen else block(x)
    return x
''',
        "reentrant checkpoint: the first block's input is data, so it gets no gradient": '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    if budget_bytes < len(blocks) * checkpointed_block_bytes:
        raise ValueError("too small")
    excess = sum(plain_block_bytes) - budget_bytes
    chosen = set()
    for index in sorted(range(len(blocks)), key=lambda i: plain_block_bytes[i], reverse=True):
        if excess <= 0:
            break
        chosen.add(index)
        excess -= plain_block_bytes[index] - checkpointed_block_bytes
    for index, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=True) if index in chosen else block(x)
    return x
''',
        'checkpoints every block whatever the budget': '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    if budget_bytes < len(blocks) * checkpointed_block_bytes:
        raise ValueError("too small")
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return x
''',
        'raises where the plain forward does not fit, rather than where nothing would': '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    if budget_bytes < sum(plain_block_bytes):
        raise ValueError("over budget")
    return blocks(x)
''',
        "patches the chosen blocks' forward and leaves them patched": '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    if budget_bytes < len(blocks) * checkpointed_block_bytes:
        raise ValueError("too small")
    import functools
    excess = sum(plain_block_bytes) - budget_bytes
    for index in sorted(range(len(blocks)), key=lambda i: plain_block_bytes[i], reverse=True):
        if excess <= 0:
            break
        blocks[index].forward = functools.partial(checkpoint, blocks[index].forward, use_reentrant=False)
        excess -= plain_block_bytes[index] - checkpointed_block_bytes
    return blocks(x)
''',
    },
}
