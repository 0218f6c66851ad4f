"""The C++ operators of the per-head mechanisms (ops/mechanisms.py): gradients, the PyTorch
definitions they replace, and the attention module that uses them."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from local_attn_fairseq.locality.dynamic_window import DynamicWindow, segment_bounds
from local_attn_fairseq.locality.gaussian import GaussianLocalness
from local_attn_fairseq.locality.spec import HeadSpec
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention
from local_attn_fairseq.ops import extension_info, mechanisms

from ..modules.helpers import decode_step_by_step

pytestmark = pytest.mark.skipif(
    not (extension_info()["loaded"] and mechanisms.cpu_operators_apply(torch.zeros(1))),
    reason="extension not built",
)
B, T, S, H, DIM = 2, 4, 5, 2, 6


def padding(bsz, src_len, rows=((0, slice(0, 2)),)):
    mask = torch.zeros(bsz, src_len, dtype=torch.bool)
    for row, keys in rows:
        mask[row, keys] = True
    return mask


# -- gradients, float64 --------------------------------------------------------------------------


def gaussian_parameters(tgt, given_window):
    """The Gaussian bias's float64 queries (B, tgt, DIM), W_p, U_p, and U_d or the windows."""
    torch.manual_seed(0)
    dbl = dict(dtype=torch.float64, requires_grad=True)
    query = torch.randn(B, tgt, DIM, **dbl)
    w_p, u_p = torch.randn(DIM, DIM, **dbl), torch.randn(H, DIM, **dbl)
    u_d = None if given_window else torch.randn(H, DIM, **dbl)
    window = torch.rand(H, **dbl) * 4 + 0.5 if given_window else None
    return query, w_p, u_p, u_d, window


@pytest.mark.parametrize("given_window, logits, causal", itertools.product([False, True], repeat=3))
def test_gaussian_localness_gradients(given_window, logits, causal):
    tgt = S if causal else T
    dbl = dict(dtype=torch.float64, requires_grad=True)
    query, w_p, u_p, u_d, window = gaussian_parameters(tgt, given_window)
    real = (~padding(B, S)).double()
    positions = real.cumsum(-1) - 1
    seen = real.cumsum(-1)[:, S - tgt :] if causal else real.sum(-1, keepdim=True).expand(-1, tgt)
    bias_logits = torch.randn(B, H, tgt, S, **dbl) if logits else None

    def bias(*args):
        *inputs, logits = args
        return mechanisms.gaussian_localness(gaussian_inputs(*inputs), logits)[0]

    args = (query, w_p, u_p, u_d, seen - 1, seen, positions, window, bias_logits)
    assert torch.autograd.gradcheck(bias, args)


def gaussian_inputs(*tensors):
    return mechanisms.GaussianInputs(*tensors, window_offset=0.1, min_window=1e-4)


