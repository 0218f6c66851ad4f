"""Which route banded_attention runs: LOCAL_ATTN_BANDED_IMPL, the automatic rule, the fallbacks,
the refusals, dispatch by the committed GPU records, and the registration of the compiled
operator pairs."""

import importlib
import os
import sys
import types
import warnings

import pytest
import torch

from local_attn_fairseq.ops import (
    banded_attention,
    choose_route,
    extension_info,
    measured_routes,
    route_records,
    route_table,
    unsupported_reasons,
)

from .test_banded_attention import TOLERANCE, dense_and_grad, implementation, make_padding, make_qkv

banded_module = importlib.import_module("local_attn_fairseq.ops.banded_attention")
EXTENSION = extension_info()
needs_extension = pytest.mark.skipif(not EXTENSION["loaded"], reason="extension not built")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the one-time warnings afresh."""
    monkeypatch.setattr(banded_module._ExtensionState, "warned", set())


@pytest.fixture
def count_calls(monkeypatch):
    """Counts the calls that reach each route's implementation."""
    calls = {"sdpa": 0, "torch": 0}
    sdpa, reference = banded_module.blocked_sdpa_output, banded_module._TorchBandedAttention.apply

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(banded_module, "blocked_sdpa_output", counted("sdpa", sdpa))
    monkeypatch.setattr(banded_module._TorchBandedAttention, "apply", counted("torch", reference))
    return calls


@pytest.mark.parametrize("value", ["triton", "SDPA", "tensor_core", "flash"])
@pytest.mark.parametrize("caller", ["choose_route", "banded_attention"])
def test_unknown_values_are_named_with_the_choices(value, caller):
    """Refused by choose_route, and by a call whose CPU inputs the kernels would take."""
    q, k, v = make_qkv(1, 1, 12, 4)
    with implementation(value), pytest.raises(ValueError) as error:
        choose_route(CPU) if caller == "choose_route" else banded_attention(q, k, v, 2, 2)
    message = str(error.value)
    assert f"LOCAL_ATTN_BANDED_IMPL={value!r}" in message
    assert all(route in message for route in banded_module.ROUTES)
    assert {"flash-window", "cudnn-band"} < set(banded_module.ROUTES)


def test_empty_value_means_auto():
    with implementation(""):
        assert choose_route(CPU) == ("extension" if EXTENSION["loaded"] else "torch")


@needs_extension
@pytest.mark.parametrize("value", ["", "auto", "extension"])
def test_the_kernels_take_cpu_calls_under_auto_and_extension(value, count_calls):
    q, k, v = make_qkv(1, 1, 12, 4)
    with implementation(value):
        assert choose_route(CPU) == "extension"
        banded_attention(q, k, v, 2, 2)
    assert count_calls == {"sdpa": 0, "torch": 0}


@needs_extension
def test_auto_keeps_the_compiled_kernels_on_the_cpu():
    with implementation("auto"):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            assert choose_route(CPU, dtype, 64, 33) == "extension"


def test_sdpa_route_runs_sdpa_and_matches_the_reference(count_calls):
    q, k, v = make_qkv(2, 3, 50, 8)
    padding = make_padding("left", 2, 50)
    with implementation("sdpa"):
        assert choose_route(CPU, q.dtype, 8, 9) == "sdpa"
        out = banded_attention(q, k, v, [0, 4, 9], [3, 0, 9], padding)
    assert count_calls == {"sdpa": 1, "torch": 0}
    with implementation("torch"):
        torch.testing.assert_close(out, banded_attention(q, k, v, [0, 4, 9], [3, 0, 9], padding))
    assert count_calls == {"sdpa": 1, "torch": 1}


def test_sdpa_with_dropout_takes_the_automatic_route_with_one_warning(count_calls):
    q, k, v = make_qkv(1, 2, 30, 4)
    results = []
    for route in ("sdpa", "auto"):
        with implementation(route), torch.random.fork_rng():
            torch.manual_seed(5)
            if route == "sdpa":
                with pytest.warns(RuntimeWarning, match="sdpa cannot apply the operator's dropout"):
                    results.append(banded_attention(q, k, v, 3, 3, dropout_p=0.3))
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # the warning is given once
                    banded_attention(q, k, v, 3, 3, dropout_p=0.3)
            else:
                results.append(banded_attention(q, k, v, 3, 3, dropout_p=0.3))
    assert count_calls["sdpa"] == 0
    torch.testing.assert_close(results[0], results[1])


