"""Long documents end to end through fairseq's tools: the English Bible as one text (prepared as
the LM demo prepares it, ``experiments.lm_demo.prepare_data``), an LM whose every head is
``local-64`` (``transformer_lm_local``, a tiny model) trained by ``fairseq-train`` on blocks of N
tokens, scored by ``fairseq-eval-lm`` on those blocks and with ``--context-window``, and
continuing an N-token prompt through ``fairseq-interactive`` from its rolling decoder cache.

N is 2,048 by default (a reduced form: a couple of minutes on 2 cores);
``LOCAL_ATTN_LONG_DOCUMENT_TOKENS=65536`` runs the full size::

    LOCAL_ATTN_LONG_DOCUMENT_TOKENS=65536 \\
        .venv/bin/python -m pytest -n 0 tests/models/test_long_documents.py
"""

import dataclasses
import math
import os

import pytest

from local_attn_fairseq.checkpoint_files import read_checkpoint
from local_attn_fairseq.experiments import lm_demo
from local_attn_fairseq.experiments.training_progress import json_log_options, parse_line
from local_attn_fairseq.modules import rolling_cache
from local_attn_fairseq.modules.rolling_cache import FULL_CACHE_VARIABLE

from ..conftest import USER_DIR, fairseq_cli
from .test_rolling_decoder_cache import assert_same_decoding, decoded

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

TOKENS_VARIABLE = "LOCAL_ATTN_LONG_DOCUMENT_TOKENS"
REDUCED_TOKENS = 2048
MIN_TOKENS = 256  # blocks several windows long
WINDOW = 64
UPDATES = 2
CONTINUATION_TOKENS = 16
# The five books of Moses, Judges and Joshua's and Ruth's held-out texts: at full size their
# training verses give a few blocks of 65,536 tokens.
BOOKS = ("Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth")


def document_tokens():
    value = os.environ.get(TOKENS_VARIABLE, str(REDUCED_TOKENS))
    if not value.isdigit() or int(value) < MIN_TOKENS:
        pytest.fail(f"{TOKENS_VARIABLE}={value!r}: give a whole number >= {MIN_TOKENS}", False)
    return int(value)