@pytest.mark.parametrize(
    "given_window, extra_bias, pad, causal",
    [(False, False, False, False), (True, True, True, False), (False, True, True, True),
     (True, False, False, True)],
)  # fmt: skip
def test_gaussian_attention_gradients(given_window, extra_bias, pad, causal):
    """The Gaussian bias and the attention in one call: the gradients, and the same values as
    the two operators one after the other."""
    torch.manual_seed(0)
    tgt = S if causal else T
    dbl = dict(dtype=torch.float64, requires_grad=True)
    q = torch.randn(B, H, tgt, 3, **dbl)
    k, v = torch.randn(B, H, S, 3, **dbl), torch.randn(B, H, S, 3, **dbl)
    query = torch.randn(B, tgt, DIM, **dbl)
    w_p, u_p = torch.randn(DIM, DIM, **dbl), torch.randn(H, DIM, **dbl)
    u_d = None if given_window else torch.randn(H, DIM, **dbl)
    window = torch.rand(H, **dbl) * 4 + 0.5 if given_window else None
    # the second sentence is all padding: its queries have no key
    key_padding_mask = padding(B, S, [(0, slice(0, 1)), (1, slice(None))]) if pad else None
    real = torch.ones(B, S, dtype=torch.float64)
    if pad:
        real = (~key_padding_mask).double()
    positions = real.cumsum(-1) - 1
    seen = real.cumsum(-1)[:, S - tgt :] if causal else real.sum(-1, keepdim=True).expand(-1, tgt)
    future = torch.triu(torch.full((tgt, S), float("-inf"), dtype=torch.float64), 1 + S - tgt)
    attn_mask = future if causal else None
    extra = torch.randn(B, H, tgt, S, **dbl) if extra_bias else None
    keep = torch.rand(B, H, tgt, S) >= 0.3
    rest = mechanisms.AttentionInputs(attn_mask, key_padding_mask, keep, 0.7, 0.3)

    def attention(q, k, v, query, w_p, u_p, *optional):
        it = iter(optional)
        u_d_, window_, extra_ = (next(it) if t is not None else None for t in (u_d, window, extra))
        inputs = gaussian_inputs(query, w_p, u_p, u_d_, seen, seen, positions, window_)
        return mechanisms.gaussian_attention(q, k, v, inputs, extra_, None, rest)[0]

    optional = [t for t in (u_d, window, extra) if t is not None]
    args = (q, k, v, query, w_p, u_p, *optional)
    assert torch.autograd.gradcheck(attention, args)
    inputs = gaussian_inputs(query, w_p, u_p, u_d, seen, seen, positions, window)
    bias = mechanisms.gaussian_localness(inputs, extra)[0]
    expected = mechanisms.dense_attention(q, k, v, bias, None, rest)
    torch.testing.assert_close(attention(*args), expected)


def window_case(segments, pad, causal):
    """A window's operator inputs in float64 (query, w_q and keys requiring gradients), with the
    key padding mask and the queries' number."""
    torch.manual_seed(0)
    window = DynamicWindow(DIM, DIM, H, 3, segments).double()
    tgt = S if causal else T
    query = torch.randn(B, tgt, DIM, dtype=torch.float64, requires_grad=True)
    keys = window.project_keys(torch.randn(B, S, DIM, dtype=torch.float64)).double().detach()
    keys.requires_grad_(True)
    key_padding_mask = padding(B, S) if pad else None
    visible = window.visible_keys(key_padding_mask, causal, B, tgt, S)
    real = ~padding(B, S) if pad else (torch.ones(B, S, dtype=torch.bool) if segments else None)
    bounds = segment_bounds(real, segments) if segments else None
    w_q = window.query_pointers.weight.detach().requires_grad_(True)

    def inputs(query, w_q, keys):
        return mechanisms.window_inputs(query, w_q, keys, visible, real, bounds)

    return inputs, (query, w_q, keys), key_padding_mask, tgt


WINDOW_CASES = [(None, False, False), (None, True, False), (2, True, False), (None, True, True)]


@pytest.mark.parametrize("segments, pad, causal", WINDOW_CASES)
def test_dynamic_window_mask_gradients(segments, pad, causal):
    inputs, window_args, _, _ = window_case(segments, pad, causal)

    def mask(*window_args):
        return mechanisms.dynamic_window_mask(inputs(*window_args))[0]

    assert torch.autograd.gradcheck(mask, window_args)


def local_scores(tgt, local_bias):
    dbl = dict(dtype=torch.float64, requires_grad=True)
    local_w, local_keys = torch.randn(H * 4, DIM, **dbl), torch.randn(B, H, S, 4, **dbl)
    local_b = torch.randn(H * 4, **dbl) if local_bias else None
    return [local_w, local_keys, *([local_b] if local_bias else [])]


def local_inputs(local_w, local_keys, *local_b):
    return mechanisms.LocalScoreInputs(local_w, local_b[0] if local_b else None, local_keys, 0.3)


