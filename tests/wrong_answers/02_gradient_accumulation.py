"""Wrong answers to notebook 02's exercises: each must fail its graded cell (tests/wrong_answers/README.md)."""

WRONG = {
    "exercise_1": {
        "divides each micro-batch's weighted mean by the number of micro-batches": '''
def accumulate_weighted(model, micro_batches, class_weights):
    for inputs, labels in micro_batches:
        (nn.functional.cross_entropy(model(inputs), labels, weight=class_weights) / len(micro_batches)).backward()
''',
        "weights each piece's weighted mean by its share of the samples, not of the weights": '''
def accumulate_weighted(model, micro_batches, class_weights):
    total = sum(len(labels) for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        (nn.functional.cross_entropy(model(inputs), labels, weight=class_weights) * len(labels) / total).backward()
''',
        "divides the weighted sum by the number of samples": '''
def accumulate_weighted(model, micro_batches, class_weights):
    total = sum(len(labels) for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        (nn.functional.cross_entropy(model(inputs), labels, weight=class_weights, reduction="sum") / total).backward()
''',
        "divides by the sum of the class weights, not of the samples' weights": '''
def accumulate_weighted(model, micro_batches, class_weights):
    for inputs, labels in micro_batches:
        summed = nn.functional.cross_entropy(model(inputs), labels, weight=class_weights, reduction="sum")
        (summed / class_weights.sum()).backward()
''',
        "forgets the class weights: the plain mean over samples": '''
def accumulate_weighted(model, micro_batches, class_weights):
    total = sum(len(labels) for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        (nn.functional.cross_entropy(model(inputs), labels, reduction="sum") / total).backward()
''',
        "forgets to divide: the weighted sums add up": '''
def accumulate_weighted(model, micro_batches, class_weights):
    for inputs, labels in micro_batches:
        nn.functional.cross_entropy(model(inputs), labels, weight=class_weights, reduction="sum").backward()
''',
        "zeroes the gradients before each micro-batch, so only the last one counts": '''
def accumulate_weighted(model, micro_batches, class_weights):
    total_weight = sum(class_weights[labels].sum() for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        model.zero_grad()
        summed = nn.functional.cross_entropy(model(inputs), labels, weight=class_weights, reduction="sum")
        (summed / total_weight).backward()
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
        "forgets to return the model": '''
def replace_batchnorm(model):
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(model, name, nn.GroupNorm(2, child.num_features))
        else:
            replace_batchnorm(child)
''',
    },
}
