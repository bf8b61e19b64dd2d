"""Wrong answers to notebook 08's exercises: the mistakes learners make (format: tests/wrong_answers/README.md).

Each wrong answer is the solution with one mistake, written out by replacing one piece of the right code, so
that the mistake named in its key is the only thing wrong with it.
"""

_ONCE = '''
def bf16_once_hooks(model):
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    copies = torch.utils.weak.WeakTensorKeyDictionary()

    def pack(tensor):
        if (tensor.dtype == torch.float32 and tensor.requires_grad
                and tensor.untyped_storage().data_ptr() not in weights):
            base = tensor if tensor._base is None else tensor._base
            if base not in copies:
                copies[base] = base.to(torch.bfloat16)
            offset = tensor.storage_offset() - base.storage_offset()
            return copies[base].as_strided(tensor.shape, tensor.stride(), offset), torch.float32
        return tensor, None

    def unpack(packed):
        tensor, dtype = packed
        return tensor if dtype is None else tensor.to(dtype)
    return pack, unpack
'''

_VOCAB = '''
class VocabChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size):
        lse = torch.stack([F.linear(hidden, rows).float().logsumexp(dim=-1)
                           for rows in weight.split(chunk_size)]).logsumexp(dim=0)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size, ctx.count = chunk_size, (targets != -100).sum()
        picked = (hidden.float() * weight[targets.clamp(min=0)].float()).sum(dim=-1)
        return ((lse - picked) * (targets != -100)).sum() / ctx.count

    @staticmethod
    def backward(ctx, grad_loss):
        (hidden, weight, targets, lse), size = ctx.saved_tensors, ctx.chunk_size
        scale = ((targets != -100) * (grad_loss / ctx.count))[:, None]
        grad_hidden, grad_weight = torch.zeros(hidden.shape, device=hidden.device), torch.empty_like(weight)
        for start, rows, grad_rows in zip(range(0, len(weight), size), weight.split(size), grad_weight.split(size)):
            probs = (F.linear(hidden, rows).float() - lse[:, None]).exp_().mul_(scale)
            inside = (targets >= start) & (targets < start + len(rows))
            probs[inside, targets[inside] - start] -= scale[inside, 0]
            grad_hidden.addmm_(probs, rows.float())
            grad_rows.copy_(probs.T @ hidden.float())
        return grad_hidden.to(hidden.dtype), grad_weight, None, None
'''


def _edit(source: str, *pairs: str) -> str:
    for old, new in zip(pairs[::2], pairs[1::2]):
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return source


def _once(*pairs: str) -> str:
    return _edit(_ONCE, *pairs)


def _vocab(*pairs: str) -> str:
    return _edit(_VOCAB, *pairs)