@pytest.mark.parametrize(
    "segments, pad, causal, local_bias",
    [case + (bias,) for case, bias in zip(WINDOW_CASES, (True, False, True, True))],
)
def test_additive_window_term_gradients(segments, pad, causal, local_bias):
    inputs, window_args, _, tgt = window_case(segments, pad, causal)
    local_args = local_scores(tgt, local_bias)

    def term(*args):
        return mechanisms.additive_window_term(inputs(*args[:3]), local_inputs(*args[3:]))[0]

    args = (*window_args, *local_args)
    assert torch.autograd.gradcheck(term, args)
    # the term is the local scores times the mask of dynamic_window_mask
    mask = mechanisms.dynamic_window_mask(inputs(*window_args))[0]
    local_w, local_keys, *local_b = local_args
    local_q = (window_args[0] @ local_w.t() + (local_b[0] if local_b else 0)) * 0.3
    local_q = local_q.view(B, tgt, H, 4).transpose(1, 2)
    expected = (local_q @ local_keys.transpose(-1, -2)) * mask
    torch.testing.assert_close(term(*args), expected)


@pytest.mark.parametrize(
    "additive, segments, pad, causal, given_terms",
    [(additive, *case, given) for additive in (False, True)
     for case, given in zip(WINDOW_CASES, (False, True, False, True))],
)  # fmt: skip
def test_window_attention_gradients(additive, segments, pad, causal, given_terms):
    """A window's mask (MW) or term (AW) and the attention in one call: the gradients, and the
    same values as the window's operator and the dense attention one after the other."""
    inputs, window_args, key_padding_mask, tgt = window_case(segments, pad, causal)
    dbl = dict(dtype=torch.float64, requires_grad=True)
    q = torch.randn(B, H, tgt, 3, **dbl)
    k, v = torch.randn(B, H, S, 3, **dbl), torch.randn(B, H, S, 3, **dbl)
    local_args = local_scores(tgt, True) if additive else []
    # a bias beside the window's own term, and a multiplier (Pande's masks) beside its mask
    bias = torch.randn(B, H, tgt, S, **dbl) if given_terms else None
    multiplier = (torch.rand(B, H, tgt, S, dtype=torch.float64) * 2) if given_terms else None
    future = torch.triu(torch.full((tgt, S), float("-inf"), dtype=torch.float64), 1 + S - tgt)
    keep = torch.rand(B, H, tgt, S) >= 0.3
    rest = mechanisms.AttentionInputs(
        future if causal else None, key_padding_mask, keep, 0.7, 0.3
    )

    def attention(q, k, v, *args):
        local_part, extra = args[3 : 3 + len(local_args)], args[3 + len(local_args) :]
        local = local_inputs(*local_part) if additive else None
        return mechanisms.window_attention(
            q, k, v, inputs(*args[:3]), local, extra[0] if extra else None, multiplier, rest
        )[0]

    args = (q, k, v, *window_args, *local_args, *([bias] if given_terms else []))
    assert torch.autograd.gradcheck(attention, args)
    if additive:
        term = mechanisms.additive_window_term(inputs(*window_args), local_inputs(*local_args))[0]
        total = term if bias is None else term + bias
        expected = mechanisms.dense_attention(q, k, v, total, multiplier, rest)
    else:
        mask = mechanisms.dynamic_window_mask(inputs(*window_args))[0]
        total = mask if multiplier is None else mask * multiplier
        expected = mechanisms.dense_attention(q, k, v, bias, total, rest)
    torch.testing.assert_close(attention(*args), expected)


@pytest.mark.parametrize(
    "bias, multiplier, attn_mask, pad", itertools.product([False, True], repeat=4)
)
def test_dense_attention_gradients(bias, multiplier, attn_mask, pad):
    torch.manual_seed(0)
    dbl = dict(dtype=torch.float64, requires_grad=True)
    q = torch.randn(B, H, T, 3, **dbl)
    k, v = torch.randn(B, H, S, 3, **dbl), torch.randn(B, H, S, 3, **dbl)
    terms = [torch.randn(B, H, T, S, **dbl) if bias else None,
             torch.rand(B, H, T, S, **dbl) * 2 if multiplier else None]  # fmt: skip
    future = torch.triu(torch.full((T, S), float("-inf"), dtype=torch.float64), 2)
    # the second sentence is all padding: its queries have no key
    key_padding_mask = padding(B, S, [(0, slice(0, 1)), (1, slice(None))]) if pad else None
    keep = torch.rand(B, H, T, S) >= 0.3

    def attention(q, k, v, *given):  # gradcheck passes only the terms that are tensors
        it = iter(given)
        bias, multiplier = (next(it) if t is not None else None for t in terms)
        rest = mechanisms.AttentionInputs(
            future if attn_mask else None, key_padding_mask, keep, 0.7, 0.3
        )
        return mechanisms.dense_attention(q, k, v, bias, multiplier, rest)

    inputs = (q, k, v, *[t for t in terms if t is not None])
    assert torch.autograd.gradcheck(attention, inputs)


