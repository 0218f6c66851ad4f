"""Dense fused attention (global heads): PyTorch's ``scaled_dot_product_attention``, with second
derivatives wherever it runs PyTorch's CPU flash kernel.

That kernel's backward has no derivative of its own, so a gradient of a gradient through global
heads (a gradient penalty, a Hessian-vector product) would stop at PyTorch's "derivative for
aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented". Where PyTorch
chooses that kernel for a call that records gradients, the call goes through the Function below:
the same forward and first-order backward kernels, and under ``create_graph`` the gradients of
the same attention as PyTorch's math composition, differentiable in turn
(``second_derivatives.gradients_with_graph``). Every other call is PyTorch's own.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .second_derivatives import gradients_with_graph

_CPU_FLASH = int(SDPBackend.FLASH_ATTENTION)


def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)``,
    twice differentiable on the CPU as everywhere else PyTorch computes it."""
    if (
        q.is_cpu
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
        and not torch.compiler.is_compiling()
        and torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)
        == _CPU_FLASH
    ):
        return _CpuFlashAttention.apply(q, k, v, attn_mask, dropout_p, is_causal, scale)[0]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )


def _math_attention(q, k, v, attn_mask, dropout_p, is_causal, scale):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )


class _CpuFlashAttention(torch.autograd.Function):
    """PyTorch's CPU flash kernels forward and backward (dropout_p = 0, which is when PyTorch
    chooses them); the math composition's gradients under ``create_graph``."""

    @staticmethod
    def forward(q, k, v, attn_mask, dropout_p, is_causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
        return out, lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, attn_mask, dropout_p, is_causal, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, attn_mask, out, lse)
        ctx.call = (dropout_p, is_causal, scale)
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, attn_mask, out, lse = ctx.saved_tensors
        dropout_p, is_causal, scale = ctx.call
        if torch.is_grad_enabled():  # create_graph: differentiable gradients
            dq, dk, dv = gradients_with_graph(
                lambda q, k, v: _math_attention(q, k, v, attn_mask, dropout_p, is_causal, scale),
                (q, k, v), grad_out,
            )  # fmt: skip
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out.contiguous(), q, k, v, out, lse, dropout_p, is_causal,
                attn_mask=attn_mask, scale=scale,
            )  # fmt: skip
        return dq, dk, dv, None, None, None, None
