"""fairseq-eval-lm --context-window with position-dependent heads (Gaussian localness).

With a context window, fairseq-eval-lm (LMContextWindowDataset) scores each block behind up to
``--context-window`` tokens of the text before it, and right-pads the rows whose context is
shorter. A scored token's Gaussian bias then sees the window as its sequence: I = context + its
block position + 1 real keys, positions counted from the first context token, padding never.
These tests run fairseq's own scoring path (its task with the block size fairseq-eval-lm uses,
LMContextWindowDataset, SequenceScorer) on checkpoints written by fairseq-train, and check every
score against the model run on the same tokens without padding, and against scoring the full
sequence. A global language model is the control.
"""

import math
from dataclasses import dataclass
from typing import List

import pytest
import torch
from fairseq import checkpoint_utils, options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.sequence_scorer import SequenceScorer
from fairseq_cli import eval_lm

from ..conftest import USER_DIR, fairseq_cli
from .test_language_model import lm_data  # noqa: F401  (the fixture: the tiny LM corpus)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOKENS_PER_SAMPLE = 32  # training block; fairseq-eval-lm scores blocks of this minus the context
CONTEXT = 16
MODELS = {
    "global": [],
    "gaussian-query": ["--localness-layers", "decoder_self:all"],
    "gaussian-layer": ["--localness-layers", "decoder_self:all", "--localness-window", "layer"],
}


@pytest.fixture(scope="module")
def train_lm(lm_data, tmp_path_factory):  # noqa: F811
    """fairseq-train (one update) of a 2-layer LM, every head Gaussian or none (the control),
    once per model for the module."""
    trained = {}

    def train(name):
        if name not in trained:
            save_dir = tmp_path_factory.mktemp(f"lm_{name}")
            fairseq_cli(
                "fairseq-train", lm_data, "--user-dir", USER_DIR, "--task", "language_modeling",
                "--arch", "transformer_lm_local_tiny", "--decoder-layers", 2,
                "--decoder-embed-dim", 32, "--decoder-ffn-embed-dim", 64,
                "--tokens-per-sample", TOKENS_PER_SAMPLE, "--sample-break-mode", "none",
                "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", 512, "--max-update", 1,
                "--required-batch-size-multiple", 1, "--seed", 1, "--num-workers", 0,
                "--no-progress-bar", "--no-epoch-checkpoints", "--save-dir", save_dir,
                *MODELS[name],
            )  # fmt: skip
            trained[name] = save_dir / "checkpoint_last.pt"
        return trained[name]

    return train


@pytest.fixture(params=sorted(MODELS))
def checkpoint(request, train_lm):
    return request.param, train_lm(request.param)


@dataclass
class ScoredRow:
    tokens: torch.Tensor  # the model's input row, context and padding included
    start: int  # where the block's own tokens begin in the row (the context's length)
    targets: torch.Tensor  # the scored tokens
    stream: List[int]  # their indices in the test set's token stream
    scores: torch.Tensor  # their log-probabilities


def eval_lm_argv(data, path, context_window, break_mode, max_tokens, batch_size=None):
    argv = [
        data, "--user-dir", USER_DIR, "--path", path, "--gen-subset", "test",
        "--tokens-per-sample", TOKENS_PER_SAMPLE, "--context-window", context_window,
        "--sample-break-mode", break_mode, "--max-tokens", max_tokens,
        "--required-batch-size-multiple", 1, "--num-workers", 0, "--cpu",
    ]  # fmt: skip
    if batch_size:
        argv += ["--batch-size", batch_size]
    return [str(a) for a in argv]


def score_rows(data, path, context_window, break_mode="none", max_tokens=4096, batch_size=None):
    """What fairseq-eval-lm scores, row by row, and the model it scores with."""
    argv = eval_lm_argv(data, path, context_window, break_mode, max_tokens, batch_size)
    cfg = convert_namespace_to_omegaconf(
        options.parse_args_and_arch(options.get_eval_lm_parser(), argv)
    )
    cfg.task.tokens_per_sample -= context_window  # as fairseq_cli.eval_lm.main does
    task = tasks.setup_task(cfg.task)
    (model,), _ = checkpoint_utils.load_model_ensemble([str(path)], task=task)
    model.eval()
    task.load_dataset("test")
    dataset = task.dataset("test")
    blocks = dataset.dataset.slice_indices  # the TokenBlockDataset's (start, end) in the stream
    batches = task.eval_lm_dataloader(
        dataset, max_tokens=max_tokens, batch_size=batch_size, num_workers=0,
        max_positions=model.max_positions(), context_window=context_window,
    )  # fmt: skip
    scorer, pad = SequenceScorer(task.target_dictionary), task.target_dictionary.pad()
    rows = []
    for sample in batches:
        for i, (hypo,) in enumerate(scorer.generate([model], sample)):
            begin, end = (int(x) for x in blocks[int(sample["id"][i])])
            assert hypo["tokens"].numel() == end - begin
            start = sample["start_indices"][i] if context_window else 0
            rows.append(
                ScoredRow(
                    sample["net_input"]["src_tokens"][i], start, hypo["tokens"],
                    list(range(begin, end)), hypo["positional_scores"],
                )  # fmt: skip
            )
    return model, pad, rows