def long_document_settings(tokens):
    """The LM demo's smoke settings at blocks of ``tokens``: every head local-64, enough verses
    (about 40 tokens each with 300 pieces) for a few blocks."""
    return dataclasses.replace(
        lm_demo.QUICK, data_name=f"data_long_{tokens}", books=BOOKS, max_verses=tokens // 10,
        window=WINDOW, tokens_per_sample=tokens, context_window=tokens // 2, max_tokens=tokens,
        max_update=UPDATES, save_interval_updates=UPDATES,
    )  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(settings, data folder, binarised data, save folder, fairseq-train's output)."""
    settings = long_document_settings(document_tokens())
    data_dir = tmp_path_factory.mktemp("long_document")
    bin_dir = lm_demo.prepare_data(str(data_dir), settings)
    train_tokens = lm_demo.count_tokens(data_dir / "spm" / "train")
    assert train_tokens >= 2 * settings.tokens_per_sample, "too few verses for two blocks"
    (_, arch, extra), = [m for m in lm_demo.models(settings) if m[1] == "transformer_lm_local"]
    save_dir = data_dir / "run"
    proc = fairseq_cli(
        "fairseq-train", *lm_demo.training_options(settings, bin_dir, arch, extra),
        "--max-update", UPDATES, "--save-dir", save_dir, *json_log_options(1),
    )  # fmt: skip
    return settings, data_dir, bin_dir, save_dir, proc.stdout


def test_fairseq_train_trains_on_blocks_of_n_tokens(trained):
    settings, _, _, save_dir, stdout = trained
    steps = [stats for tag, stats in filter(None, map(parse_line, stdout.splitlines()))
             if tag == "train_inner"]  # fmt: skip
    assert len(steps) == UPDATES, stdout[-2000:]
    assert all(math.isfinite(float(s["loss"])) for s in steps)
    # one block a batch: every update trains on N tokens
    assert all(float(s["wpb"]) == settings.tokens_per_sample for s in steps)
    state = read_checkpoint(str(save_dir / "checkpoint_last.pt"))
    assert state["optimizer_history"][-1]["num_updates"] == UPDATES
    assert f"local-{WINDOW}" in state["cfg"]["model"].locality_config


@pytest.mark.parametrize("context_window", [0, "half"])
def test_fairseq_eval_lm_scores_every_token_of_the_blocks(trained, context_window, tmp_path):
    """The training text in blocks of N tokens, each scored alone or behind the N/2 tokens
    before it: every token of the text scored once, a finite perplexity."""
    settings, data_dir, bin_dir, save_dir, _ = trained
    context = settings.context_window if context_window == "half" else 0
    proc = fairseq_cli(
        "fairseq-eval-lm", bin_dir, "--user-dir", USER_DIR, "--path",
        save_dir / "checkpoint_last.pt", "--task", "language_modeling", "--gen-subset", "train",
        "--tokens-per-sample", settings.tokens_per_sample, "--context-window", context,
        "--sample-break-mode", "none", "--max-tokens", settings.tokens_per_sample,
        "--num-workers", 0, "--required-batch-size-multiple", 1,
    )  # fmt: skip
    out = tmp_path / "eval-lm.txt"
    out.write_text(proc.stdout, encoding="utf-8")
    result = lm_demo.read_perplexity(str(out))
    assert result["tokens"] == lm_demo.count_tokens(data_dir / "spm" / "train")
    # two updates from random weights: near the vocabulary's size, far from a broken model's
    assert 1 < result["perplexity"] < 4 * settings.vocab_size


def cache_keys_recorded(monkeypatch):
    """{rolling cache: most keys its layer's cached tensors held at once}: the keys of the
    buffer behind the cached keys (a slice keeps its whole buffer alive), after each step."""
    held = {}
    drop_unreachable = rolling_cache.RollingWindowCache.drop_unreachable

    def recording(self, saved_state):
        drop_unreachable(self, saved_state)
        key = saved_state["prev_key"]
        per_key = key[:, :, :1].numel() * key.element_size()
        held[self] = max(held.get(self, 0), key.untyped_storage().nbytes() // per_key)

    monkeypatch.setattr(rolling_cache.RollingWindowCache, "drop_unreachable", recording)
    return held


def test_fairseq_interactive_continues_an_n_token_prompt_from_the_rolling_cache(
    trained, monkeypatch
):
    """The first N pieces of the training text as the prompt, continued greedily: the rolling
    cache holds window + 1 keys per layer at most and continues as the full cache does."""
    settings, data_dir, bin_dir, save_dir, _ = trained
    n = settings.tokens_per_sample
    with open(data_dir / "spm" / "train", encoding="utf-8") as f:
        pieces = " ".join(f.read().split()[:n])
    length = n + CONTINUATION_TOKENS
    positions = length + 2  # eos before the prompt, and the generator's own end

    def run():
        return fairseq_cli(
            "fairseq-interactive", bin_dir, "--user-dir", USER_DIR, "--task",
            "language_modeling", "--path", save_dir / "checkpoint_last.pt",
            "--tokens-per-sample", positions,
            "--model-overrides", f"{{'max_target_positions': {positions}}}",
            "--beam", 1, "--nbest", 1, "--max-len-a", 0, "--max-len-b", length,
            "--min-len", length, "--buffer-size", 1, "--batch-size", 1, stdin=pieces + "\n",
        )  # fmt: skip

    held = cache_keys_recorded(monkeypatch)
    monkeypatch.delenv(FULL_CACHE_VARIABLE, raising=False)
    rolling = run()
    rolling_held = held.copy()
    held.clear()
    monkeypatch.setenv(FULL_CACHE_VARIABLE, "1")
    full = run()

    assert len(rolling_held) == lm_demo.QUICK.layers  # every layer rolls
    assert max(rolling_held.values()) == WINDOW + 1
    assert min(held.values()) > n  # the recorder sees the full cache grow
    assert_same_decoding(decoded(rolling), decoded(full))
    (hypothesis,) = [line.split("\t")[2].split() for line in rolling.stdout.splitlines()
                     if line.startswith("H-")]  # fmt: skip
    assert hypothesis[:n] == pieces.split() and len(hypothesis) == length
