"""The progress lines: fairseq's JSON log parsed (on a real fairseq-train log), both display modes."""

import io

from local_attn_fairseq.experiments.training_progress import (
    ProgressDisplay,
    RunLog,
    format_duration,
    json_log_options,
    parse_line,
    read_log,
)

from ..conftest import train_tiny


def test_parse_line_reads_both_console_formats_and_ignores_the_rest():
    stats = '{"epoch": 2, "update": 1.5, "loss": "7.1", "num_updates": "30"}'
    assert parse_line(f"2026-01-01 10:00:00 | INFO | train_inner | {stats}") == (
        "train_inner",
        {"epoch": 2, "update": 1.5, "loss": "7.1", "num_updates": "30"},
    )
    assert parse_line('INFO:valid:{"epoch": 1, "valid_loss": "9.4"}')[0] == "valid"
    assert parse_line("2026-01-01 | INFO | fairseq_cli.train | begin training epoch 1") is None
    assert parse_line('2026-01-01 | INFO | train_inner | {"epoch": 2, "lo') is None  # cut by a kill


def test_a_validation_is_read_under_its_subsets_name(tmp_path):
    """A speech corpus validates on "dev_asr": its line carries the subset's name and keys."""
    path = tmp_path / "train.log"
    path.write_text(
        '2026-01-01 | INFO | train | {"epoch": 1, "train_loss": "12.0", "train_num_updates": "2"}\n'
        '2026-01-01 | INFO | dev_asr | {"epoch": 1, "dev_asr_loss": "10.987", '
        '"dev_asr_num_updates": "2", "dev_asr_wall": "13"}\n'
        '2026-01-01 | INFO | fairseq.checkpoint_utils | {"not": "a validation"}\n'
    )
    run = read_log(str(path), "asr")
    assert [(v.epoch, v.num_updates, v.loss, v.wall) for v in run.validations] == [
        (1, 2, 10.987, 13.0)
    ]


def test_a_real_fairseq_log_gives_updates_loss_speed_and_validations(tiny_data, tmp_path):
    out = train_tiny(tiny_data, tmp_path / "run", *json_log_options(2), max_update=6)
    log_path = tmp_path / "train.log"
    log_path.write_text(out.stdout + out.stderr)
    run = read_log(str(log_path), "tiny", max_update=6)
    assert run.finished and run.num_updates == 6 and run.epoch >= 1
    assert run.loss is not None and run.loss > 0 and run.words_per_s > 0
    assert run.validations and all(v.loss > 0 for v in run.validations)
    assert run.validations[-1].num_updates == 6
    assert run.epoch_words_per_s and all(w > 0 for w in run.epoch_words_per_s)


def test_run_log_follows_a_growing_file_and_estimates_time_left(tmp_path):
    path = tmp_path / "train.log"
    path.write_text("")
    run = RunLog(str(path), "model", max_update=100)
    with open(path, "a") as log:
        log.write('x | INFO | train_inner | {"epoch": 1, "update": 0.5, "loss": "5.0", "wps": "1000", ')
    run.update()
    assert run.num_updates == 0 and run.time_left() is None  # half a line: nothing yet
    with open(path, "a") as log:
        log.write('"ups": "2", "num_updates": "40"}\n')
    run.update()
    assert run.num_updates == 40 and run.loss == 5.0 and run.time_left() == 30.0
    assert run.line() == "model: epoch 1 | updates 40/100 | loss 5.000 | 1000 words/s | time left 0m30s"
    by_epoch = RunLog(str(path), "model", max_epoch=4)
    by_epoch.update()  # half of epoch 1 took 40 updates: 3.5 epochs = 280 updates left at 2/s
    assert by_epoch.time_left() == 140.0
    assert format_duration(3 * 3600 + 65) == "3h01m"


def test_a_run_resumed_into_its_finished_log_is_training_again(tmp_path):
    path = tmp_path / "train.log"
    path.write_text(
        'x | INFO | train_inner | {"epoch": 4, "update": 3.9, "loss": "6.0", "wps": "900", '
        '"ups": "2", "num_updates": "40"}\n'
        "x | INFO | fairseq_cli.train | done training in 20.0 seconds\n"
    )
    run = RunLog(str(path), "model", max_update=100)
    run.update()
    assert run.finished and run.line().endswith("| done")
    with open(path, "a") as log:  # the study raised the cap: the same run continues
        log.write(
            "x | INFO | fairseq.trainer | begin training epoch 5\n"
            'x | INFO | train_inner | {"epoch": 5, "update": 4.2, "loss": "5.9", "wps": "900", '
            '"ups": "2", "num_updates": "50"}\n'
        )
    run.update()
    assert not run.finished and run.line().endswith("| time left 0m25s")


