"""Which route banded_attention runs: LOCAL_ATTN_BANDED_IMPL, the automatic rule, the fallbacks,
and the registration of the compiled operator pairs."""

import importlib
import warnings

import pytest
import torch

from local_attn_fairseq.ops import banded_attention, choose_route, extension_info

from .test_banded_attention import implementation, make_padding, make_qkv

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
    assert all(route in message for route in ("auto", "extension", "torch", "sdpa", "tensor-core"))


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
    with implementation("tensor-core"), pytest.raises(RuntimeError, match="tensor-core kernel"):
        choose_route(CUDA, torch.bfloat16, 64, 33)


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
    # Without measured preferences the CUDA-core kernels are the default on a GPU.
    monkeypatch.setattr(banded_module, "MEASURED_GPU_PREFERENCES", ())
    with implementation("auto"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert choose_route(CUDA, dtype, 64, 33) == "extension"
        with pytest.warns(RuntimeWarning, match="head dim 300"):
            assert choose_route(CUDA, torch.float32, 300, 33) == "torch"
    # A measured preference is taken for exactly the calls it covers.
    preference = banded_module.GpuPreference(
        route="sdpa", dtypes=(torch.bfloat16,), head_dims=(64,), min_width=17, max_width=65,
        measured="test",
    )  # fmt: skip
    monkeypatch.setattr(banded_module, "MEASURED_GPU_PREFERENCES", (preference,))
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
