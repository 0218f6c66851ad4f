"""Head gates and pruned heads inside LocalMultiheadAttention."""

import pytest
import torch

from local_attn_fairseq.locality.spec import HeadSpec
from local_attn_fairseq.modules.head_pruning import pruned_attention_state
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention

E, H = 16, 4
GATES = {"temperature": 2 / 3, "log_alpha_init": 3.0}
# Head 1 borrows head 0's Wq/Wk; heads 0 and 3 carry the Gaussian bias; masks differ.
MIXED_HEADS = [
    HeadSpec("global", None, True),
    HeadSpec("band-1", (0, 0), False),
    HeadSpec("prev-1"),
    HeadSpec("global", None, True),
]


def attention(heads=None, gates=None, kept=None, qk_rows=None, seed=0, **kw):
    torch.manual_seed(seed)
    attn = LocalMultiheadAttention(
        E,
        H,
        head_specs=heads,
        self_attention=True,
        gates=gates,
        kept_heads=kept,
        qk_rows=qk_rows,
        **kw,
    )
    attn.bind_qk_owners([attn])
    return attn.eval()


def inputs():
    torch.manual_seed(1)
    x = torch.randn(7, 3, E)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, :2] = True  # left padding
    pad[2] = True  # a sentence without a single real token
    return x, pad


def set_gates(attn, log_alpha):
    with torch.no_grad():
        attn.head_gates.log_alpha.copy_(torch.tensor(log_alpha))


def test_open_test_time_gates_change_nothing():
    x, pad = inputs()
    plain = attention(MIXED_HEADS, relative_max_distance=2)
    gated = attention(MIXED_HEADS, gates=GATES, relative_max_distance=2)
    gated.load_state_dict(plain.state_dict(), strict=False)
    torch.testing.assert_close(gated(x, x, x, pad)[0], plain(x, x, x, pad)[0])