def alone(model, tokens, start, targets):
    """Log-probabilities of ``targets`` after the tokens from ``start`` on of one unpadded row,
    run in a batch of one."""
    with torch.no_grad():
        lprobs = model.get_normalized_probs(model(tokens[None]), log_probs=True)[0]
    return lprobs[start : start + targets.numel()].gather(-1, targets[:, None]).squeeze(-1)


def by_stream(rows):
    return {s: float(x) for row in rows for s, x in zip(row.stream, row.scores)}


def visible_inputs(rows, pad):
    """For every scored token: the input tokens its prediction reads (the row's real tokens up
    to and including its own input)."""
    seen = {}
    for row in rows:
        real = row.tokens[row.tokens.ne(pad)]
        for t, s in enumerate(row.stream):
            seen[s] = tuple(real[: row.start + t + 1].tolist())
    return seen


def test_fairseq_eval_lm_reports_the_perplexity_of_these_scores(train_lm, lm_data):  # noqa: F811
    """The scores below are fairseq-eval-lm's: its perplexity is theirs, with and without the
    context window."""
    path = train_lm("gaussian-query")
    for context_window in (0, CONTEXT):
        argv = eval_lm_argv(lm_data, path, context_window, "none", 4096)
        args = options.parse_args_and_arch(options.get_eval_lm_parser(), argv)
        reported = eval_lm.main(convert_namespace_to_omegaconf(args))["perplexity"]
        scores = by_stream(score_rows(lm_data, path, context_window)[2])
        expected = math.exp(-sum(scores.values()) / len(scores))
        assert float(reported) == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("break_mode", ["none", "eos"])
def test_padding_never_changes_a_score(checkpoint, lm_data, break_mode):  # noqa: F811
    """Each row fairseq-eval-lm builds (context, block, right padding), run without its padding
    in a batch of one, gives the same score for every scored token."""
    _, path = checkpoint
    model, pad, rows = score_rows(lm_data, path, CONTEXT, break_mode, batch_size=8)
    padded = [row for row in rows if row.tokens.eq(pad).any()]
    with_context = [row for row in rows if row.start > 0]
    # the first row waits for context (CONTEXT pads); eos blocks differ in length in a batch
    assert padded and with_context and rows[0].start == 0
    for row in rows:
        real = row.tokens.ne(pad)
        # LMContextWindowDataset pads on the right only: the real tokens come first
        assert not real[real.long().sum() :].any()
        expected = alone(model, row.tokens[real], row.start, row.targets)
        torch.testing.assert_close(row.scores, expected, atol=1e-5, rtol=1e-5)


def test_a_token_with_context_scores_as_inside_the_full_sequence(checkpoint, lm_data):  # noqa: F811
    """Scoring with a context window and scoring the full sequence in blocks of the training
    length: a token whose prediction reads the same inputs from the same first token gets the
    same score in both (its I and its positions are those of the full sequence); the others
    (whose window starts elsewhere) do not, for any language model with positions."""
    name, path = checkpoint
    _, pad, windowed = score_rows(lm_data, path, CONTEXT)
    _, _, full = score_rows(lm_data, path, 0)
    windowed_inputs, full_inputs = visible_inputs(windowed, pad), visible_inputs(full, pad)
    windowed_scores, full_scores = by_stream(windowed), by_stream(full)
    assert windowed_scores.keys() == full_scores.keys()
    same = [s for s in full_scores if windowed_inputs[s] == full_inputs[s]]
    other = [s for s in full_scores if windowed_inputs[s] != full_inputs[s]]
    # blocks of 16 behind the 16 tokens before them against blocks of 32: every second
    # window is a full block, the others start 16 tokens before their full block
    assert len(same) > 2 * TOKENS_PER_SAMPLE and len(other) > 2 * TOKENS_PER_SAMPLE
    for s in same:
        assert windowed_scores[s] == pytest.approx(full_scores[s], abs=1e-5), (name, s)
    differences = [abs(windowed_scores[s] - full_scores[s]) for s in other]
    assert max(differences) > 1e-3, name
