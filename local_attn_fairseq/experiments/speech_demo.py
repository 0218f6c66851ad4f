"""The speech demo: local attention windows for speech translation, chosen from contributions.

Alastruey et al. (2022)'s recipe on a corpus any machine can make, end to end on the CPU:

1. speaks 2000 short (at most 10 words) English Ding sentences with espeak-ng in MuST-C's
   layout, German translations beside them (``local_attn_fairseq.data.speech_corpus``);
2. prepares fbank manifests, vocabularies and configs (``local_attn_fairseq.data.mustc``);
3. pre-trains an ASR model, ``s2t_transformer_local_tiny`` with every encoder layer global, with
   fairseq's CTC loss on the encoder beside the decoder's;
4. runs ``local-attn-analyze contributions`` on it: the encoder's contribution matrices give one
   window per layer (``windows.txt``);
5. trains two ST models side by side, both with the encoder initialised from the ASR model
   (``--load-pretrained-encoder-from``): the baseline with global attention, and the local one
   with the windows of step 4;
6. compares the contributions of the ASR and ST baseline encoders (``contributions_asr_vs_st``);
7. scores ASR with WER and both ST models with BLEU on tst-COMMON (``fairseq-generate``) and
   prints one table, also written to ``<work-dir>/results.md``.

Every step is skipped when its output exists and is newer than what it was made from, and a
training run only when it finished, so a second run only redoes what is missing.
``--quick`` is a reduced run (small corpus, one epoch) that checks the whole pipeline in minutes.
"""

import argparse
import json
import os
import time

from ..cli_types import positive_int
from ..file_safety import atomic_write_text
from .demo import (
    add_work_dir,
    claimed_work_dir,
    generated_score,
    train_unfinished,
    training_job,
)
from .fairseq_runner import USER_DIR, exit_on_failure, run_python, run_tool, up_to_date

ARCH = "s2t_transformer_local_tiny"
ENCODER_LAYERS = 6  # the tiny arch's
GLOBAL_WINDOWS = ",".join(["0"] * ENCODER_LAYERS)
SCHEDULE = (
    "--optimizer adam --adam-betas (0.9,0.98) --lr 2e-3 --lr-scheduler inverse_sqrt "
    "--warmup-updates 300 --clip-norm 10 --dropout 0.1 --label-smoothing 0.1 --max-tokens 5000 "
    "--required-batch-size-multiple 1 --num-workers 0 --seed 1 --no-epoch-checkpoints "
    "--no-last-checkpoints --log-format simple --log-interval 50"
).split()
# ASR adds fairseq's CTC loss on the encoder output: with it the tiny model learns to align
# audio and text within a CPU budget; without it the decoder learns the language of the
# transcripts and ignores the audio for many more epochs. ST keeps the plain loss.
CRITERION = {
    "asr": "--criterion label_smoothed_cross_entropy_with_ctc --ctc-weight 0.3".split(),
    "st": ["--criterion", "label_smoothed_cross_entropy"],
}
# fairseq-fixed drops a last batch smaller than --required-batch-size-multiple: with 1 every
# test utterance is decoded.
GENERATE = (
    "--task speech_to_text --beam 5 --batch-size 50 --max-len-b 60 --num-workers 0 "
    "--required-batch-size-multiple 1"
).split()
SCORING = {
    "asr": "--scoring wer --wer-tokenizer 13a --wer-lowercase --wer-remove-punct".split(),
    "st": ["--scoring", "sacrebleu"],
}
METRIC = {"asr": "WER", "st": "BLEU"}
# 60 ASR epochs: the tiny model follows the audio (tst-COMMON WER 74, its errors sound like
# the words), so its encoder's contributions say something; about 40 min on 2 CPU cores.
FULL = {"train": 2000, "dev": 200, "test": 200, "vocab": 300, "asr_epochs": 60, "st_epochs": 40}
QUICK = {"train": 96, "dev": 16, "test": 16, "vocab": 250, "asr_epochs": 1, "st_epochs": 1}
# Short sentences: cheaper batches, and fewer frames for attention to align on a CPU budget.
MAX_WORDS = 10
DEFAULT_WORK_DIR = os.path.join("demo_runs", "speech")


