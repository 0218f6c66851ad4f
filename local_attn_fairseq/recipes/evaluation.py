"""The evaluate stage: decode or score the row's final checkpoint as the paper did, then write
``results.json`` and print the measured numbers beside the paper's (the report).
``run`` is the recipe's workspace (``workspace.RecipeWorkspace``).
"""

import json
import os
import re
import shutil

from ..checkpoint_files import UnreadableCheckpointError, read_checkpoint
from ..experiments.fairseq_runner import USER_DIR
from ..file_safety import atomic_write_text, publish, replace_own_dir
from . import scoring
from .config import RecipeError
from .training import training_settings
from .speech import task_files
from .text_preparation import dataset_of, raw_path
from .workspace import WORK_DIR_OWNER

# q, k, v and output projections of the encoder's self-attention (the papers' attention
# parameter counts), in text (layers) and speech (transformer_layers) encoders
_ENCODER_ATTENTION_WEIGHT = re.compile(
    r"^encoder\.(transformer_)?layers\.\d+\.self_attn\..*weight$"
)


def evaluate_row(run, row):
    checkpoint = run.final_checkpoint(row)
    settings = row["evaluate"]
    subset = settings.get("subset", "test")
    if not run.dry_run and not os.path.exists(checkpoint):
        raise RecipeError(f"{checkpoint} does not exist: run the train and average stages first")
    if not run.dry_run:
        try:  # before decoding: fairseq's own load would end in a traceback
            read_checkpoint(checkpoint)
        except UnreadableCheckpointError as error:
            raise RecipeError(f"{error}; run the average stage again to rewrite it") from None
    print(f"| reported as the paper's number: {headline_metric(run, row)} on {subset}", flush=True)
    if run.kind == "language_model":
        measured = evaluate_language_model(run, row, checkpoint, subset)
    elif run.kind == "speech":
        measured = evaluate_speech(run, row, checkpoint, subset)
    else:
        measured = evaluate_translation(run, row, checkpoint, subset, settings)
    if run.dry_run:
        return None
    measured.update(model_facts(run, row, checkpoint))
    return report(run, row, subset, measured)


def decode_argv(run, row, checkpoint, subset, settings):
    """fairseq-generate's argv, and the file the decoding is kept in: generate-SUBSET.txt in
    the row's generate-SUBSET folder. fairseq writes it into a temporary folder
    (``partial_results``); ``decode`` renames it into place once complete."""
    out_dir = partial_results(run, row, subset)
    argv = [run.data_path(row), "--user-dir", USER_DIR, "--path", checkpoint]
    argv += ["--gen-subset", subset, "--beam", settings.get("beam", 5)]
    argv += [
        "--lenpen",
        settings.get("lenpen", 1.0),
        "--batch-size",
        settings.get("batch_size", 64),
    ]
    # default: outputs up to the input length + 50 (Vaswani et al.)
    argv += [
        "--max-len-a",
        settings.get("max_len_a", 1),
        "--max-len-b",
        settings.get("max_len_b", 50),
    ]
    # every sentence is decoded: batches need not be a multiple of 8 (fairseq's default)
    argv += ["--results-path", out_dir, "--required-batch-size-multiple", 1]
    name = f"generate-{subset}.txt"
    return argv, os.path.join(run.row_dir(row["name"]), f"generate-{subset}", name)


def partial_results(run, row, subset):
    return os.path.join(run.row_dir(row["name"]), f".generate-{subset}.partial")


def decode(run, row, subset, argv, output):
    """Run fairseq-generate into an emptied temporary folder, then rename its output to
    ``output``: a killed decoding leaves no partial file under the name of a finished one."""
    partial = partial_results(run, row, subset)
    if not run.dry_run:
        try:  # a killed decoding's folder is emptied; one of someone else's is not
            replace_own_dir(partial, WORK_DIR_OWNER)
        except FileExistsError:
            raise RecipeError(
                f"{partial} exists and was not written by the recipes; move it away"
            ) from None
    run.run_tool("fairseq-generate", argv, os.path.join(run.row_dir(row["name"]), "generate.log"))
    if run.dry_run:
        return
    os.makedirs(os.path.dirname(output), exist_ok=True)
    publish(os.path.join(partial, os.path.basename(output)), output)
    shutil.rmtree(partial)


def evaluate_translation(run, row, checkpoint, subset, settings):
    argv, output = decode_argv(run, row, checkpoint, subset, settings)
    argv += ["--remove-bpe", "sentencepiece", "--scoring", "sacrebleu", "--num-workers", 0]
    decode(run, row, subset, argv, output)
    if run.dry_run:
        return {}
    target = dataset_of(run)["target"]
    with open(raw_path(run, subset, target), encoding="utf-8") as f:
        references = [line.rstrip("\n") for line in f]
    hyps, _ = scoring.read_generate_output(output, expected=len(references))
    measured = {"sacrebleu": scoring.sacrebleu_score(hyps, references)}
    variants = bleu_variants(settings)
    if "tokenized" in variants:
        options = tokenized_options(settings)
        measured["tokenized_bleu"] = scoring.tokenized_bleu(hyps, references, target, **options)
    # "bleu" is the variant the paper reports (the first listed), beside its number
    measured["bleu"] = measured["tokenized_bleu" if variants[0] == "tokenized" else "sacrebleu"]
    return measured


BLEU_VARIANTS = ("sacrebleu", "tokenized")


