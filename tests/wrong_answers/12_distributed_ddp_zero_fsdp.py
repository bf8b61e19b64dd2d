"""Wrong answers to notebook 12's exercises: each replaces the solution cell, and the graded cell must fail on it."""

_UPDATE = '''
def zero1_update(models, optimizers):
    for optimizer in optimizers:
        optimizer.step()
    with torch.no_grad():
        for rank, optimizer in enumerate(optimizers):
            owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
            for index, parameter in enumerate(models[rank].parameters()):
                if id(parameter) in owned:
                    for other in models:
                        list(other.parameters())[index].copy_(parameter)
'''

_BALANCED = '''
def zero1_optimizers(models):
    sizes = {name: p.numel() for name, p in models[0].named_parameters()}
    shares, loads = [[] for _ in models], [0] * len(models)
    for name in sorted(sizes, key=sizes.get, reverse=True):
        rank = loads.index(min(loads))
        shares[rank].append(name)
        loads[rank] += sizes[name]
    return [torch.optim.AdamW([dict(model.named_parameters())[n] for n in share], lr=LEARNING_RATE, foreach=False)
            for model, share in zip(models, shares)]
'''

WRONG = {
    "exercise_1": {
        "every rank's optimizer holds all the parameters (DDP's state, nothing sharded)": '''
def zero1_optimizers(models):
    return [torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, foreach=False) for model in models]
''' + _UPDATE,
        "shares by position (every other tensor: all the weights on rank 0), not balanced by size": '''
def zero1_optimizers(models):
    return [torch.optim.AdamW(list(model.parameters())[rank::len(models)], lr=LEARNING_RATE, foreach=False)
            for rank, model in enumerate(models)]
''' + _UPDATE,
        "no broadcast: each rank updates its share, the other replicas never see it": _BALANCED + '''
def zero1_update(models, optimizers):
    for optimizer in optimizers:
        optimizer.step()
''',
        "broadcasts before stepping (the other replicas get the weights from before the update)": _BALANCED + '''
def zero1_update(models, optimizers):
    with torch.no_grad():
        for rank, optimizer in enumerate(optimizers):
            owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
            for index, parameter in enumerate(models[rank].parameters()):
                if id(parameter) in owned:
                    for other in models:
                        list(other.parameters())[index].copy_(parameter)
    for optimizer in optimizers:
        optimizer.step()
''',
        "broadcasts everything from rank 0 (not each parameter from its owner): rank 1's updates are lost":
            _BALANCED + '''
def zero1_update(models, optimizers):
    for optimizer in optimizers:
        optimizer.step()
    with torch.no_grad():
        for source, *replicas in zip(*(model.parameters() for model in models)):
            for replica in replicas:
                replica.copy_(source)
''',
        "averages the replicas' weights after stepping (an all-reduce of weights, not a broadcast)": _BALANCED + '''
def zero1_update(models, optimizers):
    for optimizer in optimizers:
        optimizer.step()
    with torch.no_grad():
        for parameters in zip(*(model.parameters() for model in models)):
            average = sum(p.detach().clone() for p in parameters) / len(parameters)
            for parameter in parameters:
                parameter.copy_(average)
''',
        "the learning rate scaled by the number of ranks (the gradients are averaged already)": '''
def zero1_optimizers(models):
    sizes = {name: p.numel() for name, p in models[0].named_parameters()}
    shares, loads = [[] for _ in models], [0] * len(models)
    for name in sorted(sizes, key=sizes.get, reverse=True):
        rank = loads.index(min(loads))
        shares[rank].append(name)
        loads[rank] += sizes[name]
    return [torch.optim.AdamW([dict(model.named_parameters())[n] for n in share], lr=LEARNING_RATE * len(models),
                              foreach=False) for model, share in zip(models, shares)]
''' + _UPDATE,
        "round-robin over the names sorted alphabetically (every bias on rank 0, every weight on rank 1)": '''
def zero1_optimizers(models):
    names = sorted(name for name, _ in models[0].named_parameters())
    return [torch.optim.AdamW([dict(model.named_parameters())[n] for n in names[rank::len(models)]],
                              lr=LEARNING_RATE, foreach=False) for rank, model in enumerate(models)]
''' + _UPDATE,
        "shares contiguous runs of tensors (balanced only when every layer has the same shape)": '''
def zero1_optimizers(models):
    names = [name for name, _ in models[0].named_parameters()]
    per_rank = -(-len(names) // len(models))
    return [torch.optim.AdamW([dict(model.named_parameters())[n] for n in names[rank * per_rank:(rank + 1) * per_rank]],
                              lr=LEARNING_RATE, foreach=False) for rank, model in enumerate(models)]
''' + _UPDATE,
        "sorts by size, then deals the tensors round-robin (balanced only for equal pairs of shapes)": '''
def zero1_optimizers(models):
    sizes = {name: p.numel() for name, p in models[0].named_parameters()}
    order = sorted(sizes, key=sizes.get, reverse=True)
    return [torch.optim.AdamW([dict(model.named_parameters())[n] for n in order[rank::len(models)]], lr=LEARNING_RATE,
                              foreach=False) for rank, model in enumerate(models)]
''' + _UPDATE,
        "each owner sends its update to 'the other rank' only (right for two ranks)": _BALANCED + '''
def zero1_update(models, optimizers):
    for optimizer in optimizers:
        optimizer.step()
    with torch.no_grad():
        for rank, optimizer in enumerate(optimizers):
            owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
            for mine, theirs in zip(models[rank].parameters(), models[1 - rank].parameters()):
                if id(mine) in owned:
                    theirs.copy_(mine)
''',
        "broadcasts by rebinding .data: the replicas end up sharing the owner's tensors": _BALANCED + '''
def zero1_update(models, optimizers):
    for optimizer in optimizers:
        optimizer.step()
    for rank, optimizer in enumerate(optimizers):
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for mine, *replicas in zip(models[rank].parameters(), *(m.parameters() for m in models)):
            if id(mine) in owned:
                for replica in replicas:
                    replica.data = mine.data
''',
        "AdamW without weight decay (weight_decay=0: not the optimizer asked for)": '''
def zero1_optimizers(models):
    sizes = {name: p.numel() for name, p in models[0].named_parameters()}
    shares, loads = [[] for _ in models], [0] * len(models)
    for name in sorted(sizes, key=sizes.get, reverse=True):
        rank = loads.index(min(loads))
        shares[rank].append(name)
        loads[rank] += sizes[name]
    return [torch.optim.AdamW([dict(model.named_parameters())[n] for n in share], lr=LEARNING_RATE, weight_decay=0.0,
                              foreach=False) for model, share in zip(models, shares)]
''' + _UPDATE,
        "greedy to the least-loaded rank in the model's order, not largest first": '''
def zero1_optimizers(models):
    sizes = {name: p.numel() for name, p in models[0].named_parameters()}
    shares, loads = [[] for _ in models], [0] * len(models)
    for name in sizes:
        rank = loads.index(min(loads))
        shares[rank].append(name)
        loads[rank] += sizes[name]
    return [torch.optim.AdamW([dict(model.named_parameters())[n] for n in share], lr=LEARNING_RATE, foreach=False)
            for model, share in zip(models, shares)]

def zero1_update(models, optimizers):
    for optimizer in optimizers:
        optimizer.step()
    for rank, optimizer in enumerate(optimizers):
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for mine, *replicas in zip(models[rank].parameters(), *(m.parameters() for m in models)):
            if id(mine) in owned:
                for replica in replicas:
                    replica.data.copy_(mine.data)
''',
        'brings replicas up to date by rebinding .data to a clone (a new storage every step)': '''
def zero1_optimizers(models):
    sizes = {name: p.numel() for name, p in models[0].named_parameters()}
    shares, loads = [[] for _ in models], [0] * len(models)
    for name in sorted(sizes, key=sizes.get, reverse=True):
        rank = loads.index(min(loads))
        shares[rank].append(name)
        loads[rank] += sizes[name]
    return [torch.optim.AdamW([dict(model.named_parameters())[n] for n in share], lr=LEARNING_RATE, foreach=False)
            for model, share in zip(models, shares)]

def zero1_update(models, optimizers):
    for optimizer in optimizers:
        optimizer.step()
    for rank, optimizer in enumerate(optimizers):
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for mine, *replicas in zip(models[rank].parameters(), *(m.parameters() for m in models)):
            if id(mine) in owned:
                for replica in replicas:
                    replica.data = mine.data.clone()
''',
    },
    "exercise_2": {
        "broadcasts from the last rank (the replicas agree, on rank 1's initial weights)": '''
def broadcast_from_rank0(models):
    with torch.no_grad():
        for *replicas, source in zip(*(model.parameters() for model in models)):
            for replica in replicas:
                replica.copy_(source)
''',
        "copies the weights only, not the biases": '''
def broadcast_from_rank0(models):
    with torch.no_grad():
        for (name, source), *replicas in zip(*(model.named_parameters() for model in models)):
            if name.endswith("weight"):
                for _, replica in replicas:
                    replica.copy_(source)
''',
        "shares rank 0's tensors instead of copying them (replica.data = source.data)": '''
def broadcast_from_rank0(models):
    for source, *replicas in zip(*(model.parameters() for model in models)):
        for replica in replicas:
            replica.data = source.data
''',
        "averages the replicas (an all-reduce, not a broadcast)": '''
def broadcast_from_rank0(models):
    with torch.no_grad():
        for parameters in zip(*(model.parameters() for model in models)):
            average = sum(p.detach().clone() for p in parameters) / len(parameters)
            for parameter in parameters:
                parameter.copy_(average)
''',
        "copies without torch.no_grad (an in-place change of a leaf that requires grad)": '''
def broadcast_from_rank0(models):
    for source, *replicas in zip(*(model.parameters() for model in models)):
        for replica in replicas:
            replica.copy_(source)
''',
        "adds rank 0's weights to the replica's instead of copying them": '''
def broadcast_from_rank0(models):
    with torch.no_grad():
        for source, *replicas in zip(*(model.parameters() for model in models)):
            for replica in replicas:
                replica.add_(source)
''',
        "swaps the two replicas' weights (they still differ)": '''
def broadcast_from_rank0(models):
    with torch.no_grad():
        for first, second in zip(models[0].parameters(), models[1].parameters()):
            kept = first.detach().clone()
            first.copy_(second)
            second.copy_(kept)
''',
        "stops after the first tensor (a return inside the loop)": '''
def broadcast_from_rank0(models):
    with torch.no_grad():
        for source, *replicas in zip(*(model.parameters() for model in models)):
            for replica in replicas:
                replica.copy_(source)
            return
''',
        "copies the parameters only: BatchNorm's running statistics stay each rank's own": '''
def broadcast_from_rank0(models):
    with torch.no_grad():
        for source, *replicas in zip(*(model.parameters() for model in models)):
            for replica in replicas:
                replica.copy_(source)
''',
        "copies rank 0's tensors into models[1] only (right for two ranks)": '''
def broadcast_from_rank0(models):
    with torch.no_grad():
        for source, replica in zip(models[0].state_dict().values(), models[1].state_dict().values()):
            replica.copy_(source)
''',
        "replaces every replica by a deep copy of rank 0's model (new tensors, not copied into in place)": '''
def broadcast_from_rank0(models):
    import copy
    models[1:] = [copy.deepcopy(models[0]) for _ in models[1:]]
''',
        "copies the floating-point tensors only: BatchNorm's batch counter stays each rank's own": '''
def broadcast_from_rank0(models):
    with torch.no_grad():
        for source, *replicas in zip(*(model.state_dict().values() for model in models)):
            if source.is_floating_point():
                for replica in replicas:
                    replica.copy_(source)
''',
        'copies with requires_grad switched off, then switches it on for every parameter (a frozen one trains)': '''
def broadcast_from_rank0(models):
    for kind in (nn.Module.parameters, nn.Module.buffers):
        for source, *replicas in zip(*(kind(model) for model in models)):
            for replica in replicas:
                replica.requires_grad_(False)
                replica.copy_(source.detach())
                if kind is nn.Module.parameters:
                    replica.requires_grad_(True)
''',
    },
}
