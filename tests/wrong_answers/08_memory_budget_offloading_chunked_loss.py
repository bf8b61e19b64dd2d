"""Wrong answers to notebook 08's exercises: the mistakes learners make (format: tests/wrong_answers/README.md)."""

WRONG = {
    "exercise_1": {
        "copies section 1's bf16 hooks: half the bytes, not a quarter": '''
def fp8_hooks(model):
    weights = {p.data_ptr() for p in model.parameters()}

    def pack(tensor):
        if tensor.dtype == torch.float32 and tensor.requires_grad and tensor.data_ptr() not in weights:
            return tensor.to(torch.bfloat16), torch.float32
        return tensor, None

    def unpack(packed):
        tensor, dtype = packed
        return tensor if dtype is None else tensor.to(dtype)
    return pack, unpack
''',
        "converts to float8 without a scale: small activations flush to zero": '''
def fp8_hooks(model):
    weights = {p.data_ptr() for p in model.parameters()}

    def pack(tensor):
        if tensor.dtype == torch.float32 and tensor.requires_grad and tensor.data_ptr() not in weights:
            return tensor.to(torch.float8_e4m3fn), torch.float32
        return tensor, None

    def unpack(packed):
        tensor, dtype = packed
        return tensor if dtype is None else tensor.to(dtype)
    return pack, unpack
''',
        "scales in pack but forgets to multiply the scale back in unpack": '''
def fp8_hooks(model):
    weights = {p.data_ptr() for p in model.parameters()}

    def pack(tensor):
        if tensor.dtype == torch.float32 and tensor.requires_grad and tensor.data_ptr() not in weights:
            scale = tensor.abs().amax() / 448
            return (tensor / scale).to(torch.float8_e4m3fn), scale
        return tensor, None

    def unpack(packed):
        tensor, scale = packed
        return tensor if scale is None else tensor.float()
    return pack, unpack
''',
        "converts the weights too: their float8 copies add bytes": '''
def fp8_hooks(model):
    def pack(tensor):
        if tensor.dtype == torch.float32 and tensor.requires_grad:
            scale = tensor.abs().amax() / 448
            return (tensor / scale).to(torch.float8_e4m3fn), scale
        return tensor, None

    def unpack(packed):
        tensor, scale = packed
        return tensor if scale is None else tensor.float() * scale
    return pack, unpack
''',
    },
    "exercise_2": {
        "keeps the recipe's backward: the gradient of the unsmoothed loss": '''
class ChunkedSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, eps):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk_size, ctx.eps = chunk_size, eps
        return sum(F.cross_entropy(F.linear(h, weight).float(), t, reduction="sum", label_smoothing=eps)
                   for h, t in zip(hidden.split(chunk_size), targets.split(chunk_size))) / len(targets)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight, dtype=torch.float32)
        for start in range(0, len(targets), ctx.chunk_size):
            h, t = hidden[start:start + ctx.chunk_size], targets[start:start + ctx.chunk_size]
            probs = F.linear(h, weight).float().softmax(dim=-1)
            probs[torch.arange(len(t)), t] -= 1
            probs *= grad_loss / len(targets)
            grad_hidden[start:start + len(t)] = probs.to(weight.dtype) @ weight
            grad_weight.addmm_(probs.T, h.float())
            del probs
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None
''',
        "spreads eps, not eps / V, over every token": '''
class ChunkedSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, eps):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk_size, ctx.eps = chunk_size, eps
        return sum(F.cross_entropy(F.linear(h, weight).float(), t, reduction="sum", label_smoothing=eps)
                   for h, t in zip(hidden.split(chunk_size), targets.split(chunk_size))) / len(targets)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight, dtype=torch.float32)
        for start in range(0, len(targets), ctx.chunk_size):
            h, t = hidden[start:start + ctx.chunk_size], targets[start:start + ctx.chunk_size]
            probs = F.linear(h, weight).float().softmax(dim=-1)
            probs[torch.arange(len(t)), t] -= 1 - ctx.eps
            probs.sub_(ctx.eps).mul_(grad_loss / len(targets))
            grad_hidden[start:start + len(t)] = probs.to(weight.dtype) @ weight
            grad_weight.addmm_(probs.T, h.float())
            del probs
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None
''',
        "smooths the gradient but forgets label_smoothing in the forward's loss": '''
class ChunkedSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, eps):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk_size, ctx.eps = chunk_size, eps
        return sum(F.cross_entropy(F.linear(h, weight).float(), t, reduction="sum")
                   for h, t in zip(hidden.split(chunk_size), targets.split(chunk_size))) / len(targets)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight, dtype=torch.float32)
        for start in range(0, len(targets), ctx.chunk_size):
            h, t = hidden[start:start + ctx.chunk_size], targets[start:start + ctx.chunk_size]
            probs = F.linear(h, weight).float().softmax(dim=-1)
            probs[torch.arange(len(t)), t] -= 1 - ctx.eps
            probs.sub_(ctx.eps / weight.shape[0]).mul_(grad_loss / len(targets))
            grad_hidden[start:start + len(t)] = probs.to(weight.dtype) @ weight
            grad_weight.addmm_(probs.T, h.float())
            del probs
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None
''',
        "right values, but the forward computes all the logits at once": '''
class ChunkedSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, eps):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk_size, ctx.eps = chunk_size, eps
        return F.cross_entropy(F.linear(hidden, weight).float(), targets, label_smoothing=eps)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight, dtype=torch.float32)
        for start in range(0, len(targets), ctx.chunk_size):
            h, t = hidden[start:start + ctx.chunk_size], targets[start:start + ctx.chunk_size]
            probs = F.linear(h, weight).float().softmax(dim=-1)
            probs[torch.arange(len(t)), t] -= 1 - ctx.eps
            probs.sub_(ctx.eps / weight.shape[0]).mul_(grad_loss / len(targets))
            grad_hidden[start:start + len(t)] = probs.to(weight.dtype) @ weight
            grad_weight.addmm_(probs.T, h.float())
            del probs
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None
''',
        "keeps the previous chunk's probabilities alive while the next one is computed (no del)": '''
class ChunkedSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, eps):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk_size, ctx.eps = chunk_size, eps
        return sum(F.cross_entropy(F.linear(h, weight).float(), t, reduction="sum", label_smoothing=eps)
                   for h, t in zip(hidden.split(chunk_size), targets.split(chunk_size))) / len(targets)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight, dtype=torch.float32)
        for start in range(0, len(targets), ctx.chunk_size):
            h, t = hidden[start:start + ctx.chunk_size], targets[start:start + ctx.chunk_size]
            probs = F.linear(h, weight).float().softmax(dim=-1)
            probs[torch.arange(len(t)), t] -= 1 - ctx.eps
            probs.sub_(ctx.eps / weight.shape[0]).mul_(grad_loss / len(targets))
            grad_hidden[start:start + len(t)] = probs.to(weight.dtype) @ weight
            grad_weight.addmm_(probs.T, h.float())
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None
''',
    },
}
