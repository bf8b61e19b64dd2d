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
    },
    "exercise_2": {
        "forgets the step counters": '''
def predict_adamw_state_bytes(model):
    return sum(2 * p.numel() * 4 for p in model.parameters() if p.requires_grad)
''',
        "counts a step counter per element instead of per tensor": '''
def predict_adamw_state_bytes(model):
    return sum(3 * p.numel() * 4 for p in model.parameters() if p.requires_grad)
''',
        "adds the weights to the optimizer's state": '''
def predict_adamw_state_bytes(model):
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum(3 * p.numel() * 4 for p in trainable) + 4 * len(trainable)
''',
        "counts one moment, as SGD with momentum would": '''
def predict_adamw_state_bytes(model):
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() * 4 for p in trainable) + 4 * len(trainable)
''',
    },
}
