"""The fairseq runner on real child processes: logs, failures, side-by-side training, staleness.

A tiny Python program stands in for fairseq-train: it writes one of fairseq's JSON progress
lines and its last words, so the runs take a fraction of a second.
"""

import io
import os
import sys
import time

import pytest

from local_attn_fairseq.experiments.fairseq_runner import (
    RunFailed,
    TrainingJob,
    kept_output,
    run_python,
    run_tool,
    threads_per_run,
    train_side_by_side,
    training_finished,
    up_to_date,
)
from local_attn_fairseq.experiments.training_progress import ProgressDisplay, RunLog

# argv: updates, seconds to sleep first, file to append "<label> start/end" to (or "-")
FAKE_TRAIN = r"""
import json, os, sys, time
updates, pause, trace = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if trace != "-":
    open(trace, "a").write(f"{sys.argv[4]} start\n")
time.sleep(pause)
stats = {"epoch": 1, "update": 1.0, "loss": "4.5", "wps": "1000", "ups": "2",
         "num_updates": str(updates)}
print("2026-01-01 10:00:00 | INFO | train_inner | " + json.dumps(stats), flush=True)
print("threads " + os.environ["OMP_NUM_THREADS"], flush=True)
print("2026-01-01 10:00:01 | INFO | fairseq_cli.train | done training in 0.1 seconds", flush=True)
if trace != "-":
    open(trace, "a").write(f"{sys.argv[4]} end\n")
"""
FAIL = "import sys; print('something broke'); sys.exit(3)"
# writes its pid (into a file renamed into place), then waits to be stopped
WAIT = r"""
import os, sys, time
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
"""
# fails once the waiting job has started
FAIL_LATER = r"""
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
print("something broke")
sys.exit(3)
"""


def fake_job(tmp_path, label, updates=5, pause=0.0, trace="-", append=False):
    log = tmp_path / label / "train.log"
    command = [sys.executable, "-c", FAKE_TRAIN, updates, pause, trace, label]
    return TrainingJob(label, command, RunLog(str(log), label, max_update=10), append=append)


def quiet_display():
    stream = io.StringIO()
    return ProgressDisplay(stream, interval=0.0, tty=False), stream


def test_run_tool_logs_the_output_and_raises_with_its_tail(tmp_path, capsys):
    log = tmp_path / "logs" / "hello.log"
    text = run_tool(sys.executable, ["-c", "print('hello from the tool')"], log)
    assert text == log.read_text() == "hello from the tool\n"
    assert capsys.readouterr().out.startswith(f"$ {sys.executable} -c ")
    with pytest.raises(RunFailed, match=r"failed \(3\), see .*broke\.log:\nsomething broke"):
        run_tool(sys.executable, ["-c", FAIL], tmp_path / "broke.log")
    with pytest.raises(RunFailed, match="failed"):
        run_python(["-c", FAIL])
    assert run_python(["-c", "print('to the console')"]) is None


def test_training_finished_reads_the_last_words_and_up_to_date_the_times(tmp_path):
    log = tmp_path / "train.log"
    assert not training_finished(str(log))
    log.write_text("epoch 1 | loss 5\n")
    assert not training_finished(str(log))  # an interrupted run
    log.write_text("epoch 1 | loss 5\ndone training in 3.0 seconds\n")
    assert training_finished(str(log))

    checkpoint, score = tmp_path / "checkpoint.pt", tmp_path / "score.txt"
    checkpoint.write_text("weights")
    assert not up_to_date(str(score), str(checkpoint))
    score.write_text("BLEU = 1")
    os.utime(checkpoint, (time.time() - 10, time.time() - 10))
    assert up_to_date(str(score), str(checkpoint))
    os.utime(checkpoint, (time.time() + 10, time.time() + 10))  # trained again since
    assert not up_to_date(str(score), str(checkpoint))
    older = tmp_path / "older.txt"
    older.write_text("data")
    os.utime(older, (time.time() - 10, time.time() - 10))
    assert up_to_date(str(score), str(older))
    assert not up_to_date(str(score), str(older), str(checkpoint))  # every source counts


def read_score(path):
    with open(path) as f:
        words = f.read().split()
    if words[:1] != ["score"]:
        raise RunFailed(f"no score in {path}")
    return int(words[1])


