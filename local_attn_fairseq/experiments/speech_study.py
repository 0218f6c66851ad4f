"""The speech study: Alastruey et al. (2022)'s claim on synthetic speech of the Bible verses.

The claim: an ST encoder whose self-attention is restricted to the windows that Algorithm 1
chooses from an ASR encoder's contributions translates as well as a global one, at a fraction
of the encoder's attention cost. The study, on the small-scale study's runner (runs keyed by
their settings, trained until validation loss stops improving, resumable, records kept):

1. the English side of the Bible verse pairs, spoken by espeak-ng (``data.speech_corpus
   --corpus bible-en-es``): verses of at most ``--max-words`` words, the first ``--train-size``
   training verses, the held-out books of the text study (the same test set) spoken by a
   voice that training never hears; 80-dim filterbanks (``data.mustc``);
2. ASR pre-training of ``s2t_transformer_local_tiny`` at ``--model-dim`` (128: the
   architecture's own 64 under-fits the corpus) with every encoder layer global, with
   fairseq's CTC loss on the encoder beside the decoder's (``experiments.speech_pipeline``
   says why);
3. the contributions analysis of its encoder over the dev set: one window per layer
   (Algorithm 1, the paper's width convention) and each layer's CCD;
4. two ST arms, each initialised from the ASR encoder, identical but for the encoder's
   attention: global, and local with the chosen windows; ``--seeds`` seeds each;
5. WER of the ASR model, BLEU of every ST run on the held-out test books, the CCD of every
   encoder, and the cost side: encoder self-attention operations and attention-weight memory
   of both arms over the corpus's lengths, and their encoders' measured forward + backward
   time at its mean length.

Each run is scored as soon as it is finished and recorded in ``--records`` (one JSON file per
run: corpus, arm, seed, WER or BLEU, windows, CCD, validation curve) under a key that is the same
on any machine; a later session reads the runs recorded there and trains only the rest. The
report (tables, learning curves, the claim's verdict) goes to ``WORK/speech_study.md`` and, with
``--write-docs``, into ``docs/speech_study.md`` and the claims table of
``docs/small_scale_study.md`` (between their markers).

    python scripts/speech_study.py --jobs 2 --write-docs
    python scripts/speech_study.py --tiny      # a smoke run: a few dozen utterances, few updates
"""

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional

from ..checkpoint_files import copy_checkpoint, weights_fingerprint
from ..cli_types import non_negative_int, positive_int
from ..data.mustc import read_manifest
from . import speech_pipeline, study
from .demo import add_work_dir, claimed_work_dir
from .fairseq_runner import USER_DIR, RunFailed, exit_on_failure, run_python
from .small_scale_study import seed_list
from .speech_study_report import ARMS, window_list, write_report
from .training_progress import ProgressDisplay, console_logging

CORPUS = "bible-en-es"
LANG = "es"
GLOBAL_WINDOWS = speech_pipeline.GLOBAL_WINDOWS
DEFAULT_WORK_DIR = "speech_study_runs"
DOCS = "docs"


@dataclass(frozen=True)
class Sizes:
    """Everything that sets the corpus and the budget of the study."""

    max_words: int
    train: int
    dev: Optional[int]  # None: every verse of the held-out books (after the word cap)
    test: Optional[int]
    vocab: int
    asr_max_update: int
    st_max_update: int
    # Width of the tiny architecture's layers (its own is 64; FFN four times as wide)
    model_dim: int = 64
    utterances_per_talk: int = 8
    timing_rounds: int = 5  # of the encoders' forward + backward, at the corpus's mean length
    timing_batch: Optional[int] = None  # utterances (default: a batch of MAX_TOKENS frames)
    # Bible books to read (None: all): a few give a small corpus in a fraction of the time
    books: Optional[str] = None


# Sized for about 10 hours of a 2-core machine (docs/speech_study.md): 8,000 verses of at most
# 25 words are 13 hours of speech, ~480 updates an epoch; width 128, since 64 under-fits them.
FULL = Sizes(max_words=25, train=8000, dev=None, test=None, vocab=1000,
             asr_max_update=15_000, st_max_update=12_000, model_dim=128)  # fmt: skip
TINY = Sizes(max_words=12, train=24, dev=6, test=6, vocab=100,
             asr_max_update=4, st_max_update=4, utterances_per_talk=4, timing_rounds=1,
             timing_batch=2, books="Genesis,Philippians,Joshua")  # fmt: skip


def corpus_tag(sizes):
    tag = f"w{sizes.max_words}_train{sizes.train}"
    if sizes.dev or sizes.test:
        tag += f"_dev{sizes.dev or 'all'}_test{sizes.test or 'all'}"
    return tag


