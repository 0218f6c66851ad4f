"""Live progress of fairseq-train runs, read from their own logs.

fairseq-train run with ``--log-format json`` writes one JSON object per logged step
(``| train_inner | {...}``), per epoch (``| train | {...}``) and per validation
(``| valid | {...}``). A :class:`RunLog` follows one run's log file as it grows;
:class:`ProgressDisplay` shows one line per run (epoch, updates, loss, words/s, time left),
redrawn in place on a terminal and printed every ``interval`` seconds otherwise (CI, logs).
"""

import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field

# fairseq's console format "<date> <time> | INFO | <tag> | {json}", or Python's default
# "INFO:<tag>:{json}" where logging was configured before fairseq's. The tag of a validation
# is its subset's name: "valid", or "dev_asr" for a speech corpus (loggers of modules have
# dotted names).
_JSON_LINE = re.compile(
    r"(?:\| |^INFO:)(?P<tag>[A-Za-z][\w-]*)(?: \| |:)(?P<stats>\{.*\})\s*$"
)
DONE_TRAINING = "done training in"  # fairseq-train's last log line
# logged at the start of every epoch, also by a run resumed into the log of its earlier part
EPOCH_BEGINS = "begin training epoch"
# a resumed run's starting point: what its log holds beyond it is trained again
_CHECKPOINT_LOADED = re.compile(r"Loaded checkpoint .* \(epoch (\d+) @ (\d+) updates\)")
# a resumed run that finds no checkpoint (killed before its first was saved) starts over
_NO_CHECKPOINT = "No existing checkpoint found"


def json_log_options(interval):
    """Options that make fairseq-train log what RunLog reads, every `interval` updates."""
    return ["--log-format", "json", "--log-interval", str(interval)]


class _CurrentStdoutHandler(logging.StreamHandler):
    """Writes each record to ``sys.stdout`` as it is when the record is emitted (as
    ``logging.lastResort`` does for stderr), never to a stream it kept: a tool's ``main`` run in
    a process that swaps stdout for a while (a test capturing it, a caller redirecting it)
    leaves no handler on a stream that is closed once the swap ends."""

    def __init__(self):
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stdout


# fairseq's tools' own log format (fairseq_cli's logging.basicConfig)
LOG_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"


def console_logging():
    """fairseq-train's console log format on stdout, at INFO (or $LOGLEVEL): importing fairseq
    configures Python's default format at DEBUG, which this replaces."""
    logging.basicConfig(
        format=LOG_FORMAT,
        datefmt="%Y-%m-%d %H:%M:%S",
        level=os.environ.get("LOGLEVEL", "INFO").upper(),
        handlers=[_CurrentStdoutHandler()],
        force=True,
    )


def parse_line(line):
    """(tag, stats) of one of fairseq's JSON log lines, or None for any other line."""
    match = _JSON_LINE.search(line)
    if match is None:
        return None
    try:
        return match["tag"], json.loads(match["stats"])
    except json.JSONDecodeError:
        return None  # a line cut by a kill mid-write


def _number(stats, key):
    value = stats.get(key)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


@dataclass
class Validation:
    epoch: int
    num_updates: int
    loss: float
    wall: float = None  # the run's wall seconds (all sessions) when it was logged, if known


