"""Wrong answers to notebook 03's exercises: each must be rejected by its graded cell (tests/wrong_answers/README.md)."""

WRONG = {
    "exercise_1": {
        "the reentrant checkpoint: the frozen embedding's output requires no grad, so no block trains": '''
def lm_forward_checkpointed(lm, tokens, mask):
    x = lm.embed(tokens)
    for block in lm.blocks:
        x = checkpoint(block, x, mask, use_reentrant=True)
    return lm.head(x)
''',
        "use_reentrant left out: still reentrant, the forum's pitfall again": '''
def lm_forward_checkpointed(lm, tokens, mask):
    x = lm.embed(tokens)
    for block in lm.blocks:
        x = checkpoint(block, x, mask)
    return lm.head(x)
''',
        "no checkpointing at all": '''
def lm_forward_checkpointed(lm, tokens, mask):
    x = lm.embed(tokens)
    for block in lm.blocks:
        x = block(x, mask)
    return lm.head(x)
''',
        "the whole stack in one checkpoint: it keeps less after forward and holds every block's activations in backward": '''
def lm_forward_checkpointed(lm, tokens, mask):
    def run_blocks(x, mask):
        for block in lm.blocks:
            x = block(x, mask)
        return x
    return lm.head(checkpoint(run_blocks, lm.embed(tokens), mask, use_reentrant=False))
''',
        "drops the mask: checkpoints the inner block only": '''
def lm_forward_checkpointed(lm, tokens, mask):
    x = lm.embed(tokens)
    for block in lm.blocks:
        x = checkpoint(block.block, x, use_reentrant=False)
    return lm.head(x)
''',
        "the reentrant fix applied per block: detaching each input cuts the earlier blocks off": '''
def lm_forward_checkpointed(lm, tokens, mask):
    x = lm.embed(tokens)
    for block in lm.blocks:
        x = checkpoint(block, x.detach().requires_grad_(), mask, use_reentrant=True)
    return lm.head(x)
''',
        "checkpoints every other block": '''
def lm_forward_checkpointed(lm, tokens, mask):
    x = lm.embed(tokens)
    for index, block in enumerate(lm.blocks):
        x = checkpoint(block, x, mask, use_reentrant=False) if index % 2 == 0 else block(x, mask)
    return lm.head(x)
''',
    },
    "exercise_2": {
        "rounds down: one block too few, over the budget": '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    if budget_bytes < len(blocks) * checkpointed_block_bytes:
        raise ValueError("too small")
    excess = len(blocks) * plain_block_bytes - budget_bytes
    to_checkpoint = max(0, excess // (plain_block_bytes - checkpointed_block_bytes))
    for index, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if index < to_checkpoint else block(x)
    return x
''',
        "checkpoints every block whatever the budget": '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    if budget_bytes < len(blocks) * checkpointed_block_bytes:
        raise ValueError("too small")
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return x
''',
        "never checkpoints": '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    if budget_bytes < len(blocks) * checkpointed_block_bytes:
        raise ValueError("too small")
    return blocks(x)
''',
        "a budget met exactly counts as exceeded: one block too many at the boundary": '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    if budget_bytes < len(blocks) * checkpointed_block_bytes:
        raise ValueError("too small")
    to_checkpoint = 0
    while len(blocks) * plain_block_bytes - to_checkpoint * (plain_block_bytes - checkpointed_block_bytes) >= budget_bytes \\
            and to_checkpoint < len(blocks):
        to_checkpoint += 1
    for index, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if index < to_checkpoint else block(x)
    return x
''',
        "never raises: checkpoints everything and goes over the budget silently": '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    excess = len(blocks) * plain_block_bytes - budget_bytes
    to_checkpoint = min(len(blocks), max(0, -(-excess // (plain_block_bytes - checkpointed_block_bytes))))
    for index, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if index < to_checkpoint else block(x)
    return x
''',
        "reentrant checkpoint: the first block's input is data, so it gets no gradient": '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    if budget_bytes < len(blocks) * checkpointed_block_bytes:
        raise ValueError("too small")
    excess = len(blocks) * plain_block_bytes - budget_bytes
    to_checkpoint = max(0, -(-excess // (plain_block_bytes - checkpointed_block_bytes)))
    for index, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=True) if index < to_checkpoint else block(x)
    return x
''',
        "counts a checkpointed block as saving everything it kept: too few blocks": '''
def forward_within_budget(blocks, x, budget_bytes, plain_block_bytes, checkpointed_block_bytes):
    if budget_bytes < len(blocks) * checkpointed_block_bytes:
        raise ValueError("too small")
    excess = len(blocks) * plain_block_bytes - budget_bytes
    to_checkpoint = max(0, -(-excess // plain_block_bytes))
    for index, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if index < to_checkpoint else block(x)
    return x
''',
    },
}