def synthesize(corpus, sizes, workers):
    """The spoken corpus; the tool continues a corpus it left part-way and skips a finished one."""
    if os.path.exists(os.path.join(corpus, f"en-{LANG}", "data", "tst-COMMON", "txt",
                                   f"tst-COMMON.{LANG}")):  # fmt: skip
        return
    argv = [
        "-m", "local_attn_fairseq.data.speech_corpus", "--corpus", CORPUS, "--out-dir", corpus,
        "--max-words", sizes.max_words, "--train-size", sizes.train,
        "--utterances-per-talk", sizes.utterances_per_talk, "--workers", workers,
    ]  # fmt: skip
    for option, value in (
        ("--dev-size", sizes.dev), ("--test-size", sizes.test), ("--books", sizes.books)
    ):  # fmt: skip
        if value:
            argv += [option, value]
    run_python(argv)


@dataclass
class SpeechData:
    corpus: str
    data: str  # the prepared manifests, vocabularies and configs
    work: str  # the runs' folder

    def manifest(self, subset):
        """The rows of one manifest (e.g. ``train_st``)."""
        return read_manifest(os.path.join(self.data, f"{subset}.tsv"))

    def manifest_frames(self, subset):
        """Filterbank frames of every utterance of one manifest."""
        return [int(row["n_frames"]) for row in self.manifest(subset)]


def prepare(work, sizes, workers):
    corpus = os.path.join(work, f"corpus_{corpus_tag(sizes)}")
    synthesize(corpus, sizes, workers)
    experiment = os.path.join(work, f"{corpus_tag(sizes)}_spm{sizes.vocab}")
    data = os.path.join(experiment, "data")
    speech_pipeline.prepare(corpus, data, sizes.vocab, workers, LANG)
    return SpeechData(corpus, data, experiment)


def model_options(model_dim):
    """The architecture's widths, as fairseq options would set them."""
    return {
        "encoder_embed_dim": model_dim, "encoder_ffn_embed_dim": 4 * model_dim,
        "decoder_embed_dim": model_dim, "decoder_ffn_embed_dim": 4 * model_dim,
    }  # fmt: skip


def run_argv(data, task, windows, seed, model_dim, pretrained=None):
    widths = [
        text for name, value in model_options(model_dim).items()
        for text in ("--" + name.replace("_", "-"), str(value))
    ]  # fmt: skip
    argv = [
        data.data, "--user-dir", USER_DIR, "--task", "speech_to_text", "--config-yaml",
        f"config_{task}.yaml", "--train-subset", f"train_{task}", "--valid-subset",
        f"dev_{task}", "--arch", speech_pipeline.ARCH, *widths, "--encoder-attention-windows",
        windows, *speech_pipeline.SCHEDULE, *speech_pipeline.CRITERION[task], "--seed", str(seed),
    ]  # fmt: skip
    if pretrained:
        argv += ["--load-pretrained-encoder-from", pretrained]
    return argv


def asr_run(data, model_dim):
    argv = run_argv(data, "asr", GLOBAL_WINDOWS, 1, model_dim)
    return study.TrainingRun("asr", "ASR, global encoder (CTC + cross-entropy)", argv, data.work)


def st_runs(data, encoder, windows, seeds, model_dim):
    """Both arms, seed by seed (a study stopped part-way has both arms of its first seeds)."""
    arms = {"global": GLOBAL_WINDOWS, "local": windows}
    return [
        study.TrainingRun(
            f"st_{arm}", ARMS[arm], run_argv(data, "st", arms[arm], seed, model_dim, encoder),
            data.work,
        )
        for seed in seeds
        for arm in arms
    ]


def arm_of(run):
    return run.name[len("st_") :] if run.name.startswith("st_") else run.name


# ---- scoring and records ------------------------------------------------------------------

RECORD_FIELDS = (
    "max_update", "patience", "seed", "metric", "score", "windows", "ccd", "updates_trained",
    "updates_to_convergence", "converged", "validations",
)  # fmt: skip


def record_path(records, run):
    return os.path.join(records, f"{CORPUS}-speech-{run.name}-seed{run.seed}-{run.key}.json")


def encoder_ccd(data, checkpoint, task, out_dir, num_sentences):
    """Mean CCD per encoder layer over the dev set, and the windows Algorithm 1 chooses."""
    windows = speech_pipeline.contributions(data, checkpoint, out_dir, num_sentences, task)
    with open(os.path.join(out_dir, "contributions.json"), encoding="utf-8") as f:
        layers = json.load(f)["layers"]
    return windows, [round(layer["ccd_mean"], 4) for layer in layers], layers


