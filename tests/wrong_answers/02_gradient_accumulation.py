"""Wrong answers to notebook 02's exercises: each must fail its graded cell (tests/wrong_answers/README.md)."""

WRONG = {
    "exercise_1": {
        "divides each micro-batch's mean by the number of micro-batches (biased when they differ in size)": '''
def accumulate(model, micro_batches):
    for x, y in micro_batches:
        (nn.functional.cross_entropy(model(x), y) / len(micro_batches)).backward()
''',
        "forgets to divide": '''
def accumulate(model, micro_batches):
    for x, y in micro_batches:
        nn.functional.cross_entropy(model(x), y).backward()
''',
        "sums the losses but divides by the number of micro-batches": '''
def accumulate(model, micro_batches):
    for x, y in micro_batches:
        (nn.functional.cross_entropy(model(x), y, reduction="sum") / len(micro_batches)).backward()
''',
        "zeroes the gradients between micro-batches": '''
def accumulate(model, micro_batches):
    total = sum(len(y) for _, y in micro_batches)
    for x, y in micro_batches:
        model.zero_grad(set_to_none=True)
        (nn.functional.cross_entropy(model(x), y, reduction="sum") / total).backward()
''',
    },
    "exercise_2": {
        "removes the normalisation instead of replacing it": '''
def replace_batchnorm(model):
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(model, name, nn.Identity())
        else:
            replace_batchnorm(child)
    return model
''',
        "puts BatchNorm in eval mode (running statistics) and keeps it": '''
def replace_batchnorm(model):
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.eval()
    return model
''',
        "keeps BatchNorm without running statistics: it still normalises over the batch": '''
def replace_batchnorm(model):
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(model, name, nn.BatchNorm2d(child.num_features, track_running_stats=False).to(child.weight.device))
        else:
            replace_batchnorm(child)
    return model
''',
        "builds a fresh net without BatchNorm, losing the trained convolutions": '''
def replace_batchnorm(model):
    return utils.SmallConvNet(3, NUM_CLASSES, width=8, num_blocks=2, batchnorm=False)
''',
        "replaces only the BatchNorms directly under the model (they sit inside blocks)": '''
def replace_batchnorm(model):
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(model, name, nn.GroupNorm(2, child.num_features))
    return model
''',
    },
}
