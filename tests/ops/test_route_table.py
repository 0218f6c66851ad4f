"""The route table of the banded operator (ops/route_table.py): what each route declares, the
reasons it gives for a call it cannot take, the adapters it asks, the attention module's entry
point, the docs' table; and GPU records read as dispatch cells (ops/route_records.py)."""

import importlib
import json
import os
import sys
import types

import pytest
import torch

from local_attn_fairseq.ops import band_capabilities, extension_info, route_supports
from local_attn_fairseq.ops import route_records, route_table, unsupported_reasons

from .test_banded_attention import implementation, make_padding, make_qkv

banded_module = importlib.import_module("local_attn_fairseq.ops.banded_attention")
REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
OUR_ROUTES = ("extension", "tensor-core", "sdpa", "torch")
LIBRARY_ROUTES = ("flash-window", "cudnn-band")
needs_extension = pytest.mark.skipif(not extension_info()["loaded"], reason="extension not built")


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_the_table_has_every_route_of_the_operator():
    assert set(route_table.ROUTE_TABLE) == set(banded_module.ROUTES) - {"auto"}
    assert route_table.LIBRARY_ROUTES == LIBRARY_ROUTES
    for route, support in route_table.ROUTE_TABLE.items():
        assert support.name == route
        assert set(support.features) <= set(route_table.FEATURES), route
        assert set(dict(support.notes)) <= set(route_table.FEATURES), route


@pytest.mark.parametrize("route", LIBRARY_ROUTES)
def test_float32_and_the_cpu_never_reach_the_library_routes(route, sm90):
    for dtype in (torch.float32, torch.float64):
        assert f"not {str(dtype)[6:]}" in " ".join(
            route_table.declared_reasons(route, CUDA, dtype, 64)
        )  # fmt: skip
    assert route_table.declared_reasons(route, CPU, torch.bfloat16, 64) == [
        "it runs on CUDA devices only, not cpu"
    ]
    assert route_table.declared_reasons(route, CUDA, torch.bfloat16, 64) == []
    assert route_table.declared_reasons(route, CUDA, torch.float16, 128, ["dropout"]) == []


def test_head_dims_and_capabilities(monkeypatch, sm90):
    reasons = route_table.declared_reasons
    assert reasons("tensor-core", CUDA, torch.bfloat16, 48) == [
        "it takes head dims 32, 64, 128, not 48"
    ]
    assert reasons("flash-window", CUDA, torch.bfloat16, 96) != []
    assert reasons("cudnn-band", CUDA, torch.bfloat16, 96) == []  # a multiple of 8, <= 128
    assert reasons("cudnn-band", CUDA, torch.bfloat16, 100) != []
    assert reasons("cudnn-band", CUDA, torch.bfloat16, 256) != []
    assert reasons("extension", CUDA, torch.float32, 256) == []
    assert reasons("extension", CUDA, torch.float32, 300) == [
        "it takes head dims any (CUDA: up to 256), not 300"
    ]
    assert reasons("extension", CPU, torch.float32, 300) == []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    for route in ("tensor-core",) + LIBRARY_ROUTES:
        assert reasons(route, CUDA, torch.float16, 64) == [
            "it needs a GPU of compute capability 8.0 or newer"
        ]
    assert reasons("extension", CUDA, torch.float16, 64) == []


def test_the_device_is_not_asked_about_calls_the_declaration_already_refuses(monkeypatch):
    def no_gpu(device=None):
        raise AssertionError("asked for the capability of a call refused anyway")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_gpu)
    assert route_table.declared_reasons("tensor-core", CUDA, torch.float32, 64) == [
        "it takes float16 and bfloat16, not float32"
    ]


def test_features_a_call_needs(sm90):
    reasons = route_table.declared_reasons
    assert reasons("sdpa", CPU, torch.float32, 8, ["dropout"]) == ["it has no attention dropout"]
    for route in OUR_ROUTES:
        assert "fewer queries than keys" in " ".join(
            reasons(route, CUDA, torch.float16, 64, ["unequal_lengths"])
        )  # fmt: skip
    for route in LIBRARY_ROUTES:
        assert reasons(route, CUDA, torch.float16, 64, ["unequal_lengths", "dropout"]) == []
    for route in route_table.ROUTE_TABLE:  # no route takes a window that excludes the query
        assert reasons(route, CUDA, torch.float16, 64, ["query_excluding_bounds"]) != []


