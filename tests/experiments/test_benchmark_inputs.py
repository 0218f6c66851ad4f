"""The benchmarks' inputs: counts of nothing, and output files that are not theirs to replace or
cannot be written, refused with one line before anything is measured.

Cheap: each script in benchmarks/ is loaded as a module and its parser (or ``main(argv)``,
where the check comes before any measurement) is called in this process.
"""

import importlib.util
import json
import os

import pytest

from local_attn_fairseq.experiments import demo, host_overhead
from local_attn_fairseq.file_safety import claim_output_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRID = os.path.join(REPO, "benchmarks", "results", "h200_bf16_d64_fwd_bwd_grid.json")


def script(name):
    """benchmarks/<name>.py as a module (not run: its ``__name__`` is not ``__main__``)."""
    path = os.path.join(REPO, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def banded():
    return script("banded_attention")


def argument_error(parse, argv, capsys):
    """argparse's refusal (status 2): its last stderr line."""
    with pytest.raises(SystemExit) as exited:
        parse([str(a) for a in argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def exit_message(call, argv):
    """The one-line message of the SystemExit that ``call(argv)`` ends with."""
    with pytest.raises(SystemExit) as exited:
        call([str(a) for a in argv])
    message = str(exited.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


COUNTS = {
    "banded_attention": ["--repeats", "--lengths", "--widths", "--batch", "--heads", "--dim"],
    "head_pruning": ["--rounds", "--repeats", "--batch", "--length", "--kept"],
    "host_overhead": ["--rounds", "--calls", "--threads"],
    "long_context": ["--lengths", "--decode-lengths", "--layers", "--dims", "--heads",
                     "--global-heads", "--window", "--vocab-size", "--rounds", "--timing-steps",
                     "--threads"],
    "speech_encoder": ["--rounds", "--seconds", "--batch", "--threads"],
    "pande_masks": ["--repeats", "--lengths", "--heads", "--batch", "--embed-dim"],
    "training_throughput": ["--rounds", "--batches", "--max-tokens"],
}


@pytest.mark.parametrize(
    "name, option", [(name, option) for name, options in COUNTS.items() for option in options]
)
def test_a_count_of_nothing_is_refused(name, option, capsys):
    module = script(name)
    parse = getattr(module, "parse_args", None) or module.main  # pande_masks: main parses
    line = argument_error(parse, [option, "0"], capsys)
    assert line.endswith(f"argument {option}: must be at least 1, got 0"), line


def test_head_pruning_keeps_at_most_the_heads_a_layer_has(capsys):
    line = argument_error(script("head_pruning").parse_args, ["--kept", "9"], capsys)
    assert "--kept: at most 8 heads per layer, got 9" in line


def test_the_speech_encoder_benchmark_takes_each_size_with_its_own_windows():
    speech_encoder = script("speech_encoder")
    assert speech_encoder.parse_args([]).windows == "0,0,0,5,5,9,13,11,15,19,17,21"
    tiny = speech_encoder.parse_args(["--arch", "s2t_transformer_local_tiny"])
    assert tiny.windows == "0,0,3,5,5,7"
    message = exit_message(
        speech_encoder.main, ["--arch", "s2t_transformer_local_tiny", "--windows", "3,3"]
    )
    assert "gives 2 windows but the encoder has 6 layers" in message


def user_file(tmp_path, name, text="mine\n"):
    path = tmp_path / name
    path.write_text(text)
    return path


# An earlier run's table or records (another GPU's grid, say) are replaced only with
# --overwrite, as any other file is.
@pytest.mark.parametrize(
    "option, text",
    [("--output", "mine\n"), ("--json", "mine\n"), ("--output", "banded route: an earlier run\n"),
     ("--json", json.dumps([{"T": 64, "w": 5, "mode": "fwd", "route": "banded", "ms": 1.0}]))],
)  # fmt: skip
def test_the_kernel_benchmark_replaces_no_existing_file(banded, tmp_path, option, text):
    mine = user_file(tmp_path, "results", text)
    message = exit_message(banded.parse_args, [option, mine, "--repeats", "1"])
    assert message.startswith(f"error: {option}: {mine}: exists; choose another path")
    assert "--overwrite" in message and mine.read_text() == text
    args = banded.parse_args([option, str(mine), "--overwrite"])
    assert getattr(args, option[2:]) == str(mine)


def test_the_kernel_benchmark_refuses_one_file_for_both_outputs(banded, tmp_path, capsys):
    both = str(tmp_path / "new.md")
    line = argument_error(banded.parse_args, ["--output", both, "--json", both], capsys)
    assert "--output and --json name the same file" in line
    args = banded.parse_args(["--output", both, "--json", str(tmp_path / "new.json")])
    assert args.output == both


@pytest.mark.parametrize("option", ["--output", "--json"])
def test_an_output_that_cannot_be_written_is_one_line(banded, tmp_path, option, capsys):
    afile = user_file(tmp_path, "afile", "")
    line = argument_error(banded.parse_args, [option, afile / "sub" / "t.md"], capsys)
    assert f"argument {option}: " in line and f"{afile} is a file, not a folder" in line
    line = argument_error(banded.parse_args, [option, tmp_path], capsys)
    assert f"argument {option}: " in line and "is a folder" in line


def test_the_results_table_replaces_an_existing_file_only_with_overwrite(tmp_path, capsys):
    results_table = script("results_table")
    mine = user_file(tmp_path, "notes.md")
    message = exit_message(results_table.main, [GRID, "--output", mine])
    assert message.startswith(f"error: --output: {mine}: exists") and "--overwrite" in message
    assert mine.read_text() == "mine\n"
    afile = user_file(tmp_path, "afile", "")
    line = argument_error(results_table.main, [GRID, "--output", afile / "t.md"], capsys)
    assert "argument --output: " in line and "is a file, not a folder" in line
    table = tmp_path / "table.md"
    results_table.main([GRID, "--output", str(table)])
    first = table.read_text()
    assert first.startswith("GPU: ")
    message = exit_message(results_table.main, [GRID, "--output", table])  # an earlier table
    assert message.startswith(f"error: --output: {table}: exists") and table.read_text() == first
    results_table.main([GRID, "--output", str(mine), "--overwrite"])
    assert mine.read_text() == first
    capsys.readouterr()


@pytest.mark.parametrize(
    "name, start",
    [("host_overhead", host_overhead.TABLE_START), ("speech_encoder", None)],
)
def test_the_other_benchmarks_refuse_an_existing_output(tmp_path, name, start, capsys):
    module = script(name)
    start = start or module.TABLE_START
    mine = user_file(tmp_path, "notes.md")
    message = exit_message(module.parse_args, ["--output", mine])
    assert message.startswith(f"error: --output: {mine}: exists") and mine.read_text() == "mine\n"
    assert module.parse_args(["--output", str(mine), "--overwrite"]).overwrite
    earlier = user_file(tmp_path, "earlier.md", start + "an earlier run\n")
    message = exit_message(module.parse_args, ["--output", earlier])
    assert message.startswith(f"error: --output: {earlier}: exists")
    assert earlier.read_text() == start + "an earlier run\n"
    afile = user_file(tmp_path, "afile", "")
    line = argument_error(module.parse_args, ["--output", afile / "t.md"], capsys)
    assert "argument --output: " in line and "is a file, not a folder" in line


def test_the_throughput_benchmark_claims_its_work_dir_as_the_demos_do(tmp_path, monkeypatch):
    throughput = script("training_throughput")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("mine\n")
    message = exit_message(throughput.main, ["--work-dir", mine])
    assert message.startswith("error: --work-dir: ") and "--overwrite" in message
    afile = user_file(tmp_path, "afile", "")
    assert exit_message(throughput.main, ["--work-dir", afile / "out"]).startswith(
        "error: --work-dir: "
    )
    measured = []
    monkeypatch.setattr(throughput, "measure", lambda args: measured.append(args.work_dir))
    shared = tmp_path / "demo_runs"
    claim_output_dir(str(shared), demo.WORK_DIR_OWNER)  # the demo's folder: its data is shared
    (shared / "results.md").write_text("the Ding demo's\n")
    throughput.main(["--work-dir", str(shared)])
    throughput.main(["--work-dir", str(mine), "--overwrite"])
    assert measured == [str(shared), str(mine)]
