"""Wrong answers to notebook 03's exercises: each must fail its graded cell (tests/wrong_answers/README.md)."""

WRONG = {
    "exercise_1": {
        "keeps the forum's reentrant checkpoint with a data input": '''
def fixed_forward(model, x):
    backbone, head = model
    return head(checkpoint(backbone, x, use_reentrant=True))
''',
        "drops checkpointing altogether": '''
def fixed_forward(model, x):
    backbone, head = model
    return head(backbone(x))
''',
        "checkpoints the head instead of the backbone": '''
def fixed_forward(model, x):
    backbone, head = model
    return checkpoint(head, backbone(x), use_reentrant=False)
''',
        "runs the backbone under no_grad to save its activations": '''
def fixed_forward(model, x):
    backbone, head = model
    with torch.no_grad():
        features = backbone(x)
    return head(features)
''',
    },
    "exercise_2": {
        "checkpoints every other block": '''
def every_third(blocks, x):
    for index, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if index % 2 == 0 else block(x)
    return x
''',
        "checkpoints blocks 2, 5, 8, ... (off by one)": '''
def every_third(blocks, x):
    for index, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if (index + 1) % 3 == 0 else block(x)
    return x
''',
        "uses the reentrant checkpoint: block 0's input is data, so block 0 gets no gradient": '''
def every_third(blocks, x):
    for index, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=True) if index % 3 == 0 else block(x)
    return x
''',
        "checkpoints segments of three blocks": '''
def every_third(blocks, x):
    for start in range(0, len(blocks), 3):
        x = checkpoint(blocks[start:start + 3], x, use_reentrant=False)
    return x
''',
        "checkpoints every block": '''
def every_third(blocks, x):
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return x
''',
    },
}
