"""The speech study's report: its tables, learning curves, the claim's verdicts, the cost.

Written from the study's records (``experiments.speech_study``) into ``WORK/speech_study.md``
and, on request, between the markers of ``docs/speech_study.md`` and of the claims part of
``docs/small_scale_study.md``, whose other text is kept.
"""

import json
import math
import os
import statistics
from dataclasses import asdict

from ..file_safety import atomic_write_text
from . import study
from .speech_pipeline import ARCH, GLOBAL_WINDOWS
from .study_report import replace_section
from .training_progress import Validation

REPORT_START = "<!-- speech study report: start -->"
REPORT_END = "<!-- speech study report: end -->"
CLAIMS_START = "<!-- speech study claims: start -->"
CLAIMS_END = "<!-- speech study claims: end -->"
ARMS = {"global": "ST, global encoder", "local": "ST, local encoder (Algorithm 1's windows)"}
NO_WORSE_MARGIN = 1.0  # BLEU: "translates as well as" the global arm
TARGET_BLEU = 8.0  # the global arm must translate for the comparison to mean anything
TARGET_FLOP_RATIO = 0.5


def window_list(windows):
    return [int(w) for w in str(windows).split(",")]


def speech_length(hours):
    return f"{hours:.1f} h" if hours >= 1 else f"{hours * 60:.1f} min"


def corpus_facts(data):
    """Utterances, hours of speech and speakers of every split, from the ST manifests."""
    facts = {}
    for split in ("train", "dev", "tst-COMMON"):
        rows = data.manifest(f"{split}_st")
        facts[split] = {
            "utterances": len(rows),
            "hours": sum(int(r["n_frames"]) for r in rows) / 100 / 3600,
            "speakers": sorted({r["speaker"] for r in rows}),
        }
    return facts


def summarise_arm(records):
    scores = [r["score"] for r in records]
    layers = len(records[0]["ccd"])
    return {
        "runs": len(records),
        "seeds": [r["seed"] for r in records],
        "mean": statistics.mean(scores),
        "std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
        "min": min(scores),
        "max": max(scores),
        "updates_to_convergence": round(
            statistics.mean(r["updates_to_convergence"] for r in records)
        ),
        "converged": sum(r["converged"] for r in records),
        "ccd": [statistics.mean(r["ccd"][i] for r in records) for i in range(layers)],
        "ccd_per_seed": [statistics.mean(r["ccd"]) for r in records],  # over layers
        "windows": records[0]["windows"],
        # BLEU on the test audio shuffled across verses: the level of not listening
        "shuffled": statistics.mean(r.get("shuffled_audio_score", math.nan) for r in records),
    }


def verdicts(asr, arms, cost):
    """(claim, measured, verdict) rows: the paper's claim and the study's targets."""
    rows = []
    if "global" in arms and "local" in arms:
        g, l = arms["global"], arms["local"]
        diff = l["mean"] - g["mean"]
        provisional = "; provisional: one seed" if min(g["runs"], l["runs"]) < 2 else ""
        verdict = ("holds" if diff >= -NO_WORSE_MARGIN else "does not hold") + provisional
        if not any(window_list(l["windows"])):
            verdict = "not tested: Algorithm 1 chose no window, the local arm is the global one"
        rows.append((
            "an ST encoder with Algorithm 1's windows translates as well as a global one "
            f"(within {NO_WORSE_MARGIN:.0f} BLEU)",
            f"BLEU {l['mean']:.2f} ± {l['std']:.2f} local vs {g['mean']:.2f} ± {g['std']:.2f} "
            f"global ({diff:+.2f})",
            verdict,
        ))  # fmt: skip
        shuffled = "" if math.isnan(g["shuffled"]) else (
            f" ({g['shuffled']:.2f} on the test audio shuffled across verses)"
        )
        rows.append((
            f"the global arm translates (target: at least {TARGET_BLEU:.0f} BLEU)",
            f"BLEU {g['mean']:.2f}{shuffled}",
            "met" if g["mean"] >= TARGET_BLEU else "not met: the comparison ranks models that "
            "translate poorly",
        ))  # fmt: skip
        asr_ccd, st_ccd = statistics.mean(asr["ccd"]), statistics.mean(g["ccd"])
        seeds = g["ccd_per_seed"]
        spread = f" (seeds {min(seeds):.3f}-{max(seeds):.3f})" if len(seeds) > 1 else ""
        if all(c > asr_ccd for c in seeds):
            verdict = "holds"
        elif all(c < asr_ccd for c in seeds):
            verdict = "does not hold"
        else:  # a mean on one side says nothing when the seeds fall on both
            verdict = "not shown: the seeds fall on both sides of the ASR encoder's CCD"
        rows.append((
            "ST encoders are more diagonal (local) than the ASR encoder they start from "
            "(Figure 3)",
            f"mean CCD over layers: ASR {asr_ccd:.3f}, ST global {st_ccd:.3f}{spread}",
            verdict,
        ))  # fmt: skip
    if cost:
        ratio = cost["arms"]["local"]["flops_at_mean"] / cost["arms"]["global"]["flops_at_mean"]
        rows.append((
            "local windows cost a fraction of the encoder's self-attention (target: at most "
            f"{TARGET_FLOP_RATIO}x the operations at the mean length)",
            f"{ratio:.2f}x at {cost['mean_encoder_frames']} encoder positions",
            "met" if ratio <= TARGET_FLOP_RATIO else "not met",
        ))  # fmt: skip
    return rows


