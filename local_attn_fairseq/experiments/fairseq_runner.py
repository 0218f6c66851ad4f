"""Running fairseq's command-line tools for the demos, the study and the recipes.

- ``run_tool``: one tool to its end in a child process (the console script beside this
  Python), its output kept in a log; ``run_in_process``: the same tool's parser and ``main`` in
  this process, so a recipe pays for importing torch and fairseq once, not once per step;
  ``run_captured_in_process``: the same, its output in the log alone as from a child (the
  demos' binarisation before their runs train, their scoring once the runs have trained). All
  print the equivalent shell command first.
- ``TrainingJob`` and ``train_side_by_side``: several ``fairseq-train`` runs at once, the cores
  split between them, one live progress line per run.
- ``training_finished``, ``up_to_date`` and ``kept_output``: what an earlier run has already
  done, so a second run only redoes what is missing or stale.
"""

import contextlib
import logging
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

from ..file_safety import publish
from .training_progress import DONE_TRAINING, LOG_FORMAT, ProgressDisplay, RunLog

TOOLS = ("fairseq-preprocess", "fairseq-train", "fairseq-generate", "fairseq-eval-lm")
BIN = os.path.dirname(sys.executable)
# What fairseq's --user-dir loads: this package's own folder.
USER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_TAIL = 3000  # characters of a failed run's log shown in its error


class RunFailed(RuntimeError):
    """A fairseq tool or training run exited with an error; the message ends with its log's tail."""


def exit_on_failure(step, *args):
    """``step(*args)`` for a command's ``main``: a failed run ends the program with its message
    and a non-zero exit, not a traceback."""
    try:
        return step(*args)
    except RunFailed as e:
        sys.exit(f"error: {e}")


def command_line(tool, argv):
    return "$ " + " ".join([tool, *(shlex.quote(str(a)) for a in argv)])


def tool_path(tool):
    """The console script of ``tool`` installed beside the running Python."""
    return os.path.join(BIN, tool)


def log_tail(log_path):
    with open(log_path, encoding="utf-8", errors="replace") as f:
        return f.read()[-LOG_TAIL:]


