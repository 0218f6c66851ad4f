"""The prepare stage of the text recipes: raw splits -> sentencepiece -> fairseq-preprocess.

Each step is skipped when its output exists, so a stopped or repeated prepare redoes only what
is missing; ``prepare.json`` beside the data records the raw source and settings it is made
from, and a prepare from other ones is refused (``RecipeWorkspace.check_prepared_inputs``). The
raw splits stay under ``WORK/data/NAME/raw``: the evaluate stage scores against them.
``run`` is the recipe's workspace (``workspace.RecipeWorkspace``).
"""

import os

from ..data.text import encode_file, has_binarised, preprocess_argv, train_sentencepiece
from ..file_safety import replace_own_dir
from . import corpora
from .config import (
    DEFAULT_SPM_SENTENCES,
    RecipeError,
    joined_dictionary,
    load_dataset,
    prepare_settings,
)
from .workspace import WORK_DIR_OWNER, raw_fingerprint


def dataset_of(run):
    return load_dataset(run.recipe["data"])


def raw_path(run, split, lang):
    return os.path.join(run.data, "raw", f"{split}.{lang}")


def prepare_text(run):
    dataset = dataset_of(run)
    langs = corpora.languages(dataset)
    settings = prepare_settings(run.recipe)
    raw, spm_dir = os.path.join(run.data, "raw"), os.path.join(run.data, "spm")
    if run.dry_run:
        print(f"| prepare: {run.recipe['data']} -> {raw} -> sentencepiece {settings} -> {run.bin}")
        return
    raw_files = raw_source(run, dataset)
    if not run.check_prepared_inputs(raw_files):
        corpora.check_sources(dataset, run.raw_dir)  # a source that cannot be used records nothing
        run.record_prepared_inputs(raw_files)
    if not os.path.exists(os.path.join(raw, ".complete")):
        corpora.assemble(dataset, run.raw_dir, os.path.join(run.data, "downloads"), raw)
        open(os.path.join(raw, ".complete"), "w").close()
    models = sentencepiece_models(langs, settings, raw, spm_dir)
    encode_splits(langs, models, raw, spm_dir, PairFilter.from_settings(settings))
    binarise(run, langs, spm_dir, joined_dictionary(settings))


def raw_source(run, dataset):
    """{name: [size, time]} of the files in --raw-dir the preparation reads ({} without one)."""
    if not run.raw_dir:
        return {}
    return raw_fingerprint(run.raw_dir, corpora.source_names(dataset, run.raw_dir))


def sentencepiece_models(langs, settings, raw, spm_dir):
    """{lang: model path}: one joint model, or one per language.

    A model whose vocabulary is in place is whole (``train_sentencepiece`` renames the vocabulary
    last); a killed training leaves only temporary files, and is redone."""
    os.makedirs(spm_dir, exist_ok=True)
    joint = settings.get("joint", False) and len(langs) > 1
    groups = {"joint": langs} if joint else {lang: [lang] for lang in langs}
    models = {}
    for name, members in groups.items():
        prefix = os.path.join(spm_dir, f"spm.{name}")
        if not os.path.exists(prefix + ".vocab"):
            train_sentencepiece(
                [os.path.join(raw, f"train.{lang}") for lang in members],
                prefix,
                int(settings.get("vocab_size", 32000)),
                settings.get("model_type", "bpe"),
                settings.get("spm_sentences", DEFAULT_SPM_SENTENCES),
                exact_size=False,
            )
        models.update({lang: prefix + ".model" for lang in members})
    return models


def encode_splits(langs, models, raw, spm_dir, pair_filter=None):
    for split in corpora.SPLITS:
        outputs = [os.path.join(spm_dir, f"{split}.{lang}") for lang in langs]
        if all(os.path.exists(p) for p in outputs):
            continue
        for lang, out in zip(langs, outputs):
            encode_file(models[lang], os.path.join(raw, f"{split}.{lang}"), out + ".tmp")
        if split == "train" and pair_filter:
            pair_filter.apply([o + ".tmp" for o in outputs])
        for out in outputs:
            os.replace(out + ".tmp", out)


