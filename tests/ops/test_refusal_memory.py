"""What a training forward on the CPU operators leaves allocated for its backward: the tensors
the backward saves and the outputs, and nothing more. The refusal of second derivatives
(csrc/operator_autograd.h) needs the operators' inputs only as graph edges; holding the
tensors would keep a (B, H, T, S) term per layer alive until the backward."""

import pytest
import torch

from local_attn_fairseq.experiments import layer_memory
from local_attn_fairseq.ops import extension_info, mechanisms

pytestmark = pytest.mark.skipif(
    not (extension_info()["loaded"] and mechanisms.cpu_operators_apply(torch.zeros(1))),
    reason="extension not built",
)

# Bytes a forward may hold beyond the saved tensors: the leaks this guards against are a
# (B, H, T, S) tensor, 32 KiB and more at the sizes below.
SMALL = 1024
B, H, T, DIM, HEAD_DIM = 2, 2, 32, 8, 4


@pytest.mark.parametrize("name", sorted(layer_memory.LAYERS))
def test_layer_keeps_only_what_its_backward_saves(name):
    layer = layer_memory.build_layer(name, embed_dim=4 * DIM, heads=4)
    memory = layer_memory.layer_forward_memory(layer, length=64, batch=B)
    assert memory.saved > 0
    assert memory.beyond_saved <= SMALL, memory


def _leaf(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def _gaussian_inputs():
    real = torch.ones(B, T, dtype=torch.float64)
    seen = real.sum(-1, keepdim=True).expand(-1, T)
    return mechanisms.GaussianInputs(
        _leaf(B, T, DIM), _leaf(DIM, DIM), _leaf(H, DIM), _leaf(H, DIM), seen - 1, seen,
        real.cumsum(-1) - 1, None, 0.1, 1e-4,
    )  # fmt: skip


def _window_inputs():
    return mechanisms.window_inputs(
        _leaf(B, T, DIM), _leaf(2 * H * HEAD_DIM, DIM), _leaf(B, 2 * H, T, HEAD_DIM), None,
        None, None,
    )  # fmt: skip


def _local_scores():
    return mechanisms.LocalScoreInputs(
        _leaf(H * HEAD_DIM, DIM), _leaf(H * HEAD_DIM), _leaf(B, H, T, HEAD_DIM), 0.5
    )


def operator_calls():
    """Each operator that takes a (B, H, T, S) term, given one made in the call from a leaf
    (so that nothing but the graph can hold it): the call and its inputs."""
    q, k, v = (_leaf(B, H, T, HEAD_DIM) for _ in range(3))
    term = _leaf(B, H, T, T)
    attention = mechanisms.AttentionInputs(None, None, None, 0.5, 0.0)
    gaussian, window, local = _gaussian_inputs(), _window_inputs(), _local_scores()
    calls = {
        "dense_attention": lambda: mechanisms.dense_attention(
            q, k, v, term * 2, None, attention
        ),
        "gaussian_localness": lambda: mechanisms.gaussian_localness(gaussian, term * 2),
        "gaussian_attention": lambda: mechanisms.gaussian_attention(
            q, k, v, gaussian, term * 2, None, attention
        ),
        "window_attention (MW)": lambda: mechanisms.window_attention(
            q, k, v, window, None, term * 2, None, attention
        ),
        "window_attention (AW)": lambda: mechanisms.window_attention(
            q, k, v, window, local, term * 2, None, attention
        ),
    }
    leaves = [q, k, v, term, *gaussian[:4], *window[:3], *local[:3]]
    return calls, leaves


@pytest.mark.parametrize("name", sorted(operator_calls()[0]))
def test_operator_keeps_only_what_its_backward_saves(name):
    calls, leaves = operator_calls()
    memory = layer_memory.forward_memory(calls[name], leaves)
    assert memory.beyond_saved <= SMALL, memory
