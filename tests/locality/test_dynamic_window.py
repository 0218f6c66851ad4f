import itertools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from local_attn_fairseq.locality.dynamic_window import (
    DynamicWindow,
    prefix_and_suffix_sums,
    reverse_cumsum,
    soft_window_mask,
    sums_by_product,
)

D, H, HD = 12, 3, 4
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
aten = torch.ops.aten


def module(segment_size=None, dim=D):
    torch.manual_seed(0)
    return DynamicWindow(dim, dim, H, HD, segment_size)


def random_pointers(pad, rows, sharpness=2.0):
    """(bsz, rows, n) distributions over the real keys of each sentence, 0 on its pads."""
    logits = torch.randn(pad.size(0), rows, pad.size(1), dtype=torch.float64) * sharpness
    probs = torch.softmax(logits.masked_fill(pad[:, None, :], float("-inf")), -1)
    return probs.nan_to_num(0.0)  # only all-padding sentences produce NaN here


def brute_force_token_mask(phi_l, phi_r):
    """E[[l <= i <= r] + [r <= i <= l]] over all discrete pairs (l, r), phi_l x phi_r weighted."""
    n = phi_l.size(-1)
    mask = torch.zeros_like(phi_l)
    for left, right in itertools.product(range(n), range(n)):
        weight = phi_l[..., left] * phi_r[..., right]
        for i in range(n):
            flag = int(left <= i <= right) + int(right <= i <= left)
            mask[..., i] += weight * flag
    return mask


def brute_force_segment_mask(phi_l, phi_r, pad, b):
    """Eq. 11 with the explicit J_n of Eq. 10 over each sentence's real keys."""
    mask = torch.zeros_like(phi_l)
    for s in range(pad.size(0)):
        real = (~pad[s]).nonzero().flatten()
        n = len(real)
        if n == 0:
            continue
        ones_based = torch.arange(1, n + 1)
        # J[i, j] = 1 if i <= b * ceil(j / b) (rows i, columns j, 1-based)
        j_matrix = (ones_based[:, None] <= b * torch.ceil(ones_based[None, :] / b)).double()
        left, right = phi_l[s][..., real], phi_r[s][..., real]
        compact = (left @ j_matrix) * (right @ j_matrix.T) + (right @ j_matrix) * (
            left @ j_matrix.T
        )
        mask[s][..., real] = compact
    return mask


def padding(bsz_lengths, n, left):
    pad = torch.zeros(len(bsz_lengths), n, dtype=torch.bool)
    for s, length in enumerate(bsz_lengths):
        if left:
            pad[s, : n - length] = True
        else:
            pad[s, length:] = True
    return pad


# -- the mask from given pointers --------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 8])
@pytest.mark.parametrize("sharpness", [0.5, 5.0])
def test_token_mask_is_the_expectation_over_discrete_windows(n, sharpness):
    torch.manual_seed(n)
    pad = torch.zeros(2, n, dtype=torch.bool)
    phi_l, phi_r = random_pointers(pad, 3, sharpness), random_pointers(pad, 3, sharpness)
    mask = soft_window_mask(phi_l, phi_r)
    assert mask.dtype == torch.float32
    torch.testing.assert_close(mask, brute_force_token_mask(phi_l, phi_r).float())


@pytest.mark.parametrize("left", [True, False])
def test_token_mask_with_padding_is_the_expectation_over_real_keys(left):
    torch.manual_seed(1)
    pad = padding([8, 5, 1], 8, left)
    phi_l, phi_r = random_pointers(pad, 4), random_pointers(pad, 4)
    mask = soft_window_mask(phi_l, phi_r, key_padding_mask=pad)
    torch.testing.assert_close(mask, brute_force_token_mask(phi_l, phi_r).float())
    assert (mask[pad[:, None, :].expand_as(mask)] == 0).all()


def test_one_hot_pointers_give_the_discrete_window_and_count_a_collapsed_one_twice():
    def one_hot(i):
        return torch.eye(7)[i].view(1, 7)

    window = torch.tensor([0, 0, 1, 1, 1, 1, 0.0])
    torch.testing.assert_close(soft_window_mask(one_hot(2), one_hot(5))[0], window)
    torch.testing.assert_close(soft_window_mask(one_hot(5), one_hot(2))[0], window)  # crossed
    # Eq. 9 taken literally: both of its terms fire when l = r = i
    torch.testing.assert_close(soft_window_mask(one_hot(3), one_hot(3))[0], 2 * torch.eye(7)[3])