def claims_table(rows):
    lines = ["| claim | measured | verdict |", "|---|---|---|"]
    return lines + [f"| {claim} | {measured} | {verdict} |" for claim, measured, verdict in rows]


def cost_lines(cost):
    g, l = cost["arms"]["global"], cost["arms"]["local"]
    t = cost["timing"]
    gflop = 1e9
    mib = 2**20
    return [
        f"Encoder self-attention of the two arms (d {cost['embed_dim']}, {cost['heads']} heads, "
        f"{cost['layers']} layers; the attention products only), at the training utterances' "
        "mean length "
        f"({cost['mean_fbank_frames']} filterbank frames, {cost['mean_encoder_frames']} encoder "
        f"positions) and summed over the {cost['utterances']:,} training utterances; measured: "
        f"one forward + backward of each encoder (same weights) on a batch of {t['batch']} "
        f"utterances at the mean length, median of {t['rounds']} rounds, "
        f"{t['threads']} CPU thread{'s' if t['threads'] > 1 else ''}"
        + (f", the process's {t['clock']}" if "clock" in t else "")
        + ":",
        "",
        "| | global | local | local / global |",
        "|---|---:|---:|---:|",
        f"| operations at the mean length (MFLOP, forward) | {g['flops_at_mean'] / 1e6:.1f} | "
        f"{l['flops_at_mean'] / 1e6:.1f} | {l['flops_at_mean'] / g['flops_at_mean']:.2f} |",
        f"| operations over the corpus (GFLOP, forward) | {g['flops_corpus'] / gflop:.1f} | "
        f"{l['flops_corpus'] / gflop:.1f} | {l['flops_corpus'] / g['flops_corpus']:.2f} |",
        f"| attention weights at the mean length (KiB, float32) | "
        f"{g['weight_bytes_at_mean'] / 1024:.0f} | {l['weight_bytes_at_mean'] / 1024:.0f} | "
        f"{l['weight_bytes_at_mean'] / g['weight_bytes_at_mean']:.2f} |",
        f"| encoder forward + backward (s) | {t['global']['seconds']:.3f} | "
        f"{t['local']['seconds']:.3f} | {t['local']['seconds'] / t['global']['seconds']:.2f} |",
        f"| encoder peak memory (MiB) | {t['global']['peak_bytes'] / mib:.0f} | "
        f"{t['local']['peak_bytes'] / mib:.0f} | "
        f"{t['local']['peak_bytes'] / max(t['global']['peak_bytes'], 1):.2f} |",
        "",
    ]