def projection_inputs(dtype):
    """x (len 5, bsz 3, dim 7) and three projections of 2, 1 and 3 heads of 4, one of them
    without a bias."""
    torch.manual_seed(0)
    x = torch.randn(5, 3, 7, dtype=dtype, requires_grad=True)
    rows = (8, 4, 12)
    weights = [torch.randn(n, 7, dtype=dtype, requires_grad=True) for n in rows]
    biases = [torch.randn(8, dtype=dtype, requires_grad=True), None,
              torch.randn(12, dtype=dtype, requires_grad=True)]  # fmt: skip
    return x, weights, biases


def test_project_heads_gradients():
    x, weights, biases = projection_inputs(torch.float64)

    def project(x, w0, w1, w2, b0, b2):
        return mechanisms.project_heads(x, [(w0, b0), (w1, None), (w2, b2)], 4)

    assert torch.autograd.gradcheck(project, (x, *weights, biases[0], biases[2]))


def test_project_heads_is_f_linear_split_into_heads():
    x, weights, biases = projection_inputs(torch.float32)
    ours = mechanisms.project_heads(x, list(zip(weights, biases)), 4)

    def reference():
        return [F.linear(x, w, b).view(5, 3, -1, 4).permute(1, 2, 0, 3)
                for w, b in zip(weights, biases)]  # fmt: skip

    ref = reference()
    leaves = [x, *weights, biases[0], biases[2]]
    grad_outputs = [torch.randn(r.shape) for r in ref]
    grads = torch.autograd.grad(ours, leaves, grad_outputs)
    ref_grads = torch.autograd.grad(ref, leaves, grad_outputs)
    for out, expected in zip(ours, ref):
        assert out.shape == expected.shape and torch.equal(out, expected)  # the same product
    for grad, expected in zip(grads, ref_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)
    # an output outside the loss: its weight's gradient is zero, the others' as before
    ours = mechanisms.project_heads(x, list(zip(weights, biases)), 4)
    grads = torch.autograd.grad(ours[0].sum() + ours[2].sum(), weights)
    assert not grads[1].any()
    ref = reference()
    ref_grads = torch.autograd.grad(ref[0].sum() + ref[2].sum(), [weights[0], weights[2]])
    torch.testing.assert_close([grads[0], grads[2]], list(ref_grads), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # inference: the same outputs, no graph
        plain = mechanisms.project_heads(x, list(zip(weights, biases)), 4)
    assert all(torch.equal(a, b) and a.grad_fn is None for a, b in zip(plain, ours))


def test_project_heads_refuses_bad_input():
    x, weights, biases = projection_inputs(torch.float32)
    with pytest.raises(RuntimeError, match=r"weight 0 must be \(heads \* 3, 7\)"):
        mechanisms.project_heads(x, [(weights[0], None)], 3)  # 8 rows: not heads of 3
    with pytest.raises(RuntimeError, match="bias 0 must be"):
        mechanisms.project_heads(x, [(weights[0], biases[2])], 4)
    with pytest.raises(RuntimeError, match="weight 1 must be a Float CPU tensor"):
        mechanisms.project_heads(x, [(weights[0], None), (weights[1].double(), None)], 4)
    with pytest.raises(RuntimeError, match=r"x must be \(len, bsz, dim\)"):
        mechanisms.project_heads(x[0], [(weights[0], None)], 4)


# -- the operators against the PyTorch definitions ---------------------------------------------


def outputs_and_gradients(monkeypatch, impl, compute, leaves, seed=1):
    monkeypatch.setenv(mechanisms.IMPL_ENV, impl)
    for leaf in leaves:
        leaf.grad = None
    torch.manual_seed(seed)
    out = compute()
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))
    return out.detach(), [leaf.grad.clone() for leaf in leaves]


