"""fairseq's own command-line options (those its tests/test_binaries.py runs) against every family
of the plugin's models, fairseq's ``transformer`` and ``transformer_lm`` as the controls.

Each family is trained once (two updates of tiny dimensions on the tiny corpus) and its checkpoint
is shared by the option cases. The tools run in this process, their arguments parsed by fairseq's
own parsers and passed to their ``main``, as fairseq's tests do: no child process pays seconds
for importing fairseq. The cases of one family run one after the other, so a pytest-xdist
worker trains few families.

Run it alone with ``python -m pytest -n 0 tests/models/test_fairseq_option_matrix.py``;
docs/fairseq_features.md has the matrix as a table.
"""

import contextlib
import io
import json
import logging
import math
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List

import pytest
import torch
from fairseq import checkpoint_utils, distributed_utils, options
from fairseq.data import data_utils
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq_cli import eval_lm, generate, interactive, preprocess, train

from ..conftest import TINY_MODEL, TRAIN, USER_DIR, forget_previous_best
from .helpers import ensemble_token_scores

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Half Tied's encoder (layers 1-2 use the Wq/Wk of layer 0 head 0) and decoder heads that borrow
# the Wq/Wk of the layer below, in self- and cross-attention.
CROSS_LAYER_TIES = (
    "{encoder_self: {0: [identity, identity@0, prev-1@0, prev-2@0, next-1@0, next-2@0, band-1@0,"
    " band-2@0], 1-2: [identity@0.0, identity@0.0, prev-1@0.0, prev-2@0.0, next-1@0.0, next-2@0.0,"
    " band-1@0.0, band-2@0.0]},"
    " decoder_self: {0: [prev-1, identity, global, global, global, global, global, global],"
    " 1: [prev-1@0.0, identity@0.1, global@0.2, global, global, global, global, global]},"
    " decoder_cross: {1: [global@0.0, global@0.1, global, global, global, global, global, global]}}"
)
MT_FAMILIES = {
    "transformer": ["--arch", "transformer"],  # fairseq's own: the control
    "tied": ["--arch", "transformer_local_tied"],  # Pande et al. (i), 1LocHead 7TiedLoc All6
    "cross_layer_tied": ["--arch", "transformer_local", "--locality-config", CROSS_LAYER_TIES],
    "localness": ["--arch", "transformer_localness"],  # Yang et al., encoder layers 0-2
    "dynwin": ["--arch", "transformer_dynwin"],  # Nguyen et al., Enc(AW)-Cr(AW,Seg)-Dec(MW)
    "gated": [  # Voita et al.: Hard Concrete gates on every head, trained with the L0 penalty
        "--arch", "transformer_local", "--head-gates", "enc,dec,cross",
        "--criterion", "label_smoothed_cross_entropy_l0",
    ],
}  # fmt: skip
LM_SHAPE = (
    "--decoder-layers 3 --decoder-attention-heads 4 --decoder-embed-dim 32 "
    "--decoder-ffn-embed-dim 64 --share-decoder-input-output-embed"
).split()
LM_FAMILIES = {
    "transformer_lm": ["--arch", "transformer_lm"],  # fairseq's own: the control
    "lm_localness": ["--arch", "transformer_lm_local", "--localness-layers", "decoder_self:0-1"],
    "lm_dynwin": ["--arch", "transformer_lm_dynwin"],  # Dec(MW) in layers 0-2
}

EVAL_BLEU = ["--eval-bleu", "--eval-bleu-args", '{"beam": 2, "max_len_b": 8}']
# Decoding of the whole tiny test set (40 sentences) in one batch, hypotheses of up to 8 tokens.
DECODE = ["--gen-subset", "test", "--max-len-b", 8, "--batch-size", 40, "--num-workers", 0]
SHORT_RUN = ["--max-update", 2, "--disable-validation"]
LAYERDROP = ["--encoder-layerdrop", 0.5, "--decoder-layerdrop", 0.5]
# fairseq's LayerDrop pruning at load time: keep encoder layers 0, 2, 4 and decoder layer 0 (the
# layers whose Wq/Wk the tied heads of the other layers use stay).
KEEP_LAYERS = {"encoder_layers_to_keep": "0,2,4", "decoder_layers_to_keep": "0"}
TEST_SENTENCES = 40


# ---- fairseq's tools in this process -----------------------------------------------------------