def test_tensor_core_without_the_kernel_is_an_error(monkeypatch):
    monkeypatch.setattr(banded_module, "_built_with_tensor_core", lambda module: False)
    with implementation("tensor-core"), pytest.raises(RuntimeError) as e:
        choose_route(CUDA, torch.bfloat16, 64, 33)
    message = str(e.value)
    assert "\n" not in message and "LOCAL_ATTN_BANDED_IMPL=tensor-core" in message
    assert "built without the tensor-core kernel" in message


@needs_extension
def test_tensor_core_sends_inputs_it_cannot_take_to_the_automatic_route(monkeypatch):
    monkeypatch.setattr(banded_module, "_built_with_tensor_core", lambda module: True)
    with implementation("tensor-core"):
        with pytest.warns(RuntimeWarning, match="CUDA devices only"):
            assert choose_route(CPU, torch.bfloat16, 64, 33) == "extension"
        with pytest.warns(RuntimeWarning, match="float16 and bfloat16, not float32"):
            assert choose_route(CUDA, torch.float32, 64, 33) == "extension"
        with pytest.warns(RuntimeWarning, match="head dims"):
            assert choose_route(CUDA, torch.bfloat16, 48, 33) == "extension"


@needs_extension
@pytest.mark.skipif(not EXTENSION.get("tensor_core"), reason="built without the tensor-core kernel")
def test_auto_on_a_gpu_takes_the_tensor_core_kernel_where_it_was_measured(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    measured = [
        (torch.bfloat16, 64, 5), (torch.bfloat16, 64, 1025), (torch.float16, 64, 257),
        (torch.bfloat16, 32, 33), (torch.bfloat16, 128, 257),
    ]  # fmt: skip
    not_measured = [
        (torch.bfloat16, 64, 3), (torch.bfloat16, 64, 1027), (torch.float16, 64, 513),
        (torch.float16, 128, 33), (torch.bfloat16, 128, 17), (torch.float32, 64, 33),
        (torch.bfloat16, 48, 33),
    ]  # fmt: skip
    with implementation("auto"):
        for dtype, dim, width in measured:
            assert choose_route(CUDA, dtype, dim, width) == "tensor-core", (dtype, dim, width)
            assert choose_route(CUDA, dtype, dim, width, dropout_p=0.1) == "tensor-core"
            assert choose_route(CPU, dtype, dim, width) == "extension"
        for dtype, dim, width in not_measured:
            assert choose_route(CUDA, dtype, dim, width) == "extension", (dtype, dim, width)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
        assert choose_route(CUDA, torch.bfloat16, 64, 33) == "extension"


@needs_extension
@pytest.mark.skipif(not EXTENSION.get("cuda"), reason="extension built without CUDA kernels")
def test_auto_on_a_gpu_takes_only_measured_routes(monkeypatch):
    # Without records or default preferences the CUDA-core kernels are the default on a GPU.
    monkeypatch.setattr(banded_module, "DEFAULT_GPU_PREFERENCES", ())
    monkeypatch.setattr(banded_module, "MEASURED_ROUTES", {})
    with implementation("auto"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert choose_route(CUDA, dtype, 64, 33, length=1024) == "extension"
        with pytest.warns(RuntimeWarning, match="head dim 300"):
            assert choose_route(CUDA, torch.float32, 300, 33) == "torch"
    # A default preference is taken for exactly the calls it covers and its route can take.
    preference = banded_module.GpuPreference(
        route="sdpa", dtypes=(torch.bfloat16,), head_dims=(64,), min_width=17, max_width=65,
        measured="test",
    )  # fmt: skip
    monkeypatch.setattr(banded_module, "DEFAULT_GPU_PREFERENCES", (preference,))
    with implementation("auto"):
        assert choose_route(CUDA, torch.bfloat16, 64, 33) == "sdpa"
        assert choose_route(CUDA, torch.bfloat16, 64, 33, dropout_p=0.1) == "extension"
        assert choose_route(CUDA, torch.bfloat16, 64, 129) == "extension"
        assert choose_route(CUDA, torch.float16, 64, 33) == "extension"
        assert choose_route(CUDA, torch.bfloat16, 128, 33) == "extension"
        assert choose_route(CPU, torch.bfloat16, 64, 33) == "extension"


def test_torch_route_never_loads_anything(count_calls):
    q, k, v = make_qkv(1, 1, 12, 4)
    with implementation("torch"):
        assert choose_route(CPU) == "torch" and choose_route(CUDA, torch.bfloat16, 64) == "torch"
        banded_attention(q, k, v, 2, 2)
    assert count_calls == {"sdpa": 0, "torch": 1}


# ---------------------------------------------------------------------------------------------
# The library routes, asked for by name.


@pytest.mark.parametrize("route", ["flash-window", "cudnn-band"])
@pytest.mark.parametrize("caller", ["choose_route", "banded_attention"])
def test_library_routes_refuse_cpu_tensors_in_one_line(route, caller):
    q, k, v = make_qkv(1, 2, 12, 64, torch.bfloat16)
    with implementation(route), pytest.raises(RuntimeError) as error:
        if caller == "choose_route":
            choose_route(CPU, torch.bfloat16, 64, 5)
        else:
            banded_attention(q, k, v, 2, 2)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"LOCAL_ATTN_BANDED_IMPL={route} cannot take this call: ")
    assert "CUDA devices only, not cpu" in message


@pytest.fixture
def fake_adapter(monkeypatch):
    """The flash-window adapter replaced by one that records its calls: what it refuses is
    ``refuse`` (a list), and its output is a tensor of sevens."""
    calls = []
    fake = types.SimpleNamespace(refuse=[])

    def unsupported_reasons(q, k, v, left, right, key_padding_mask, dropout_p):
        calls.append(("reasons", left, right, dropout_p))
        return list(fake.refuse)

    def flash_window_attention(q, k, v, left, right, key_padding_mask, scale, dropout_p):
        calls.append(("attention", left, right, key_padding_mask, scale, dropout_p))
        return torch.full_like(q, 7.0), q.new_zeros(q.shape[:3], dtype=torch.float32)

    module = types.ModuleType("local_attn_fairseq.ops.flash_window")
    module.unsupported_reasons = unsupported_reasons
    module.flash_window_attention = flash_window_attention
    monkeypatch.setitem(sys.modules, "local_attn_fairseq.ops.flash_window", module)
    fake.calls = calls
    return fake


def test_a_library_route_runs_its_adapter_with_the_operators_arguments(fake_adapter):
    """The adapter gets the validated call (windows clipped to the sequence, the padding as
    bool, the scale, dropout_p) and no keep-mask: the library draws its own."""
    q, k, v = make_qkv(2, 3, 10, 8)
    padding = make_padding("left", 2, 10)
    args = (q, k, v, (2, 9, 0), (1, 0, 9), padding, None, 0.5, 0.25)
    with implementation("flash-window"):
        out = banded_module._run_route("flash-window", args)
    assert torch.equal(out, torch.full_like(q, 7.0))
    assert fake_adapter.calls[0] == ("reasons", (2, 9, 0), (1, 0, 9), 0.25)
    assert fake_adapter.calls[1][:3] == ("attention", (2, 9, 0), (1, 0, 9))
    assert fake_adapter.calls[1][3] is padding and fake_adapter.calls[1][4:] == (0.5, 0.25)


def test_what_the_adapter_refuses_is_refused_in_one_line_when_forced(fake_adapter):
    fake_adapter.refuse = ["padding inside a sentence", "something else"]
    q, k, v = make_qkv(1, 2, 10, 8)
    args = (q, k, v, (2, 2), (2, 2), None, None, 0.5, 0.0)
    with implementation("flash-window"), pytest.raises(RuntimeError) as error:
        banded_module._run_route("flash-window", args)
    message = str(error.value)
    assert "\n" not in message and "padding inside a sentence; something else" in message
    assert not any(call[0] == "attention" for call in fake_adapter.calls)


def test_a_measured_library_route_the_adapter_refuses_falls_back_to_the_default(fake_adapter):
    """Chosen by ``auto`` (a record made it the cell's winner), a call the adapter refuses runs
    on the route the default rule gives, with the same result as that route."""
    fake_adapter.refuse = ["not this call"]
    q, k, v = make_qkv(1, 2, 10, 8)
    args = (q, k, v, (2, 2), (2, 2), None, None, 0.5, 0.0)
    with implementation("auto"):
        out = banded_module._run_route("flash-window", args)
    with implementation("torch"):
        expected = banded_module._run_route("torch", args)
    torch.testing.assert_close(out, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("route", ["flash-window", "cudnn-band"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("padding_kind", ["none", "left", "right_and_empty"])
def test_cuda_library_route_through_banded_attention_matches_dense_reference(
    route, dtype, padding_kind
):
    """The user's path to a library route: LOCAL_ATTN_BANDED_IMPL and banded_attention, with
    per-head windows and padding on either side of a sentence, through autograd. Real query
    rows (and the gradients they send) against the dense float64 reference; padded query rows
    are zeros."""
    batch, heads, length, dim = 3, 4, 150, 64
    left, right = [0, 5, 40, 200], [7, 0, 40, 3]
    q, k, v = make_qkv(batch, heads, length, dim, dtype, device="cuda")
    padding = make_padding("left" if padding_kind == "left" else "none", batch, length)
    if padding_kind == "right_and_empty":
        padding = torch.arange(length)[None, :] >= torch.tensor([150, 97, 0])[:, None]
    cuda_padding = None if padding is None else padding.cuda()
    reasons = unsupported_reasons(route, q, k, v, left, right, cuda_padding)
    if reasons:
        pytest.skip(f"{route}: {'; '.join(reasons)}")
    real = torch.ones(batch, length, dtype=torch.bool) if padding is None else ~padding
    upstream = torch.randn(batch, heads, length, dim, generator=torch.Generator().manual_seed(1))
    upstream = upstream * real[:, None, :, None]  # padded rows send nothing back
    with implementation(route):
        out = banded_attention(q, k, v, left, right, cuda_padding)
    grads = torch.autograd.grad(out, (q, k, v), upstream.to("cuda", dtype))
    ref_out, ref_grads, _ = dense_and_grad(q, k, v, left, right, padding, upstream)
    rows = real[:, None, :, None].expand_as(ref_out)
    out = out.detach().cpu().double()
    assert torch.equal(out[~rows], torch.zeros_like(out[~rows]))
    torch.testing.assert_close(out[rows], ref_out[rows], **TOLERANCE[dtype])
    for got, want in zip(grads, ref_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.cpu().double(), want, **TOLERANCE[dtype])


# ---------------------------------------------------------------------------------------------
# Dispatch by the committed GPU records.

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def fake_gpu(monkeypatch):
    """An sm_90 GPU as seen by dispatch, with every route built and every library importable
    (no CUDA tensor is made)."""

    class Extension:
        @staticmethod
        def built_with_cuda():
            return True

    monkeypatch.setattr(banded_module, "load_extension", lambda: Extension)
    monkeypatch.setattr(banded_module, "_built_with_tensor_core", lambda module: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(route_table, "library_reasons", lambda route: [])


def todays_choice(dtype, dim, width):
    """The GPU rule before the records decided cells (the first H200 run's preferences)."""
    tensor_core = (
        (dtype == torch.bfloat16 and dim == 64 and 5 <= width <= 1025)
        or (dtype == torch.float16 and dim == 64 and 5 <= width <= 257)
        or (dtype == torch.bfloat16 and dim in (32, 128) and 33 <= width <= 257)
    )
    return "tensor-core" if tensor_core else "extension"


def test_the_measured_table_is_what_the_committed_records_give():
    with open(os.path.join(REPOSITORY, route_records.MODULE_PATH)) as f:
        committed = f.read()
    assert route_records.measured_routes_text(REPOSITORY) == committed, (
        "ops/measured_routes.py is out of date: run python benchmarks/measured_routes.py"
    )
    decided = {cell: route for cell, route in measured_routes.CELLS.items() if route}
    assert banded_module.MEASURED_ROUTES == {
        (getattr(torch, d), dim, t, w): route for (d, dim, t, w), route in decided.items()
    }


def test_auto_takes_the_recorded_winner_in_every_covered_cell_and_the_default_elsewhere(fake_gpu):
    changed = []
    with implementation("auto"):
        for (name, dim, length, width), winner in measured_routes.CELLS.items():
            dtype = getattr(torch, name)
            expected = winner or todays_choice(dtype, dim, width)
            assert choose_route(CUDA, dtype, dim, width, length=length) == expected, (
                name, dim, length, width,
            )  # fmt: skip
            if expected != todays_choice(dtype, dim, width):
                changed.append((name, dim, length, width))
            for other in (length - 1, length + 1, None):  # cells no record covers
                got = choose_route(CUDA, dtype, dim, width, length=other)
                assert got == todays_choice(dtype, dim, width), (name, dim, other, width)
            assert choose_route(CPU, dtype, dim, width, length=length) == "extension"
    # The records change the default somewhere: float16 at T = 16, w = 3 (H100, 0.74 against
    # the CUDA-core kernels' 0.79 ms), below the default rule's smallest width.
    assert ("float16", 64, 16, 3) in changed


def test_no_committed_record_makes_a_library_route_a_default(fake_gpu):
    assert not set(measured_routes.CELLS.values()) & set(route_table.LIBRARY_ROUTES)
    with implementation("auto"):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for dim in (32, 64, 128):
                for length in (16, 1024, 4096, 16384):
                    for width in (3, 33, 257, 1025):
                        route = choose_route(CUDA, dtype, dim, width, length=length)
                        assert route not in route_table.LIBRARY_ROUTES


def test_a_recorded_winner_that_cannot_take_the_call_leaves_it_to_the_default(
    fake_gpu, monkeypatch
):
    cell = (torch.bfloat16, 64, 1024, 33)
    monkeypatch.setattr(banded_module, "MEASURED_ROUTES", {cell: "sdpa"})
    with implementation("auto"):
        assert choose_route(CUDA, torch.bfloat16, 64, 33, length=1024) == "sdpa"
        assert choose_route(CUDA, torch.bfloat16, 64, 33, 0.1, 1024) == "tensor-core"  # dropout
    monkeypatch.setattr(banded_module, "MEASURED_ROUTES", {cell: "flash-window"})
    monkeypatch.setattr(route_table, "library_reasons", lambda route: ["not installed"])
    with implementation("auto"):
        assert choose_route(CUDA, torch.bfloat16, 64, 33, length=1024) == "tensor-core"


def test_banded_attention_asks_for_the_cell_of_its_length(monkeypatch):
    asked = []

    def recording(device, dtype, head_dim, width, dropout_p, length):
        asked.append((head_dim, width, length))
        return "torch"

    monkeypatch.setattr(banded_module, "choose_route", recording)
    q, k, v = make_qkv(1, 2, 30, 8)
    with implementation("torch"):
        banded_attention(q, k, v, [3, 50], [0, 1])
    assert asked == [(8, 29 + 1 + 1, 30)]  # left clipped to T - 1 = 29


# ---------------------------------------------------------------------------------------------
# Registration of the compiled operator pairs.


def test_registration_skips_a_pair_the_library_does_not_define():
    assert not banded_module.register_operator_pair("no_such_forward", "no_such_backward")


@needs_extension
def test_both_pairs_are_registered_where_defined():
    assert banded_module.register_operator_pair("banded_forward", "banded_backward")
    tensor_core = banded_module._op_defined("banded_forward_tensor_core")
    assert banded_module.register_operator_pair(
        "banded_forward_tensor_core", "banded_backward_tensor_core"
    ) == tensor_core  # fmt: skip
    assert EXTENSION["tensor_core"] in (False, tensor_core)


@needs_extension
@pytest.mark.parametrize("forward", ["banded_forward", "banded_forward_tensor_core"])
def test_fake_kernels_give_shapes_on_the_meta_device(forward):
    if not banded_module._op_defined(forward):
        pytest.skip(f"the loaded extension predates local_attn::{forward}")
    q, k, v = (torch.empty(2, 3, 40, 64, device="meta", dtype=torch.bfloat16) for _ in range(3))
    out, lse = getattr(torch.ops.local_attn, forward)(
        q, k, v, [4, 0, 2], [1, 1, 0], None, None, 0.125, 0.0
    )
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert lse.shape == (2, 3, 40) and lse.dtype == torch.float32
    backward = forward.replace("forward", "backward")
    grads = getattr(torch.ops.local_attn, backward)(
        out, q, k, v, out, lse, [4, 0, 2], [1, 1, 0], None, None, 0.125, 0.0
    )
    assert all(g.shape == q.shape for g in grads)


@needs_extension
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_opcheck_of_the_tensor_core_pair_on_a_gpu():
    if not (EXTENSION.get("tensor_core") and torch.cuda.get_device_capability() >= (8, 0)):
        pytest.skip("the tensor-core kernel is not built, or the GPU is older than sm_80")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = (
            torch.randn(2, 3, 70, 64, generator=gen).to("cuda", dtype).requires_grad_()
            for _ in range(3)
        )
        padding = make_padding("empty_row", 2, 70).cuda()
        keep = torch.rand(2, 3, 70, 21, generator=gen).cuda() >= 0.2
        for args in (
            (q, k, v, [4, 0, 10], [1, 10, 0], padding, keep, 0.125, 0.2),
            (q, k, v, [3, 3, 3], [3, 3, 3], None, None, 0.125, 0.0),
        ):
            torch.library.opcheck(torch.ops.local_attn.banded_forward_tensor_core.default, args)
            detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            out, lse = torch.ops.local_attn.banded_forward_tensor_core(*detached)
            grad = torch.randn_like(out)
            backward = (grad, *detached[:3], out, lse, *detached[3:])
            backward_op = torch.ops.local_attn.banded_backward_tensor_core.default
            torch.library.opcheck(backward_op, backward)