def assert_same_on_both_routes(monkeypatch, compute, leaves):
    out, grads = outputs_and_gradients(monkeypatch, "auto", compute, leaves)
    ref_out, ref_grads = outputs_and_gradients(monkeypatch, "torch", compute, leaves)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "strategy, centre, causal, pad, logits",
    [(s, c, causal, pad, logits) for s in ("query", "fixed", "head") for c in ("paper", "code")
     for causal, pad, logits in ((False, False, True), (True, True, True), (False, True, False))],
)  # fmt: skip
def test_gaussian_operator_matches_pytorch(monkeypatch, strategy, centre, causal, pad, logits):
    torch.manual_seed(0)
    loc = GaussianLocalness(DIM, DIM, H, strategy, fixed_window=3.0, max_window=6.0, centre=centre)
    if loc.z is not None:
        torch.nn.init.normal_(loc.z)
    tgt = S if causal else T
    q = torch.randn(B, tgt, DIM, requires_grad=True)
    k = torch.randn(B, S, DIM)
    extra = torch.randn(B, H, tgt, S, requires_grad=True) if logits else None
    leaves = [q, *loc.parameters()] + ([extra] if logits else [])
    mask = padding(B, S) if pad else None
    assert_same_on_both_routes(monkeypatch, lambda: loc(q, k, mask, causal, extra)[0], leaves)


@pytest.mark.parametrize("segments, causal, pad", [(None, False, False), (None, True, True),
                                                   (1, False, True), (3, False, True)])  # fmt: skip
def test_window_operator_matches_pytorch(monkeypatch, segments, causal, pad):
    torch.manual_seed(0)
    window = DynamicWindow(DIM, DIM, H, 3, segments)
    tgt = S if causal else T
    query = torch.randn(B, tgt, DIM, requires_grad=True)
    key = torch.randn(B, S, DIM, requires_grad=True)
    mask = padding(B, S, [(0, slice(0, 2)), (1, slice(None))]) if pad else None
    leaves = [query, key, *window.parameters()]
    assert_same_on_both_routes(monkeypatch, lambda: window(query, key, mask, causal), leaves)
    window.record = True
    window(query, key, mask, causal)
    monkeypatch.setenv(mechanisms.IMPL_ENV, "torch")
    recorded = window.last_pointers
    window(query, key, mask, causal)
    for ours, ref in zip(recorded, window.last_pointers):
        torch.testing.assert_close(ours, ref)


# -- the attention module ----------------------------------------------------------------------

E, HEADS = 16, 4
LAYOUTS = {
    "gaussian": [HeadSpec(gaussian=True)] * HEADS,
    "mw": [HeadSpec(window="mw")] * HEADS,
    "aw": [HeadSpec(window="aw")] * HEADS,
    "aw-seg2 and gaussian": [HeadSpec(window="aw", segment=2, gaussian=True)] * HEADS,
    "mw and gaussian": [HeadSpec(window="mw", gaussian=True)] * HEADS,
    "aw and pande": [HeadSpec(m, window="aw") for m in ("prev-1", "next-1", "band-1", "global")],
    "pande and mw": [HeadSpec(m, window="mw") for m in ("prev-1", "next-1", "band-1", "global")],
    "pande": [HeadSpec(m) for m in ("prev-1", "next-1", "band-1", "global")],
}


def module(layout, causal=False, dropout=0.0):
    torch.manual_seed(0)
    attn = LocalMultiheadAttention(
        E, HEADS, head_specs=LAYOUTS[layout], causal=causal, self_attention=True, dropout=dropout
    )
    attn.bind_qk_owners([attn])
    return attn


ATTENTION_OPERATORS = ("dense_attention", "gaussian_attention", "window_attention")


def count_operator_calls(monkeypatch, name="dense_attention"):
    calls = []
    operator = getattr(mechanisms, name)

    def counted(*args):
        calls.append(1)
        return operator(*args)

    monkeypatch.setattr(mechanisms, name, counted)
    return calls