def score_run(run, log, data, task, max_update, dev_size):
    """A finished run's record: WER (ASR) or BLEU (ST) of its best checkpoint on the test
    books (for ST also on the test audio shuffled across verses, the level of a model that
    does not listen), the windows it trained with, its encoder's CCD, its validation curve."""
    checkpoint = os.path.join(run.save_dir, "checkpoint_best.pt")
    generated = os.path.join(run.save_dir, "test", "generate-tst-COMMON.txt")
    os.makedirs(os.path.dirname(generated), exist_ok=True)
    score = speech_pipeline.score(data.data, checkpoint, task, generated)
    chosen, ccd, layers = encoder_ccd(
        data.data, checkpoint, task, os.path.join(run.save_dir, "contributions"), dev_size
    )
    windows = run.option("--encoder-attention-windows")
    rates = log.epoch_words_per_s[1:] or log.epoch_words_per_s
    record = {
        "corpus": CORPUS,
        "arm": arm_of(run),
        "seed": run.seed,
        "metric": speech_pipeline.METRIC[task],
        "score": score,
        "windows": windows,
        "ccd": ccd,
        "updates_trained": log.num_updates,
        "updates_to_convergence": study.convergence_update(log),
        "converged": log.num_updates < max_update,
        "train_words_per_s": round(statistics.mean(rates)) if rates else None,
        "validations": [vars(v) for v in log.validations],
    }
    if task == "asr":
        record["chosen_windows"] = chosen
        record["contributions"] = layers
        record["weights_fingerprint"] = weights_fingerprint(checkpoint)
    else:
        record["shuffled_audio_score"] = shuffled_audio_score(data, run)
    return record


def shuffled_audio_score(data, run):
    """BLEU of an ST run's best checkpoint on the test audio shuffled across verses."""
    shuffled = speech_pipeline.write_shuffled_audio_subset(data.data, "st")
    return speech_pipeline.score(
        data.data, os.path.join(run.save_dir, "checkpoint_best.pt"), "st",
        os.path.join(run.save_dir, "test", f"generate-{shuffled}.txt"), shuffled,
    )  # fmt: skip


def encoder_path(asr, asr_record):
    """Where the ST runs load their encoder from: a copy of the ASR model's best checkpoint
    named by the update it was saved at and the fingerprint of its weights, so that an ASR run
    trained further (a raised cap) or trained again (on a machine without its checkpoint) gives
    the ST runs new keys instead of changing what recorded runs started from. (Records of the
    first ASR run have no fingerprint: their ST runs keep the name by update alone.)"""
    best_update = asr_record["updates_to_convergence"]
    fingerprint = asr_record.get("weights_fingerprint")
    name = f"encoder_for_st_u{best_update}" + (f"_{fingerprint}" if fingerprint else "")
    return os.path.join(asr.save_dir, name + ".pt")


def copy_encoder(asr, asr_record):
    """The ST runs' encoder, copied from the ASR run's best checkpoint once; refused when that
    checkpoint holds other weights than the recorded ASR model's."""
    path = encoder_path(asr, asr_record)
    if not os.path.exists(path):
        best = os.path.join(asr.save_dir, "checkpoint_best.pt")
        recorded = asr_record.get("weights_fingerprint")
        found = weights_fingerprint(best) if recorded else None
        if found != recorded:
            raise RunFailed(
                f"{best} is not the recorded ASR model (weights {found}, recorded {recorded}): "
                "move the ASR record away to score this one instead"
            )
        copy_checkpoint(best, path)
    return path


class Recorded:
    """The runs scored so far, read from and added to the records folder."""

    def __init__(self, records, patience, pass_over_others=False):
        # by run folder: with no window chosen the two arms have the same options (and key)
        self.records, self.patience, self.by_run = records, patience, {}
        self.pass_over_others = pass_over_others  # records under other caps (study.read_record)

    def read(self, run, max_update):
        record = study.read_record(
            record_path(self.records, run), max_update, self.patience, RECORD_FIELDS,
            self.pass_over_others,
        )  # fmt: skip
        if record is not None:
            self.by_run[run.save_dir] = record
        return record

    def add(self, run, record, max_update):
        path = record_path(self.records, run)
        self.by_run[run.save_dir] = study.write_record(path, record, run, max_update, self.patience)
        print(f"| {run.label}, seed {run.seed}: {record['metric']} {record['score']:.2f} -> {path}")