def test_route_supports_answers_the_declarations():
    assert route_supports("torch", "second_derivatives")
    assert not route_supports("extension", "second_derivatives")
    assert route_supports("flash-window", "log_sum_exp")
    assert not route_supports("sdpa", "log_sum_exp")
    assert not route_supports("flash-window", "computed_padded_queries")
    assert route_supports("tensor-core", "computed_padded_queries")
    assert route_supports("cudnn-band", "dropout")
    assert not route_supports("cudnn-band", "operator_dropout_mask")
    assert route_supports("tensor-core", "operator_dropout_mask")
    with pytest.raises(ValueError, match="unknown feature 'flash'.*second_derivatives"):
        route_supports("torch", "flash")
    with pytest.raises(ValueError, match="'triton' is not a route.*cudnn-band"):
        route_supports("triton", "padding")


def test_a_missing_adapter_or_library_is_a_reason(monkeypatch):
    installed = {"local_attn_fairseq.ops.flash_window", "local_attn_fairseq.ops.cudnn_band"}
    monkeypatch.setattr(route_table, "_installed", installed.__contains__)
    assert route_table.library_reasons("flash-window") == []
    assert route_table.library_reasons("cudnn-band") == [
        "nvidia-cudnn-frontend (the cudnn module) is not installed"
    ]
    installed.add("cudnn")
    assert route_table.library_reasons("cudnn-band") == []
    installed.discard("local_attn_fairseq.ops.flash_window")
    assert route_table.library_reasons("flash-window") == [
        "its adapter local_attn_fairseq.ops.flash_window is not installed"
    ]
    assert all(route_table.library_reasons(route) == [] for route in OUR_ROUTES)


@pytest.fixture
def fake_cudnn_adapter(monkeypatch):
    """ops/cudnn_band.py replaced by a module that records what it is asked."""
    asked = []
    module = types.ModuleType("local_attn_fairseq.ops.cudnn_band")

    def unsupported_reasons(q, k, v, left, right, key_padding_mask, dropout_p):
        asked.append((tuple(q.shape), tuple(k.shape), left, right, dropout_p))
        return ["the adapter's own reason"]

    module.unsupported_reasons = unsupported_reasons
    module.cudnn_band_attention = lambda *args: None
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return asked


def test_adapter_reasons_come_from_the_adapter(fake_cudnn_adapter):
    q, k, v = make_qkv(1, 2, 6, 8)
    reasons = route_table.adapter_reasons("cudnn-band", q, k, v, [1, 2], [0, 0], None, 0.1)
    assert reasons == ["the adapter's own reason"]
    assert fake_cudnn_adapter == [((1, 2, 6, 8), (1, 2, 6, 8), [1, 2], [0, 0], 0.1)]
    assert route_table.adapter_attention("cudnn-band") is sys.modules[
        "local_attn_fairseq.ops.cudnn_band"
    ].cudnn_band_attention


def test_an_adapter_that_cannot_be_imported_is_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "local_attn_fairseq.ops.flash_window", None)
    q, k, v = make_qkv(1, 1, 4, 8)
    reasons = route_table.adapter_reasons("flash-window", q, k, v, [1], [1], None, 0.0)
    assert len(reasons) == 1 and reasons[0].startswith("its adapter cannot be imported (")


