"""Scores as the papers report them: sacreBLEU, tokenised BLEU, WER, and what a training log says
about speed and size.
"""

import re

import sacrebleu

from .config import RecipeError

_HYPOTHESIS = re.compile(r"^D-(\d+)\t[^\t]*\t(.*)$")
_TARGET = re.compile(r"^T-(\d+)\t(.*)$")


def read_generate_output(path, expected=None):
    """(hypotheses, references) of a fairseq-generate output file, in sentence order."""
    hyps, refs = {}, {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if m := _HYPOTHESIS.match(line):
                hyps[int(m.group(1))] = m.group(2)
            elif m := _TARGET.match(line):
                refs[int(m.group(1))] = m.group(2)
    if expected is not None and len(hyps) != expected:
        raise ValueError(f"{path}: {len(hyps)} hypotheses for {expected} sentences")
    order = sorted(hyps)
    return [hyps[i] for i in order], [refs.get(i, "") for i in order]


def sacrebleu_score(hyps, refs):
    return round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)


# Ott et al. (2018) and Vaswani et al. (2017) split hyphenated compounds before scoring En-De
# (tensor2tensor's get_ende_bleu.sh, fairseq's scripts/compound_split_bleu.sh): "a-b" is scored
# as three tokens "a ##AT##-##AT## b". Applied after Moses' tokeniser, as those scripts do.
_COMPOUND = re.compile(r"(\S)-(\S)")


def moses_tokenizer(lang):
    """Moses' tokeniser (sacremoses, in the pinned stack: see requirements.txt)."""
    try:
        from sacremoses import MosesTokenizer
    except ImportError:
        raise RecipeError(
            "tokenised BLEU needs Moses' tokeniser (sacremoses): run scripts/setup_env.sh, or "
            "pip install -c constraints.txt sacremoses"
        ) from None
    return MosesTokenizer(lang=lang)


def split_compounds(line):
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def tokenized_bleu(hyps, refs, lang, compound_split=False, aggressive_dashes=False):
    """Case-sensitive BLEU of Moses-tokenised text (multi-bleu.perl's and fairseq-score's
    convention). ``aggressive_dashes`` is Moses' ``-a`` (hyphens as ``@-@``), the tokenisation
    of fairseq's WMT14 En-Fr data; ``compound_split`` the En-De compound splitting above."""
    tok = moses_tokenizer(lang)

    def split(lines):
        out = [
            tok.tokenize(line, escape=False, return_str=True,
                         aggressive_dash_splits=aggressive_dashes)  # fmt: skip
            for line in lines
        ]
        return [split_compounds(line) for line in out] if compound_split else out

    return round(sacrebleu.corpus_bleu(split(hyps), [split(refs)], tokenize="none").score, 2)


def tokenized_bleu_name(compound_split=False, aggressive_dashes=False):
    """How ``tokenized_bleu`` scored, for the report."""
    name = "case-sensitive BLEU of Moses-tokenised text"
    if aggressive_dashes:
        name += " (hyphens split, Moses -a)"
    if compound_split:
        name += " with compound splitting (##AT##-##AT##)"
    return name


def word_error_rate(hyps, refs):
    """WER in percent: word edit distance over reference words, lower-cased, without
    punctuation (the usual MuST-C ASR scoring)."""
    errors = words = 0
    for hyp, ref in zip(hyps, refs):
        h, r = _wer_words(hyp), _wer_words(ref)
        errors += _edit_distance(h, r)
        words += len(r)
    return round(100.0 * errors / max(words, 1), 2)


def _wer_words(text):
    return re.sub(r"[^\w\s']", " ", text.lower()).split()


def _edit_distance(a, b):
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


# Where a training starts from 0 updates: nothing to resume, or a model to fine-tune from.
_FRESH_START = re.compile(
    r"No existing checkpoint found|Loaded checkpoint .* \(epoch \d+ @ 0 updates\)"
)
_EPOCH_SUMMARY = re.compile(r"\| train \| epoch (\d+) \|.*")


def training_summary(log_text):
    """{params, updates_per_s, words_per_s} from a fairseq-train log (None where absent).

    The log may hold several sessions (a training resumed after a stop, one log kept across
    them): the speeds are those of the training the log ends with, from its last fresh start,
    over all its epochs (each epoch's summary line counted once, its last: a resumed epoch's
    line covers the whole epoch, fairseq keeping the epoch's meters in the checkpoint)."""
    params = re.search(r"num\. shared model params: ([\d,]+)", log_text)
    starts = list(_FRESH_START.finditer(log_text))
    current = log_text[starts[-1].end():] if starts else log_text
    epochs = {}
    for line in _EPOCH_SUMMARY.finditer(current):
        epochs[int(line.group(1))] = line.group(0)
    updates = seconds = words = 0.0
    done = 0  # updates at the end of the previous epoch
    for epoch in sorted(epochs):
        fields = dict(re.findall(r"\| (\w+) ([\d.]+)", epochs[epoch]))
        ups, total = float(fields.get("ups", 0)), int(float(fields.get("num_updates", done)))
        if ups > 0 and total > done:
            updates += total - done
            seconds += (total - done) / ups
            words += float(fields.get("wps", 0)) * (total - done) / ups
        done = max(done, total)
    return {
        "params": int(params.group(1).replace(",", "")) if params else None,
        "updates_per_s": round(updates / seconds, 2) if seconds else None,
        "words_per_s": round(words / seconds, 1) if seconds else None,
    }
