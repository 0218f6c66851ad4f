"""Every mechanism of LocalMultiheadAttention in bfloat16 and float16: finite outputs and
gradients close to float32, sentences without a real key give zeros, head gates whose gradient
sums beyond float16's range, and fairseq-train --fp16 of the model with every mechanism. Where a
GPU is present, the same on CUDA, and fairseq-train --fp16 / generate on the GPU."""

import copy

import pytest
import torch

from local_attn_fairseq.locality.spec import HeadSpec
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention

from ..conftest import TRAIN, USER_DIR, fairseq_cli
from ..models.helpers import generate
from ..models.test_combined_mechanisms import COMBINED_MODEL, COMBINED_OPTIONS

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]

E, H, T, B = 32, 4, 9, 3
GATES = {"temperature": 2.0 / 3.0, "log_alpha_init": 0.0}
MECHANISMS = {
    "fixed masks, tied": dict(
        head_specs=[HeadSpec("band-1"), HeadSpec("prev-1", (0, 0)), HeadSpec("next-2"), HeadSpec()]
    ),
    "local heads (banded)": dict(
        head_specs=[HeadSpec("local-1"), HeadSpec("local-2"), HeadSpec("local-1", (0, 0)),
                    HeadSpec("local-0-3")]  # fmt: skip
    ),
    "local and global": dict(
        head_specs=[HeadSpec("local-1"), HeadSpec("band-2"), HeadSpec(), HeadSpec("local-0-3")]
    ),
    "gaussian, query windows": dict(
        head_specs=[HeadSpec(gaussian=True), HeadSpec("band-1", gaussian=True), HeadSpec(),
                    HeadSpec()]  # fmt: skip
    ),
    "gaussian, layer windows": dict(
        head_specs=[HeadSpec(gaussian=True)] * H, localness={"window": "layer"}
    ),
    "gaussian, head windows": dict(
        head_specs=[HeadSpec(gaussian=True)] * H, localness={"window": "head"}
    ),
    "dynamic windows": dict(
        head_specs=[HeadSpec(window="mw"), HeadSpec(window="aw"), HeadSpec("band-1"), HeadSpec()]
    ),
    "relative positions": dict(
        head_specs=[HeadSpec("band-1"), HeadSpec(), HeadSpec(), HeadSpec()],
        relative_max_distance=3,
        relative_values=True,
    ),
    "head gates": dict(head_specs=[HeadSpec()] * H, gates=GATES),
}
SEGMENT_WINDOWS = dict(head_specs=[HeadSpec(window="aw", segment=3), HeadSpec(window="mw")] * 2)
# bfloat16 keeps 8 bits of mantissa, float16 11: errors relative to the largest float32 value
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


def attention(causal, **kw):
    torch.manual_seed(0)
    attn = LocalMultiheadAttention(E, H, self_attention=True, causal=causal, **kw)
    attn.bind_qk_owners([attn])
    torch.nn.init.normal_(attn.out_proj.bias)  # a zero bias would hide a non-zero empty row
    return attn.eval()


def padded_batch(causal):
    """Sentence 0 is full, sentence 1 padded (left in the encoder, right in the decoder, as
    fairseq pads), sentence 2 is padding only."""
    torch.manual_seed(1)
    x = torch.randn(T, B, E)
    pad = torch.zeros(B, T, dtype=torch.bool)
    if causal:
        pad[1, T - 3 :] = True
    else:
        pad[1, :3] = True
    pad[2] = True
    return x, pad


def forward_backward(attn, x, pad, dtype, device="cpu"):
    attn = copy.deepcopy(attn).to(device, dtype)
    x = x.detach().to(device, dtype).requires_grad_()
    pad = pad.to(device)
    future = torch.triu(torch.full((T, T), float("-inf")), 1) if attn.causal else None
    future = None if future is None else future.to(device)
    out, weights = attn(x, x, x, key_padding_mask=pad, attn_mask=future, need_head_weights=True)
    out.float().square().sum().backward()
    grads = {n: p.grad.float() for n, p in attn.named_parameters() if p.grad is not None}
    return out.float().cpu(), weights.float().cpu(), x.grad.float().cpu(), grads, attn.cpu()


def assert_close_to_float32(value, reference, dtype, what):
    assert torch.isfinite(value).all(), f"{what}: not finite in {dtype}"
    error = (value - reference).abs().max().item()
    assert error <= TOLERANCE[dtype] * reference.abs().max().item(), f"{what}: error {error:.3g}"