@contextlib.contextmanager
def log_records(*logger_names):
    """The messages the named loggers emit at INFO and above, whatever the root logger's level."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.name, record.getMessage()))

    handler = Keep(logging.INFO)
    loggers = [logging.getLogger(name) for name in logger_names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)


def parse(parser, argv):
    return options.parse_args_and_arch(parser, [str(a) for a in argv])


# The notices hydra gives each time fairseq composes its configuration from a command line.
HYDRA_NOTICES = (
    r"\s*(hydra\.experimental\.\w+\(\) is no longer experimental|The version_base parameter"
    r"|In 'config': Usage of deprecated keyword|'config' is validated against ConfigStore"
    r"|The strict flag in the compose API)"
)


@contextlib.contextmanager
def fairseq_tool():
    """Around a tool's ``main``: what it prints is kept, hydra's notices are left out."""
    out = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(out):
        warnings.filterwarnings("ignore", message=HYDRA_NOTICES, category=UserWarning)
        yield out


@dataclass
class TrainingLog:
    """fairseq-train's JSON progress records: one per update (train_inner), one per validation."""

    updates: List[dict]
    valid: List[dict]

    def at(self, update: int) -> dict:
        return next(r for r in self.updates if int(r["num_updates"]) == update)

    def value(self, update: int, key: str) -> float:
        return float(self.at(update)[key])


def train_main(args):
    """What fairseq-train does with its parsed arguments."""
    distributed_utils.call_main(convert_namespace_to_omegaconf(args), train.main)


def fairseq_train(*argv) -> TrainingLog:
    args = parse(options.get_training_parser(), [*argv, "--log-format", "json"])
    forget_previous_best()
    with log_records("fairseq.logging.progress_bar") as records, fairseq_tool():
        train_main(args)
    by_tag = defaultdict(list)
    for tag, message in records:
        by_tag[tag].append(json.loads(message))
    return TrainingLog(updates=by_tag["train_inner"], valid=by_tag["valid"])