class PairFilter:
    """The training pairs kept, counted in pieces, as Moses' ``clean-corpus-n.perl`` keeps them
    (the cleaning of fairseq's prepare-wmt14en2fr.sh: ``-ratio 1.5 ... 1 250``): every side has
    ``min_length`` to ``max_length`` pieces, and no side is more than ``length_ratio`` times as
    long as another. Yang et al.'s Zh-En "maximum length limited to 50" is ``max_length`` alone.
    """

    SETTINGS = ("min_length", "max_length", "length_ratio")

    def __init__(self, min_length=None, max_length=None, length_ratio=None):
        self.min_length, self.max_length, self.length_ratio = min_length, max_length, length_ratio

    @classmethod
    def from_settings(cls, settings):
        """The filter of a recipe's prepare settings, or None when it sets none of them."""
        given = {k: settings[k] for k in cls.SETTINGS if settings.get(k)}
        return cls(**given) if given else None

    def keeps(self, lengths):
        if self.min_length and min(lengths) < self.min_length:
            return False
        if self.max_length and max(lengths) > self.max_length:
            return False
        if self.length_ratio and len(lengths) > 1:
            # an empty side has no ratio; clean-corpus-n.perl drops it (min length 1) first
            if min(lengths) == 0 or max(lengths) / min(lengths) > self.length_ratio:
                return False
        return True

    def describe(self):
        parts = []
        if self.min_length or self.max_length:
            parts.append(f"{self.min_length or 0} to {self.max_length or 'any number of'} pieces")
        if self.length_ratio:
            parts.append(f"sides at most {self.length_ratio} times as long as each other")
        return ", ".join(parts)

    def apply(self, paths):
        """Rewrite the parallel files ``paths`` with the kept pairs only."""
        columns = []
        for path in paths:
            with open(path, encoding="utf-8") as f:
                columns.append(f.readlines())
        keep = [
            i
            for i, lines in enumerate(zip(*columns))
            if self.keeps([len(x.split()) for x in lines])
        ]
        if not keep:
            raise RecipeError(f"the training pair filter ({self.describe()}) leaves no pair")
        for path, lines in zip(paths, columns):
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(lines[i] for i in keep)
        print(f"| kept {len(keep)} of {len(columns[0])} training pairs ({self.describe()})")


def binarise(run, langs, spm_dir, joint):
    """fairseq-preprocess into ``bin.partial``, renamed to ``bin`` once complete, so a stopped
    binarisation is redone from scratch and never mistaken for a finished one."""
    source, target = langs[0], (langs[1] if len(langs) > 1 else None)
    if has_binarised(run.bin, "test", source, target):
        return
    if os.path.exists(run.bin):
        raise RecipeError(
            f"{run.bin} exists but holds no complete binarised data for {source}-{target}; "
            "it is not replaced: move it away or choose another --work-dir"
        )
    prefixes = {s: os.path.join(spm_dir, s) for s in corpora.SPLITS}
    if target is None:  # monolingual: fairseq reads {split}.bin, so the files drop the suffix
        prefixes = {s: os.path.join(spm_dir, f"{s}.{source}") for s in corpora.SPLITS}
    partial = run.bin + ".partial"
    try:
        # fairseq-preprocess refuses a folder with dictionaries
        replace_own_dir(partial, WORK_DIR_OWNER)
    except FileExistsError:
        raise RecipeError(
            f"{partial} exists and was not written by the recipes; move it away or choose "
            "another --work-dir"
        ) from None
    argv = preprocess_argv(source, target, prefixes, partial, joined=joint)
    run.run_tool("fairseq-preprocess", argv, os.path.join(run.data, "preprocess.log"))
    os.replace(partial, run.bin)