def test_a_closed_gate_removes_exactly_that_heads_output():
    x, pad = inputs()
    gated = attention(gates=GATES)
    set_gates(gated, [3.0, -3.0, 3.0, 3.0])
    reference = attention()
    reference.load_state_dict(gated.state_dict(), strict=False)
    with torch.no_grad():
        reference.v_proj.weight[4:8] = 0
        reference.v_proj.bias[4:8] = 0
    torch.testing.assert_close(gated(x, x, x, pad)[0], reference(x, x, x, pad)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sentences", [3, 2])  # 21 tokens: the weight is scaled; 14 < E: outputs
def test_gates_scale_each_heads_output_before_the_projection(dtype, sentences):
    """Gated heads run as out_proj's columns scaled by their gates (or, with fewer tokens than
    columns, as gated outputs): the same output and the same gradients (input, weights, gates)
    as multiplying each head's output by its gate."""
    x, pad = inputs()
    x, pad = x[:, :sentences].to(dtype), pad[:sentences]
    gated = attention(MIXED_HEADS, gates=GATES, relative_max_distance=2).to(dtype)
    plain = attention(MIXED_HEADS, relative_max_distance=2).to(dtype)
    plain.load_state_dict(gated.state_dict(), strict=False)
    sample = torch.tensor([0.0, 0.3, 1.0, 0.75], dtype=dtype, requires_grad=True)
    gated.head_gates.forward = lambda: sample  # a training sample, fixed for both layers
    per_feature = sample.repeat_interleave(E // H)
    plain.out_proj.register_forward_pre_hook(lambda _, args: (args[0] * per_feature,))

    grads = []
    for layer in (gated, plain):
        inp = x.clone().requires_grad_()
        out = layer(inp, inp, inp, pad, need_weights=False)[0]
        params = [inp, layer.out_proj.weight, layer.q_proj.weight, sample]
        grads.append((out, *torch.autograd.grad((out * out).sum(), params)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want)


def test_a_hook_on_out_proj_sees_the_gated_head_outputs():
    """Analysis tools (LRP) read out_proj's input: with a hook there, a call with more tokens
    than columns still hands out_proj the gated outputs, and computes the same layer."""
    x, pad = inputs()
    gated = attention(gates=GATES)
    set_gates(gated, [3.0, -3.0, 3.0, 3.0])  # head 1 closed at test time
    unhooked = gated(x, x, x, pad, need_weights=False)[0]
    seen = []
    gated.out_proj.register_forward_hook(lambda module, args, output: seen.append(args[0]))
    torch.testing.assert_close(gated(x, x, x, pad, need_weights=False)[0], unhooked)
    (head_outputs,) = seen
    assert x.shape[0] * x.shape[1] >= E and head_outputs.shape == (7, 3, E)
    assert head_outputs[..., 4:8].abs().max() == 0 and head_outputs[..., :4].abs().max() > 0


def test_a_backward_hook_on_out_proj_runs():
    x, pad = inputs()
    gated = attention(gates=GATES).train()
    grads = []
    gated.out_proj.register_full_backward_hook(lambda module, g_in, g_out: grads.append(g_out))
    gated(x, x, x, pad, need_weights=False)[0].sum().backward()
    assert len(grads) == 1


def test_training_samples_new_gates_every_forward():
    x, pad = inputs()
    gated = attention(gates={**GATES, "log_alpha_init": 0.0}).train()
    gated.dropout_module.p = 0.0
    torch.manual_seed(3)
    first, second = gated(x, x, x, pad)[0], gated(x, x, x, pad)[0]
    assert not torch.allclose(first, second)


@pytest.mark.parametrize(
    "log_alpha, kept",
    [
        ([-1.0, 2.0, 2.0, 2.0], [1, 2, 3]),  # head 0 closed, its Wq/Wk still used by head 1
        ([2.0, -1.0, -1.0, 2.0], [0, 3]),
        ([-1.0, -1.0, -1.0, 2.0], [3]),
    ],
)
def test_pruned_layer_equals_the_gated_layer_at_test_time(log_alpha, kept):
    x, pad = inputs()
    gated = attention(
        MIXED_HEADS, gates=GATES, relative_max_distance=2, localness={"window": "query"}
    )
    set_gates(gated, log_alpha)
    pruned = attention(
        MIXED_HEADS, kept=kept, qk_rows=[0, 2, 3], relative_max_distance=2,
        localness={"window": "query"}, seed=5,
    )  # fmt: skip
    state = pruned_attention_state(gated, pruned, "m")
    pruned.load_state_dict({k[len("m.") :]: v for k, v in state.items()})
    assert pruned.num_heads == len(kept)
    assert pruned.v_proj.weight.shape == (len(kept) * 4, E)
    assert pruned.out_proj.weight.shape == (E, len(kept) * 4)
    out_gated, w_gated = gated(x, x, x, pad, need_head_weights=True)
    out_pruned, w_pruned = pruned(x, x, x, pad, need_head_weights=True)
    torch.testing.assert_close(out_pruned, out_gated, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w_pruned, w_gated[kept])


WINDOW_HEADS = [
    HeadSpec(window="aw"),
    HeadSpec("band-1", window="mw", segment=2),
    HeadSpec(window="aw", segment=2),
    HeadSpec(window="mw"),
]


@pytest.mark.parametrize(
    "log_alpha, kept", [([-1.0, 2.0, -1.0, 2.0], [1, 3]), ([2.0, -1.0, -1.0, -1.0], [0])]
)
def test_pruning_keeps_the_dynamic_windows_of_the_kept_heads(log_alpha, kept):
    x, pad = inputs()
    gated = attention(WINDOW_HEADS, gates=GATES)
    set_gates(gated, log_alpha)
    pruned = attention(WINDOW_HEADS, kept=kept, seed=5)
    state = pruned_attention_state(gated, pruned, "m")
    pruned.load_state_dict({k[len("m.") :]: v for k, v in state.items()})
    assert len(pruned.dynamic_windows) == len({WINDOW_HEADS[h].segment for h in kept})
    out_gated, w_gated = gated(x, x, x, pad, need_head_weights=True)
    out_pruned, w_pruned = pruned(x, x, x, pad, need_head_weights=True)
    torch.testing.assert_close(out_pruned, out_gated, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w_pruned, w_gated[kept])


def test_layer_without_heads_keeps_only_the_bias():
    x, pad = inputs()
    empty = attention(kept=[])
    assert empty.q_proj is None and empty.v_proj is None
    assert empty.out_proj.weight.shape == (E, 0)
    out, weights = empty(x, x, x, pad, need_weights=True)
    torch.testing.assert_close(out, empty.out_proj.bias.expand(7, 3, E))
    assert weights.shape == (3, 7, 7) and not weights.any()


def test_missing_gates_are_added_when_loading_a_checkpoint_without_them():
    plain, gated = attention(), attention(gates=GATES)
    state = {f"layer.{k}": v for k, v in plain.state_dict().items()}
    gated.upgrade_state_dict_named(state, "layer")
    assert torch.equal(state["layer.head_gates.log_alpha"], torch.full((H,), 3.0))


def test_glorot_gates_added_to_a_checkpoint_without_them_start_spread():
    """Gates added for fine-tuning start from their initialisation: Voita et al.'s glorot
    uniform U(-b, b), b = sqrt(6 / (H + H)), instead of the constant."""
    plain, gated = attention(), attention(gates={**GATES, "init": "glorot"})
    assert gated.head_gates.init == "glorot"
    state = {f"layer.{k}": v for k, v in plain.state_dict().items()}
    gated.upgrade_state_dict_named(state, "layer")
    added = state["layer.head_gates.log_alpha"]
    assert added.abs().max() <= (6 / (H + H)) ** 0.5 and added.unique().numel() == H