@dataclass
class RunLog:
    """What one run's log says so far; `update()` reads the lines written since the last call.

    ``max_update``, ``max_epoch`` or ``max_seconds`` (whichever the run stops at) gives the time
    left. ``max_seconds`` is a budget of training time (fairseq's ``--stop-time-hours``), which
    fairseq counts across sessions: ``seconds_offset`` is what earlier sessions spent of it.
    """

    path: str
    label: str
    max_update: int = None
    max_epoch: int = None
    max_seconds: float = None
    seconds_offset: float = 0.0
    epoch: int = 0
    epoch_progress: float = 0.0  # fractional epochs done, from train_inner's "update" field
    num_updates: int = 0
    loss: float = None
    words_per_s: float = None
    updates_per_s: float = None
    wall: float = None  # this session's seconds at its last logged step
    words_per_s_by_epoch: dict = field(default_factory=dict)  # epoch -> its training words/s
    validations: list = field(default_factory=list)
    finished: bool = False
    resuming: bool = False  # a new part of the run started; its checkpoint is not loaded yet
    _offset: int = 0
    _pending: str = ""

    def update(self):
        if not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8", errors="replace") as log:
            log.seek(self._offset)
            text = log.read()
            self._offset = log.tell()
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()  # an unfinished last line waits for its end
        for line in lines:
            self.read_line(line)

    def continue_log(self):
        """A new part of the run is about to log into the same file: read what the earlier parts
        logged, and show no count of theirs until this part logs where it resumes."""
        self.update()
        self.resuming = True

    def read_line(self, line):
        if DONE_TRAINING in line:
            self.finished = True
        elif EPOCH_BEGINS in line:  # a run continued under a higher cap trains again
            self.finished = False
        loaded = _CHECKPOINT_LOADED.search(line)
        if loaded:
            self.resume_from(int(loaded[1]), int(loaded[2]))
            return
        if _NO_CHECKPOINT in line:
            self.resume_from(1, 0)
            return
        parsed = parse_line(line)
        if parsed is None:
            return
        tag, stats = parsed
        self.resuming = False
        prefix = "" if tag == "train_inner" else tag + "_"
        updates = _number(stats, prefix + "num_updates")
        if stats.get("epoch") is not None:
            self.epoch = int(stats["epoch"])
        if updates is not None:
            self.num_updates = int(updates)
        if tag == "train_inner":
            self.loss = _number(stats, "loss")
            self.words_per_s = _number(stats, "wps")
            self.updates_per_s = _number(stats, "ups")
            self.epoch_progress = _number(stats, "update") or self.epoch_progress
            self.wall = _number(stats, "wall")
        elif tag == "train":
            self.epoch_progress = float(self.epoch)
            self.loss = _number(stats, "train_loss") if "train_loss" in stats else self.loss
            if _number(stats, "train_wps") is not None:
                self.words_per_s_by_epoch[self.epoch] = _number(stats, "train_wps")
        elif _number(stats, prefix + "loss") is not None:  # a validation subset's line
            entry = Validation(
                self.epoch, self.num_updates, _number(stats, prefix + "loss"),
                _number(stats, prefix + "wall"),
            )  # fmt: skip
            # a validation logged again after a resume replaces the one of the same update
            self.validations = [v for v in self.validations if v.num_updates != entry.num_updates]
            self.validations.append(entry)

    def resume_from(self, epoch, num_updates):
        """The run restarts from a checkpoint at the start of `epoch`: the updates an
        interrupted earlier part logged beyond it, and their validations, are undone."""
        self.resuming = False
        self.epoch, self.num_updates = epoch, num_updates
        self.wall = None  # the earlier session's clock
        self.epoch_progress = float(epoch - 1)
        self.validations = [v for v in self.validations if v.num_updates <= num_updates]
        for later in [e for e in self.words_per_s_by_epoch if e >= epoch]:
            del self.words_per_s_by_epoch[later]

    @property
    def epoch_words_per_s(self):
        """Training words/s of every epoch trained, in order."""
        return [self.words_per_s_by_epoch[e] for e in sorted(self.words_per_s_by_epoch)]

    def time_left(self):
        """Seconds until the cap at the current speed, or None while unknown."""
        if self.finished:
            return 0.0
        if self.max_seconds:
            spent = self.seconds_spent()
            return None if spent is None else max(0.0, self.max_seconds - spent)
        if not self.updates_per_s:
            return None
        if self.max_update:
            return max(0, self.max_update - self.num_updates) / self.updates_per_s
        if self.max_epoch and self.epoch_progress and self.num_updates:
            updates_per_epoch = self.num_updates / self.epoch_progress
            epochs_left = max(0.0, self.max_epoch - self.epoch_progress)
            return epochs_left * updates_per_epoch / self.updates_per_s
        return None

    def seconds_spent(self):
        """Training seconds of the budget spent so far, or None before this session logs."""
        return None if self.wall is None else self.seconds_offset + self.wall

    def line(self):
        """One line: label, epoch, updates, loss, words/s, time left."""
        if self.resuming:  # what the log says so far is the earlier part's, not where it resumes
            return f"{self.label}: resuming from its last checkpoint"
        if self.finished:
            state = "done"
        elif self.num_updates == 0:
            state = "starting"
        else:
            left = self.time_left()
            state = "time left " + (format_duration(left) if left is not None else "?")
        cap = f"/{self.max_update}" if self.max_update else ""
        loss = f"{self.loss:.3f}" if self.loss is not None else "-"
        speed = f"{self.words_per_s:.0f}" if self.words_per_s is not None else "-"
        return (
            f"{self.label}: epoch {self.epoch} | updates {self.num_updates}{cap} | loss {loss} "
            f"| {speed} words/s | {state}"
        )

    def progress_fraction(self):
        if self.resuming:
            return None
        if self.finished:
            return 1.0
        if self.max_update:
            return min(1.0, self.num_updates / self.max_update)
        if self.max_seconds:
            spent = self.seconds_spent()
            return None if spent is None else min(1.0, spent / self.max_seconds)
        if self.max_epoch:
            return min(1.0, self.epoch_progress / self.max_epoch)
        return None


def format_duration(seconds):
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def read_log(path, label="", **caps):
    """A RunLog of a whole log file, as it is now."""
    run = RunLog(path, label, **caps)
    run.update()
    return run


class ProgressDisplay:
    """One line per run: redrawn in place on a terminal, printed every `interval` s otherwise."""

    BAR_WIDTH = 20

    def __init__(self, stream=None, interval=30.0, tty=None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval = interval
        self._drawn = 0  # lines drawn in place last time (terminal mode)
        self._last_print = None
        self._last_lines = {}

    def show(self, runs, force=False):
        for run in runs:
            run.update()
        if self.tty:
            self._redraw(runs)
            return
        now = time.monotonic()
        if force or self._last_print is None or now - self._last_print >= self.interval:
            self._last_print = now
            for run in runs:
                line = run.line()
                if self._last_lines.get(run.path) != line:  # nothing new: nothing printed
                    self._last_lines[run.path] = line
                    print("| progress | " + line, file=self.stream, flush=True)

    def _redraw(self, runs):
        lines = [self._bar(run) + " " + run.line() for run in runs]
        up = f"\x1b[{self._drawn}F" if self._drawn else ""
        self.stream.write(up + "".join("\r\x1b[2K" + line + "\n" for line in lines))
        self.stream.flush()
        self._drawn = len(lines)

    def _bar(self, run):
        fraction = run.progress_fraction()
        if fraction is None:
            return "[" + " " * self.BAR_WIDTH + "]"
        filled = int(fraction * self.BAR_WIDTH)
        return "[" + "#" * filled + "." * (self.BAR_WIDTH - filled) + "]"

    def finish(self, runs):
        """The final state, printed once more whatever the mode; the next output starts below."""
        self.show(runs, force=True)
        self._drawn = 0