WRONG = {
    "exercise_1": {
        "section 1's recipe unchanged: a tensor saved twice is copied twice": _once(
            "            if base not in copies:\n                copies[base] = base.to(torch.bfloat16)\n", "",
            "            return copies[base].as_strided(", "            return base.to(torch.bfloat16).as_strided("),
        "a plain dict keyed by data_ptr(): every copy stays alive after backward (and a dead tensor's memory can be "
        "handed a stale copy)": _once(
            "    copies = torch.utils.weak.WeakTensorKeyDictionary()", "    copies = {}",
            "            base = tensor if tensor._base is None else tensor._base\n",
            "            base = tensor if tensor._base is None else tensor._base\n            key = base.data_ptr()\n",
            "            if base not in copies:\n                copies[base] = base.to(torch.bfloat16)",
            "            if key not in copies:\n                copies[key] = base.to(torch.bfloat16)",
            "            return copies[base].as_strided(", "            return copies[key].as_strided("),
        "a plain dict keyed by id(tensor): it never forgets, so the copies outlive backward": _once(
            "    copies = torch.utils.weak.WeakTensorKeyDictionary()", "    copies = {}",
            "            if base not in copies:\n                copies[base] = base.to(torch.bfloat16)",
            "            if id(base) not in copies:\n                copies[id(base)] = base.to(torch.bfloat16)",
            "            return copies[base].as_strided(", "            return copies[id(base)].as_strided("),
        "keys the copies by the tensor, not its base: the (B·T, C) views a Linear saves are copied again": _once(
            "            base = tensor if tensor._base is None else tensor._base",
            "            base = tensor"),
        "recognises weights by data_ptr(): a slice of a fused weight is copied": _once(
            "    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}",
            "    weights = {p.data_ptr() for p in model.parameters()}",
            "                and tensor.untyped_storage().data_ptr() not in weights):",
            "                and tensor.data_ptr() not in weights):"),
        "packs the input batch too (no requires_grad test)": _once(
            "        if (tensor.dtype == torch.float32 and tensor.requires_grad\n",
            "        if (tensor.dtype == torch.float32\n"),
        "returns the float32 tensor itself for a later save instead of the shared copy": _once(
            "            if base not in copies:\n                copies[base] = base.to(torch.bfloat16)\n",
            "            if base in copies:\n                return tensor, None\n"
            "            copies[base] = base.to(torch.bfloat16)\n"),
        "unpack hands back the bf16 copy without converting it to float32": _once(
            "        return tensor if dtype is None else tensor.to(dtype)", "        return tensor"),
        "keys the copies by tensor.untyped_storage(), a new object at every call: nothing is shared": _once(
            "    copies = torch.utils.weak.WeakTensorKeyDictionary()", "    copies = {}",
            "            if base not in copies:\n                copies[base] = base.to(torch.bfloat16)",
            "            storage = base.untyped_storage()\n            if storage not in copies:\n"
            "                copies[storage] = base.to(torch.bfloat16)",
            "            return copies[base].as_strided(", "            return copies[storage].as_strided("),
        "rebuilds a view with view(tensor.shape): right for a Linear's flattening, wrong for a slice or a transpose": '''
def bf16_once_hooks(model):
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    copies = torch.utils.weak.WeakTensorKeyDictionary()

    def pack(tensor):
        if (tensor.dtype == torch.float32 and tensor.requires_grad
                and tensor.untyped_storage().data_ptr() not in weights):
            base = tensor if tensor._base is None else tensor._base
            if base not in copies:
                copies[base] = base.to(torch.bfloat16)
            offset = tensor.storage_offset() - base.storage_offset()
            return copies[base].view(tensor.shape), torch.float32
        return tensor, None

    def unpack(packed):
        tensor, dtype = packed
        return tensor if dtype is None else tensor.to(dtype)
    return pack, unpack
''',
        "as_strided without the view's offset into its base": '''
def bf16_once_hooks(model):
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    copies = torch.utils.weak.WeakTensorKeyDictionary()

    def pack(tensor):
        if (tensor.dtype == torch.float32 and tensor.requires_grad
                and tensor.untyped_storage().data_ptr() not in weights):
            base = tensor if tensor._base is None else tensor._base
            if base not in copies:
                copies[base] = base.to(torch.bfloat16)
            offset = tensor.storage_offset() - base.storage_offset()
            return copies[base].as_strided(tensor.shape, tensor.stride()), torch.float32
        return tensor, None

    def unpack(packed):
        tensor, dtype = packed
        return tensor if dtype is None else tensor.to(dtype)
    return pack, unpack
''',
        "unpack turns every saved tensor into float32, integer indices and bf16 tensors included": '''
def bf16_once_hooks(model):
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    copies = torch.utils.weak.WeakTensorKeyDictionary()

    def pack(tensor):
        if (tensor.dtype == torch.float32 and tensor.requires_grad
                and tensor.untyped_storage().data_ptr() not in weights):
            base = tensor if tensor._base is None else tensor._base
            if base not in copies:
                copies[base] = base.to(torch.bfloat16)
            offset = tensor.storage_offset() - base.storage_offset()
            return copies[base].as_strided(tensor.shape, tensor.stride(), offset), torch.float32
        return tensor, None

    def unpack(packed):
        tensor, dtype = packed
        return tensor.float()
    return pack, unpack
''',
    },
    "exercise_2": {
        "the log-sum-exp of each chunk summed, not log-sum-exp'd: lse of the whole vocabulary is wrong": _vocab(
            "for rows in weight.split(chunk_size)]).logsumexp(dim=0)", "for rows in weight.split(chunk_size)]).sum(dim=0)"),
        "the mean over every token, padding included": _vocab(
            "ctx.chunk_size, ctx.count = chunk_size, (targets != -100).sum()",
            "ctx.chunk_size, ctx.count = chunk_size, len(targets)"),
        "skips the last, partial chunk of the vocabulary in backward": _vocab(
            "zip(range(0, len(weight), size), weight.split(size), grad_weight.split(size))",
            "zip(range(0, len(weight) - size + 1, size), weight.split(size), grad_weight.split(size))",
            "torch.empty_like(weight)", "torch.zeros_like(weight)"),
        "softmax without the one-hot: the target's -1 is missing from the gradient": _vocab(
            "            probs[inside, targets[inside] - start] -= scale[inside, 0]\n", ""),
        "normalises each chunk on its own (its own softmax) instead of by the whole vocabulary's log-sum-exp": _vocab(
            "probs = (F.linear(hidden, rows).float() - lse[:, None]).exp_().mul_(scale)",
            "probs = F.linear(hidden, rows).float().softmax(dim=-1).mul_(scale)"),
        "the padding's rows get a gradient (no mask in the scale)": _vocab(
            "scale = ((targets != -100) * (grad_loss / ctx.count))[:, None]",
            "scale = (torch.ones_like(lse) * (grad_loss / ctx.count))[:, None]",
            "inside = (targets >= start) & (targets < start + len(rows))",
            "inside = (targets >= start) & (targets < start + len(rows)) & (targets != -100)"),
        "right values, but the weight's gradient accumulates in float32 and is cast at the end: the recipe's floor":
            _vocab("grad_hidden, grad_weight = torch.zeros(hidden.shape, device=hidden.device), torch.empty_like(weight)",
                   "grad_hidden = torch.zeros(hidden.shape, device=hidden.device)\n"
                   "        grad_weight = torch.empty_like(weight, dtype=torch.float32)",
                   "        return grad_hidden.to(hidden.dtype), grad_weight, None, None",
                   "        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None"),
        "right values, but backward computes every token's logits over the whole vocabulary at once": _vocab(
            "        for start, rows, grad_rows in zip(range(0, len(weight), size), weight.split(size), grad_weight.split(size)):",
            "        size = len(weight)\n"
            "        for start, rows, grad_rows in zip(range(0, len(weight), size), weight.split(size), grad_weight.split(size)):"),
        "forward keeps every chunk's logits for backward": _vocab(
            "        ctx.save_for_backward(hidden, weight, targets, lse)",
            "        ctx.save_for_backward(hidden, weight, targets, lse, F.linear(hidden, weight).float())",
            "        (hidden, weight, targets, lse), size = ctx.saved_tensors, ctx.chunk_size",
            "        (hidden, weight, targets, lse, _), size = ctx.saved_tensors, ctx.chunk_size"),
        "ignores grad_loss: right only when nothing scales the loss (no GradScaler, no accumulation divisor)": '''
class VocabChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size):
        lse = torch.stack([F.linear(hidden, rows).float().logsumexp(dim=-1)
                           for rows in weight.split(chunk_size)]).logsumexp(dim=0)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size, ctx.count = chunk_size, (targets != -100).sum()
        picked = (hidden.float() * weight[targets.clamp(min=0)].float()).sum(dim=-1)
        return ((lse - picked) * (targets != -100)).sum() / ctx.count

    @staticmethod
    def backward(ctx, grad_loss):
        (hidden, weight, targets, lse), size = ctx.saved_tensors, ctx.chunk_size
        scale = ((targets != -100) / ctx.count)[:, None]
        grad_hidden, grad_weight = torch.zeros(hidden.shape, device=hidden.device), torch.empty_like(weight)
        for start, rows, grad_rows in zip(range(0, len(weight), size), weight.split(size), grad_weight.split(size)):
            probs = (F.linear(hidden, rows).float() - lse[:, None]).exp_().mul_(scale)
            inside = (targets >= start) & (targets < start + len(rows))
            probs[inside, targets[inside] - start] -= scale[inside, 0]
            grad_hidden.addmm_(probs, rows.float())
            grad_rows.copy_(probs.T @ hidden.float())
        return grad_hidden.to(hidden.dtype), grad_weight, None, None
''',
        "sets the padding targets to 0 in place, in the caller's tensor": '''
class VocabChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size):
        lse = torch.stack([F.linear(hidden, rows).float().logsumexp(dim=-1)
                           for rows in weight.split(chunk_size)]).logsumexp(dim=0)
        real = targets != -100
        ctx.count = real.sum()
        targets[~real] = 0
        ctx.save_for_backward(hidden, weight, targets, lse, real)
        ctx.chunk_size = chunk_size
        picked = (hidden.float() * weight[targets].float()).sum(dim=-1)
        return ((lse - picked) * real).sum() / ctx.count

    @staticmethod
    def backward(ctx, grad_loss):
        (hidden, weight, targets, lse, real), size = ctx.saved_tensors, ctx.chunk_size
        scale = (real * (grad_loss / ctx.count))[:, None]
        grad_hidden, grad_weight = torch.zeros(hidden.shape, device=hidden.device), torch.empty_like(weight)
        for start, rows, grad_rows in zip(range(0, len(weight), size), weight.split(size), grad_weight.split(size)):
            probs = (F.linear(hidden, rows).float() - lse[:, None]).exp_().mul_(scale)
            inside = real & (targets >= start) & (targets < start + len(rows))
            probs[inside, targets[inside] - start] -= scale[inside, 0]
            grad_hidden.addmm_(probs, rows.float())
            grad_rows.copy_(probs.T @ hidden.float())
        return grad_hidden.to(hidden.dtype), grad_weight, None, None
''',
    },
}
