"""Wrong answers to notebook 07's exercises: each must make its graded cell fail (tests/wrong_answers/README.md)."""

WRONG = {
    "exercise_1": {
        "calls .item() but evaluates with grad on: every layer's activations are kept until the loss is gone": '''
def evaluate_fixed(eval_model, eval_batches):
    total_loss = 0.0
    for batch, batch_targets in eval_batches:
        total_loss += mse_loss(eval_model(batch), batch_targets).item()
    return total_loss / len(eval_batches)
''',
        "model.eval() instead of no_grad: eval() does not stop autograd from recording": '''
def evaluate_fixed(eval_model, eval_batches):
    eval_model.eval()
    total_loss = 0.0
    for batch, batch_targets in eval_batches:
        total_loss += mse_loss(eval_model(batch), batch_targets).item()
    eval_model.train()
    return total_loss / len(eval_batches)
''',
        "no graph, but returns a tensor, not a Python float": '''
def evaluate_fixed(eval_model, eval_batches):
    total_loss = 0.0
    with torch.no_grad():
        for batch, batch_targets in eval_batches:
            total_loss += mse_loss(eval_model(batch), batch_targets)
    return total_loss / len(eval_batches)
''',
        "returns the total, not the mean": '''
def evaluate_fixed(eval_model, eval_batches):
    total_loss = 0.0
    with torch.inference_mode():
        for batch, batch_targets in eval_batches:
            total_loss += mse_loss(eval_model(batch), batch_targets).item()
    return total_loss
''',
            "no_grad around the loss only: the model's forward still records its graph": '''
def evaluate_fixed(eval_model, eval_batches):
    total_loss = 0.0
    for batch, batch_targets in eval_batches:
        output = eval_model(batch)
        with torch.no_grad():
            total_loss += mse_loss(output, batch_targets).item()
    return total_loss / len(eval_batches)
''',
        "returns the last batch's loss, not the mean": '''
def evaluate_fixed(eval_model, eval_batches):
    with torch.inference_mode():
        for batch, batch_targets in eval_batches:
            last_loss = mse_loss(eval_model(batch), batch_targets).item()
    return last_loss
''',
        "divides by the number of samples, not of batches": '''
def evaluate_fixed(eval_model, eval_batches):
    total_loss = 0.0
    with torch.inference_mode():
        for batch, batch_targets in eval_batches:
            total_loss += mse_loss(eval_model(batch), batch_targets).item()
    return total_loss / sum(len(batch) for batch, _ in eval_batches)
''',
        "stops the graph by freezing the model (requires_grad_(False)) and leaves it frozen": '''
def evaluate_fixed(eval_model, eval_batches):
    eval_model.requires_grad_(False)
    total_loss = 0.0
    for batch, batch_targets in eval_batches:
        total_loss += mse_loss(eval_model(batch), batch_targets).item()
    return total_loss / len(eval_batches)
''',
        "evaluates in eval mode under inference_mode, and leaves the model in eval mode": '''
def evaluate_fixed(eval_model, eval_batches):
    eval_model.eval()
    total_loss = 0.0
    with torch.inference_mode():
        for batch, batch_targets in eval_batches:
            total_loss += mse_loss(eval_model(batch), batch_targets).item()
    return total_loss / len(eval_batches)
''',
        "weights each batch by its rows: the mean over samples, right only when the batches are equal": '''
def evaluate_fixed(eval_model, eval_batches):
    total_loss = 0.0
    with torch.inference_mode():
        for batch, batch_targets in eval_batches:
            total_loss += mse_loss(eval_model(batch), batch_targets).item() * len(batch)
    return total_loss / sum(len(batch) for batch, _ in eval_batches)
''',
        "eval() for the evaluation, then train() at the end whatever mode the model was in": '''
def evaluate_fixed(eval_model, eval_batches):
    eval_model.eval()
    total_loss = 0.0
    with torch.no_grad():
        for batch, batch_targets in eval_batches:
            total_loss += mse_loss(eval_model(batch), batch_targets).item()
    eval_model.train()
    return total_loss / len(eval_batches)
''',
        "freezes every parameter, then unfreezes every one: a parameter frozen before is left trainable": '''
def evaluate_fixed(eval_model, eval_batches):
    eval_model.requires_grad_(False)
    total_loss = 0.0
    for batch, batch_targets in eval_batches:
        total_loss += mse_loss(eval_model(batch), batch_targets).item()
    eval_model.requires_grad_(True)
    return total_loss / len(eval_batches)
''',
    },

    "exercise_2": {
        "in-place saves one activation per layer: the peak is the end of forward plus one more activation": '''
def predict_forward_peak_bytes(batch, widths, inplace):
    hidden = widths[1:-1]
    end_of_forward = sum(hidden) + widths[-1]
    return 4 * batch * (end_of_forward if inplace else end_of_forward + max(hidden))
''',
        "the uniform-width formula of section 3 with the widest layer as H": '''
def predict_forward_peak_bytes(batch, widths, inplace):
    H, L, C = max(widths[1:-1]), len(widths) - 2, widths[-1]
    return 4 * batch * (L * H + C if inplace else H * (L + 1))
''',
        "forgets the output of the last Linear at the end of forward": '''
def predict_forward_peak_bytes(batch, widths, inplace):
    hidden = widths[1:-1]
    if inplace:
        candidates = [sum(hidden[:k + 1]) for k in range(len(hidden))]
    else:
        candidates = [sum(hidden[:k]) + 2 * hidden[k] for k in range(len(hidden))]
    return 4 * batch * max(candidates)
''',
        "in-place changes nothing: the same peak either way": '''
def predict_forward_peak_bytes(batch, widths, inplace):
    hidden = widths[1:-1]
    candidates = [sum(hidden[:k]) + 2 * hidden[k] for k in range(len(hidden))]
    return 4 * batch * max(candidates + [sum(hidden) + widths[-1]])
''',
        "counts the input batch, which existed before the forward pass": '''
def predict_forward_peak_bytes(batch, widths, inplace):
    hidden = widths[1:-1]
    end_of_forward = sum(hidden) + widths[-1]
    if inplace:
        candidates = [sum(hidden[:k + 1]) for k in range(len(hidden))]
    else:
        candidates = [sum(hidden[:k]) + 2 * hidden[k] for k in range(len(hidden))]
    return 4 * batch * (widths[0] + max(candidates + [end_of_forward]))
''',
            "adds the moments up instead of taking the largest": '''
def predict_forward_peak_bytes(batch, widths, inplace):
    hidden = widths[1:-1]
    end_of_forward = sum(hidden) + widths[-1]
    if inplace:
        candidates = [sum(hidden[:k + 1]) for k in range(len(hidden))]
    else:
        candidates = [sum(hidden[:k]) + 2 * hidden[k] for k in range(len(hidden))]
    return 4 * batch * max(sum(candidates), end_of_forward)
''',
        "a layer's input and output only, without the activations saved before it": '''
def predict_forward_peak_bytes(batch, widths, inplace):
    hidden = widths[1:-1]
    end_of_forward = sum(hidden) + widths[-1]
    if inplace:
        candidates = list(hidden)
    else:
        candidates = [2 * width for width in hidden]
    return 4 * batch * max(candidates + [end_of_forward])
''',
        "section 3's uniform formula with the first hidden width for every layer: right only when they are equal": '''
def predict_forward_peak_bytes(batch, widths, inplace):
    H, L, C = widths[1], len(widths) - 2, widths[-1]
    return 4 * batch * (L * H + C if inplace else max(H * (L + 1), L * H + C))
''',
        "the peak only at the last ReLU or at the end of forward": '''
def predict_forward_peak_bytes(batch, widths, inplace):
    hidden = widths[1:-1]
    end_of_forward = sum(hidden) + widths[-1]
    if inplace:
        candidates = [sum(hidden[:k + 1]) for k in range(len(hidden))]
    else:
        candidates = [sum(hidden) + hidden[-1]] if hidden else []
    return 4 * batch * max(candidates + [end_of_forward])
''',
    },

    "exercise_3": {
        "no clipping: a plain step in the hook": '''
def attach_clipped_sgd_in_backward(sgd_model, lr, momentum, max_norm):
    sgd_optimizers = {p: torch.optim.SGD([p], lr=lr, momentum=momentum) for p in sgd_model.parameters() if p.requires_grad}
    def clip_step_and_free(param):
        sgd_optimizers[param].step()
        sgd_optimizers[param].zero_grad(set_to_none=True)
    return [p.register_post_accumulate_grad_hook(clip_step_and_free) for p in sgd_optimizers]
''',
        "clips after the step": '''
def attach_clipped_sgd_in_backward(sgd_model, lr, momentum, max_norm):
    sgd_optimizers = {p: torch.optim.SGD([p], lr=lr, momentum=momentum) for p in sgd_model.parameters() if p.requires_grad}
    def clip_step_and_free(param):
        sgd_optimizers[param].step()
        nn.utils.clip_grad_norm_([param], max_norm)
        sgd_optimizers[param].zero_grad(set_to_none=True)
    return [p.register_post_accumulate_grad_hook(clip_step_and_free) for p in sgd_optimizers]
''',
        "hooks on every parameter, the frozen table too": '''
def attach_clipped_sgd_in_backward(sgd_model, lr, momentum, max_norm):
    sgd_optimizers = {p: torch.optim.SGD([p], lr=lr, momentum=momentum) for p in sgd_model.parameters()}
    def clip_step_and_free(param):
        nn.utils.clip_grad_norm_([param], max_norm)
        sgd_optimizers[param].step()
        sgd_optimizers[param].zero_grad(set_to_none=True)
    return [p.register_post_accumulate_grad_hook(clip_step_and_free) for p in sgd_optimizers]
''',
        "steps and clips but never frees the gradient": '''
def attach_clipped_sgd_in_backward(sgd_model, lr, momentum, max_norm):
    sgd_optimizers = {p: torch.optim.SGD([p], lr=lr, momentum=momentum) for p in sgd_model.parameters() if p.requires_grad}
    def clip_step_and_free(param):
        nn.utils.clip_grad_norm_([param], max_norm)
        sgd_optimizers[param].step()
    return [p.register_post_accumulate_grad_hook(clip_step_and_free) for p in sgd_optimizers]
''',
        "a fresh optimizer inside the hook at every step: the momentum buffer is lost": '''
def attach_clipped_sgd_in_backward(sgd_model, lr, momentum, max_norm):
    def clip_step_and_free(param):
        nn.utils.clip_grad_norm_([param], max_norm)
        optimizer = torch.optim.SGD([param], lr=lr, momentum=momentum)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.register_post_accumulate_grad_hook(clip_step_and_free) for p in sgd_model.parameters() if p.requires_grad]
''',
        "clips by value, not by norm": '''
def attach_clipped_sgd_in_backward(sgd_model, lr, momentum, max_norm):
    sgd_optimizers = {p: torch.optim.SGD([p], lr=lr, momentum=momentum) for p in sgd_model.parameters() if p.requires_grad}
    def clip_step_and_free(param):
        nn.utils.clip_grad_value_([param], max_norm)
        sgd_optimizers[param].step()
        sgd_optimizers[param].zero_grad(set_to_none=True)
    return [p.register_post_accumulate_grad_hook(clip_step_and_free) for p in sgd_optimizers]
''',
        "register_hook runs before the gradient is accumulated into .grad: the step finds no gradient": '''
def attach_clipped_sgd_in_backward(sgd_model, lr, momentum, max_norm):
    sgd_optimizers = {p: torch.optim.SGD([p], lr=lr, momentum=momentum) for p in sgd_model.parameters() if p.requires_grad}
    def make_hook(param):
        def clip_step_and_free(grad):
            nn.utils.clip_grad_norm_([param], max_norm)
            sgd_optimizers[param].step()
            sgd_optimizers[param].zero_grad(set_to_none=True)
        return clip_step_and_free
    return [p.register_hook(make_hook(p)) for p in sgd_optimizers]
''',
        "SGD([param], momentum, lr): positional arguments swapped, the momentum becomes the learning rate": '''
def attach_clipped_sgd_in_backward(sgd_model, lr, momentum, max_norm):
    sgd_optimizers = {p: torch.optim.SGD([p], momentum, lr) for p in sgd_model.parameters() if p.requires_grad}
    def clip_step_and_free(param):
        nn.utils.clip_grad_norm_([param], max_norm)
        sgd_optimizers[param].step()
        sgd_optimizers[param].zero_grad(set_to_none=True)
    return [p.register_post_accumulate_grad_hook(clip_step_and_free) for p in sgd_optimizers]
''',
        "momentum SGD by hand, rebinding param.data to the new values instead of updating in place": '''
def attach_clipped_sgd_in_backward(sgd_model, lr, momentum, max_norm):
    velocities = {}
    def clip_step_and_free(param):
        nn.utils.clip_grad_norm_([param], max_norm)
        velocity = velocities.get(param)
        velocity = param.grad.clone() if velocity is None else velocity * momentum + param.grad
        velocities[param] = velocity
        param.data = param.data - lr * velocity
        param.grad = None
    return [p.register_post_accumulate_grad_hook(clip_step_and_free) for p in sgd_model.parameters() if p.requires_grad]
''',
        "clips in each hook, but one SGD steps all parameters in the last hook: every gradient lives until the end": '''
def attach_clipped_sgd_in_backward(sgd_model, lr, momentum, max_norm):
    trainable = [p for p in sgd_model.parameters() if p.requires_grad]
    sgd = torch.optim.SGD(trainable, lr=lr, momentum=momentum)
    arrived = []

    def clip_and_maybe_step(param):
        nn.utils.clip_grad_norm_([param], max_norm)
        arrived.append(param)
        if len(arrived) == len(trainable):
            sgd.step()
            sgd.zero_grad(set_to_none=True)
            arrived.clear()

    return [p.register_post_accumulate_grad_hook(clip_and_maybe_step) for p in trainable]
''',
    },
}