def test_a_run_resumed_from_an_earlier_checkpoint_forgets_what_it_trains_again(tmp_path):
    path = tmp_path / "train.log"
    epoch = 'x | INFO | {} | {{"epoch": {}, "{}num_updates": "{}", "{}": "{}"}}\n'
    path.write_text(
        epoch.format("train", 1, "train_", 30, "train_wps", 900)
        + epoch.format("valid", 1, "valid_", 30, "valid_loss", 7.0)
        + epoch.format("train", 2, "train_", 60, "train_wps", 950)
        + epoch.format("valid", 2, "valid_", 60, "valid_loss", 6.5)
        + 'x | INFO | train_inner | {"epoch": 3, "update": 2.5, "num_updates": "75", "ups": "2"}\n'
    )  # killed in epoch 3 before its checkpoint, and again before epoch 2's was saved
    run = RunLog(str(path), "model", max_update=100)
    run.update()
    assert run.num_updates == 75
    with open(path, "a") as log:
        log.write(
            "x | INFO | fairseq.trainer | Loaded checkpoint /runs/m/checkpoint_last.pt "
            "(epoch 2 @ 30 updates)\n"
        )
    run.update()
    assert (run.epoch, run.num_updates) == (2, 30) and "updates 30/100" in run.line()
    assert [v.num_updates for v in run.validations] == [30]
    assert run.epoch_words_per_s == [900.0]

    run.continue_log()  # a later part starts; killed again before any checkpoint was kept
    assert run.line() == "model: resuming from its last checkpoint"
    assert run.progress_fraction() is None
    with open(path, "a") as log:
        log.write("x | INFO | fairseq.trainer | No existing checkpoint found /runs/m/ckpt.pt\n")
    run.update()
    assert (run.epoch, run.num_updates, run.validations, run.epoch_words_per_s) == (1, 0, [], [])
    assert run.line() == "model: epoch 1 | updates 0/100 | loss - | - words/s | starting"


def test_a_budget_of_training_time_counts_earlier_sessions(tmp_path):
    """fairseq's --stop-time-hours counts the training time stored in the checkpoint a run
    resumes from: the time left is the budget less that and this session's wall clock."""
    path = tmp_path / "train.log"
    step = 'x | INFO | train_inner | {{"epoch": 1, "num_updates": "{}", "wall": "{}"}}\n'
    path.write_text(step.format(10, 100))
    run = RunLog(str(path), "model", max_seconds=600)
    run.update()
    assert run.time_left() == 500.0 and run.progress_fraction() == 100 / 600
    assert run.line() == "model: epoch 1 | updates 10 | loss - | - words/s | time left 8m20s"
    # a later session, resumed from a checkpoint that had spent 240 s of the budget
    resumed = RunLog(str(path), "model", max_seconds=600, seconds_offset=240.0)
    resumed.continue_log()
    with open(path, "a") as log:
        log.write("x | INFO | fairseq.trainer | Loaded checkpoint /r/checkpoint_last.pt "
                  "(epoch 1 @ 10 updates)\n")  # fmt: skip
    resumed.update()
    assert resumed.time_left() is None  # the earlier session's clock no longer counts
    with open(path, "a") as log:
        log.write(step.format(20, 60))
    resumed.update()
    assert resumed.time_left() == 300.0 and resumed.progress_fraction() == 0.5


def test_plain_mode_prints_lines_only_when_due_and_changed(tmp_path):
    path = tmp_path / "train.log"
    path.write_text('x | INFO | train_inner | {"epoch": 1, "update": 0.1, "num_updates": "5", "ups": "1"}\n')
    stream = io.StringIO()
    display = ProgressDisplay(stream, interval=3600, tty=False)
    run = RunLog(str(path), "m", max_update=10)
    display.show([run])
    display.show([run])  # not due yet
    display.finish([run])  # due, but the line has not changed
    assert stream.getvalue().splitlines() == ["| progress | m: epoch 1 | updates 5/10 | loss - | - words/s | time left 0m05s"]
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()


def test_terminal_mode_redraws_one_bar_per_run_in_place(tmp_path):
    logs = []
    for name, updates in (("a", 5), ("b", 10)):
        path = tmp_path / f"{name}.log"
        path.write_text(f'x | INFO | train_inner | {{"epoch": 1, "num_updates": "{updates}", "ups": "1"}}\n')
        logs.append(RunLog(str(path), name, max_update=10))
    stream = io.StringIO()
    display = ProgressDisplay(stream, tty=True)
    display.show(logs)
    display.show(logs)
    first, second = stream.getvalue().split("\n", 2)[:2]
    assert first.startswith("\r\x1b[2K[##########..........] a: epoch 1 | updates 5/10")
    assert second.startswith("\r\x1b[2K[####################] b: epoch 1 | updates 10/10")
    assert "\x1b[2F" in stream.getvalue()  # the second drawing moves up over the first
