"""Wrong answers to notebook 01's exercises: each must fail its graded cell (tests/wrong_answers/README.md)."""

WRONG = {
    "exercise_1": {
        "gives the frozen embedding a gradient and a momentum buffer too": '''
def predict_state_bytes(model):
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights, weights, weights
''',
        "assumes 4 bytes per element, whatever the dtype": '''
def predict_state_bytes(model):
    weights = sum(4 * p.numel() for p in model.parameters())
    trainable = sum(4 * p.numel() for p in model.parameters() if p.requires_grad)
    return weights, trainable, trainable
''',
        "counts only the trainable weights": '''
def predict_state_bytes(model):
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return trainable, trainable, trainable
''',
        "gives SGD with momentum Adam's two buffers": '''
def predict_state_bytes(model):
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return weights, trainable, 2 * trainable
''',
        "counts the weight matrices and forgets the biases and the LayerNorm": '''
def predict_state_bytes(model):
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2 and p.requires_grad)
    return weights, trainable, trainable
''',
        "keeps the momentum in fp32 whatever the parameters' dtype": '''
def predict_state_bytes(model):
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    return weights, sum(p.numel() * p.element_size() for p in trainable), sum(p.numel() * 4 for p in trainable)
''',
        "counts each module's weight, so a tied head counts twice": '''
def predict_state_bytes(model):
    tensors = [t for m in model.modules() for t in (getattr(m, "weight", None), getattr(m, "bias", None))
               if isinstance(t, torch.nn.Parameter)]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    trainable = sum(t.numel() * t.element_size() for t in tensors if t.requires_grad)
    return weights, trainable, trainable
''',
        "takes the embedding for the frozen part by its type, not by requires_grad": '''
def predict_state_bytes(model):
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for m in model.modules() if not isinstance(m, nn.Embedding)
                    for p in m.parameters(recurse=False))
    return weights, trainable, trainable
''',
        "freezes a module whole when any of its parameters is frozen": '''
def predict_state_bytes(model):
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for m in model.modules() if not list(m.children())
                    and all(q.requires_grad for q in m.parameters()) for p in m.parameters())
    return weights, trainable, trainable
''',
        "calls requires_grad_(False) on the frozen parts again, as if to be sure": '''
def predict_state_bytes(model):
    for p in model.parameters():
        p.requires_grad_(p.requires_grad and p.dim() > 0 and p.numel() > 0 and not isinstance(p, int) and p.requires_grad)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    model[0].requires_grad_(False)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return weights, trainable, trainable
''',
        "takes every parameter's element size from the first parameter's dtype": '''
def predict_state_bytes(model):
    element = next(model.parameters()).element_size()
    weights = sum(p.numel() for p in model.parameters()) * element
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) * element
    return weights, trainable, trainable
''',
        "switches the model to eval mode to count it, and leaves it there": '''
def predict_state_bytes(model):
    model.eval()                                   # counting, not training
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return weights, trainable, trainable
''',
    },
    "exercise_2": {
        "forgets the step counters": '''
def predict_adamw_state_bytes(model, amsgrad):
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum((3 if amsgrad else 2) * p.numel() * p.element_size() for p in trainable)
''',
        "assumes fp32 state whatever the parameters' dtype": '''
def predict_adamw_state_bytes(model, amsgrad):
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum((3 if amsgrad else 2) * p.numel() * 4 for p in trainable) + 4 * len(trainable)
''',
        "counts the frozen parameters too": '''
def predict_adamw_state_bytes(model, amsgrad):
    params = list(model.parameters())
    return sum((3 if amsgrad else 2) * p.numel() * p.element_size() for p in params) + 4 * len(params)
''',
        "counts the tied weight twice, once per name in the state_dict": '''
def predict_adamw_state_bytes(model, amsgrad):
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    tensors = [t for name, t in model.state_dict(keep_vars=True).items() if id(t) not in frozen]
    return sum((3 if amsgrad else 2) * t.numel() * t.element_size() for t in tensors) + 4 * len(tensors)
''',
        "forgets AMSGrad's third buffer": '''
def predict_adamw_state_bytes(model, amsgrad):
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum(2 * p.numel() * p.element_size() for p in trainable) + 4 * len(trainable)
''',
        "counts a step counter per element instead of per tensor": '''
def predict_adamw_state_bytes(model, amsgrad):
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum((3 if amsgrad else 2) * p.numel() * p.element_size() + 4 * p.numel() for p in trainable)
''',
        "stores the step counter in the parameter's dtype": '''
def predict_adamw_state_bytes(model, amsgrad):
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum(((3 if amsgrad else 2) * p.numel() + 1) * p.element_size() for p in trainable)
''',
        "adds the weights to the optimizer's state": '''
def predict_adamw_state_bytes(model, amsgrad):
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum((4 if amsgrad else 3) * p.numel() * p.element_size() for p in trainable) + 4 * len(trainable)
''',
        "takes the LayerNorm for the frozen part by its type, not by requires_grad": '''
def predict_adamw_state_bytes(model, amsgrad):
    trainable = [p for m in model.modules() if not isinstance(m, nn.LayerNorm) for p in m.parameters(recurse=False)]
    return sum((3 if amsgrad else 2) * p.numel() * p.element_size() for p in trainable) + 4 * len(trainable)
''',
        "counts a step counter per module, not per parameter tensor": '''
def predict_adamw_state_bytes(model, amsgrad):
    trainable = [p for p in model.parameters() if p.requires_grad]
    modules = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    return sum((3 if amsgrad else 2) * p.numel() * p.element_size() for p in trainable) + 4 * len(modules)
''',
        "takes a step counter's size from the dtype, 8 bytes in fp64": '''
def predict_adamw_state_bytes(model, amsgrad):
    trainable = [p for p in model.parameters() if p.requires_grad]
    counter = 8 if trainable and trainable[0].dtype == torch.float64 else 4
    return sum((3 if amsgrad else 2) * p.numel() * p.element_size() for p in trainable) + counter * len(trainable)
''',
        "takes every parameter's element size from the first parameter's dtype": '''
def predict_adamw_state_bytes(model, amsgrad):
    element = next(model.parameters()).element_size()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum((3 if amsgrad else 2) * p.numel() * element for p in trainable) + 4 * len(trainable)
''',
        "steps a throwaway AdamW on zero gradients and reads its state (the weight decay moves the weights)": '''
def predict_adamw_state_bytes(model, amsgrad):
    trainable = [p for p in model.parameters() if p.requires_grad]
    probe = torch.optim.AdamW(trainable, amsgrad=amsgrad)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    probe.step()
    total = sum(s.numel() * s.element_size() for state in probe.state.values() for s in state.values())
    for p in trainable:
        p.grad = None
    return total
''',
    },
}