@dataclass
class Decoded:
    """The S-/T-/H-/P-/A- lines of fairseq-generate or fairseq-interactive, by sentence id."""

    text: str
    sources: Dict[int, str] = field(default_factory=dict)
    targets: Dict[int, str] = field(default_factory=dict)
    hypotheses: Dict[int, List[tuple]] = field(default_factory=lambda: defaultdict(list))
    positional: Dict[int, List[List[float]]] = field(default_factory=lambda: defaultdict(list))
    alignments: Dict[int, List[str]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def parse(cls, text):
        out = cls(text)
        for line in text.splitlines():
            kind, _, rest = line.partition("-")
            fields = rest.split("\t")
            if kind not in ("S", "T", "H", "P", "A") or not fields[0].isdigit():
                continue
            i = int(fields[0])
            value = fields[1] if len(fields) > 1 else ""
            if kind == "S":
                out.sources[i] = value
            elif kind == "T":
                out.targets[i] = value
            elif kind == "H":
                out.hypotheses[i].append((float(value), fields[2] if len(fields) > 2 else ""))
            elif kind == "P":
                out.positional[i].append([float(x) for x in value.split()])
            elif kind == "A":
                out.alignments[i].append(value)
        return out

    def best(self):
        """The first (best) hypothesis of every sentence, by id."""
        return {i: h[0][1] for i, h in self.hypotheses.items()}

    def scores(self):
        return [score for hypos in self.hypotheses.values() for score, _ in hypos]


def fairseq_generate(data_bin, checkpoint, *argv) -> Decoded:
    args = parse(
        options.get_generation_parser(),
        [data_bin, "--user-dir", USER_DIR, "--path", checkpoint, *argv],
    )
    with fairseq_tool() as out:
        generate.main(args)
    return Decoded.parse(out.getvalue())


def fairseq_interactive(data_bin, checkpoint, input_file, *argv) -> Decoded:
    args = parse(
        options.get_interactive_generation_parser(),
        [data_bin, "--user-dir", USER_DIR, "--path", checkpoint, "--input", input_file, *argv],
    )
    with fairseq_tool() as out:
        interactive.main(args)
    return Decoded.parse(out.getvalue())


def fairseq_eval_lm(data_bin, checkpoint, *argv):
    """fairseq-eval-lm's results (loss, perplexity) and the number of tokens it scored."""
    args = parse(
        options.get_eval_lm_parser(),
        [data_bin, "--user-dir", USER_DIR, "--path", checkpoint, *argv],
    )
    with log_records("fairseq_cli.eval_lm") as records, fairseq_tool():
        results = eval_lm.main(args)
    scored = [re.search(r"Evaluated ([\d,]+) tokens", m) for _, m in records]
    tokens = [int(found.group(1).replace(",", "")) for found in scored if found]
    assert len(tokens) == 1, records
    return results, tokens[0]


def fairseq_preprocess(*argv):
    """fairseq-preprocess in this process."""
    logger = logging.getLogger("fairseq_cli.preprocess")
    handlers = list(logger.handlers)
    try:
        with fairseq_tool():
            preprocess.main(options.get_preprocessing_parser().parse_args([str(a) for a in argv]))
    finally:  # fairseq-preprocess adds a log file handler to its logger and never removes it
        for handler in set(logger.handlers) - set(handlers):
            logger.removeHandler(handler)
            handler.close()


# ---- trained families, shared by the option cases ----------------------------------------------


@dataclass
class Run:
    save_dir: object
    log: TrainingLog

    @property
    def checkpoint(self):
        return self.save_dir / "checkpoint_last.pt"

    def parameters(self):
        return checkpoint_utils.load_checkpoint_to_cpu(str(self.checkpoint))["model"]


class Matrix:
    """The training runs and decodings of each family, each done once per module; a family's
    ``base`` run (``base_options``) is the checkpoint its decodings use."""

    def __init__(self, data_bin, families, shape, train_options, base_options, tmp_path_factory):
        self.data_bin, self.families, self.shape = data_bin, families, shape
        self.train_options, self.base_options = train_options, base_options
        self.tmp = tmp_path_factory
        self._runs, self._decoded = {}, {}

    def train(self, family, *extra) -> Run:
        key = (family, *map(str, extra))
        if key not in self._runs:
            save_dir = self.tmp.mktemp(f"{family}_train")
            argv = [self.data_bin, "--user-dir", USER_DIR, *self.families[family], *self.shape,
                    *self.train_options, "--save-dir", save_dir, *extra]  # fmt: skip
            self._runs[key] = Run(save_dir, fairseq_train(*argv))
        return self._runs[key]

    def base(self, family) -> Run:
        return self.train(family, *self.base_options)

    def generate(self, family, *extra) -> Decoded:
        key = (family, *map(str, extra))
        if key not in self._decoded:
            self._decoded[key] = fairseq_generate(self.data_bin, self.base(family).checkpoint,
                                                  *extra)  # fmt: skip
        return self._decoded[key]


@pytest.fixture(scope="module", params=list(MT_FAMILIES))
def family(request):
    """A translation family: pytest runs every case of one family before the next one's."""
    return request.param


@pytest.fixture(scope="module")
def mt(tiny_data, tmp_path_factory):
    # the base run: two updates, then validation with BLEU (the --eval-bleu case reads its log)
    base = ["--max-update", 2, *EVAL_BLEU]
    return Matrix(tiny_data / "bin", MT_FAMILIES, TINY_MODEL, TRAIN, base, tmp_path_factory)


def greedy(mt, family) -> Decoded:
    return mt.generate(family, *DECODE, "--beam", 1)


# fairseq drops a last batch smaller than --required-batch-size-multiple (8): keep the tiny
# valid and test sets whole.
LM_TASK = ["--task", "language_modeling", "--required-batch-size-multiple", 1]
LM_TRAIN = [
    *LM_TASK, "--tokens-per-sample", 64, "--sample-break-mode", "complete", "--optimizer", "adam",
    "--lr", "1e-3", "--max-tokens", 1000, "--seed", 1, "--num-workers", 0, "--no-progress-bar",
    "--log-interval", 1, "--no-epoch-checkpoints",
]  # fmt: skip


@pytest.fixture(scope="module", params=list(LM_FAMILIES))
def lm_family(request):
    return request.param


@pytest.fixture(scope="module")
def lm(tiny_data, tmp_path_factory):
    """The English side of the tiny corpus, binarised for language modelling."""
    small, dest = tiny_data / "small", tiny_data / "lm-bin-option-matrix"
    if not (dest / "dict.txt").exists():
        fairseq_preprocess("--only-source", "--trainpref", small / "train.en", "--validpref",
                           small / "valid.en", "--testpref", small / "test.en", "--destdir", dest,
                           "--workers", 1)  # fmt: skip
    return Matrix(dest, LM_FAMILIES, LM_SHAPE, LM_TRAIN, ["--max-update", 2], tmp_path_factory)


def assert_finite(scores):
    assert scores and all(math.isfinite(s) for s in scores), scores


def assert_one_hypothesis_per_sentence(decoded, n=TEST_SENTENCES, nbest=1):
    assert sorted(decoded.hypotheses) == list(range(n)), decoded.text[-2000:]
    assert all(len(h) == nbest for h in decoded.hypotheses.values())
    assert_finite(decoded.scores())


def tokens(text):
    # fairseq-generate shows an unknown word of a reference as <<unk>>, of a hypothesis as <unk>
    return text.replace("<<unk>>", "<unk>").split()


def assert_trained_the_same(run, reference):
    """The losses and gradient norms of both updates (as logged, to three decimals) and every
    parameter after them are the reference run's."""
    for update in (1, 2):
        for key in ("loss", "gnorm"):
            expected = pytest.approx(reference.log.value(update, key), abs=1e-3)
            assert run.log.value(update, key) == expected, key
    expected, found = reference.parameters(), run.parameters()
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(found[name], value, atol=1e-5, rtol=1e-4, msg=name)


# ---- fairseq-generate's options -----------------------------------------------------------------


def test_greedy_scores_are_the_mean_of_the_token_scores(mt, family):
    decoded = greedy(mt, family)
    assert_one_hypothesis_per_sentence(decoded)
    assert "BLEU4 = " in decoded.text
    for i, [(score, hypo)] in decoded.hypotheses.items():
        [positional] = decoded.positional[i]
        assert len(positional) == len(tokens(hypo)) + 1  # and the end of sentence
        assert score == pytest.approx(sum(positional) / len(positional), abs=1e-3)


def test_nbest(mt, family):
    decoded = mt.generate(family, *DECODE, "--beam", 4, "--nbest", 4)
    assert_one_hypothesis_per_sentence(decoded, nbest=4)
    for hypos in decoded.hypotheses.values():
        scores = [score for score, _ in hypos]
        assert scores == sorted(scores, reverse=True)
        assert len({hypo for _, hypo in hypos}) == 4  # four different translations


def test_sampling_with_temperature(mt, family):
    decoded = mt.generate(family, *DECODE, "--sampling", "--temperature", 2, "--beam", 2,
                          "--nbest", 2)  # fmt: skip
    assert_one_hypothesis_per_sentence(decoded, nbest=2)
    # two draws at temperature 2 from an almost untrained model are not all the same
    assert any(h[0][1] != h[1][1] for h in decoded.hypotheses.values())


def test_sampling_topk_1_is_greedy(mt, family):
    """Drawing from the single most probable token is greedy search, scores included."""
    decoded = mt.generate(family, *DECODE, "--sampling", "--sampling-topk", 1, "--beam", 1)
    assert_one_hypothesis_per_sentence(decoded)
    reference = greedy(mt, family)
    assert decoded.best() == reference.best()
    assert decoded.scores() == pytest.approx(reference.scores(), abs=1e-5)


def test_sampling_topp_below_the_top_probability_is_greedy(mt, family):
    """The smallest set of tokens holding p of the mass, for a tiny p, is the top token alone."""
    decoded = mt.generate(family, *DECODE, "--sampling", "--sampling-topp", 1e-6, "--beam", 1)
    assert_one_hypothesis_per_sentence(decoded)
    reference = greedy(mt, family)
    assert decoded.best() == reference.best()
    assert decoded.scores() == pytest.approx(reference.scores(), abs=1e-5)


def test_diversity_rate(mt, family):
    decoded = mt.generate(family, *DECODE, "--diversity-rate", 0.5, "--beam", 6, "--nbest", 2)
    assert_one_hypothesis_per_sentence(decoded, nbest=2)
    for hypos in decoded.hypotheses.values():
        assert hypos[0][1] != hypos[1][1]


def test_prefix_size(mt, family):
    decoded = mt.generate(family, *DECODE, "--beam", 2, "--prefix-size", 2)
    assert_one_hypothesis_per_sentence(decoded)
    for i, [(_, hypo)] in decoded.hypotheses.items():
        assert tokens(hypo)[:2] == tokens(decoded.targets[i])[:2]


def test_retain_dropout(mt, family):
    """Dropout stays on at inference: the same greedy search scores differently."""
    decoded = mt.generate(family, *DECODE, "--beam", 1, "--retain-dropout")
    assert_one_hypothesis_per_sentence(decoded)
    reference = greedy(mt, family)
    assert decoded.scores() != pytest.approx(reference.scores(), abs=1e-4)


def test_match_source_len(mt, family):
    decoded = mt.generate(family, *DECODE, "--beam", 2, "--match-source-len")
    assert_one_hypothesis_per_sentence(decoded)
    for i, [(_, hypo)] in decoded.hypotheses.items():
        # fairseq's source lengths count the source's end-of-sentence token
        assert len(tokens(hypo)) == len(tokens(decoded.sources[i])) + 1


def test_print_alignment(mt, family):
    decoded = mt.generate(family, *DECODE, "--beam", 2, "--print-alignment")
    assert_one_hypothesis_per_sentence(decoded)
    for i, [(_, hypo)] in decoded.hypotheses.items():
        [alignment] = decoded.alignments[i]
        pairs = [tuple(map(int, pair.split("-"))) for pair in alignment.split()]
        # one source position per target token
        assert [t for _, t in pairs] == list(range(len(tokens(hypo))))
        assert all(0 <= s < len(tokens(decoded.sources[i])) for s, _ in pairs)


def test_no_repeat_ngram_size(mt, family):
    decoded = mt.generate(family, *DECODE, "--beam", 3, "--no-repeat-ngram-size", 2)
    assert_one_hypothesis_per_sentence(decoded)
    for [(_, hypo)] in decoded.hypotheses.values():
        words = tokens(hypo)
        bigrams = list(zip(words, words[1:]))
        assert len(bigrams) == len(set(bigrams)), hypo


def score_as_references(mt, decoded, checkpoints, tiny_data, folder) -> Decoded:
    """``--score-reference`` of the first hypothesis of every test sentence, binarised as the
    target side with the corpus's dictionaries, by the model or ensemble ``checkpoints``."""
    raw, dest = folder / "raw", folder / "bin"
    raw.mkdir(parents=True)
    with open(tiny_data / "small" / "test.de", encoding="utf-8") as f:
        (raw / "test.de").write_text(f.read(), encoding="utf-8")
    best = decoded.best()
    translations = "".join(" ".join(tokens(best[i])) + "\n" for i in range(TEST_SENTENCES))
    (raw / "test.en").write_text(translations, encoding="utf-8")
    fairseq_preprocess("--source-lang", "de", "--target-lang", "en", "--testpref", raw / "test",
                       "--destdir", dest, "--srcdict", mt.data_bin / "dict.de.txt",
                       "--tgtdict", mt.data_bin / "dict.en.txt", "--workers", 1)  # fmt: skip
    scored = fairseq_generate(dest, checkpoints, *DECODE, "--score-reference")
    assert_one_hypothesis_per_sentence(scored)
    assert scored.best() == best
    return scored


def assert_scored_as_decoded(scored, decoded):
    for i in range(TEST_SENTENCES):
        assert scored.hypotheses[i][0][0] == pytest.approx(decoded.hypotheses[i][0][0], abs=1e-4)
        # token scores are printed to four decimals
        assert scored.positional[i][0] == pytest.approx(decoded.positional[i][0], abs=2e-4)


def test_score_reference_gives_greedy_translations_their_scores(mt, family, tiny_data, tmp_path):
    """--score-reference scores a given target with one full forward pass of the decoder; given
    each sentence's greedy translation as its target, it must find the scores that greedy search
    found one token at a time (incremental decoding)."""
    reference = greedy(mt, family)
    scored = score_as_references(mt, reference, mt.base(family).checkpoint, tiny_data, tmp_path)
    assert_scored_as_decoded(scored, reference)


def test_ensemble(mt, family, tiny_data, tmp_path):
    """``--path a.pt:b.pt:c.pt``: the family's model, a second seed of it (a model of the same
    modules, whose caches and incremental states must stay its own) and fairseq's transformer.
    Greedy search with the ensemble gives each token the log of the models' mean probability:
    the token scores of each model's --score-reference of the ensemble's translations, averaged
    as probabilities, and the ensemble's own --score-reference (one full forward pass of every
    decoder) gives the scores that search found one token at a time."""
    models = [mt.base(family), mt.train(family, *mt.base_options, "--seed", 2),
              mt.base("transformer")]  # fmt: skip
    checkpoints = [str(run.checkpoint) for run in models]
    ensemble = fairseq_generate(mt.data_bin, ":".join(checkpoints), *DECODE, "--beam", 1)
    assert_one_hypothesis_per_sentence(ensemble)
    assert ensemble.scores() != greedy(mt, family).scores()  # the other models count
    scored = score_as_references(mt, ensemble, ":".join(checkpoints), tiny_data, tmp_path / "all")
    assert_scored_as_decoded(scored, ensemble)
    alone = [
        score_as_references(mt, ensemble, checkpoint, tiny_data, tmp_path / f"model{m}")
        for m, checkpoint in enumerate(checkpoints)
    ]
    for i in range(TEST_SENTENCES):
        expected = ensemble_token_scores([scored_alone.positional[i][0] for scored_alone in alone])
        assert ensemble.positional[i][0] == pytest.approx(expected, abs=5e-4)


def test_a_left_out_last_batch_is_said(mt, monkeypatch):
    """One sentence per batch under fairseq's default --required-batch-size-multiple 8: fairseq
    leaves out the last batch, one sentence, and the plugin's shim says so (its translations are
    fairseq's own)."""
    from local_attn_fairseq import compat

    monkeypatch.setattr(compat, "_dropped_batches_said", set())
    with log_records(compat.__name__) as records:
        decoded = fairseq_generate(mt.data_bin, mt.base("tied").checkpoint, "--gen-subset", "test",
                                   "--max-len-b", 8, "--batch-size", 1, "--num-workers", 0,
                                   "--beam", 1)  # fmt: skip
    assert len(decoded.hypotheses) == TEST_SENTENCES - 1
    assert [m for _, m in records if "leaves out 1 of 40 examples" in m], records


def test_right_padded_sources_translate_as_left_padded(mt, family):
    """fairseq pads a batch's sources on the left; ``--left-pad-source`` (a flag that turns it
    off) pads them on the right, moving every shorter sentence's tokens in its batch. The
    translations and their scores stay those of the default."""
    reference = greedy(mt, family)
    decoded = mt.generate(family, *DECODE, "--beam", 1, "--left-pad-source")
    assert_one_hypothesis_per_sentence(decoded)
    assert decoded.best() == reference.best()
    for i in range(TEST_SENTENCES):
        assert decoded.hypotheses[i][0][0] == pytest.approx(reference.hypotheses[i][0][0], abs=1e-4)


# Without dropout, whose masks fall on other tokens when the tokens move in their batch.
NO_DROPOUT = ["--dropout", 0, "--attention-dropout", 0, "--activation-dropout", 0]


@pytest.mark.parametrize("option", ["--left-pad-source", "--left-pad-target"])
def test_the_padding_side_trains_the_same_model(mt, family, option):
    """Right-padded sources (``--left-pad-source``, which turns fairseq's left padding off) or
    left-padded targets (``--left-pad-target``): the same batches with their tokens moved, so
    the losses and gradient norms of two updates, and the parameters after them, are those of
    fairseq's default padding."""
    default = mt.train(family, *NO_DROPOUT, *SHORT_RUN)
    moved = mt.train(family, *NO_DROPOUT, option, *SHORT_RUN)
    task = checkpoint_utils.load_checkpoint_to_cpu(str(moved.checkpoint))["cfg"]["task"]
    assert (task.left_pad_source, task.left_pad_target) == (
        (False, False) if option == "--left-pad-source" else (True, True)
    )
    assert_trained_the_same(moved, default)


# ---- fairseq-interactive ------------------------------------------------------------------------


def test_interactive_batches_translate_as_generate_does(mt, family, tiny_data, tmp_path):
    """Six sentences of different lengths read in batches of 4 (buffer 4): each batch pads its
    sentences differently from fairseq-generate's one batch of 40, the translations are the
    same."""
    n = 6
    with open(tiny_data / "small" / "test.de", encoding="utf-8") as f:
        lines = [next(f) for _ in range(n)]
    assert len({len(line.split()) for line in lines}) > 1
    input_file = tmp_path / "input.de"
    input_file.write_text("".join(lines), encoding="utf-8")
    decoded = fairseq_interactive(
        mt.data_bin, mt.base(family).checkpoint, input_file, "--source-lang", "de",
        "--target-lang", "en", "--beam", 1, "--max-len-b", 8, "--buffer-size", 4,
        "--batch-size", 4,
    )  # fmt: skip
    assert_one_hypothesis_per_sentence(decoded, n=n)
    reference = greedy(mt, family)
    assert decoded.best() == {i: reference.best()[i] for i in range(n)}
    for i in range(n):
        assert decoded.hypotheses[i][0][0] == pytest.approx(reference.hypotheses[i][0][0], abs=1e-4)


def test_interactive_constraints(mt, family, tiny_data, tmp_path):
    """Lexically constrained beam search: each sentence's constraint (a word of its reference)
    is in its translation."""
    n = 6
    known = {line.split()[0] for line in (mt.data_bin / "dict.en.txt").read_text().splitlines()}
    lines = []
    with open(tiny_data / "small" / "test.de", encoding="utf-8") as de, \
            open(tiny_data / "small" / "test.en", encoding="utf-8") as en:  # fmt: skip
        for source, target in zip(de, en):
            words = [w for w in target.split() if w in known]
            if words:
                lines.append((source.strip(), max(words, key=len)))
            if len(lines) == n:
                break
    input_file = tmp_path / "input.de"
    input_file.write_text("".join(f"{s}\t{c}\n" for s, c in lines), encoding="utf-8")
    decoded = fairseq_interactive(
        mt.data_bin, mt.base(family).checkpoint, input_file, "--source-lang", "de",
        "--target-lang", "en", "--beam", 3, "--max-len-b", 8, "--constraints",
    )  # fmt: skip
    assert_one_hypothesis_per_sentence(decoded, n=n)
    for i, (_, constraint) in enumerate(lines):
        assert constraint in tokens(decoded.hypotheses[i][0][1]), (constraint, decoded.text)


# ---- fairseq's Python API -----------------------------------------------------------------------


def test_hub_interface_translates_as_generate_does(mt, family, tiny_data):
    """``from_pretrained`` (fairseq's hub interface) on the plugin's checkpoint, then
    ``translate``: six sentences in one batch, fairseq-generate's greedy translations."""
    from fairseq.models.transformer import TransformerModel

    n = 6
    with open(tiny_data / "small" / "test.de", encoding="utf-8") as f:
        lines = [next(f).strip() for _ in range(n)]
    hub = TransformerModel.from_pretrained(
        str(mt.base(family).save_dir), checkpoint_file="checkpoint_last.pt",
        data_name_or_path=str(mt.data_bin),
    )  # fmt: skip
    reference = greedy(mt, family).best()
    assert hub.translate(lines, beam=1, max_len_b=8) == [reference[i] for i in range(n)]


# ---- fairseq-train's options --------------------------------------------------------------------


def test_eval_bleu(mt, family):
    [valid] = mt.base(family).log.valid
    assert 0 <= float(valid["valid_bleu"]) <= 100
    assert math.isfinite(float(valid["valid_loss"]))


def test_update_freq_accumulates_two_batches(mt, family):
    base = mt.base(family).log
    accumulated = mt.train(family, "--update-freq", 2, "--max-update", 1, "--disable-validation",
                           "--no-save").log  # fmt: skip
    # the one update holds the first two batches of the run without --update-freq
    for key in ("bsz", "wpb"):
        assert accumulated.value(1, key) == base.value(1, key) + base.value(2, key)
    assert math.isfinite(accumulated.value(1, "loss"))
    assert len(accumulated.updates) == 1


@pytest.mark.parametrize("option", ["--checkpoint-activations", "--offload-activations"])
def test_activation_checkpointing_trains_the_same_model(mt, family, option):
    """Recomputing activations in the backward pass (dropout masks replayed) gives the losses,
    gradient norms and parameters of the run that keeps them."""
    assert_trained_the_same(mt.train(family, option, *SHORT_RUN), mt.base(family))


def test_store_ema(mt, family, tmp_path):
    """fairseq's exponential moving average of the weights: it leaves training as it was, holds
    every weight once (tied Wq/Wk included), and its checkpoint (fairseq's
    ``save_ema_as_checkpoint``) translates."""
    base = mt.base(family)
    run = mt.train(family, "--store-ema", "--ema-decay", 0.5, *SHORT_RUN)
    trained = run.parameters()
    for name, value in base.parameters().items():
        torch.testing.assert_close(trained[name], value, atol=1e-5, rtol=1e-4, msg=name)
    state = checkpoint_utils.load_checkpoint_to_cpu(str(run.checkpoint))
    ema = state["extra_state"]["ema"]
    assert ema.keys() == trained.keys()
    assert all(torch.isfinite(value).all() for value in ema.values() if value.is_floating_point())
    # averaged with the weights of earlier updates, the weights updated by training differ
    assert any(not torch.equal(ema[name], trained[name]) for name in trained)
    averaged = tmp_path / "checkpoint_ema.pt"
    checkpoint_utils.save_ema_as_checkpoint(str(run.checkpoint), str(averaged))
    assert_one_hypothesis_per_sentence(fairseq_generate(mt.data_bin, averaged, *DECODE,
                                                        "--beam", 2))  # fmt: skip


def test_layerdrop_train_and_generate(mt, family):
    run = mt.train(family, *LAYERDROP, *SHORT_RUN)
    assert all(math.isfinite(r) for r in [run.log.value(1, "loss"), run.log.value(2, "loss")])
    decoded = fairseq_generate(mt.data_bin, run.checkpoint, *DECODE, "--beam", 2)
    assert_one_hypothesis_per_sentence(decoded)


def test_layerdrop_layers_to_keep(mt, family):
    """fairseq's pruning at load time: the kept layers, renumbered, with their trained weights."""
    run = mt.train(family, *LAYERDROP, *SHORT_RUN)
    [model], _ = checkpoint_utils.load_model_ensemble(
        [str(run.checkpoint)], arg_overrides=KEEP_LAYERS
    )
    assert len(model.encoder.layers) == 3 and len(model.decoder.layers) == 1
    trained = run.parameters()
    for new, old in enumerate([0, 2, 4]):
        for name, value in model.encoder.layers[new].state_dict().items():
            torch.testing.assert_close(value, trained[f"encoder.layers.{old}.{name}"], msg=name)
    decoded = fairseq_generate(mt.data_bin, run.checkpoint, *DECODE, "--beam", 2,
                               "--model-overrides", str(KEEP_LAYERS))  # fmt: skip
    assert_one_hypothesis_per_sentence(decoded)


# ---- language models: fairseq-eval-lm and generation --------------------------------------------


def test_eval_lm_context_window_scores_every_token_once(lm, lm_family):
    """Blocks of 16 new tokens, each scored after the 16 tokens before it: every token of the
    test split is scored, once."""
    results, scored = fairseq_eval_lm(
        lm.data_bin, lm.base(lm_family).checkpoint, *LM_TASK, "--gen-subset", "test",
        "--sample-break-mode", "none", "--tokens-per-sample", 32, "--context-window", 16,
        "--max-tokens", 1000, "--num-workers", 0,
    )  # fmt: skip
    test_split = data_utils.load_indexed_dataset(str(lm.data_bin / "test"), None)
    assert scored == test_split.sizes.sum()
    assert_finite([results["loss"], results["perplexity"]])


def test_eval_lm_scores_sentences_alone_as_in_padded_batches(lm, lm_family):
    """``--sample-break-mode eos``: a sample is one sentence, padded to its batch's longest. One
    sentence a batch (no padding) scores the test split as batches of 40 do."""
    argv = [*LM_TASK, "--gen-subset", "test", "--sample-break-mode", "eos",
            "--tokens-per-sample", 64, "--num-workers", 0]  # fmt: skip
    checkpoint = lm.base(lm_family).checkpoint
    batched, scored = fairseq_eval_lm(lm.data_bin, checkpoint, *argv, "--batch-size", 40)
    alone, scored_alone = fairseq_eval_lm(lm.data_bin, checkpoint, *argv, "--batch-size", 1)
    assert scored_alone == scored
    assert float(alone["loss"]) == pytest.approx(float(batched["loss"]), abs=1e-5)


LM_DECODE = [*LM_TASK, "--gen-subset", "test", "--sample-break-mode", "eos",
             "--tokens-per-sample", 64, "--batch-size", 40, "--num-workers", 0,
             "--max-len-a", 1, "--max-len-b", 4]  # fmt: skip


def assert_continues_its_prompt(decoded, nbest):
    """fairseq-generate with the language_modeling task continues each test sentence."""
    assert_one_hypothesis_per_sentence(decoded, nbest=nbest)
    continued = 0
    for i, hypos in decoded.hypotheses.items():
        prompt = tokens(decoded.sources[i])
        for _, hypo in hypos:
            assert tokens(hypo)[: len(prompt)] == prompt
            continued += len(tokens(hypo)) > len(prompt)
    assert continued > 0


def test_lm_generate_beam(lm, lm_family):
    assert_continues_its_prompt(lm.generate(lm_family, *LM_DECODE, "--beam", 2), nbest=1)


def test_lm_generate_sampling(lm, lm_family):
    decoded = lm.generate(lm_family, *LM_DECODE, "--sampling", "--sampling-topk", 5,
                          "--temperature", 0.7, "--beam", 2, "--nbest", 2)  # fmt: skip
    assert_continues_its_prompt(decoded, nbest=2)