def report(facts, sizes, settings, asr, arms, cost, image):
    train, dev, test = facts["train"], facts["dev"], facts["tst-COMMON"]
    held_out = sorted(set(dev["speakers"]) | set(test["speakers"]))
    heard = sorted(set(held_out) & set(train["speakers"]))
    lines = [
        "## The speech study",
        "",
        f"English Bible verses of at most {sizes.max_words} words spoken by espeak-ng, Spanish "
        f"translations: {train['utterances']:,} training utterances "
        f"({speech_length(train['hours'])}, {len(train['speakers'])} voices), dev "
        f"{dev['utterances']} ({speech_length(dev['hours'])}) and test {test['utterances']} "
        f"({speech_length(test['hours'])}) from the text study's held-out "
        f"books, spoken by {', '.join(held_out)}"
        + (f" (also heard in training: {', '.join(heard)})" if heard else
           ", a voice training never hears")  # fmt: skip
        + f". Model `{ARCH}` at width {sizes.model_dim} (FFN {4 * sizes.model_dim}), "
        f"sentencepiece {sizes.vocab} per task; every run trained until "
        f"validation loss had not improved for {settings['patience']} epochs or its cap (ASR "
        f"{sizes.asr_max_update:,}, ST {sizes.st_max_update:,} updates); the checkpoint of the "
        "best validation loss is scored on the test books.",
        "",
    ]
    if asr is None:
        return "\n".join(lines + ["No run of the speech study is recorded yet.", ""])
    lines += [
        "| model | encoder windows | test score | test audio shuffled across verses | "
        "updates to convergence | runs converged |",
        "|---|---|---:|---:|---:|---:|",
        f"| ASR (global) | {GLOBAL_WINDOWS} | WER {asr['score']:.2f} | | "
        f"{asr['updates_to_convergence']:,} | {int(asr['converged'])}/1 |",
    ]
    for arm, s in arms.items():
        seeds = f"{s['runs']} seed" + ("s" if s["runs"] > 1 else "")
        shuffled = "" if math.isnan(s["shuffled"]) else f"BLEU {s['shuffled']:.2f}"
        lines.append(
            f"| {ARMS[arm]} | {s['windows']} | BLEU {s['mean']:.2f} ± {s['std']:.2f} "
            f"({s['min']:.2f}-{s['max']:.2f}, {seeds}) | {shuffled} | "
            f"{s['updates_to_convergence']:,} | {s['converged']}/{s['runs']} |"
        )
    lines += [
        "",
        "The ASR encoder's contributions over the dev set (Algorithm 1 with the paper's width "
        "convention, 2i; w: the chosen window, 0 = global) and the CCD of every encoder (ST: "
        "mean over seeds):",
        "",
        "| layer | mu ± sigma | w | CL | CCD ASR |" + "".join(f" CCD {ARMS[a]} |" for a in arms),
        "|---:|---:|---:|---:|---:|" + "---:|" * len(arms),
    ]
    for i, layer in enumerate(asr["contributions"]):
        lines.append(
            f"| {i + 1} | {layer['window_mean']:.2f} ± {layer['window_std']:.2f} | "
            f"{window_list(asr['chosen_windows'])[i]} | {layer['contribution_loss_mean']:.2f} | "
            f"{asr['ccd'][i]:.3f} |" + "".join(f" {s['ccd'][i]:.3f} |" for s in arms.values())
        )
    lines += [""]
    if cost:
        lines += cost_lines(cost)
    rows = verdicts(asr, arms, cost)
    if rows:
        lines += ["The claim and the targets:", "", *claims_table(rows), ""]
    else:
        lines += ["The claim is judged once both ST arms have a run recorded.", ""]
    lines += [
        f"![Validation loss of the ASR and ST runs against updates and training time]"
        f"(images/{image})",
        "",
        f"Command: `{settings['command'].strip()}` ({settings['machine']}; the recorded runs "
        f"trained for {settings['training_hours']:.1f} hours, each run's time summed).",
        "",
    ]
    return "\n".join(lines)


def update_document(path, start, end, section, title):
    existing = title
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            existing = f.read()
    atomic_write_text(path, replace_section(existing, section, start, end))


def training_hours(records):
    return sum(max((v.get("wall") or 0.0 for v in r["validations"]), default=0.0)
               for r in records) / 3600  # fmt: skip


def write_report(data, sizes, settings, asr_record, st_records, cost, targets):
    """The report into WORK (and the docs, with --write-docs): Markdown, curves, JSON."""
    arms = {}
    for arm in ARMS:
        records = [r for r in st_records if r["arm"] == arm]
        if records:
            arms[arm] = summarise_arm(records)
    recorded = ([asr_record] if asr_record else []) + st_records
    settings = dict(settings, training_hours=training_hours(recorded))
    image = "speech_study_curves.png"
    section = report(corpus_facts(data), sizes, settings, asr_record, arms, cost, image)
    claims = ""
    if asr_record and arms:
        claims = "\n".join([
            "The speech study's claims (Alastruey et al. 2022; [speech_study.md]"
            "(speech_study.md)):", "", *claims_table(verdicts(asr_record, arms, cost)), "",
        ])  # fmt: skip
    for folder, images, with_claims in targets:
        if recorded:
            curves = {"ASR": [[Validation(**v) for v in asr_record["validations"]]]}
            for arm in arms:
                curves[ARMS[arm]] = [
                    [Validation(**v) for v in r["validations"]]
                    for r in st_records if r["arm"] == arm
                ]  # fmt: skip
            study.plot_curves(curves, "Speech study: validation loss",
                              os.path.join(images, image))  # fmt: skip
        update_document(os.path.join(folder, "speech_study.md"), REPORT_START, REPORT_END,
                        section, "# Speech study\n")  # fmt: skip
        if with_claims and claims:
            update_document(os.path.join(folder, "small_scale_study.md"), CLAIMS_START,
                            CLAIMS_END, claims, "# Small-scale study\n")  # fmt: skip
    atomic_write_text(
        os.path.join(data.work, "speech_study.json"),
        json.dumps({"settings": settings, "sizes": asdict(sizes), "asr": asr_record,
                    "st": st_records, "arms": arms, "cost": cost}, indent=1),  # fmt: skip
    )
    return section
