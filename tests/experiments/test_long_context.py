"""The long-context benchmark: its quick run through the script (real models, real training
steps, real incremental decoding), and the pieces that decide whether a configuration fits."""

import json
import os

import pytest
import torch

from local_attn_fairseq.cpu_allocator import find_tcmalloc
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
    # its own process, as a user starts it: it starts itself again under tcmalloc
    proc = run_script(
        SCRIPT, "--quick", "--threads", 1, "--memory-cap-gb", CAP_GIB, "--output", output,
        separate_process=True,
    )  # fmt: skip
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
    assert record["machine"]["allocator"] == ("tcmalloc" if find_tcmalloc() else "glibc")
    assert f"{record['machine']['allocator']}'s malloc" in proc.stdout
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
def test_the_rolling_cache_decodes_on_alone_timed_beside_a_fresh_one(quick_run):
    proc, record = quick_run
    settings, decoding = record["settings"], record["decoding"]
    (point,) = decoding["rolling_cache_alone"]
    assert point["t"] == settings["rolling_decode_lengths"][0] > settings["decode_lengths"][-1]
    assert point["reference_t"] == settings["decode_lengths"][0]
    assert point["ms_per_token"] > 0 and point["reference_ms_per_token"] > 0
    ratio = point["ms_per_token"] / point["reference_ms_per_token"]
    assert point["ms_per_token_over_reference"] == pytest.approx(ratio)
    # still the window's keys, as at every lockstep length
    assert point["cache_bytes_per_layer"] == decoding["points"][0]["local"]["cache_bytes_per_layer"]
    assert f"| {point['t']} | {point['ms_per_token']:.2f} |" in proc.stdout


def test_a_reference_decoder_restarts_from_the_prompt_and_decodes_as_the_first_did():
    """The reference of the rolling points: a fresh state from the same prompt gives the same
    greedy tokens and logits as the decoder it was restarted from gave at those steps."""
    settings = long_context.Settings(**long_context.QUICK_SIZES)
    with models.LanguageModelBuilder(settings) as builder, torch.no_grad():
        rolling = decoding.prompted_decoders(builder)["local"]
        logits = []
        for index in range(24):
            rolling.advance(index)
            logits.append(rolling.logits)
        fresh = rolling.restarted("reference", 16)
        assert fresh.state == {} and fresh.step_seconds == [] and fresh.tokens.shape == (1, 17)
        for index in range(16):
            fresh.advance(index)
            torch.testing.assert_close(fresh.logits, logits[index], rtol=0, atol=1e-5)
        assert torch.equal(fresh.tokens[0], rolling.tokens[0, :17])


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
        timed = {name: {} for name in infos}
        cells = training.train_at_length(builder, infos, 32, measured, timed, lines.append)
        assert cells["mixed"].does_not_fit.startswith("out of memory (RuntimeError: ")
        assert cells["mixed"].step_seconds == [] and 32 not in measured["mixed"]
        assert cells["global"].words_per_second > 0 and cells["local"].peak_bytes > 0
        assert any("T=32 mixed: does not fit (out of memory" in line for line in lines)

        def broken(*args):
            raise ValueError("a bug, not a lack of memory")

        monkeypatch.setattr(memory, "build_trainer", broken)
        with pytest.raises(ValueError, match="a bug"):
            training.train_at_length(builder, infos, 32, measured, timed, lines.append)


def test_a_configuration_over_the_time_cap_is_reported_too_slow_and_not_built(monkeypatch):
    settings = long_context.Settings(
        **dict(long_context.QUICK_SIZES, lengths=(32, 64), rounds=1, time_cap_minutes=1)
    )

    def build(*args):
        raise AssertionError("a model over the time cap was built")

    lines = []
    with models.LanguageModelBuilder(settings) as builder:
        infos = memory.describe_models(builder)
        measured = {name: {16: 10**6} for name in infos}
        # the global model took 10 s a step at T = 16 and 40 at 32: 160 at 64, 480 for 3 steps
        timed = {name: {16: 0.001, 32: 0.002} for name in infos}
        timed["global"] = {16: 10.0, 32: 40.0}
        monkeypatch.setattr(memory, "build_trainer", build)
        with pytest.raises(AssertionError, match="was built"):
            training.train_at_length(builder, infos, 64, measured, timed, lines.append)
        only_global = {"global": infos["global"]}
        cells = training.train_at_length(builder, only_global, 64, measured, timed, lines.append)
    cell = cells["global"]
    assert cell.estimated_seconds == pytest.approx(480)
    assert cell.too_slow.startswith("estimated 8.0 min for 3 steps > time cap 1 min")
    assert not cell.measured and not cell.does_not_fit and cell.step_seconds == []
    assert 64 not in timed["global"] and 64 not in measured["global"]
    record = cell.record()
    assert record["fits"] and record["too_slow"] == cell.too_slow
    assert record["words_per_second"] is None and record["peak_bytes"] is None
    assert any("T=64 global: too slow, not run (estimated 8.0 min" in line for line in lines)