def bleu_variants(settings):
    """The BLEU variants a translation row reports, the paper's own first (the headline)."""
    variants = settings.get("bleu", ["sacrebleu"])
    unknown = [v for v in variants if v not in BLEU_VARIANTS]
    if not variants or unknown:
        raise RecipeError(f"evaluate.bleu {variants!r}: a list of {', '.join(BLEU_VARIANTS)}")
    return variants


def tokenized_options(settings):
    return {
        "compound_split": bool(settings.get("compound_split")),
        "aggressive_dashes": bool(settings.get("aggressive_dashes")),
    }


def headline_metric(run, row):
    """What the row's ``bleu`` (or ``wer``, ``perplexity``) is, in words, for the report."""
    settings = row["evaluate"]
    if run.kind == "language_model":
        return "perplexity per sentencepiece token (fairseq-eval-lm)"
    if run.kind == "speech":
        if settings.get("metric") == "wer":
            return "WER, lower-cased, without punctuation"
        return "sacreBLEU (13a) of the ST output"
    if bleu_variants(settings)[0] == "tokenized":
        return scoring.tokenized_bleu_name(**tokenized_options(settings))
    return "sacreBLEU (13a, detokenised)"


def evaluate_speech(run, row, checkpoint, subset):
    files = task_files(run, row)
    settings = row["evaluate"]
    argv, output = decode_argv(run, row, checkpoint, files[subset], settings)
    argv += ["--task", "speech_to_text", "--config-yaml", files["config"]]
    argv += ["--scoring", "sacrebleu", "--num-workers", 0]
    decode(run, row, files[subset], argv, output)
    if run.dry_run:
        return {}
    hyps, refs = scoring.read_generate_output(output)
    if not hyps:
        raise RecipeError(f"{output}: no hypotheses")
    if settings.get("metric") == "wer":
        return {"wer": scoring.word_error_rate(hyps, refs)}
    return {"bleu": scoring.sacrebleu_score(hyps, refs)}


def evaluate_language_model(run, row, checkpoint, subset):
    argv = [run.bin, "--user-dir", USER_DIR, "--path", checkpoint, "--gen-subset", subset]
    argv += ["--task", "language_modeling", "--sample-break-mode", "eos"]
    argv += ["--max-tokens", 4096, "--num-workers", 0]
    result = run.run_tool(
        "fairseq-eval-lm", argv, os.path.join(run.row_dir(row["name"]), "eval_lm.log")
    )
    return {} if run.dry_run else {"perplexity": round(float(result["perplexity"]), 2)}


def model_facts(run, row, checkpoint):
    """Size and speed: parameters, encoder attention weights, heads kept, updates per second."""
    facts = {}
    log = os.path.join(run.row_dir(row["name"]), "train.log")
    if os.path.exists(log):
        with open(log, encoding="utf-8") as f:
            summary = scoring.training_summary(f.read())
        facts["steps_per_s"] = summary["updates_per_s"]
    state = read_checkpoint(checkpoint)
    facts["params"] = count_parameters(state["model"])
    facts["encoder_attention_params"] = sum(
        v.numel() for k, v in state["model"].items() if _ENCODER_ATTENTION_WEIGHT.match(k)
    )
    kept_path = run.heads_kept(row["name"])
    if row["prune"] and os.path.exists(kept_path):
        with open(kept_path) as f:
            kept = json.load(f)
        order = ("encoder_self", "decoder_self", "decoder_cross")
        facts["heads"] = "/".join(str(sum(map(len, kept[t]))) for t in order if t in kept)
    return facts


def count_parameters(weights):
    """Model parameters in a state dict, a tensor shared by several names (tied embeddings)
    counted once, buffers (version counters, position tables' placeholders) left out."""
    seen, total = set(), 0
    for key, value in weights.items():
        if key.endswith("_float_tensor") or key.endswith(".version"):
            continue
        storage = (value.untyped_storage().data_ptr(), value.storage_offset(), value.shape)
        if storage not in seen:
            seen.add(storage)
            total += value.numel()
    return total


def report(run, row, subset, measured):
    results = {
        "recipe": run.recipe["name"],
        "row": row["name"],
        "table": row["table"],
        "subset": subset,
        "seed": run.seed,
        "checkpoint": run.final_checkpoint(row),
        "measured": measured,
        "paper": row["paper"],
        "headline": headline_metric(run, row),
        "chosen_not_from_paper": row["chosen"],
        "departures_from_paper": row["departures"],
        # what the command line changed, and the settings the numbers were measured with
        "given": run.settings_given,
        "settings": {
            "train": training_settings(run, row),
            "average": row["average"],
            "evaluate": row["evaluate"],
        },
    }
    path = os.path.join(run.row_dir(row["name"]), "results.json")
    atomic_write_text(path, json.dumps(results, indent=2))
    print(f"\n{run.recipe['name']} | {row['name']} | {subset} (seed {run.seed})")
    print(f"{'metric':26s} {'measured':>14s} {'paper':>16s}")
    for key in sorted(set(measured) | set(row["paper"])):
        value = measured.get(key)
        shown = "-" if value is None else f"{value:,}" if isinstance(value, int) else str(value)
        print(f"{key:26s} {shown:>14s} {str(row['paper'].get(key, '')):>16s}")
    print(f"(bleu / wer / perplexity: {results['headline']})")
    print(f"(written to {path})")
    return results
