"""The language-model demo's pieces: the running text, what it reads of fairseq's tools, its
models and options (the demo end to end: tests/scripts/test_lm_demo.py)."""

import os

import pytest

from local_attn_fairseq.experiments import lm_demo
from local_attn_fairseq.experiments.fairseq_runner import RunFailed


def test_chapter_lines_join_the_verses_of_each_chapter_in_order():
    verses = [
        (("Ruth", 1, 1), "In the days."),
        (("Ruth", 1, 2), "The man."),
        (("Ruth", 2, 1), "Naomi had."),
        (("Jonah", 1, 1), "Now Yahweh's word."),
    ]
    assert lm_demo.chapter_lines(verses) == [
        ("Ruth", 1, "In the days. The man."),
        ("Ruth", 2, "Naomi had."),
        ("Jonah", 1, "Now Yahweh's word."),
    ]


# fairseq-interactive's output for one prompt of 3 pieces continued by 2 (and the end forced)
INTERACTIVE = """2026-01-01 | INFO | fairseq_cli.interactive | Type the input sentence
S-0\t\u2581Now \u2581after \u2581the
W-0\t0.012\tseconds
H-0\t-3.5\t\u2581Now \u2581after \u2581the \u2581death \u2581of
D-0\t-3.5\tNow after the death of
P-0\t-1.0 -2.0 -0.5 -0.7 -0.1 -0.2
2026-01-01 | INFO | fairseq_cli.interactive | Total time: 2.000 seconds; translation time: 0.012
"""


def test_read_continuation_takes_the_tokens_after_the_prompt_and_times_every_step(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text(INTERACTIVE, encoding="utf-8")
    result = lm_demo.read_continuation(str(path))
    assert result["prompt_tokens"] == 3 and result["continuation"] == "death of"
    assert result["ms_per_token"] == pytest.approx(12 / 6)  # six decoding steps
    path.write_text(INTERACTIVE.split("H-0")[0], encoding="utf-8")  # killed while decoding
    with pytest.raises(RunFailed, match="no continuation"):
        lm_demo.read_continuation(str(path))


def test_read_perplexity_reads_fairseq_eval_lm(tmp_path):
    path = tmp_path / "eval.txt"
    path.write_text(
        "x | INFO | fairseq_cli.eval_lm | Evaluated 36,123 tokens in 19.4s (1865.08 tokens/s)\n"
        "x | INFO | fairseq_cli.eval_lm | Loss (base 2): 8.8433, Perplexity: 459.30\n"
    )
    result = lm_demo.read_perplexity(str(path))
    assert result["tokens"] == 36123 and result["perplexity"] == pytest.approx(459.30, abs=0.01)
    path.write_text("x | INFO | fairseq_cli.eval_lm | loading model(s)\n")
    with pytest.raises(RunFailed, match="no perplexity"):
        lm_demo.read_perplexity(str(path))


def fairseq_train_commands(settings, tmp_path, monkeypatch):
    """{arch: the fairseq-train command} the demo would run for each model (nothing runs)."""
    started = []
    monkeypatch.setattr(lm_demo, "train_unfinished", lambda jobs, **_: started.extend(jobs))
    lm_demo.train_models(str(tmp_path / "bin"), str(tmp_path), settings, minutes=15)
    commands = {}
    for job in started:
        command = [str(c) for c in job.command]
        commands[command[command.index("--arch") + 1]] = command
    return commands


def without_option(command, option):
    """(the command without ``option VALUE``, VALUE); VALUE is None where it is absent."""
    if option not in command:
        return command, None
    at = command.index(option)
    assert option not in command[at + 1 :], f"{option} given twice"
    return command[:at] + command[at + 2 :], command[at + 1]


@pytest.mark.parametrize("settings", [lm_demo.FULL, lm_demo.QUICK], ids=["full", "quick"])
def test_the_two_models_train_with_the_same_options_but_their_heads(
    settings, tmp_path, monkeypatch
):
    commands = fairseq_train_commands(settings, tmp_path, monkeypatch)
    assert sorted(commands) == ["transformer_lm", "transformer_lm_local"]
    rest = {}
    for arch, command in commands.items():
        command, _ = without_option(command, "--arch")
        command, save_dir = without_option(command, "--save-dir")
        assert os.path.basename(save_dir).startswith(f"{arch}-")  # each model its own folder
        rest[arch], rest[arch + " spec"] = without_option(command, "--locality-config")
    assert rest["transformer_lm spec"] is None
    window = f"local-{settings.window}"
    assert rest["transformer_lm_local spec"] == (
        "{decoder_self: {all: [" + ", ".join([window] * settings.heads) + "]}}"
    )
    assert rest["transformer_lm_local"] == rest["transformer_lm"]
    budget, _ = lm_demo.budget_options(settings, 15)  # the same budget too
    command = rest["transformer_lm"]
    assert command[command.index(budget[0]) + 1] == str(budget[1])


def test_the_budget_is_minutes_of_training_or_a_smoke_runs_updates():
    assert lm_demo.budget_options(lm_demo.FULL, 15) == (["--stop-time-hours", 0.25], "15 min")
    assert lm_demo.budget_options(lm_demo.QUICK, 15) == (["--max-update", 20], "20 updates")


def test_options(capsys):
    args = lm_demo.parse_args([])
    assert (args.settings, args.prompt) == (lm_demo.FULL, None)
    assert args.minutes == lm_demo.DEFAULT_MINUTES
    assert lm_demo.parse_args(["--quick", "--minutes", "3"]).settings == lm_demo.QUICK
    with pytest.raises(SystemExit):
        lm_demo.parse_args(["--minutes", "0"])
    assert "--minutes: must be at least 1" in capsys.readouterr().err