def test_the_time_estimate_extends_the_time_per_token_along_a_line():
    # nothing measured: no estimate (the model runs)
    assert training.estimated_step_seconds(100, {}) is None
    # one shorter length: the same time per token
    assert training.estimated_step_seconds(100, {50: 5.0}) == pytest.approx(10.0)
    # two or more: the time per token on the line through the two longest shorter ones
    timed = {10: 1.0, 20: 4.0, 40: 16.0, 1000: 1.0}  # 0.1 s per token per 10 tokens of T
    assert training.estimated_step_seconds(80, timed) == pytest.approx(80 * 0.8)
    # a time per token that fell is held, not extrapolated down
    assert training.estimated_step_seconds(80, {20: 4.0, 40: 4.0}) == pytest.approx(8.0)


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
        (["--rolling-decode-lengths", 64], "not longer than the longest --decode-lengths"),
        (["--time-cap-minutes", -1], "must be more than 0"),
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


def test_the_full_run_reports_fairseqs_model_as_too_slow_then_not_fitting():
    """At the full run's sizes, from the global model's measurements in the committed record (its
    bytes per T^2, its peaks and its step times at the shorter lengths): at T = 32768 its steps
    exceed the default time cap, at 65536 its memory exceeds the memory cap, which the all-local
    model's own estimate there stays under; the run reports both with their estimates instead
    of training them."""
    settings = long_context.Settings(**long_context.FULL_SIZES)
    assert {32768, 65536} <= set(settings.lengths)
    with open(RECORD, encoding="utf-8") as f:
        record = json.load(f)
    assert record["settings"]["dims"] == settings.dims
    assert record["models"]["global"]["arch"] == "transformer_lm"

    def estimates(name, length):
        model = record["models"][name]
        info = memory.ModelInfo(
            contenders(settings)[list(record["models"]).index(name)],
            model["parameters"],
            4 * model["parameters"],  # float32
            model["training_bytes_per_length_squared"],
        )
        rows = [(row["length"], row["models"][name]) for row in record["training"]]
        rows = [(t, cell) for t, cell in rows if cell["peak_bytes"] and t < length]
        measured = {t: cell["peak_bytes"] for t, cell in rows}
        timed = {t: t / cell["words_per_second"] for t, cell in rows}
        step = training.estimated_step_seconds(length, timed)
        return info.estimated_bytes(length, measured), (training.UNTIMED_STEPS + settings.rounds) * step

    memory_32k, seconds_32k = estimates("global", 32768)
    assert seconds_32k > settings.time_cap_seconds
    assert estimates("global", 65536)[0] > settings.memory_cap_bytes
    assert estimates("local", 65536)[0] < settings.memory_cap_bytes


@pytest.mark.slow
def test_a_record_is_reported_and_drawn_from_its_file(quick_run, tmp_path):
    """--from-record prints the tables the run printed and draws the record (the models not run
    at T = 256 at their estimates); a file that is not a record is one line."""
    proc, record = quick_run
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    figure = tmp_path / "figure.png"
    again = run_script(SCRIPT, "--from-record", path, "--plot", figure)
    assert again.returncode == 0, again.stderr[-3000:]
    out = proc.stdout
    tables = out[out.index("long context (CPU") : out.index("record: ")].strip()
    assert again.stdout.startswith(tables)
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert again.stdout.strip().endswith(f"figure: {figure}")
    refused = run_script(SCRIPT, "--from-record", path, "--plot", figure)
    assert refused.returncode == 1 and "--plot" in refused.stderr and "exists" in refused.stderr
    (tmp_path / "other.json").write_text('{"benchmark": "banded_attention"}')
    (tmp_path / "broken.json").write_text('{"benchmark": ')
    for name, message in (("other.json", "not a record of benchmarks/long_context.py"),
                          ("broken.json", "not JSON"), ("missing.json", "cannot be read")):
        bad = run_script(SCRIPT, "--from-record", tmp_path / name)
        assert bad.returncode == 1 and message in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
    mixed = run_script(SCRIPT, "--from-record", path, "--quick")
    assert mixed.returncode == 2 and "measures nothing" in mixed.stderr