CASES = [(name, causal) for name in MECHANISMS for causal in (False, True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name,causal", CASES + [("segment windows", False)])
def test_half_precision_matches_float32(name, causal, dtype, device):
    """The float32 reference is always computed on the CPU: on CUDA this also compares the
    devices (the banded kernels, fused attention and the window masks on the GPU)."""
    attn = attention(causal, **(MECHANISMS.get(name) or SEGMENT_WINDOWS))
    x, pad = padded_batch(causal)
    ref_out, _, ref_dx, ref_grads, _ = forward_backward(attn, x, pad, torch.float32)
    out, weights, dx, grads, half = forward_backward(attn, x, pad, dtype, device)
    assert_close_to_float32(out, ref_out, dtype, "output")
    assert_close_to_float32(dx, ref_dx, dtype, "input gradient")
    assert grads.keys() == ref_grads.keys()
    for param_name, grad in grads.items():
        assert torch.isfinite(grad).all(), f"gradient of {param_name} not finite in {dtype}"
    # the padding-only sentence: no attention weight, nothing but the output bias
    assert weights[:, 2].abs().max() == 0
    bias = half.out_proj.bias.float()
    assert torch.equal(out[:, 2], bias.expand(T, E))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "name", ["fixed masks, tied", "gaussian, query windows", "relative positions"]
)
def test_causal_queries_over_left_padding_only_give_zeros(name, dtype):
    """With --left-pad-target, the first decoder queries of a padded sentence see no real key."""
    attn = attention(True, **MECHANISMS[name])
    x, _ = padded_batch(False)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, :3] = True
    out, weights, dx, _, _ = forward_backward(attn, x, pad, dtype)
    assert torch.isfinite(out).all() and torch.isfinite(dx).all()
    assert weights[:, 1, :3].abs().max() == 0 and weights[:, 1, 3:].sum((0, -1)).min() > 0


def test_gate_gradient_beyond_float16_range_stays_finite():
    """A gate scales a whole head, so its gradient sums over every token of the batch: with a
    loss-scaled float16 loss it passes 65504 long before the gradient of log alpha does."""
    attn = attention(False, **MECHANISMS["head gates"]).train()
    x = torch.randn(T, 16, E)

    def log_alpha_gradient(module, dtype, loss_scale):
        module = copy.deepcopy(module).to(dtype)
        torch.manual_seed(2)  # the same gate noise in both precisions
        out = module(x.to(dtype), x.to(dtype), x.to(dtype), need_weights=False)[0]
        (out.float().sum() * loss_scale).backward()
        return module.head_gates.log_alpha.grad.float()

    unit = log_alpha_gradient(attn, torch.float32, 1.0)
    scale = 30000 / unit.abs().max().item()  # largest log-alpha gradient: 30000, within range
    reference = unit * scale
    half = log_alpha_gradient(attn, torch.float16, scale)
    assert torch.isfinite(half).all()
    torch.testing.assert_close(half, reference, rtol=2e-2, atol=2e-2 * reference.abs().max())


def test_fairseq_train_fp16_every_mechanism(tiny_data, tmp_path):
    """fairseq's --fp16 trainer (FP16Optimizer, dynamic loss scaling) on the CPU: fairseq needs
    --fp16-no-flatten-grads there, and its overflow handler calls .cuda(), so an overflow in the
    two updates would fail the run. fairseq 0.12's --bf16 implies --tpu and cannot run here."""
    proc = fairseq_cli(
        "fairseq-train", tiny_data / "bin", "--user-dir", USER_DIR, *COMBINED_MODEL, *TRAIN,
        *COMBINED_OPTIONS, "--max-update", 2, "--save-dir", tmp_path, "--cpu", "--fp16",
        "--fp16-no-flatten-grads", "--disable-validation",
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert "num_updates 2" in log and "loss_scale 128" in log
    assert "overflow" not in log and " nan" not in log.lower()


@needs_cuda
def test_fairseq_train_fp16_and_generate_on_gpu(tiny_data, tmp_path):
    """fairseq's own GPU path: --fp16 with flattened gradients and dynamic loss scaling, every
    mechanism (local heads on the CUDA kernels), then fairseq-generate --fp16 on the GPU."""
    proc = fairseq_cli(
        "fairseq-train", tiny_data / "bin", "--user-dir", USER_DIR, *COMBINED_MODEL, *TRAIN,
        *COMBINED_OPTIONS, "--max-update", 4, "--save-dir", tmp_path, "--fp16",
        "--disable-validation",
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert "num_updates 4" in log and "cuda" in log.lower()
    assert "overflow" not in log and " nan" not in log.lower()
    generate(tiny_data, tmp_path / "checkpoint_last.pt", "--fp16")