def train_asr(data, sizes, args, recorded):
    """The ASR run's record: read, or the run trained (continued, reused) and scored."""
    run = asr_run(data, sizes.model_dim)
    record = recorded.read(run, sizes.asr_max_update)
    if record is None and not args.report_only:

        def score(finished, log):
            result = score_run(finished, log, data, "asr", sizes.asr_max_update, dev_size(data))
            recorded.add(finished, result, sizes.asr_max_update)

        study.train_runs([run], sizes.asr_max_update, args.patience, 1, ProgressDisplay(),
                         on_finished=score)  # fmt: skip
        record = recorded.by_run[run.save_dir]
    return run, record


def dev_size(data):
    return len(data.manifest_frames("dev_asr"))


def train_st(data, sizes, args, recorded, asr, asr_record):
    """Both ST arms, every seed: each run's record read, or the run trained and scored."""
    runs = st_runs(
        data, encoder_path(asr, asr_record), asr_record["chosen_windows"], args.seed_list,
        sizes.model_dim,
    )
    to_train = [run for run in runs if recorded.read(run, sizes.st_max_update) is None]
    print(f"| ST: {len(runs)} runs, {len(runs) - len(to_train)} recorded, {len(to_train)} to "
          f"train or score in {data.work}/runs", flush=True)  # fmt: skip
    if not to_train or args.report_only:
        return runs
    if not os.path.exists(os.path.join(asr.save_dir, "checkpoint_best.pt")):
        raise RunFailed(
            f"the ASR model is recorded but its checkpoint is not in {asr.save_dir} (records "
            "from another machine?): move the ASR record away to train it here again"
        )
    copy_encoder(asr, asr_record)

    def score(finished, log):
        result = score_run(finished, log, data, "st", sizes.st_max_update, dev_size(data))
        recorded.add(finished, result, sizes.st_max_update)

    study.train_runs(to_train, sizes.st_max_update, args.patience, args.jobs,
                     ProgressDisplay(), on_finished=score)  # fmt: skip
    return runs


# ---- the cost side --------------------------------------------------------------------------


