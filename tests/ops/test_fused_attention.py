"""Dense fused attention of global heads: PyTorch's CPU flash kernels, with first derivatives
from their backward and second derivatives from the math composition under create_graph."""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck

from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention
from local_attn_fairseq.ops import fused_attention as fused_module
from local_attn_fairseq.ops.fused_attention import fused_attention


def inputs(dtype=torch.float64, length=6):
    torch.manual_seed(0)
    return [torch.randn(2, 3, length, 4, dtype=dtype, requires_grad=True) for _ in range(3)]


def padding_mask(length=6):
    mask = torch.zeros(2, 1, length, length, dtype=torch.float64)
    mask[1, :, :, :2] = float("-inf")
    return mask


@pytest.mark.parametrize("call", ["plain", "causal", "mask"])
def test_first_and_second_derivatives(call):
    kw = {"plain": {}, "causal": {"is_causal": True}, "mask": {"attn_mask": padding_mask()}}[call]
    q, k, v = inputs()
    assert gradcheck(lambda q, k, v: fused_attention(q, k, v, **kw), (q, k, v))
    assert gradgradcheck(lambda q, k, v: fused_attention(q, k, v, **kw), (q, k, v))


def test_it_runs_pytorchs_cpu_flash_kernels_and_their_outputs(monkeypatch):
    calls = []
    original = fused_module._CpuFlashAttention.apply
    monkeypatch.setattr(
        fused_module._CpuFlashAttention, "apply",
        lambda *args: calls.append(1) or original(*args),
    )  # fmt: skip
    q, k, v = inputs(torch.float32, 16)
    out = fused_attention(q, k, v, is_causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert calls == [1]
    with torch.no_grad():  # nothing to differentiate: PyTorch's own call
        fused_attention(q, k, v)
    assert calls == [1]


def test_a_gradient_penalty_through_global_heads_of_a_causal_padded_layer():
    """The fused path's second derivatives equal the explicit path's (which asks for weights)."""
    torch.manual_seed(0)
    attn = LocalMultiheadAttention(16, 4, self_attention=True, causal=True).double()
    x = torch.randn(7, 2, 16, dtype=torch.float64, requires_grad=True)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 5:] = True

    def penalty(need_weights):
        out, _ = attn(x, x, x, padding, need_weights=need_weights)
        (grad,) = torch.autograd.grad(out[:5].sum(), x, create_graph=True)
        return torch.autograd.grad(grad.square().sum(), x)[0]

    # (the explicit path forms its softmax in float32)
    torch.testing.assert_close(penalty(False), penalty(True), atol=1e-5, rtol=1e-4)