@pytest.mark.parametrize(
    "layout, causal",
    # segments cannot be causal (a decoder cannot point into an unfinished segment)
    [(layout, causal) for layout in sorted(LAYOUTS) for causal in (False, True)
     if not (causal and "seg" in layout)],
)  # fmt: skip
def test_module_with_terms_operator_matches_pytorch(monkeypatch, layout, causal):
    attn = module(layout, causal).train()
    x = torch.randn(6, 3, E, requires_grad=True)
    # left padding, and a sentence that is all padding (its outputs are zeros)
    pad = padding(3, 6, [(0, slice(0, 2)), (2, slice(None))])
    future = torch.triu(torch.full((6, 6), float("-inf")), 1) if causal else None
    calls = {name: count_operator_calls(monkeypatch, name) for name in ATTENTION_OPERATORS}
    projections = count_operator_calls(monkeypatch, "project_heads")

    def forward():
        return attn(x, x, x, key_padding_mask=pad, need_weights=False, attn_mask=future)[0]

    assert_same_on_both_routes(monkeypatch, forward, [x, *attn.parameters()])
    assert len(projections) == 1  # q, k, v, pointer keys and local keys in one call
    # one call for the attention (the "torch" route made none), which takes the Gaussian bias,
    # else the window's mask or term, in the same call
    windows = "mw" in layout or "aw" in layout
    expected = "gaussian" if "gaussian" in layout else "window" if windows else "dense"
    assert {name: len(made) for name, made in calls.items()} == {
        name: int(name.startswith(expected)) for name in ATTENTION_OPERATORS
    }
    out = forward()
    assert torch.isfinite(out).all() and not out[:, 2].any()


PROJECTED_LAYOUTS = {
    "plain": [HeadSpec()] * HEADS,
    "local": [HeadSpec("local-2")] * HEADS,
    "tied": [HeadSpec(m, (0, 0) if h else None)
             for h, m in enumerate(("prev-1", "next-1", "band-1", "global"))],
    "two windows": [HeadSpec(window="mw")] * 2 + [HeadSpec(window="aw", segment=2)] * 2,
}  # fmt: skip


@pytest.mark.parametrize(
    "layout, cross", [(layout, False) for layout in PROJECTED_LAYOUTS] + [("two windows", True)]
)
def test_module_projects_the_keys_in_one_call(monkeypatch, layout, cross):
    """Self-attention projects q, k, v and the windows' keys in one call, encoder-decoder
    attention (keys of another width) k, v and the windows' keys; as nn.Linear does."""
    torch.manual_seed(0)
    kdim = 12 if cross else None
    attn = LocalMultiheadAttention(
        E, HEADS, kdim=kdim, vdim=kdim, head_specs=PROJECTED_LAYOUTS[layout],
        self_attention=not cross, encoder_decoder_attention=cross,
    ).train()  # fmt: skip
    attn.bind_qk_owners([attn])
    x = torch.randn(6, 3, E, requires_grad=True)
    keys = torch.randn(7, 3, 12, requires_grad=True) if cross else x
    pad = padding(3, keys.size(0), [(0, slice(0, 2))])
    projections = count_operator_calls(monkeypatch, "project_heads")

    def forward():
        return attn(x, keys, keys, key_padding_mask=pad, need_weights=False)[0]

    leaves = [x, *attn.parameters()] + ([keys] if cross else [])
    assert_same_on_both_routes(monkeypatch, forward, leaves)
    assert len(projections) == 1


@pytest.mark.parametrize("layout", ["gaussian", "aw"])
def test_module_decodes_step_by_step_through_the_operators(monkeypatch, layout):
    attn = module(layout, causal=True).eval()
    x = torch.randn(5, 2, E)
    future = torch.triu(torch.full((5, 5), float("-inf")), 1)
    full = attn(x, x, x, need_weights=False, attn_mask=future)[0]
    operator = {"gaussian": "gaussian_attention", "aw": "window_attention"}[layout]
    calls = count_operator_calls(monkeypatch, operator)
    steps = decode_step_by_step(attn, x, need_weights=False)  # as fairseq's decoder calls it
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)
    assert len(calls) == x.size(0)  # every step through the operator
    # the explicit path, which returns the weights, decodes the same
    steps = decode_step_by_step(attn, x)
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)