def run_tool(tool, argv, log_path, env=None):
    """Run ``tool`` (a fairseq console script, or any executable path) with ``argv`` to its end,
    stdout and stderr into ``log_path``; returns the log's text, raises RunFailed on an error."""
    argv = [str(a) for a in argv]
    print(command_line(tool, argv), flush=True)
    executable = tool if os.path.sep in tool else tool_path(tool)
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    # Scoring and analysis often run beside training runs that hold the cores: OpenMP's
    # spinning workers then wait for each other (fairseq-generate of a tiny speech model, 2
    # threads beside two training runs: 75 s against 2.3 s with passive waiting).
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.run([executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=env)
    if process.returncode != 0:
        raise RunFailed(
            f"{tool} failed ({process.returncode}), see {log_path}:\n{log_tail(log_path)}"
        )
    with open(log_path, encoding="utf-8", errors="replace") as f:
        return f.read()


def run_python(argv, log_path=None):
    """Run ``python argv...`` with this interpreter; output to the console or to ``log_path``."""
    if log_path is not None:
        return run_tool(sys.executable, argv, log_path)
    print(command_line(sys.executable, argv), flush=True)
    if subprocess.run([sys.executable, *map(str, argv)]).returncode != 0:
        raise RunFailed(command_line(sys.executable, argv) + " failed")
    return None


def training_finished(log_path):
    """Whether the fairseq-train run logging to ``log_path`` ran to its end: an interrupted run
    leaves the checkpoint_best.pt of some epoch behind, so only the last words of its log count."""
    if not os.path.exists(log_path):
        return False
    with open(log_path, encoding="utf-8", errors="replace") as f:
        return DONE_TRAINING in f.read()


def up_to_date(output, *sources):
    """Whether ``output`` exists and was written after every source: a score or an analysis of
    a checkpoint that was trained again since is stale."""
    if not os.path.exists(output):
        return False
    written = os.path.getmtime(output)
    return all(written >= os.path.getmtime(source) for source in sources)


def kept_output(tool, argv, checkpoint, out_path, read, env=None, in_process=False):
    """``read(path)`` of what ``tool argv`` printed about ``checkpoint``, kept in ``out_path`` and
    reused while it is newer than the checkpoint and ``read`` finds its result there.

    ``read`` raises RunFailed when the output lacks the result. The output goes to
    ``<out_path>.partial`` (kept for reading when the tool fails) and is renamed into place only
    when the tool succeeded and ``read`` found its result, so an interrupted run of the tool is
    redone instead of being taken for a finished one. ``in_process``: the tool runs here
    (``run_captured_in_process``), for a caller that runs nothing beside it.
    """
    if up_to_date(out_path, checkpoint):
        try:
            return read(out_path)
        except RunFailed:
            pass
    partial = f"{out_path}.partial"
    if in_process:
        run_captured_in_process(tool, argv, partial)
    else:
        run_tool(tool, argv, partial, env)
    result = read(partial)
    publish(partial, out_path)
    return result


def threads_per_run(parallel):
    return max(1, (os.cpu_count() or 2) // max(1, parallel))


@dataclass
class TrainingJob:
    """One fairseq-train run: its full command, the log it writes and what watches that log.

    ``append`` continues a log across sessions (a resumed run) instead of starting it afresh.
    """

    label: str
    command: List[str]
    progress: RunLog
    append: bool = False

    @property
    def log_path(self):
        return self.progress.path

    def start(self, threads):
        cmd = [str(c) for c in self.command]
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        line = command_line(cmd[0], cmd[1:])
        print(line, flush=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as in run_tool: the cores may be shared
        if self.append:
            self.progress.continue_log()
        with open(self.log_path, "a" if self.append else "w", encoding="utf-8") as log:
            if self.append:
                log.write(line + "\n")
                log.flush()
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def train_side_by_side(
    jobs, parallel=None, display: Optional[ProgressDisplay] = None, poll=1.0, on_finished=None
):
    """Run every job, ``parallel`` at a time (default: all at once) with the cores split between
    them, one progress line per running job. Small models use two threads poorly, so side by
    side they finish sooner than one after the other, and they see the same machine while their
    words/s are measured. ``on_finished(job)`` follows each job that succeeds, while the others
    train. Raises RunFailed (the other runs stopped) when one fails."""
    jobs = list(jobs)
    parallel = parallel or max(1, len(jobs))
    threads = threads_per_run(parallel)
    display = display or ProgressDisplay()
    waiting, active = list(jobs), []  # active: (job, process)
    try:
        while waiting or active:
            while waiting and len(active) < parallel:
                job = waiting.pop(0)
                active.append((job, job.start(threads)))
                job.progress.update()  # after the start: a fresh log has replaced any earlier one
            display.show([job.progress for job, _ in active])
            for job, process in list(active):
                if process.poll() is None:
                    continue
                display.finish([job.progress])
                active.remove((job, process))
                if process.returncode != 0:
                    raise RunFailed(
                        f"fairseq-train of {job.label} failed ({process.returncode}), "
                        f"see {job.log_path}:\n{log_tail(job.log_path)}"
                    )
                job.progress.update()
                if on_finished:
                    on_finished(job)
            if active:
                time.sleep(poll)
    finally:  # a failed run, a failed on_finished or an interrupt stops the runs still going
        for _, process in active:
            process.terminate()
            process.wait()


# ---- fairseq's tools inside this process ---------------------------------------------------


# The line `logging_to` writes where a later session starts in a log that holds earlier ones.
NEW_SESSION = "==== new session: "


def last_session_finished(log_path):
    """Whether the last session that `logging_to` wrote in ``log_path`` ran fairseq-train to its
    end (a training resumed from a checkpoint at its cap would still take one more update)."""
    if not os.path.exists(log_path):
        return False
    with open(log_path, encoding="utf-8", errors="replace") as f:
        return DONE_TRAINING in f.read().rpartition(NEW_SESSION)[2]


@contextlib.contextmanager
def logging_to(path):
    """Also send every log record (fairseq's progress lines included) to ``path``, after what
    it holds: a resumed training keeps its earlier sessions' log (a line marks where each new
    session starts)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{NEW_SESSION}{time.strftime('%Y-%m-%d %H:%M:%S')} ====\n")
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


def run_in_process(tool, argv, log_path):
    """Run one fairseq tool's ``main`` with ``argv`` here; returns what it returns."""
    argv = [str(a) for a in argv]
    print(command_line(tool, argv), flush=True)
    with logging_to(log_path):
        return _IN_PROCESS[tool](argv)


def run_captured_in_process(tool, argv, log_path):
    """``run_tool`` without the child process: ``tool``'s ``main`` here, what it prints and logs
    written to ``log_path`` only, a failure raised as RunFailed with the log's tail. Spares a
    Python start and the imports of torch and fairseq (about 5 s a call) where tools run one
    after another; beside training runs, ``run_tool``'s child waits passively for its cores,
    which this process's threads, started long before, cannot be told to do."""
    argv = [str(a) for a in argv]
    print(command_line(tool, argv), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    failure = None
    with open(log_path, "w", encoding="utf-8") as log:
        handler = logging.StreamHandler(log)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root.handlers[:] = [handler]  # as from a child: its records in its log, not on the console
        root.setLevel(logging.INFO)
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                _IN_PROCESS[tool](argv)
        except (Exception, SystemExit) as error:  # SystemExit: fairseq's argument errors
            failure = error
        finally:
            root.handlers[:] = saved[0]
            root.setLevel(saved[1])
    if failure is not None:
        raise RunFailed(
            f"{tool} failed ({type(failure).__name__}: {failure}), see {log_path}:\n"
            f"{log_tail(log_path)}"
        ) from failure


def _preprocess(argv):
    from fairseq import options
    from fairseq_cli import preprocess

    return preprocess.main(options.get_preprocessing_parser().parse_args(argv))


def _train(argv):
    from fairseq import distributed_utils, options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli import train

    args = options.parse_args_and_arch(options.get_training_parser(), input_args=argv)
    return distributed_utils.call_main(convert_namespace_to_omegaconf(args), train.main)


def _generate(argv):
    from fairseq import options
    from fairseq_cli import generate

    args = options.parse_args_and_arch(options.get_generation_parser(), input_args=argv)
    return generate.main(args)


def _eval_lm(argv):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli import eval_lm

    args = options.parse_args_and_arch(options.get_eval_lm_parser(), input_args=argv)
    return eval_lm.main(convert_namespace_to_omegaconf(args))


# fairseq is imported by each runner when first used: the dry runs and the argument errors of
# the recipes answer without paying for it.
_IN_PROCESS = {
    "fairseq-preprocess": _preprocess,
    "fairseq-train": _train,
    "fairseq-generate": _generate,
    "fairseq-eval-lm": _eval_lm,
}
