"""The long-context benchmark: its quick run through the script (real models, real training
steps, real incremental decoding), and the pieces that decide whether a configuration fits."""

import json
import os

import pytest

from local_attn_fairseq.experiments import long_context
from local_attn_fairseq.experiments.long_context import decoding, memory, models, training
from local_attn_fairseq.experiments.long_context.settings import contenders
from local_attn_fairseq.modules.rolling_cache import FULL_CACHE_VARIABLE

from ..conftest import REPO, run_script

SCRIPT = os.path.join("benchmarks", "long_context.py")
RECORD = os.path.join(REPO, "benchmarks", "results", "long_context_cpu.json")
# At the quick sizes the three models are estimated at about 3.5 MiB at T = 64 and 6 MiB at
# T = 256: a cap between, so that T = 256 is reported as not fitting, and not run.
CAP_GIB = 5 / 1024

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, one_torch_thread):
    output = tmp_path_factory.mktemp("long_context") / "record.json"
    proc = run_script(
        SCRIPT, "--quick", "--threads", 1, "--memory-cap-gb", CAP_GIB, "--output", output
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(output.read_text())


@pytest.mark.slow
def test_the_quick_run_prints_its_tables_and_writes_its_record(quick_run):
    proc, record = quick_run
    assert "| T | global words/s | local words/s | mixed words/s |" in proc.stdout
    assert "| t | global ms/token | local ms/token | local_full_cache ms/token |" in proc.stdout
    assert "| long_context | T=256 mixed: does not fit" in proc.stderr  # progress lines
    assert record["complete"] and record["benchmark"] == "long_context"
    assert record["machine"]["threads"] == 1
    assert {"torch", "fairseq", "date", "cpu"} <= set(record["machine"])
    settings = record["settings"]
    assert settings["lengths"] == [64, 256] and settings["layers"] == 2
    assert settings["dims"] == 64 and settings["window"] == 8
    assert settings["max_positions"] >= max(settings["decode_lengths"]) + 1
    # the same parameters in all three: only the attention differs
    models = record["models"]
    assert list(models) == ["global", "local", "mixed"]
    assert models["global"]["arch"] == "transformer_lm"
    assert models["global"]["locality_config"] is None
    assert len({m["parameters"] for m in models.values()}) == 1
    assert [row["length"] for row in record["training"]] == [64, 256]
    first = record["training"][0]
    for cell in first["models"].values():
        assert cell["fits"] and cell["words_per_second"] > 0 and cell["peak_bytes"] > 0
        assert len(cell["words_per_second_rounds"]) == settings["rounds"]
    for ratio in first["ratios"].values():
        assert ratio["words_per_second"] > 0 and ratio["memory"] > 0
    assert [p["t"] for p in record["decoding"]["points"]] == settings["decode_lengths"]


@pytest.mark.slow
def test_the_rolling_cache_decodes_as_the_full_one_and_holds_only_the_window(quick_run):
    _, record = quick_run
    decoding = record["decoding"]
    check = decoding["rolling_vs_full_cache"]
    assert check["agree"] and check["same_greedy_tokens"]
    assert check["max_abs_logit_difference"] <= check["tolerance"]
    assert check["steps"] == max(record["settings"]["decode_lengths"])
    last = decoding["points"][-1]
    share = (record["settings"]["window"] + 1) / last["t"]
    rolling = last["local"]["cache_bytes_per_layer"]
    full = last["local_full_cache"]["cache_bytes_per_layer"]
    assert all(r <= share * f for r, f in zip(rolling, full))
    # the full cache holds what fairseq's own attention holds; the rolling one stops growing
    assert full == last["global"]["cache_bytes_per_layer"]
    assert decoding["points"][0]["local"]["cache_bytes_per_layer"] == rolling
    for point in decoding["points"]:
        assert all(point[name]["ms_per_token"] > 0 for name in ("global", "local"))


@pytest.mark.slow
def test_a_configuration_over_the_memory_cap_is_reported_not_run(quick_run):
    proc, record = quick_run
    longest = record["training"][-1]
    for name, model in longest["models"].items():
        assert not model["fits"] and model["does_not_fit"].startswith("estimated")
        assert model["estimated_bytes"] > record["settings"]["memory_cap_bytes"]
        assert model["words_per_second"] is None and model["peak_bytes"] is None
        assert f"T=256 {name}: does not fit: estimated" in proc.stdout
    for ratio in ("local/global", "mixed/global"):
        assert longest["ratios"][ratio] == {"words_per_second": None, "memory": None}
    assert all(model["fits"] for model in record["training"][0]["models"].values())
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| 256 |"))
    assert row.count("does not fit") == 6 and "n/a" in row  # words/s and MiB; no ratio


def test_running_out_of_memory_is_reported_and_other_errors_are_not_hidden(monkeypatch):
    settings = long_context.Settings(**dict(long_context.QUICK_SIZES, lengths=(32,), rounds=1))
    real_build = memory.build_trainer

    def build(builder, contender, length):
        if contender.name == "mixed":
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                "allocate memory: you tried to allocate 1099511627776 bytes."
            )
        return real_build(builder, contender, length)

    monkeypatch.setattr(memory, "build_trainer", build)
    lines = []
    with models.LanguageModelBuilder(settings) as builder:
        infos = memory.describe_models(builder)
        measured = {name: {} for name in infos}
        cells = training.train_at_length(builder, infos, 32, measured, lines.append)
        assert cells["mixed"].does_not_fit.startswith("out of memory (RuntimeError: ")
        assert cells["mixed"].step_seconds == [] and 32 not in measured["mixed"]
        assert cells["global"].words_per_second > 0 and cells["local"].peak_bytes > 0
        assert any("T=32 mixed: does not fit (out of memory" in line for line in lines)

        def broken(*args):
            raise ValueError("a bug, not a lack of memory")

        monkeypatch.setattr(memory, "build_trainer", broken)
        with pytest.raises(ValueError, match="a bug"):
            training.train_at_length(builder, infos, 32, measured, lines.append)