def synthesize(corpus, sizes, workers):
    if os.path.exists(os.path.join(corpus, "en-de", "data", "tst-COMMON", "txt", "tst-COMMON.de")):
        return
    run_python(
        [
            "-m", "local_attn_fairseq.data.speech_corpus", "--out-dir", corpus,
            "--train-size", sizes["train"], "--dev-size", sizes["dev"],
            "--test-size", sizes["test"], "--utterances-per-talk", 4, "--max-words", MAX_WORDS,
            "--workers", workers,
        ]
    )  # fmt: skip


def prepare(corpus, data, vocab_size, workers, lang="de"):
    if os.path.exists(os.path.join(data, "config_st.yaml")):
        return
    run_python(
        [
            "-m", "local_attn_fairseq.data.mustc", "--mustc-root", corpus, "--lang", lang,
            "--out-dir", data, "--vocab-size", vocab_size, "--workers", workers,
        ]
    )  # fmt: skip


def train_job(name, data, task, save_dir, windows, epochs, pretrained=None):
    """fairseq-train of one ASR or ST model; ST starts from the ASR model's encoder."""
    options = [
        "--user-dir", USER_DIR, "--task", "speech_to_text", "--config-yaml",
        f"config_{task}.yaml", "--train-subset", f"train_{task}", "--valid-subset", f"dev_{task}",
        "--arch", ARCH, "--encoder-attention-windows", windows, *SCHEDULE, *CRITERION[task],
    ]  # fmt: skip
    if pretrained:
        options += ["--load-pretrained-encoder-from", pretrained]
    return training_job(name, data, options, epochs, save_dir)


def train_together(jobs):
    """Train the unfinished jobs at once, the cores split between them, one progress line per
    run meanwhile. Small models use two threads poorly, so together they finish sooner."""
    started = time.time()
    trained = train_unfinished(jobs, side_by_side=len(jobs))
    if trained:
        names = ", ".join(job.label for job in trained)
        print(f"| trained {names} in {time.time() - started:.0f} s")


def score(data, checkpoint, task, out_path, generate=GENERATE):
    if not up_to_date(out_path, checkpoint):
        run_tool(
            "fairseq-generate",
            [
                data, "--user-dir", USER_DIR, "--path", checkpoint, *generate, "--config-yaml",
                f"config_{task}.yaml", "--gen-subset", f"tst-COMMON_{task}", *SCORING[task],
            ],
            out_path,
        )  # fmt: skip
    return generated_score(out_path, METRIC[task])


def contributions(data, checkpoint, out_dir, num_sentences, st_checkpoint=None, task="asr"):
    """``local-attn-analyze contributions`` on the ASR encoder over the dev set (and, given
    ``st_checkpoint``, on that ST encoder beside it: Figure 3's comparison); returns the
    windows it chose from the first encoder. With ``task="st"`` the first checkpoint is an ST
    model, analysed on the ST manifests (its CCD; its windows are not used)."""
    windows_path = os.path.join(out_dir, "windows.txt")
    checkpoints = [checkpoint] + ([st_checkpoint] if st_checkpoint else [])
    if not up_to_date(windows_path, *checkpoints):
        argv = [
            "contributions", "--path", checkpoint, "--data", data, "--config-yaml",
            f"config_{task}.yaml", "--gen-subset", f"dev_{task}", "--num-sentences",
            num_sentences, "--output-dir", out_dir,
        ]  # fmt: skip
        if st_checkpoint:
            argv += ["--compare-path", st_checkpoint, "--compare-config-yaml", "config_st.yaml"]
            argv += ["--compare-gen-subset", "dev_st"]
        run_tool("local-attn-analyze", argv, out_dir + ".log")
    with open(windows_path, encoding="utf-8") as f:
        return f.read().strip()


def results_table(rows):
    lines = ["| model | encoder attention windows | tst-COMMON |", "|---|---|---:|"]
    for row in rows:
        lines.append(f"| {row['model']} | {row['windows']} | {row['metric']} {row['score']:.2f} |")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_work_dir(parser, DEFAULT_WORK_DIR, "corpus, runs and results")
    parser.add_argument("--quick", action="store_true", help="small corpus, one epoch each")
    parser.add_argument("--asr-epochs", type=positive_int, help="ASR pre-training epochs")
    parser.add_argument("--st-epochs", type=positive_int, help="epochs of each ST model")
    parser.add_argument(
        "--train-size",
        type=positive_int,
        help=f"training utterances (default {FULL['train']}; --quick {QUICK['train']}); "
        "Ding's training split has about 13,000 sentences short enough",
    )
    parser.add_argument("--workers", type=positive_int, default=2, help="synthesis and preparation")
    return parser.parse_args(argv)