def test_unsupported_reasons_of_a_call(fake_cudnn_adapter, monkeypatch):
    """The table's reasons first; a library route's adapter is asked only about calls the table
    lets through (so the adapter is not imported for a CPU tensor)."""
    q, k, v = make_qkv(2, 2, 10, 64, torch.bfloat16)
    reasons = unsupported_reasons("cudnn-band", q, k, v, 3, [0, 2], make_padding("left", 2, 10))
    assert "it runs on CUDA devices only, not cpu" in reasons
    assert fake_cudnn_adapter == []
    assert unsupported_reasons("torch", q, k, v, [3, 1], 0) == []
    assert unsupported_reasons("sdpa", q, k, v, 3, 3, dropout_p=0.1) == [
        "it has no attention dropout"
    ]
    shorter = q[:, :, 4:]
    assert "fewer queries than keys" in " ".join(unsupported_reasons("torch", shorter, k, v, 1, 1))
    for excluding in ([3, -1], torch.tensor([3, -1]), -1):
        assert unsupported_reasons("torch", q, k, v, excluding, 1) == [
            "it has no windows that exclude the query (left < 0 or right < 0)"
        ]
    # A call the table allows is put to the adapter, with per-head windows as lists.
    monkeypatch.setattr(route_table, "declared_reasons", lambda *args, **kwargs: [])
    monkeypatch.setattr(route_table, "library_reasons", lambda route: [])
    reasons = unsupported_reasons("cudnn-band", shorter, k, v, 3, [0, 2], None, 0.2)
    assert reasons == ["the adapter's own reason"]
    assert fake_cudnn_adapter == [((2, 2, 6, 64), (2, 2, 10, 64), [3, 3], [0, 2], 0.2)]


@needs_extension
def test_band_capabilities_on_the_cpu():
    with implementation("auto"):
        answer = band_capabilities(CPU, torch.float32, 16)
        assert answer.route == "extension"
        assert answer.support is route_table.ROUTE_TABLE["extension"]
        assert answer.usable == ("extension", "sdpa", "torch")
        assert answer.supports("computed_padded_queries") and answer.supports("log_sum_exp")
        assert not answer.supports("second_derivatives")
        assert band_capabilities(CPU, torch.float32, 16, dropout_p=0.1).usable == (
            "extension", "torch",
        )  # fmt: skip
    with implementation("torch"):
        assert band_capabilities(CPU, torch.bfloat16, 16).supports("second_derivatives")
    with implementation("flash-window"), pytest.raises(RuntimeError, match="CUDA devices only"):
        band_capabilities(CPU, torch.bfloat16, 64)


def test_the_docs_hold_the_route_table():
    with open(os.path.join(REPOSITORY, "docs", "banded_attention.md")) as f:
        docs = f.read()
    assert route_table.support_table_markdown() in docs


def test_the_docs_table_says_what_each_route_declares():
    rows = route_table.support_table_markdown().splitlines()[2:]
    by_route = {row.split(" | ")[0].strip("| `"): row.split(" | ") for row in rows}
    assert by_route["flash-window"][9] == "zeros, lse -inf (packed away)"
    assert by_route["extension"][9] == "computed"
    assert by_route["cudnn-band"][2] == "float16 and bfloat16"
    assert by_route["torch"][-1] == "yes |"
    assert by_route["tensor-core"][4] == "sm_80+"


# ---------------------------------------------------------------------------------------------
# GPU records read as dispatch cells.


def record(route, ms, T=1024, w=33, **fields):
    base = dict(
        gpu="NVIDIA H200", torch="2.11.0+cu130", date="2026-12-01T00:00:00+00:00",
        dtype="bfloat16", banded_impl="extension", B=8, H=8, D=64, mode="fwd+bwd",
    )  # fmt: skip
    return dict(base, T=T, w=w, route=route, ms=ms, **fields)


def cell(times, **fields):
    """One cell's records: {row name: ms or None}."""
    return [record(route, ms, **fields) for route, ms in times.items()]


def write(tmp_path, name, records):
    path = tmp_path / name
    path.write_text(json.dumps(records))
    return str(path)


PEERS = {"flex": 1.0, "global": 2.0}


