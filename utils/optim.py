"""The optimizer step in backward: update each parameter as soon as its gradient is ready.

Introduced in notebook 07. A normal training step keeps the gradients of *all* parameters alive
from the end of ``backward()`` until ``optimizer.step()`` and ``zero_grad()``: ``P`` bytes of
gradients on top of everything else. ``attach_optimizer_in_backward`` gives each parameter its own
optimizer and runs it from a ``Tensor.register_post_accumulate_grad_hook`` hook, which autograd
calls once that parameter's gradient is complete; the hook steps and frees the gradient at once,
so at most a few gradients are alive at any moment. This is the recipe of the PyTorch tutorial
*How to save memory by fusing the optimizer step into the backward pass*.

It changes *when* each update happens, not *what* it computes: with the same optimizer settings,
the parameters after N steps equal those of a normal loop (notebook 07 asserts it). It does not
combine with gradient accumulation (each ``backward()`` steps) or with clipping by the global norm
(no step can wait for the norm of all gradients).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

# parameter -> the handle that steps it, so that one parameter is never stepped by two handles
_ATTACHED = WeakIdKeyDictionary()


@dataclass
class OptimizerInBackward:
    """What ``attach_optimizer_in_backward`` returns: one optimizer per parameter, and their hooks.

    Attributes:
        optimizers: one optimizer per parameter, in the order of ``model.parameters()``.
        handles: the hook handles (one per parameter).
        num_steps: optimizer steps taken so far, over all parameters (one per parameter per
            ``backward()``).

    Use ``remove()`` (or a ``with`` block) to detach the hooks; the parameters keep their values
    and the optimizers their state, so a normal loop can take over.
    """

    optimizers: list[torch.optim.Optimizer]
    handles: list[RemovableHandle] = field(default_factory=list)
    num_steps: int = 0
    _params: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def attached(self) -> bool:
        """True until ``remove()`` is called."""
        return bool(self.handles)

    def remove(self) -> None:
        """Detach every hook. Safe to call twice. Gradients are again kept, as in a normal loop."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for param in self._params:
            if _ATTACHED.get(param) is self:
                del _ATTACHED[param]
        self._params = []

    def __enter__(self) -> OptimizerInBackward:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


def attach_optimizer_in_backward(
    model: torch.nn.Module | Iterable[torch.Tensor],
    make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
) -> OptimizerInBackward:
    """Step each parameter inside ``backward()``, as soon as its gradient is accumulated, and free it.

    Why it exists: the gradients of all parameters are never alive at once, which lowers the peak
    of a step whose peak sits at the end of backward or in the optimizer step by up to the
    gradients' bytes (``P`` in fp32). After ``loss.backward()`` there is nothing left to do: no
    ``optimizer.step()``, no ``zero_grad()``.

    Args:
        model: an ``nn.Module`` (its parameters that require grad are attached; frozen ones are
            skipped) or an iterable of parameters, each of which must require grad and be a leaf.
            A parameter listed twice (tied weights) is attached once.
        make_optimizer: called once per parameter with a one-element list ``[param]``; must return
            a ``torch.optim.Optimizer`` over exactly that parameter, e.g.
            ``lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True)``.

    Returns:
        An ``OptimizerInBackward``; keep it, and call ``.remove()`` to detach the hooks.

    Raises:
        TypeError: ``model`` is neither a module nor an iterable of tensors, ``make_optimizer`` is
            not callable or returns something other than an optimizer.
        ValueError: no parameter to attach, a parameter that does not require grad or is not a
            leaf, a parameter already attached by another call, or an optimizer that does not
            hold exactly its parameter.

    Example:
        >>> handle = attach_optimizer_in_backward(model, lambda p: torch.optim.AdamW(p, lr=1e-3))
        >>> for inputs, targets in batches:
        ...     loss_fn(model(inputs), targets).backward()   # steps and frees each gradient
        >>> handle.remove()

    Known limitations:
        * Gradient accumulation: every ``backward()`` steps, so micro-batches are not summed.
        * Clipping by the global norm (``clip_grad_norm_``) needs every gradient before any step;
          only a per-parameter clip can run inside the hook.
        * An LR scheduler needs one scheduler per optimizer (``handle.optimizers``).
        * ``requires_grad`` must not change while attached; DDP/FSDP have their own versions.
    """
    if not callable(make_optimizer):
        raise TypeError(f"make_optimizer must be callable (params -> optimizer), got {type(make_optimizer).__name__}")
    params = _trainable_parameters(model)
    handle = OptimizerInBackward(optimizers=[])
    try:
        for param in params:
            if param in _ATTACHED:
                raise ValueError("a parameter already has an optimizer in backward: call .remove() on the "
                                 "earlier handle first")
            optimizer = make_optimizer([param])
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"make_optimizer must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
            held = [p for group in optimizer.param_groups for p in group["params"]]
            if len(held) != 1 or held[0] is not param:
                raise ValueError(f"make_optimizer must return an optimizer over exactly the parameter it is "
                                 f"given; it holds {len(held)} parameter(s)")
            handle.optimizers.append(optimizer)
            handle.handles.append(param.register_post_accumulate_grad_hook(_make_hook(optimizer, handle)))
            handle._params.append(param)
            _ATTACHED[param] = handle
    except Exception:
        handle.remove()
        raise
    return handle


def _make_hook(optimizer: torch.optim.Optimizer, handle: OptimizerInBackward) -> Callable[[torch.Tensor], None]:
    def step_and_free(param: torch.Tensor) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)   # the gradient dies here, not at the end of the step
        handle.num_steps += 1
    return step_and_free


def _trainable_parameters(model: torch.nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(model, torch.nn.Module):
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        if isinstance(model, torch.Tensor):
            params = [model]
        else:
            try:
                params = list(model)
            except TypeError:
                raise TypeError(f"model must be an nn.Module or an iterable of parameters, not "
                                f"{type(model).__name__}") from None
        for param in params:
            if not isinstance(param, torch.Tensor):
                raise TypeError(f"expected parameters (tensors), found a {type(param).__name__}")
            if not param.requires_grad:
                raise ValueError(f"a parameter of shape {tuple(param.shape)} does not require grad: it would "
                                 "never be stepped; leave frozen parameters out")
            if not param.is_leaf:
                raise ValueError(f"a tensor of shape {tuple(param.shape)} is not a leaf (it is computed from "
                                 "others): only leaf tensors accumulate a .grad to step")
    unique: list[torch.Tensor] = []
    seen: set[int] = set()
    for param in params:
        if id(param) not in seen:
            seen.add(id(param))
            unique.append(param)
    if not unique:
        raise ValueError("no parameter that requires grad: nothing to attach an optimizer to")
    return unique