def attention_cost(data, windows, model_dim, rounds, batch=None):
    """Both arms' encoder self-attention over the training utterances' lengths: operations and
    attention-weight bytes at the mean length and summed over the corpus, and one forward +
    backward of their encoders (same weights) timed on a batch at the mean length."""
    import torch

    from ..models.s2t_transformer_local import s2t_transformer_local_tiny
    from .speech_encoder_cost import build_encoder, measure, self_attention_cost

    frames = torch.tensor(data.manifest_frames("train_st"))
    mean_frames = round(float(frames.float().mean()))
    arms = {"global": GLOBAL_WINDOWS, "local": windows}
    torch.manual_seed(1)
    encoders = {
        arm: build_encoder(w, arch=s2t_transformer_local_tiny, **model_options(model_dim))[0]
        for arm, w in arms.items()
    }
    encoders["local"].load_state_dict(encoders["global"].state_dict())
    layer = encoders["global"].transformer_layers[0].self_attn
    cost = {
        "mean_fbank_frames": mean_frames,
        "utterances": len(frames),
        "embed_dim": layer.embed_dim,
        "heads": layer.num_heads,
        "layers": len(window_list(windows)),
        "arms": {},
    }
    for arm, w in arms.items():
        at_mean = self_attention_cost([mean_frames], window_list(w), layer.embed_dim,
                                      layer.num_heads)  # fmt: skip
        corpus = self_attention_cost(frames, window_list(w), layer.embed_dim, layer.num_heads)
        cost["arms"][arm] = {
            "windows": w,
            "flops_at_mean": float(at_mean["flops"][0]),
            "weight_bytes_at_mean": float(at_mean["weight_bytes"][0]),
            "flops_corpus": float(corpus["flops"].sum()),
            "weight_bytes_corpus": float(corpus["weight_bytes"].sum()),
        }
    cost["mean_encoder_frames"] = int(at_mean["encoder_frames"][0])
    batch = batch or max(1, speech_pipeline.MAX_TOKENS // mean_frames)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the study's runs may hold the cores: see measure's cpu_time
    try:
        measured = measure(encoders, mean_frames, batch, rounds, cpu_time=True)
    finally:
        torch.set_num_threads(threads)
    cost["timing"] = {
        "batch": batch,
        "rounds": rounds,
        "threads": 1,
        "clock": "CPU time",
        **{arm: {"seconds": t, "peak_bytes": m} for arm, (t, m, _) in measured.items()},
    }
    return cost


# ---- the command line ---------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_work_dir(parser, DEFAULT_WORK_DIR, "corpus, runs and report")
    parser.add_argument(
        "--tiny", action="store_true",
        help="a smoke run: a few dozen utterances, a few updates per run (no study)",
    )  # fmt: skip
    parser.add_argument("--max-words", type=positive_int, help=f"default {FULL.max_words}")
    parser.add_argument("--train-size", type=positive_int, help=f"default {FULL.train:,}")
    parser.add_argument("--vocab-size", type=positive_int, help=f"default {FULL.vocab}")
    parser.add_argument("--model-dim", type=positive_int,
                        help=f"width of the model's layers (default {FULL.model_dim})")  # fmt: skip
    parser.add_argument("--asr-max-update", type=positive_int,
                        help=f"cap of the ASR run (default {FULL.asr_max_update:,})")
    parser.add_argument("--st-max-update", type=positive_int,
                        help=f"cap of each ST run (default {FULL.st_max_update:,})")  # fmt: skip
    parser.add_argument(
        "--patience", type=non_negative_int, default=3,
        help="stop a run when validation loss has not improved for this many epochs",
    )  # fmt: skip
    parser.add_argument("--seeds", type=seed_list, default="1,2,3",
                        help="seeds of each ST arm (the ASR run has seed 1)")  # fmt: skip
    parser.add_argument("--jobs", type=positive_int, default=2,
                        help="ST runs side by side, the cores split between them")  # fmt: skip
    parser.add_argument("--workers", type=positive_int, default=2,
                        help="speech synthesis and feature processes")  # fmt: skip
    parser.add_argument("--records", help="folder of the runs' records (default: WORK/records)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: report the runs recorded so far")  # fmt: skip
    parser.add_argument(
        "--write-docs", action="store_true",
        help="also write the report into docs/speech_study.md, docs/images/ and the claims "
        "table of docs/small_scale_study.md (of the current directory: the repository's)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.seed_list = args.seeds
    overrides = {
        "max_words": args.max_words, "train": args.train_size, "vocab": args.vocab_size,
        "model_dim": args.model_dim,
        "asr_max_update": args.asr_max_update, "st_max_update": args.st_max_update,
    }  # fmt: skip
    args.sizes = replace(TINY if args.tiny else FULL,
                         **{k: v for k, v in overrides.items() if v is not None})  # fmt: skip
    return args


@dataclass
class Outcome:
    """What the study's steps produced: the data, every run and its record, the cost side."""

    data: SpeechData
    asr_record: Optional[dict]
    st_runs: list
    st_records: list
    cost: Optional[dict]


def run_steps(args):
    """Corpus, ASR, windows, ST arms, scores and cost: each step skipped where done."""
    sizes, work = args.sizes, os.path.abspath(args.work_dir)
    data = prepare(work, sizes, args.workers)
    # the work folder's own records, or a report: a record under other caps is passed over
    passed_over = args.records is None or args.report_only
    recorded = Recorded(os.path.abspath(args.records or os.path.join(work, "records")),
                        args.patience, passed_over)  # fmt: skip
    asr, asr_record = train_asr(data, sizes, args, recorded)
    runs, st_records, cost = [], [], None
    if asr_record is not None:
        runs = train_st(data, sizes, args, recorded, asr, asr_record)
        st_records = [recorded.by_run[r.save_dir] for r in runs if r.save_dir in recorded.by_run]
        if any(r["arm"] == "local" for r in st_records):
            cost = attention_cost(
                data, asr_record["chosen_windows"], sizes.model_dim, sizes.timing_rounds,
                sizes.timing_batch,
            )
    return Outcome(data, asr_record, runs, st_records, cost)


def report_settings(args, argv, started, script="scripts/speech_study.py"):
    return {
        "command": f"python {script} " + " ".join(sys.argv[1:] if argv is None else argv),
        "minutes": (time.time() - started) / 60,
        "machine": f"{os.cpu_count()} CPU cores",
        "patience": args.patience,
        "seeds": args.seed_list,
    }


def run_study(args, argv):
    work = os.path.abspath(args.work_dir)
    started = time.time()
    outcome = run_steps(args)
    targets = [(work, os.path.join(work, "images"), False)]
    if args.write_docs:
        docs = os.path.abspath(DOCS)
        targets.append((docs, os.path.join(docs, "images"), True))
    print(write_report(outcome.data, args.sizes, report_settings(args, argv, started),
                       outcome.asr_record, outcome.st_records, outcome.cost, targets))  # fmt: skip


def main(argv=None):
    args = parse_args(argv)
    console_logging()
    with claimed_work_dir(args):
        exit_on_failure(run_study, args, argv)