def test_the_fastest_route_wins_a_cell_measured_beside_both_peers(tmp_path):
    path = write(tmp_path, "a.json", cell({"banded": 3.0, "tensor-core": 1.5, "blocked": 2.0,
                                           "flash-window": 1.2, **PEERS}))  # fmt: skip
    assert route_records.verdicts([path]) == {("bfloat16", 64, 1024, 33): "flash-window"}
    assert route_records.measurements([path])[("bfloat16", 64, 1024, 33)] == [
        {"extension": 3.0, "tensor-core": 1.5, "sdpa": 2.0, "flash-window": 1.2}
    ]


def test_a_margin_under_five_percent_decides_nothing(tmp_path):
    close = write(tmp_path, "a.json", cell({"banded": 1.04, "tensor-core": 1.0, **PEERS}))
    assert route_records.verdicts([close]) == {("bfloat16", 64, 1024, 33): None}
    clear = write(tmp_path, "b.json", cell({"banded": 1.06, "tensor-core": 1.0, **PEERS}))
    assert route_records.verdicts([clear]) == {("bfloat16", 64, 1024, 33): "tensor-core"}


@pytest.mark.parametrize("missing", ["flex", "global"])
def test_a_cell_without_both_peers_is_not_evidence(tmp_path, missing):
    times = {"banded": 3.0, "tensor-core": 1.0, **PEERS}
    times[missing] = None  # it failed to run: a note, no figure
    path = write(tmp_path, "a.json", cell(times))
    assert route_records.verdicts([path]) == {}


def test_which_records_count(tmp_path):
    times = {"banded": 3.0, "tensor-core": 1.0, **PEERS}
    paths = [
        write(tmp_path, "cpu.json", cell(times, gpu="CPU, 2 threads")),
        write(tmp_path, "fwd.json", cell(times, mode="fwd")),
        write(tmp_path, "other.json", {"benchmark": "long_context"}),
        write(tmp_path, "alone.json", cell({"tensor-core": 1.0, **PEERS})),  # nothing to beat
    ]
    assert route_records.verdicts(paths) == {}
    impl = write(tmp_path, "impl.json", cell({"banded": 1.0, "blocked": 3.0, **PEERS},
                                             banded_impl="tensor-core"))  # fmt: skip
    assert route_records.verdicts([impl]) == {("bfloat16", 64, 1024, 33): "tensor-core"}


def test_runs_of_one_cell_must_agree(tmp_path):
    first = cell({"banded": 3.0, "tensor-core": 1.0, **PEERS})
    agreeing = cell({"banded": 2.0, "tensor-core": 1.0, **PEERS}, B=32)
    disagreeing = cell({"banded": 1.0, "tensor-core": 2.0, **PEERS}, date="2026-12-02")
    key = ("bfloat16", 64, 1024, 33)
    assert route_records.verdicts([write(tmp_path, "a.json", first + agreeing)]) == {
        key: "tensor-core"
    }
    both = [write(tmp_path, "a.json", first), write(tmp_path, "b.json", disagreeing)]
    assert route_records.verdicts(both) == {key: None}


def test_the_rendered_module_holds_the_verdicts(tmp_path):
    paths = [
        write(tmp_path, "a.json", cell({"banded": 3.0, "tensor-core": 1.0, **PEERS})
              + cell({"banded": 1.0, "cudnn-band": 1.01, **PEERS}, T=2048, w=129)),
    ]  # fmt: skip
    verdicts = route_records.verdicts(paths)
    text = route_records.render_measured_routes(verdicts, ["benchmarks/results/a.json"])
    namespace = {}
    exec(compile(text, "measured_routes.py", "exec"), namespace)
    assert namespace["CELLS"] == {
        ("bfloat16", 64, 1024, 33): "tensor-core",
        ("bfloat16", 64, 2048, 129): None,
    }
    assert namespace["SOURCES"] == ("benchmarks/results/a.json",)


def test_the_committed_records_cover_no_library_route():
    used = [p for p in route_records.record_files(os.path.join(REPOSITORY, "benchmarks", "results"))
            if route_records.kernel_records(p)]  # fmt: skip
    assert used  # the H100 and H200 records
    measured = route_records.measurements(used)
    assert not any(set(run) & set(LIBRARY_ROUTES) for runs in measured.values() for run in runs)