@pytest.mark.parametrize("b", [1, 2, 3, 5])
@pytest.mark.parametrize("left", [True, False])
def test_segment_mask_matches_the_J_matrix_definition(b, left):
    torch.manual_seed(b)
    pad = padding([8, 7, 4, 1], 8, left)  # 7 real keys with b = 2, 3, 5: a short last segment
    phi_l, phi_r = random_pointers(pad, 3), random_pointers(pad, 3)
    mask = soft_window_mask(phi_l, phi_r, segment_size=b, key_padding_mask=pad)
    expected = brute_force_segment_mask(phi_l, phi_r, pad, b).float()
    torch.testing.assert_close(mask, expected)


@pytest.mark.parametrize("left", [True, False])
def test_segment_mask_is_constant_within_each_segment_of_real_keys(left):
    torch.manual_seed(2)
    b, n, length = 3, 10, 8  # segments of real keys: 0-2, 3-5, 6-7
    pad = padding([length], n, left)
    phi_l, phi_r = random_pointers(pad, 5), random_pointers(pad, 5)
    mask = soft_window_mask(phi_l, phi_r, segment_size=b, key_padding_mask=pad)
    real = mask[..., ~pad[0]]
    for first, last in [(0, 3), (3, 6), (6, 8)]:
        segment = real[..., first:last]
        torch.testing.assert_close(segment, segment[..., :1].expand_as(segment))
    assert not torch.allclose(real[..., 2], real[..., 3])  # neighbouring segments differ
    assert (mask[..., pad[0]] == 0).all()


def test_segment_size_one_is_the_token_mask():
    torch.manual_seed(3)
    pad = padding([6, 3], 6, left=True)
    phi_l, phi_r = random_pointers(pad, 2), random_pointers(pad, 2)
    torch.testing.assert_close(
        soft_window_mask(phi_l, phi_r, 1, pad), soft_window_mask(phi_l, phi_r, None, pad)
    )


def test_reverse_cumsum_keeps_small_tails_accurate_and_zero_tails_zero():
    # a pointer sure of its first keys: P(pointer >= j) decays to 1e-12 and then is exactly 0;
    # total - cumsum would cancel these tails down to rounding noise of 1
    decaying = torch.cat([0.5 ** torch.arange(40, dtype=torch.float64), torch.zeros(3)])
    phi = (decaying / decaying.sum())[None]
    tail = reverse_cumsum(phi.float())
    exact = phi.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(tail[:, :40].double(), exact[:, :40], rtol=1e-5, atol=0.0)
    assert (tail[:, 40:] == 0).all()


@pytest.mark.parametrize("sums", [sums_by_product, prefix_and_suffix_sums])
def test_both_sums_of_the_product_are_the_scans_with_exact_zero_tails(sums):
    """The product with [L | L^T] (a GPU's route for up to MATMUL_SCAN_MAX_KEYS keys) gives
    what cumsum and reverse_cumsum give: small tails accurate, tails of zeros exactly 0, heads
    of zeros exactly 0, and the same gradients."""
    decaying = torch.cat([torch.zeros(2), 0.5 ** torch.arange(40.0), torch.zeros(3)])
    phi = torch.stack([decaying / decaying.sum(), torch.softmax(torch.randn(45), -1)])
    phi = phi[:, None].expand(2, 3, 45).float().requires_grad_()
    at_most, at_least = sums(phi)
    exact_most, exact_least = phi.double().cumsum(-1), reverse_cumsum(phi.double())
    torch.testing.assert_close(at_most.double(), exact_most, rtol=1e-5, atol=1e-7)
    nonzero = (slice(None), slice(None), slice(0, 42))
    torch.testing.assert_close(at_least[nonzero].double(), exact_least[nonzero], rtol=1e-5, atol=0)
    assert (at_least[0, :, 42:] == 0).all() and (at_most[0, :, :2] == 0).all()
    weights = torch.randn(2, 2, 3, 45)
    grad = torch.autograd.grad((at_most * weights[0] + at_least * weights[1]).sum(), phi)[0]
    expected = weights[0].flip(-1).cumsum(-1).flip(-1) + weights[1].cumsum(-1)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)


# -- the module ---------------------------------------------------------------------------------


def test_pointers_follow_eqs_7_and_8_per_head_over_real_keys():
    window = module()
    q, k = torch.randn(2, 4, D), torch.randn(2, 6, D)
    pad = padding([6, 4], 6, left=True)
    phi_l, phi_r = window.pointers(q, k, pad)
    (left_q, right_q), (left_k, right_k) = (
        window.query_pointers.weight.chunk(2),
        window.key_pointers.weight.chunk(2),
    )
    for phi, wq, wk in [(phi_l, left_q, left_k), (phi_r, right_q, right_k)]:
        for h in range(H):
            rows = slice(h * HD, (h + 1) * HD)
            logits = (q @ wq[rows].T) @ (k @ wk[rows].T).transpose(1, 2) / math.sqrt(HD)
            expected = torch.softmax(logits.masked_fill(pad[:, None, :], float("-inf")), -1)
            torch.testing.assert_close(phi[:, h], expected)