def run_demo(args):
    sizes = dict(QUICK if args.quick else FULL)
    sizes["asr_epochs"] = args.asr_epochs or sizes["asr_epochs"]
    sizes["st_epochs"] = args.st_epochs or sizes["st_epochs"]
    sizes["train"] = args.train_size or sizes["train"]
    work = os.path.abspath(args.work_dir)
    os.makedirs(work, exist_ok=True)
    # Each corpus size and vocabulary gets its own directories: a --quick run never reuses
    # the full demo's files, nor the other way round.
    tag = f"{sizes['train']}-{sizes['dev']}-{sizes['test']}"
    corpus = os.path.join(work, f"corpus_{tag}")
    experiment = os.path.join(work, f"runs_{tag}_spm{sizes['vocab']}")
    data = os.path.join(experiment, "data")
    started = time.time()

    synthesize(corpus, sizes, args.workers)
    prepare(corpus, data, sizes["vocab"], args.workers)

    asr_dir = os.path.join(experiment, f"asr_ctc_e{sizes['asr_epochs']}")
    train_together([train_job("ASR", data, "asr", asr_dir, GLOBAL_WINDOWS, sizes["asr_epochs"])])
    asr = os.path.join(asr_dir, "checkpoint_best.pt")
    windows = contributions(data, asr, os.path.join(asr_dir, "contributions"), sizes["dev"])
    print(f"| windows from the ASR encoder's contributions: {windows}")

    st_runs = {}
    for name, st_windows in (("global", GLOBAL_WINDOWS), ("local", windows)):
        save_dir = os.path.join(
            asr_dir, f"st_{name}_e{sizes['st_epochs']}_w{st_windows.replace(',', '-')}"
        )
        job = train_job(f"ST {name}", data, "st", save_dir, st_windows, sizes["st_epochs"], asr)
        st_runs[name] = (save_dir, st_windows, job)
    train_together([job for _, _, job in st_runs.values()])
    st_baseline = os.path.join(st_runs["global"][0], "checkpoint_best.pt")
    compared = os.path.join(asr_dir, "contributions_asr_vs_st")
    contributions(data, asr, compared, sizes["dev"], st_checkpoint=st_baseline)
    print(f"| contributions of the ASR and ST baseline encoders: {compared}")

    rows = [
        {"model": "ASR (global)", "windows": GLOBAL_WINDOWS, "metric": "WER",
         "score": score(data, asr, "asr", os.path.join(asr_dir, "generate-tst-COMMON.txt"))},
    ]  # fmt: skip
    for name, label in (("global", "ST baseline (global)"), ("local", "ST local (windows)")):
        save_dir, st_windows, _ = st_runs[name]
        checkpoint = os.path.join(save_dir, "checkpoint_best.pt")
        bleu = score(data, checkpoint, "st", os.path.join(save_dir, "generate-tst-COMMON.txt"))
        rows.append({"model": label, "windows": st_windows, "metric": "BLEU", "score": bleu})

    table = results_table(rows)
    title = (
        f"Synthetic MuST-C en-de (espeak-ng), tst-COMMON {sizes['test']} utterances; "
        f"{sizes['train']} training utterances, ASR {sizes['asr_epochs']} epochs, "
        f"ST {sizes['st_epochs']} epochs each"
    )
    atomic_write_text(os.path.join(work, "results.md"), f"{title}\n\n{table}\n")
    atomic_write_text(
        os.path.join(work, "results.json"), json.dumps({"sizes": sizes, "rows": rows}, indent=2)
    )
    print(f"\n{title}, {(time.time() - started) / 60:.1f} min\n\n{table}")


def main(argv=None):
    args = parse_args(argv)
    with claimed_work_dir(args):  # the demos' owner: demo_runs/speech is inside demo_runs/
        exit_on_failure(run_demo, args)
