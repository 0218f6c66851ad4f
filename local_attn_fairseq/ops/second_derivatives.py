"""Second derivatives of the Python autograd Functions of ``ops/``.

Their backwards run kernels that autograd cannot look into (the compiled operators, PyTorch's
flash attention, loops of in-place updates), so gradients they return carry no history. Under
``create_graph`` (a gradient penalty, a Hessian-vector product, meta-learning) such a Function
instead runs its output again as a composition of differentiable PyTorch operations and returns
that composition's gradients, built with their own graph: the same first derivatives, and
correct second derivatives. The composition may cost more memory than the Function's own
backward (the log-sum-exp over all keys forms every logit); it runs only when asked for, and
under torch.func's transforms, which differentiate with ``create_graph``. (The compiled
operators' own Autograd kernels refuse second derivatives instead: csrc/operator_autograd.h.)
"""

from typing import Callable, List, Optional, Sequence

import torch


def gradients_with_graph(
    composition: Callable[..., torch.Tensor],
    inputs: Sequence[Optional[torch.Tensor]],
    grad_output: torch.Tensor,
) -> List[Optional[torch.Tensor]]:
    """The gradients of ``composition(*inputs)`` for ``grad_output``, differentiable in turn
    (None for an input that is not a tensor requiring gradients)."""
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    result: List[Optional[torch.Tensor]] = [None] * len(inputs)
    if not wanted:
        return result
    with torch.enable_grad():
        output = composition(*inputs)
        if not output.requires_grad:
            # The inputs' graph is gone (those of a torch.func.vjp whose transform has returned
            # before its vjp function runs): the composition again from fresh leaves, whose
            # gradients are the same first derivatives.
            inputs = [
                t.detach().requires_grad_() if i in wanted else t for i, t in enumerate(inputs)
            ]
            output = composition(*inputs)
    gradients = torch.autograd.grad(
        output, [inputs[i] for i in wanted], grad_output, create_graph=True, allow_unused=True
    )
    for i, gradient in zip(wanted, gradients):
        result[i] = gradient
    return result