def test_forward_is_the_mask_of_its_recorded_pointers():
    window = module(segment_size=2)
    window.record = True
    q, k = torch.randn(2, 3, D), torch.randn(2, 7, D)
    pad = padding([7, 5], 7, left=True)
    mask = window(q, k, pad)
    assert mask.shape == (2, H, 3, 7) and mask.dtype == torch.float32
    phi_l, phi_r = window.last_pointers
    torch.testing.assert_close(mask, soft_window_mask(phi_l, phi_r, 2, pad))
    torch.testing.assert_close(phi_l.sum(-1), torch.ones(2, H, 3))


@pytest.mark.parametrize("segment_size", [None, 3])
def test_left_and_right_padding_give_the_unpadded_mask_on_real_keys(segment_size):
    window = module(segment_size)
    q, k = torch.randn(1, 4, D), torch.randn(1, 5, D)
    alone = window(q, k, None)
    garbage = torch.randn(1, 2, D) * 100  # whatever sits under the pads must not matter
    left = window(q, torch.cat([garbage, k], 1), padding([5], 7, left=True))
    right = window(q, torch.cat([k, garbage], 1), padding([5], 7, left=False))
    torch.testing.assert_close(left[..., 2:], alone)
    torch.testing.assert_close(right[..., :5], alone)
    assert (left[..., :2] == 0).all() and (right[..., 5:] == 0).all()


@pytest.mark.parametrize("tgt_len,src_len", [(6, 6), (3, 7)])
def test_causal_block_equals_decoding_query_by_query(tgt_len, src_len):
    window = module()
    states = torch.randn(2, src_len, D)
    pad = padding([src_len, src_len - 2], src_len, left=False)  # targets are right-padded
    block = window(states[:, src_len - tgt_len :], states, pad, causal=True)
    for t in range(tgt_len):
        position = src_len - tgt_len + t
        keys = slice(0, position + 1)
        step = window(states[:, position : position + 1], states[:, keys], pad[:, keys], True)
        torch.testing.assert_close(block[:, :, t, keys], step[:, :, 0])
        assert (block[:, :, t, position + 1 :] == 0).all()  # exactly: no future leaks


def gradients(window, mask):
    torch.manual_seed(5)
    (mask * torch.randn_like(mask)).sum().backward()
    return {name: p.grad for name, p in window.named_parameters()}


@pytest.mark.parametrize("segment_size", [None, 2])
def test_gradients_reach_all_four_pointer_projections(segment_size):
    window = module(segment_size)
    pad = padding([6, 4], 6, left=True)
    mask = window(torch.randn(2, 5, D), torch.randn(2, 6, D), pad)
    grads = gradients(window, mask)
    assert set(grads) == {"query_pointers.weight", "key_pointers.weight"}
    for name, grad in grads.items():
        for side, half in zip(("left", "right"), grad.chunk(2)):  # W_L and W_R both learn
            assert torch.isfinite(half).all() and half.abs().sum() > 0, (name, side)


@pytest.mark.parametrize("segment_size,causal", [(None, False), (3, False), (None, True)])
def test_a_sentence_without_real_keys_gives_zero_rows_and_finite_gradients(segment_size, causal):
    window = module(segment_size)
    pad = padding([5, 0], 5, left=True)
    if causal:
        pad[0, :2] = True  # a left-padded target: its first two queries see no real key
    q, k = torch.randn(2, 5, D, requires_grad=True), torch.randn(2, 5, D, requires_grad=True)
    mask = window(q, k, pad, causal=causal)
    assert (mask[1] == 0).all() and torch.isfinite(mask).all()
    for phi in window.pointers(q, k, pad, causal):  # kept for analysis: zeros, not NaN
        assert (phi[1] == 0).all() and torch.isfinite(phi).all()
    if causal:
        assert (mask[0, :, :2] == 0).all() and (mask[0, :, 2:] != 0).any()
    grads = gradients(window, mask)
    for tensor in [*grads.values(), q.grad, k.grad]:
        assert torch.isfinite(tensor).all()
    assert (q.grad[1] == 0).all() and all(g.abs().sum() > 0 for g in grads.values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("segment_size", [None, 2])
def test_half_precision_inputs_give_finite_float32_masks(dtype, segment_size):
    window = module(segment_size)
    q, k = torch.randn(2, 4, D), torch.randn(2, 6, D)
    pad = padding([6, 3], 6, left=True)
    reference = window(q.to(dtype).float(), k.to(dtype).float(), pad)
    low = window.to(dtype)
    mask = low(q.to(dtype), k.to(dtype), pad)
    assert mask.dtype == torch.float32
    torch.testing.assert_close(mask, reference, atol=0.05, rtol=0.05)
    # q.k of these would overflow float16 (65504): the logits must be formed in float32
    huge = low((q * 300).to(dtype), (k * 300).to(dtype), pad)
    assert torch.isfinite(huge).all() and huge.dtype == torch.float32


class TensorRecorder(TorchDispatchMode):
    """Records the largest tensor produced and what every matrix product contracts over."""

    PRODUCTS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default}

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.contracted = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        if func in self.PRODUCTS:
            first_matrix = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2][0]
            self.contracted.add(first_matrix.size(-1))
        return out


