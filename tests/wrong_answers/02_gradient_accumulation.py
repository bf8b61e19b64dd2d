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
        "runs backward on the first micro-batch only": '''
def accumulate_weighted(model, micro_batches, class_weights):
    total_weight = sum(class_weights[labels[labels != IGNORE_INDEX]].sum() for _, labels in micro_batches)
    losses = [nn.functional.cross_entropy(model(inputs).flatten(0, -2), labels.flatten(), weight=class_weights,
                                          ignore_index=IGNORE_INDEX, reduction="sum") / total_weight
              for inputs, labels in micro_batches]
    losses[0].backward()
''',
        "drops the last micro-batch, as if it were an incomplete one": '''
def accumulate_weighted(model, micro_batches, class_weights):
    total_weight = sum(class_weights[labels[labels != IGNORE_INDEX]].sum() for _, labels in micro_batches)
    for inputs, labels in micro_batches[:-1]:
        summed = nn.functional.cross_entropy(model(inputs).flatten(0, -2), labels.flatten(), weight=class_weights,
                                             ignore_index=IGNORE_INDEX, reduction="sum")
        (summed / total_weight).backward()
''',
        "adds up the losses and runs one backward: every micro-batch's activations stay alive": '''
def accumulate_weighted(model, micro_batches, class_weights):
    total_weight = sum(class_weights[labels[labels != IGNORE_INDEX]].sum() for _, labels in micro_batches)
    total = 0
    for inputs, labels in micro_batches:
        total = total + nn.functional.cross_entropy(model(inputs).flatten(0, -2), labels.flatten(),
                                                    weight=class_weights, ignore_index=IGNORE_INDEX, reduction="sum")
    (total / total_weight).backward()
''',
        "passes 2-D labels unflattened: right only for one label per sample": '''
def accumulate_weighted(model, micro_batches, class_weights):
    total_weight = sum(class_weights[labels[labels != IGNORE_INDEX]].sum() for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        summed = nn.functional.cross_entropy(model(inputs), labels, weight=class_weights, reduction="sum")
        (summed / total_weight).backward()
''',
        "counts the padding's weight in the divisor (its -100 labels clamped to class 0)": '''
def accumulate_weighted(model, micro_batches, class_weights):
    total_weight = sum(class_weights[labels.clamp(min=0)].sum() for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        summed = nn.functional.cross_entropy(model(inputs).flatten(0, -2), labels.flatten(), weight=class_weights,
                                             ignore_index=IGNORE_INDEX, reduction="sum")
        (summed / total_weight).backward()
''',
        "divides each micro-batch by its own weight, then by the number of micro-batches": '''
def accumulate_weighted(model, micro_batches, class_weights):
    for inputs, labels in micro_batches:
        own_weight = class_weights[labels[labels != IGNORE_INDEX]].sum()
        summed = nn.functional.cross_entropy(model(inputs).flatten(0, -2), labels.flatten(), weight=class_weights,
                                             ignore_index=IGNORE_INDEX, reduction="sum")
        (summed / own_weight / len(micro_batches)).backward()
''',
        "takes one optimizer step of its own after accumulating": '''
def accumulate_weighted(model, micro_batches, class_weights):
    total_weight = sum(class_weights[labels[labels != IGNORE_INDEX]].sum() for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        summed = nn.functional.cross_entropy(model(inputs).flatten(0, -2), labels.flatten(), weight=class_weights,
                                             ignore_index=IGNORE_INDEX, reduction="sum")
        (summed / total_weight).backward()
    torch.optim.SGD(model.parameters(), lr=1e-3).step()
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
        "uses a LayerNorm over [C, H, W], which fixes the image size": '''
def replace_batchnorm(model):
    sizes = {}
    hooks = [m.register_forward_hook(lambda m, a, out: sizes.update({m: tuple(out.shape[1:])}))
             for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    model(torch.zeros(1, 3, 16, 16, device=next(model.parameters()).device))
    for hook in hooks:
        hook.remove()
    def swap(module):
        for name, child in module.named_children():
            if isinstance(child, nn.BatchNorm2d):
                setattr(module, name, nn.LayerNorm(list(sizes[child])).to(child.weight.device))
            else:
                swap(child)
    swap(model)
    return model
''',
        "hard-codes four groups, which needs a channel count divisible by 4": '''
def replace_batchnorm(model):
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(model, name, nn.GroupNorm(4, child.num_features).to(child.weight.device))
        else:
            replace_batchnorm(child)
    return model
''',
        "returns a deep copy: the optimizer's parameters are no longer the model's": '''
import copy

def replace_batchnorm(model):
    model = copy.deepcopy(model)
    def swap(module):
        for name, child in module.named_children():
            if isinstance(child, nn.BatchNorm2d):
                setattr(module, name, nn.GroupNorm(1, child.num_features).to(child.weight.device))
            else:
                swap(child)
    swap(model)
    return model
''',
        "replaces the BatchNorms of model.blocks only, where SmallConvNet keeps them": '''
def replace_batchnorm(model):
    for block in model.blocks:
        block[1] = nn.GroupNorm(1, block[1].num_features).to(block[1].weight.device)
    return model
''',
        "recurses only one level down": '''
def replace_batchnorm(model):
    for module in [model, *model.children()]:
        for name, child in module.named_children():
            if isinstance(child, nn.BatchNorm2d):
                setattr(module, name, nn.GroupNorm(1, child.num_features).to(child.weight.device))
    return model
''',
        "switches the model to eval mode so that BatchNorm uses its running statistics": '''
def replace_batchnorm(model):
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(model, name, nn.GroupNorm(1, child.num_features).to(child.weight.device))
        else:
            replace_batchnorm(child)
    return model.eval()
''',
        "re-initialises the convolutions while swapping": '''
def replace_batchnorm(model):
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(model, name, nn.GroupNorm(1, child.num_features).to(child.weight.device))
        elif isinstance(child, nn.Conv2d):
            child.reset_parameters()
        else:
            replace_batchnorm(child)
    return model
''',
    },
}