def test_the_estimate_adds_the_square_term_to_a_line_through_the_shorter_lengths():
    # a + b T + c T^2, exactly
    lengths = [1, 2, 4]
    peaks = [7 + 3 * t + 5 * t * t for t in lengths]
    assert memory.quadratic_coefficient(lengths, peaks) == 5
    assert memory.quadratic_coefficient(lengths, [10, 9, 7]) == 0  # shrinking: no T^2
    square, constant = 2.0, 100
    # nothing measured yet: the square term and the constant
    assert memory.estimated_bytes(10, square, constant, {}) == 200 + 100
    # one shorter length: its linear rest scaled through the origin
    one = {5: 5 * 5 * square + constant + 40}
    assert memory.estimated_bytes(10, square, constant, one) == 200 + 100 + 80
    # two or more: the line through the two longest shorter ones (longer ones are not used)
    measured = {2: 8 + 100 + 30, 4: 32 + 100 + 50, 6: 72 + 100 + 60, 20: 10**9}
    assert memory.estimated_bytes(10, square, constant, measured) == 200 + 100 + 60 + 5 * 4


def test_the_decoder_cache_switch_is_restored_after_each_step(monkeypatch):
    monkeypatch.setenv(FULL_CACHE_VARIABLE, "1")
    with decoding.decoder_cache(full=False):
        assert FULL_CACHE_VARIABLE not in os.environ  # the rolling cache, whatever was set
    assert os.environ[FULL_CACHE_VARIABLE] == "1"
    monkeypatch.delenv(FULL_CACHE_VARIABLE)
    with decoding.decoder_cache(full=True):
        assert os.environ[FULL_CACHE_VARIABLE] == "1"
    assert FULL_CACHE_VARIABLE not in os.environ


def test_the_script_refuses_an_existing_record_and_bad_sizes_before_measuring(tmp_path):
    existing = tmp_path / "record.json"
    existing.write_text("another run's record\n")
    proc = run_script(SCRIPT, "--quick", "--output", existing)
    assert proc.returncode == 1 and "--output" in proc.stderr and "exists" in proc.stderr
    assert existing.read_text() == "another run's record\n"
    for options, message in (
        (["--heads", 4, "--global-heads", 4], "--global-heads"),
        (["--dims", 60], "not a multiple of --heads"),
        (["--decode-lengths", 4], "shorter than --timing-steps"),
        (["--memory-cap-gb", 0], "must be more than 0"),
    ):
        proc = run_script(SCRIPT, "--quick", *options, "--output", tmp_path / "new.json")
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "new.json").exists()


def test_the_all_local_model_trains_in_memory_linear_in_its_length():
    """Training memory measured as the benchmark measures it (the peak of torch's allocations from
    building the model through two steps) at three short lengths, fitted as a + bT + cT^2: the
    all-local model's c is under half a byte (a bool (T, T) mask would add 1, a float one 4);
    fairseq's transformer_lm of the same sizes, which builds its float causal mask, shows 4 or
    more, so the measurement does see a T x T tensor. The estimate's probes (each layer's
    attention given the mask its decoder gives it, and that mask) find the same."""
    lengths = (256, 512, 1024)
    settings = long_context.Settings(**dict(long_context.QUICK_SIZES, lengths=lengths))
    by_name = {contender.name: contender for contender in contenders(settings)}
    per_square = {}
    with models.LanguageModelBuilder(settings) as builder:
        for name in ("local", "global"):
            peaks = [memory.trained_twice(builder, by_name[name], t)[1] for t in lengths]
            per_square[name] = memory.quadratic_coefficient(lengths, peaks)
        probed = {name: info.per_square for name, info in memory.describe_models(builder).items()}
    assert per_square["local"] < 0.5, per_square
    assert per_square["global"] >= 4, per_square
    assert probed["local"] < 0.5 and probed["global"] >= 4, probed


def test_the_full_run_reports_fairseqs_model_as_not_fitting_at_the_longest_lengths():
    """At the full run's sizes, from the global model's measurements in the committed record (its
    bytes per T^2 and its peaks at the shorter lengths), the estimate at T = 32768 and 65536
    exceeds the default cap: the run reports it with that estimate instead of training it."""
    settings = long_context.Settings(**long_context.FULL_SIZES)
    assert {32768, 65536} <= set(settings.lengths)
    with open(RECORD, encoding="utf-8") as f:
        record = json.load(f)
    model = record["models"]["global"]
    assert record["settings"]["dims"] == settings.dims and model["arch"] == "transformer_lm"
    info = memory.ModelInfo(
        contenders(settings)[0],
        model["parameters"],
        4 * model["parameters"],  # float32
        model["training_bytes_per_length_squared"],
    )
    measured = {
        row["length"]: row["models"]["global"]["peak_bytes"]
        for row in record["training"]
        if row["models"]["global"]["fits"]
    }
    for length in (32768, 65536):
        assert info.estimated_bytes(length, measured) > settings.memory_cap_bytes