@pytest.mark.parametrize("segment_size,causal", [(None, True), (5, False)])
def test_long_sequence_needs_no_key_by_key_product_nor_cubic_memory(segment_size, causal):
    # An n x n triangular matmul contracts over the keys; an n^3 intermediate at n = 2048 would
    # be 34 GB (and exceed the bound below long before that).
    length = 2048
    window = DynamicWindow(8, 8, 1, 4, segment_size)
    states = torch.randn(1, length, 8)
    pad = padding([length - 3], length, left=not causal)
    recorder = TensorRecorder()
    with torch.no_grad(), recorder:
        mask = window(states, states, pad, causal=causal)
    # bsz * heads * tgt_len * src_len for each of the two pointers, computed stacked
    assert recorder.largest <= 2 * length * length
    assert recorder.contracted and length not in recorder.contracted
    assert mask.shape == (1, 1, length, length) and torch.isfinite(mask).all()


@needs_cuda
@pytest.mark.parametrize("segment_size,causal", [(None, True), (3, False)])
def test_cuda_matches_cpu(segment_size, causal):
    window = module(segment_size)
    q, k = torch.randn(2, 5, D), torch.randn(2, 7, D)
    pad = padding([7, 4], 7, left=not causal)
    expected = window(q if not causal else k[:, 2:], k, pad, causal)
    gpu = window.cuda()
    mask = gpu((q if not causal else k[:, 2:]).cuda(), k.cuda(), pad.cuda(), causal)
    torch.testing.assert_close(mask.cpu(), expected)


@needs_cuda
@pytest.mark.parametrize("length", [3, 40, 256, 300])  # the product up to 256 keys, then scans
@pytest.mark.parametrize("segment_size,causal", [(None, True), (None, False), (4, False)])
def test_cuda_masks_and_gradients_match_cpu_on_both_scans(length, segment_size, causal):
    window = module(segment_size)
    states = torch.randn(3, length, D)
    pad = padding([length, length - 2, 1], length, left=not causal)
    grad_mask = torch.randn(3, H, length, length)
    results = []
    for device in ("cpu", "cuda"):
        window.to(device).zero_grad()
        mask = window(states.to(device), states.to(device), pad.to(device), causal)
        (mask * grad_mask.to(device)).sum().backward()
        # copies: Module.to moves the gradients of the parameters along with them
        results.append((mask.cpu(), [p.grad.detach().cpu().clone() for p in window.parameters()]))
    (cpu_mask, cpu_grads), (gpu_mask, gpu_grads) = results
    torch.testing.assert_close(gpu_mask, cpu_mask, rtol=1e-4, atol=1e-5)
    assert torch.equal(gpu_mask == 0, cpu_mask == 0)  # masked and future keys exactly 0
    for gpu_grad, cpu_grad in zip(gpu_grads, cpu_grads):
        torch.testing.assert_close(gpu_grad, cpu_grad, rtol=1e-3, atol=1e-4)


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("segment_size", [0, -2, 2.5, True, "5"])
def test_bad_segment_sizes_are_rejected(segment_size):
    with pytest.raises(ValueError, match="segment_size"):
        DynamicWindow(D, D, H, HD, segment_size)
    with pytest.raises(ValueError, match="segment_size"):
        soft_window_mask(torch.ones(1, 2) / 2, torch.ones(1, 2) / 2, segment_size)


@pytest.mark.parametrize("dims", [(0, D, H, HD), (D, D, 0, HD), (D, D, H, 0)])
def test_non_positive_dimensions_are_rejected(dims):
    with pytest.raises(ValueError, match="positive"):
        DynamicWindow(*dims)


def test_causal_segments_are_rejected():
    states = torch.randn(1, 4, D)
    with pytest.raises(ValueError, match="segment that is not finished"):
        module(segment_size=2)(states, states, None, causal=True)


def test_inconsistent_inputs_are_rejected():
    window = module()
    with pytest.raises(ValueError, match="key_padding_mask"):
        window(torch.randn(1, 3, D), torch.randn(1, 4, D), torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="causal block"):
        window(torch.randn(1, 5, D), torch.randn(1, 4, D), None, causal=True)
    with pytest.raises(ValueError, match="expected query"):
        window(torch.randn(3, D), torch.randn(1, 4, D), None)
