"""Wrong answers to notebook 08's exercises: the mistakes learners make (format: tests/wrong_answers/README.md).

Each wrong answer is the solution with one mistake, written out by replacing one piece of the right code, so
that the mistake named in its key is the only thing wrong with it.
"""

_FP8 = '''
def fp8_hooks(model):
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        if (tensor.dtype == torch.float32 and tensor.requires_grad
                and tensor.untyped_storage().data_ptr() not in weights):
            scale = tensor.abs().amax() / 448
            return (tensor / scale).to(torch.float8_e4m3fn), scale
        return tensor, None

    def unpack(packed):
        tensor, scale = packed
        return tensor if scale is None else tensor.float() * scale
    return pack, unpack
'''


def _fp8(old: str, new: str) -> str:
    assert old in _FP8, old
    return _FP8.replace(old, new)


_SMOOTH = '''
class ChunkedSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, eps):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk_size, ctx.eps, ctx.count = chunk_size, eps, (targets != -100).sum()
        return sum(F.cross_entropy(F.linear(h, weight).float(), t, reduction="sum", label_smoothing=eps)
                   for h, t in zip(hidden.split(chunk_size), targets.split(chunk_size))) / ctx.count

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight, dtype=torch.float32)
        for start in range(0, len(targets), ctx.chunk_size):
            h, t = hidden[start:start + ctx.chunk_size], targets[start:start + ctx.chunk_size]
            probs, real = F.linear(h, weight).float().softmax(dim=-1), t != -100
            probs[real, t[real]] -= 1 - ctx.eps
            probs.sub_(ctx.eps / weight.shape[0]).mul_(real[:, None] * (grad_loss / ctx.count))
            grad_hidden[start:start + len(t)] = probs.to(weight.dtype) @ weight
            grad_weight.addmm_(probs.T, h.float())
            del probs, real
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None
'''


def _smooth(*pairs: str) -> str:
    source = _SMOOTH
    for old, new in zip(pairs[::2], pairs[1::2]):
        assert old in source, old
        source = source.replace(old, new)
    return source


WRONG = {
    "exercise_1": {
        "copies section 1's bf16 hooks: half the bytes, not a quarter": _fp8(
            "            scale = tensor.abs().amax() / 448\n            return (tensor / scale).to(torch.float8_e4m3fn), scale",
            "            return tensor.to(torch.bfloat16), torch.float32").replace(
            "return tensor if scale is None else tensor.float() * scale",
            "return tensor if scale is None else tensor.to(scale)"),
        "converts to float8 without a scale: small activations flush to zero": _fp8(
            "            return (tensor / scale).to(torch.float8_e4m3fn), scale",
            "            return tensor.to(torch.float8_e4m3fn), torch.ones((), dtype=torch.float32)"),
        "scales in pack but forgets to multiply the scale back in unpack": _fp8(
            "tensor.float() * scale", "tensor.float()"),
        "converts the weights too: their float8 copies add bytes": _fp8(
            "        if (tensor.dtype == torch.float32 and tensor.requires_grad\n"
            "                and tensor.untyped_storage().data_ptr() not in weights):",
            "        if tensor.dtype == torch.float32 and tensor.requires_grad:"),
        "e5m2 instead of e4m3 (scaled to its own largest value, 57344): one mantissa bit fewer": _fp8(
            "            scale = tensor.abs().amax() / 448\n            return (tensor / scale).to(torch.float8_e4m3fn), scale",
            "            scale = tensor.abs().amax() / 57344\n            return (tensor / scale).to(torch.float8_e5m2), scale"),
        "recognises weights by data_ptr(): a slice of a fused weight is packed": _fp8(
            "weights = {p.untyped_storage().data_ptr() for p in model.parameters()}",
            "weights = {p.data_ptr() for p in model.parameters()}").replace(
            "and tensor.untyped_storage().data_ptr() not in weights", "and tensor.data_ptr() not in weights"),
        "keeps the scale as a Python number (.item()): no 4-byte tensor, and a GPU waits at every save": _fp8(
            "scale = tensor.abs().amax() / 448", "scale = tensor.abs().amax().item() / 448"),
        "scales to 1, not to 448: the small elements fall below e4m3's normal range": _fp8(
            "scale = tensor.abs().amax() / 448", "scale = tensor.abs().amax()"),
        "packs the input batch too (no requires_grad test)": _fp8(
            "        if (tensor.dtype == torch.float32 and tensor.requires_grad\n",
            "        if (tensor.dtype == torch.float32\n"),
    },
    "exercise_2": {
        "keeps the recipe's backward: the gradient of the unsmoothed loss": _smooth(
            "probs[real, t[real]] -= 1 - ctx.eps", "probs[real, t[real]] -= 1",
            "probs.sub_(ctx.eps / weight.shape[0]).mul_(", "probs.mul_("),
        "spreads eps, not eps / V, over every token": _smooth(
            "probs.sub_(ctx.eps / weight.shape[0])", "probs.sub_(ctx.eps)"),
        "smooths the gradient but forgets label_smoothing in the forward's loss": _smooth(
            ', reduction="sum", label_smoothing=eps)', ', reduction="sum")'),
        "right values, but the forward computes all the logits at once": _smooth(
            '''        return sum(F.cross_entropy(F.linear(h, weight).float(), t, reduction="sum", label_smoothing=eps)
                   for h, t in zip(hidden.split(chunk_size), targets.split(chunk_size))) / ctx.count''',
            '''        return F.cross_entropy(F.linear(hidden, weight).float(), targets, label_smoothing=eps)'''),
        "keeps the previous chunk's probabilities alive while the next one is computed (no del)": _smooth(
            "            del probs, real\n", ""),
        "the mean over all N tokens: the padding is counted": _smooth(
            "ctx.count = chunk_size, eps, (targets != -100).sum()", "ctx.count = chunk_size, eps, len(targets)"),
        "indexes the target column with -100 itself: the padding's rows get a wrong gradient": _smooth(
            "probs[real, t[real]] -= 1 - ctx.eps", "probs[torch.arange(len(t)), t.clamp(min=0)] -= 1 - ctx.eps",
            "mul_(real[:, None] * (grad_loss / ctx.count))", "mul_(grad_loss / ctx.count)"),
        "assumes the chunk size divides N: reshapes into whole chunks": _smooth(
            "        for start in range(0, len(targets), ctx.chunk_size):\n"
            "            h, t = hidden[start:start + ctx.chunk_size], targets[start:start + ctx.chunk_size]\n",
            "        for index, (h, t) in enumerate(zip(hidden.view(-1, ctx.chunk_size, hidden.shape[1]),\n"
            "                                           targets.view(-1, ctx.chunk_size))):\n"
            "            start = index * ctx.chunk_size\n"),
        "smooths towards eps / V but applies it to the padding's rows too (no mask on the gradient)": _smooth(
            "mul_(real[:, None] * (grad_loss / ctx.count))", "mul_(grad_loss / ctx.count)"),
    },
}
