"""Gradient audits: which trainable parameters got no gradient, or an all-zero one.

Introduced in notebook 00 and used in notebook 03 to catch the reentrant-checkpoint pitfall: a
backbone that silently receives no gradient trains nothing, while the loss still goes down thanks
to the layers after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GradientAudit:
    """Names of trainable parameters by what backward left in ``.grad``.

    Attributes:
        missing: ``.grad is None`` (backward never reached them).
        zero: ``.grad`` exists but every element is 0.
        ok: a gradient with at least one non-zero element.
    """

    missing: tuple[str, ...]
    zero: tuple[str, ...]
    ok: tuple[str, ...]

    @property
    def all_ok(self) -> bool:
        """True when every trainable parameter got a non-zero gradient."""
        return not self.missing and not self.zero

    def summary(self) -> str:
        """One line with the three counts."""
        return f"{len(self.ok)} with gradient, {len(self.missing)} without (None), {len(self.zero)} all-zero"


def audit_gradients(model: torch.nn.Module) -> GradientAudit:
    """Sort a model's trainable parameters by the gradient backward left them.

    Call it after ``loss.backward()`` and before ``optimizer.zero_grad()``.

    Args:
        model: the module whose ``named_parameters()`` to audit; frozen parameters
            (``requires_grad=False``) are left out.

    Returns:
        A ``GradientAudit``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    missing, zero, ok = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            missing.append(name)
        elif not bool(param.grad.detach().ne(0).any()):
            zero.append(name)
        else:
            ok.append(name)
    return GradientAudit(tuple(missing), tuple(zero), tuple(ok))


def assert_all_parameters_have_gradients(model: torch.nn.Module, *, allow_zero: bool = False) -> GradientAudit:
    """Fail loudly, naming them, if any trainable parameter got no gradient (or an all-zero one).

    Args:
        model: the module to audit after ``backward()``.
        allow_zero: accept all-zero gradients (e.g. an embedding row no token used).

    Returns:
        The audit, when it passes.

    Raises:
        AssertionError: with the names of the parameters that got none.
    """
    audit = audit_gradients(model)
    problems = []
    if audit.missing:
        problems.append(f"no gradient (grad is None) for {len(audit.missing)} parameter(s): "
                        + ", ".join(audit.missing))
    if audit.zero and not allow_zero:
        problems.append(f"all-zero gradient for {len(audit.zero)} parameter(s): " + ", ".join(audit.zero))
    if problems:
        raise AssertionError("; ".join(problems) + ". These parameters will not train.")
    return audit


def snapshot_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of every parameter, to compare after some training steps."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def parameter_changes(before: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, float]:
    """Largest absolute change of each parameter since ``snapshot_parameters``: 0.0 means it never trained."""
    current = dict(model.named_parameters())
    if set(before) != set(current):
        raise ValueError("the snapshot and the model have different parameter names")
    return {name: float((current[name].detach() - before[name]).abs().max()) for name in before}


def flat_gradients(model: torch.nn.Module, *, zero: bool = False) -> torch.Tensor:
    """Every trainable parameter's gradient, concatenated into one detached flat vector.

    Used to compare whole gradients at once (accumulated vs full batch in notebook 02,
    checkpointed vs plain in notebook 03, mixed vs fp32 precision in notebook 04).

    Args:
        model: the module whose gradients to collect, after ``backward()``.
        zero: set the gradients to None afterwards, ready for the next experiment.

    Returns:
        A 1-D tensor (a copy) in parameter order, in the gradients' own dtype.

    Raises:
        ValueError: a trainable parameter has no gradient (it names them; see ``audit_gradients``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, p in named if p.grad is None]
    if missing:
        raise ValueError("no gradient to collect for: " + ", ".join(missing) + " (run backward() first)")
    flat = torch.cat([p.grad.detach().flatten() for _, p in named])
    if zero:
        model.zero_grad(set_to_none=True)
    return flat
