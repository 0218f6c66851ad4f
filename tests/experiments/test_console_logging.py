"""The console logging of the tools' ``main`` (``training_progress.console_logging``) writes to
stdout as it is at each record: a ``main`` run while stdout is swapped (a test capturing it, a
caller redirecting it) leaves no handler on the swapped stream once it is closed."""

import contextlib
import io
import logging

import pytest

from local_attn_fairseq.experiments.training_progress import console_logging


@pytest.fixture
def root_logging_restored():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_console_logging_follows_stdout_after_a_swap_ends(root_logging_restored, capsys):
    logger = logging.getLogger("local_attn_fairseq.tests.console")
    swapped = io.StringIO()
    with contextlib.redirect_stdout(swapped):
        console_logging()
        logger.info("while swapped")
    assert "| INFO | local_attn_fairseq.tests.console | while swapped" in swapped.getvalue()
    swapped.close()  # what a capture does when its test ends

    logger.info("after the swap")
    captured = capsys.readouterr()
    assert "Logging error" not in captured.err and "closed file" not in captured.err
    assert "| INFO | local_attn_fairseq.tests.console | after the swap" in captured.out
    root = logging.getLogger()
    assert all(not getattr(h, "stream", None) or not h.stream.closed for h in root.handlers)


def test_console_logging_takes_the_level_of_loglevel(root_logging_restored, monkeypatch, capsys):
    monkeypatch.setenv("LOGLEVEL", "warning")
    console_logging()
    logger = logging.getLogger("local_attn_fairseq.tests.console")
    logger.info("not shown")
    logger.warning("shown")
    out = capsys.readouterr().out
    assert "not shown" not in out and "| WARNING | local_attn_fairseq.tests.console | shown" in out