def test_module_dropout_is_the_drawn_mask(monkeypatch):
    """With dropout the operator drops the weights its keep mask says, scaled by 1 / (1 - p)."""
    attn = module("pande", dropout=0.4).train()  # Pande's masks: the multiplier
    x = torch.randn(5, 2, E)
    seen = {}
    dense = mechanisms.dense_attention

    def keep_arguments(*args):
        seen["args"] = args
        return dense(*args)

    monkeypatch.setattr(mechanisms, "dense_attention", keep_arguments)
    torch.manual_seed(3)
    out = attn(x, x, x, need_weights=False)[0]
    q, k, v, bias, multiplier, (_, _, keep, scale, p) = seen["args"]
    assert p == 0.4 and keep is not None and not keep.all() and keep.any()
    weights = torch.softmax(scale * q @ k.transpose(-1, -2), -1) * multiplier * keep / (1 - p)
    expected = attn._merge_heads(weights @ v, 5, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_operators_refuse_bad_input():
    q = torch.randn(B, H, T, 3)
    plain = mechanisms.AttentionInputs(None, None, None, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="bias must be"):
        mechanisms.dense_attention(q, q, q, torch.zeros(1), None, plain)
    with pytest.raises(RuntimeError, match="dropout_keep"):
        mechanisms.dense_attention(q, q, q, None, None, plain._replace(dropout_p=0.1))
    with pytest.raises(RuntimeError, match="float32 or float64"):
        half = q.half()
        mechanisms.dense_attention(half, half, half, None, None, plain)
    with pytest.raises(RuntimeError, match="not both"):
        w = torch.randn(DIM, DIM)
        inputs = mechanisms.GaussianInputs(
            torch.randn(B, T, DIM), w, torch.randn(H, DIM), None, torch.ones(B, T),
            torch.ones(B, T), torch.zeros(B, S), None, 0.0, 1e-4,
        )  # fmt: skip
        mechanisms.gaussian_localness(inputs, None)


def test_the_switch_keeps_every_call_in_pytorch(monkeypatch):
    q = torch.zeros(2)
    monkeypatch.setenv(mechanisms.IMPL_ENV, "torch")
    assert not mechanisms.cpu_operators_apply(q)
    monkeypatch.setenv(mechanisms.IMPL_ENV, "auto")
    assert mechanisms.cpu_operators_apply(q)
    assert not mechanisms.cpu_operators_apply(q, q.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # its casts are PyTorch's operations'
        assert not mechanisms.cpu_operators_apply(q)
    monkeypatch.setenv(mechanisms.IMPL_ENV, "fast")
    with pytest.raises(ValueError, match="LOCAL_ATTN_MECHANISM_IMPL"):
        mechanisms.cpu_operators_apply(q)


def test_aw_layer_records_the_pointers_it_used(monkeypatch):
    """The learned-windows analysis reads the pointers of the one-call AW term as of the mask."""
    attn = module("aw").eval()
    x = torch.randn(6, 2, E)
    pad = padding(2, 6, [(0, slice(0, 2))])
    recorded = {}
    for impl in ("auto", "torch"):
        monkeypatch.setenv(mechanisms.IMPL_ENV, impl)
        attn.dynamic_windows[0].record = True
        attn(x, x, x, key_padding_mask=pad, need_weights=False)
        recorded[impl] = attn.dynamic_windows[0].last_pointers
    for ours, ref in zip(recorded["auto"], recorded["torch"]):
        torch.testing.assert_close(ours, ref)


def test_gaussian_layer_records_its_centres_and_windows(monkeypatch):
    """The analysis reads the centres and windows of the one-call Gaussian layer as of the
    PyTorch route."""
    attn = module("gaussian").eval()
    attn.record_localness = True
    x = torch.randn(6, 2, E)
    pad = padding(2, 6, [(0, slice(0, 2))])
    recorded = {}
    for impl in ("auto", "torch"):
        monkeypatch.setenv(mechanisms.IMPL_ENV, impl)
        attn(x, x, x, key_padding_mask=pad, need_weights=False)
        recorded[impl] = attn.last_localness
    for ours, ref in zip(recorded["auto"], recorded["torch"]):
        torch.testing.assert_close(ours, ref)