def test_kept_output_is_reused_while_newer_than_its_checkpoint(tmp_path):
    checkpoint, out = tmp_path / "checkpoint.pt", tmp_path / "out.txt"
    checkpoint.write_text("weights")
    os.utime(checkpoint, (time.time() - 10, time.time() - 10))

    def kept(printed):
        program = ["-c", f"print({printed!r})"]
        return kept_output(sys.executable, program, str(checkpoint), str(out), read_score)

    assert kept("score 1") == 1
    assert kept("score 2") == 1 and not os.path.exists(f"{out}.partial")  # the kept output
    os.utime(checkpoint, (time.time() + 10, time.time() + 10))  # trained again since
    with pytest.raises(RunFailed, match="no score"):
        kept("stopped before its score")
    assert (tmp_path / "out.txt.partial").read_text() == "stopped before its score\n"
    assert read_score(out) == 1  # an output without its result never takes the name
    assert kept("score 3") == 3


def test_jobs_train_side_by_side_with_the_cores_split_and_one_line_each(tmp_path, capsys):
    jobs = [fake_job(tmp_path, "a", updates=4), fake_job(tmp_path, "b", updates=6)]
    display, stream = quiet_display()
    train_side_by_side(jobs, display=display, poll=0.05)
    for job, updates in zip(jobs, (4, 6)):
        log = open(job.log_path).read()
        assert f"threads {threads_per_run(2)}\n" in log and training_finished(job.log_path)
        assert job.progress.finished and job.progress.num_updates == updates
        assert f"| progress | {job.label}: epoch 1 | updates {updates}/10 | loss 4.500 " in (
            stream.getvalue()
        )
    assert stream.getvalue().splitlines()[-1].endswith("| done")
    assert capsys.readouterr().out.count(f"$ {sys.executable} -c ") == 2


def test_parallel_one_trains_one_job_after_the_other(tmp_path):
    trace = tmp_path / "trace.txt"
    jobs = [fake_job(tmp_path, name, pause=0.2, trace=str(trace)) for name in ("a", "b")]
    train_side_by_side(jobs, parallel=1, display=quiet_display()[0], poll=0.05)
    assert trace.read_text().split("\n")[:4] == ["a start", "a end", "b start", "b end"]
    assert f"threads {threads_per_run(1)}\n" in open(jobs[1].log_path).read()


def test_a_fresh_run_replaces_its_old_log_and_a_resumed_one_continues_it(tmp_path):
    fresh = fake_job(tmp_path, "fresh", updates=3)
    resumed = fake_job(tmp_path, "resumed", updates=8, pause=0.3, append=True)
    for job in (fresh, resumed):
        os.makedirs(os.path.dirname(job.log_path))
        with open(job.log_path, "w") as log:  # an earlier session, stopped at 7 updates
            log.write('x | INFO | train_inner | {"epoch": 1, "num_updates": "7"}\n' * 50)
    display, stream = quiet_display()
    train_side_by_side([fresh, resumed], display=display, poll=0.05)
    # until the resumed part logs, its line shows no count of the earlier part's
    progress = [line for line in stream.getvalue().splitlines() if "| resumed:" in line]
    assert progress[0] == "| progress | resumed: resuming from its last checkpoint"
    assert not any("updates 7/10" in line for line in progress) and progress[-1].endswith("done")
    fresh_log, resumed_log = open(fresh.log_path).read(), open(resumed.log_path).read()
    assert '"num_updates": "7"' not in fresh_log and fresh.progress.num_updates == 3
    assert resumed_log.count('"num_updates": "7"') == 50 and resumed.progress.num_updates == 8
    assert f"\n$ {sys.executable} -c " in resumed_log  # each session's command in its log


def test_a_failed_job_stops_the_others_and_names_its_log(tmp_path):
    pid_file = tmp_path / "waiting.pid"
    waiting = TrainingJob(
        "waiting",
        [sys.executable, "-c", WAIT, pid_file],
        RunLog(str(tmp_path / "waiting" / "train.log"), "waiting"),
    )
    broken = TrainingJob(
        "broken",
        [sys.executable, "-c", FAIL_LATER, pid_file],
        RunLog(str(tmp_path / "broken" / "train.log"), "broken"),
    )
    never_started = fake_job(tmp_path, "never")
    started = time.monotonic()
    with pytest.raises(RunFailed) as failure:
        train_side_by_side(
            [waiting, broken, never_started], parallel=2, display=quiet_display()[0], poll=0.05
        )
    assert time.monotonic() - started < 30  # the waiting job did not run its minute
    message = str(failure.value)
    assert message.startswith("fairseq-train of broken failed (3), see ")
    assert message.endswith("something broke\n")
    with pytest.raises(ProcessLookupError):  # terminated and reaped
        os.kill(int(pid_file.read_text()), 0)
    assert not os.path.exists(never_started.log_path)
