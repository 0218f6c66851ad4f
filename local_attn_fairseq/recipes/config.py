"""Recipes as data: loading ``configs/recipes/*.yaml``, choosing a row, and the fairseq options
a row trains with, as command-line tokens (nothing here imports fairseq).

A recipe file holds ``paper``, ``kind`` (translation, language_model or speech), ``data`` (a key
of ``datasets.yaml``, or a speech data description), ``prepare``, ``train`` (``arch``,
``tokens_per_batch``, ``max_tokens_per_gpu``, ``args``: fairseq-train options), ``average``,
``evaluate``, ``chosen`` (each setting the paper leaves unstated: what the recipe chose, and
from where), ``departures`` (where the recipe differs from what the paper states) and ``rows``.
A row may set ``arch``, ``args``, ``average``, ``evaluate``, ``chosen``, ``departures`` (merged
over the recipe's), ``paper`` (the numbers the paper reports), ``table``, ``base_row`` + ``init``
(start from another row's averaged model), ``prune``, ``heads_kept_from_row`` and
``unsupported`` (the row is listed but refused, with that reason). ``extends: OTHER`` merges the
file over another recipe; ``drop_rows`` removes inherited rows; keys starting with ``_`` hold
YAML anchors only. In every merge a ``null`` value deletes the key it meets.
"""

import copy
import difflib
import json
import math
import os
import re

import yaml

from ..cli_types import SELECTING_OPTIONS

# The repository: the recipes are read from its configs/recipes, beside this package.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(ROOT, "configs", "recipes")
SPECIAL_FILES = ("datasets", "profiles")
KINDS = ("translation", "language_model", "speech")


class RecipeError(ValueError):
    """A recipe, a row or an option that cannot be used, with a message saying why."""


def recipe_names():
    return sorted(
        f[: -len(".yaml")]
        for f in os.listdir(CONFIG_DIR)
        if f.endswith(".yaml") and f[: -len(".yaml")] not in SPECIAL_FILES
    )


def _read_yaml(name):
    path = os.path.join(CONFIG_DIR, f"{name}.yaml")
    if not os.path.exists(path):
        raise RecipeError(_unknown("recipe", name, recipe_names()))
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping, not {type(data).__name__}")
    return {k: v for k, v in data.items() if not str(k).startswith("_")}


def _unknown(what, name, known):
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown {what} {name!r}{hint} (known: {', '.join(known)})"


def deep_merge(base, over):
    """``over`` merged into a copy of ``base``: mappings recursively, a None value deletes."""
    merged = copy.deepcopy(base)
    for key, value in over.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_recipe(name, _seen=()):
    if name in _seen:
        raise RecipeError(f"recipe {name!r} extends itself (through {' -> '.join(_seen)})")
    data = _read_yaml(name)
    parent = data.pop("extends", None)
    dropped = data.pop("drop_rows", [])
    if parent:
        data = deep_merge(load_recipe(parent, _seen + (name,)), data)
    for row in dropped:
        data.get("rows", {}).pop(row, None)
    data["name"] = name
    _check_recipe(data)
    return data


def _check_recipe(recipe):
    name = recipe["name"]
    for key in ("kind", "data", "train", "rows"):
        if key not in recipe:
            raise RecipeError(f"recipe {name}: missing key {key!r}")
    if recipe["kind"] not in KINDS:
        raise RecipeError(f"recipe {name}: kind {recipe['kind']!r} is not one of {KINDS}")
    for row_name, row in recipe["rows"].items():
        for ref in ("base_row", "heads_kept_from_row"):
            if row.get(ref) and row[ref] not in recipe["rows"]:
                raise RecipeError(f"recipe {name}, row {row_name!r}: {ref} {row[ref]!r} is no row")


def load_profile(recipe, profile):
    with open(os.path.join(CONFIG_DIR, "profiles.yaml"), encoding="utf-8") as f:
        profiles = yaml.safe_load(f)
    if profile not in profiles:
        raise RecipeError(_unknown("profile", profile, sorted(profiles)))
    return profiles[profile].get(recipe["kind"], {})


def load_dataset(name):
    with open(os.path.join(CONFIG_DIR, "datasets.yaml"), encoding="utf-8") as f:
        datasets = yaml.safe_load(f)
    if name not in datasets:
        raise RecipeError(_unknown("data set", name, sorted(datasets)))
    return datasets[name]


def parse_override(text):
    """``KEY=VALUE`` -> ({nested mapping}); a dotted KEY names a recipe setting
    (``prepare.vocab_size=8000``), a plain one a fairseq-train option (``max-update=2``)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise RecipeError(f"--override {text!r} is not KEY=VALUE (e.g. max-update=2)")
    value = _override_value(text, value)
    path = key.split(".") if "." in key else ["train", "args", key]
    for part in reversed(path):
        value = {part: value}
    return value


def _override_value(text, value):
    """The YAML value of an override; one YAML cannot read is refused in one line, naming the
    override and where the reading stopped."""
    if value == "":
        return ""
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or type(error).__name__
        mark = getattr(error, "problem_mark", None)
        if mark is not None:
            line = f"line {mark.line + 1}, " if "\n" in value else ""
            problem += f" at {line}character {mark.column + 1}"
        raise RecipeError(
            f"--override {text!r}: the value {value!r} is not valid YAML ({problem}); give a "
            "number, a word, a list [a, b] or a mapping {key: value}"
        ) from None


def row_names(recipe):
    return list(recipe["rows"])


def get_row(recipe, name):
    """The row's settings merged over the recipe's: {arch, args, average, evaluate, ...}."""
    rows = recipe["rows"]
    if name not in rows:
        raise RecipeError(_unknown(f"row of {recipe['name']}", name, list(rows)))
    row = rows[name]
    if row.get("unsupported"):
        raise RecipeError(f"row {name!r} of {recipe['name']} cannot be run: {row['unsupported']}")
    train = recipe["train"]
    average = deep_merge(recipe.get("average", {"last": 1}), row.get("average", {}))
    # before any stage runs: a count of 0 would fail only after training, and a negative one
    # would slice the wrong checkpoints
    if not is_positive_int(average.get("last", 1)):
        raise RecipeError(
            f"average.last {average.get('last')!r}: the number of checkpoints to average, a "
            "whole number of at least 1 (e.g. --override average.last=5)"
        )
    args = deep_merge(train.get("args", {}), row.get("args", {}))
    check_selecting_options(args)
    return {
        "name": name,
        "arch": row.get("arch", train["arch"]),
        "args": args,
        "average": average,
        "evaluate": deep_merge(recipe.get("evaluate", {}), row.get("evaluate", {})),
        "paper": row.get("paper", {}),
        "table": row.get("table", ""),
        "base_row": row.get("base_row"),
        "init": row.get("init", "model"),
        "prune": bool(row.get("prune")),
        "heads_kept_from_row": row.get("heads_kept_from_row"),
        "data": row.get("data"),
        "chosen": deep_merge(recipe.get("chosen", {}), row.get("chosen", {})),
        "departures": deep_merge(recipe.get("departures", {}), row.get("departures", {})),
    }


def check_selecting_options(args):
    """A row's fairseq-train options that select layers or attention types, read as the plugin
    reads them: one that selects nothing is named before any stage runs, not by fairseq-train
    once the data is prepared."""
    for option, read in SELECTING_OPTIONS.items():
        value = args.get(option)
        if value is None or value is False:  # left out of the command line
            continue
        try:
            read(str(value))
        except ValueError as error:
            raise RecipeError(str(error)) from None


def settings_not_from_paper(chosen, departures):
    """Lines naming each setting the paper leaves unstated with the recipe's choice, then each
    place where the recipe departs from what the paper states."""
    lines = []
    for title, entries in (("chosen, not from the paper", chosen),
                           ("departs from the paper", departures)):  # fmt: skip
        if entries:
            lines.append(f"| {title}:")
            lines += [f"|   {name}: {' '.join(str(t).split())}" for name, t in entries.items()]
    return lines


def recipes_by_paper():
    """{paper: [recipe names]}, in the order of recipe_names()."""
    papers = {}
    for name in recipe_names():
        papers.setdefault(load_recipe(name)["paper"], []).append(name)
    return papers


def settings_table(names, key):
    """The markdown table of one paper's ``chosen`` (or ``departures``) settings over its recipes
    ``names``, as docs/reproduction.md carries it: one line per distinct entry, with the recipes
    it applies to when the paper has several."""
    entries = {}
    for name in names:
        for setting, text in (load_recipe(name).get(key) or {}).items():
            cell = " ".join(str(text).split()).replace("|", "\\|")
            entries.setdefault((setting, cell), []).append(name)
    if not entries:
        return ""
    several = len(names) > 1
    second = "the recipe's choice" if key == "chosen" else "the paper, and the recipe"
    lines = [f"| setting | {second} |" + (" recipes |" if several else "")]
    lines.append("|---|---|" + ("---|" if several else ""))
    for (setting, cell), users in entries.items():
        where = "all" if len(users) == len(names) else ", ".join(f"`{u}`" for u in users)
        lines.append(f"| {setting} | {cell} |" + (f" {where} |" if several else ""))
    return "\n".join(lines)


def with_settings(recipe, profile=None, overrides=()):
    """The recipe with a profile and --override settings merged over it (rows' args included:
    profile and overrides win over every row)."""
    layers = [load_profile(recipe, profile)] if profile else []
    layers += [parse_override(o) for o in overrides]
    for layer in layers:
        recipe = deep_merge(recipe, layer)
        args = layer.get("train", {}).get("args")
        if args:
            recipe["rows"] = {
                n: deep_merge(r, {"args": args}) if not r.get("unsupported") else r
                for n, r in recipe["rows"].items()
            }
    return recipe


def batch_plan(tokens_per_batch, max_tokens_per_gpu, gpus):
    """(--max-tokens, --update-freq) that give the paper's tokens per update on ``gpus`` GPUs.

    Gradients are accumulated over as few batches as fit (``max_tokens_per_gpu`` is the most a
    GPU holds), and each batch is then cut to ``tokens_per_batch / (gpus x update-freq)``: on
    more GPUs than the paper's batch needs, the batches shrink instead of the update growing, so
    max-tokens x update-freq x GPUs is the paper's batch on any GPU count.
    """
    if gpus < 1 or max_tokens_per_gpu < 1 or tokens_per_batch < 1:
        raise RecipeError(
            f"--gpus ({gpus}), tokens_per_batch ({tokens_per_batch}) and max_tokens_per_gpu "
            f"({max_tokens_per_gpu}) must be at least 1"
        )
    freq = math.ceil(tokens_per_batch / (max_tokens_per_gpu * gpus))
    max_tokens = min(max_tokens_per_gpu, max(1, round(tokens_per_batch / (gpus * freq))))
    return max_tokens, freq


def options_to_argv(options):
    """{option: value} -> fairseq command-line tokens; True is a bare flag, False omits it."""
    argv = []
    for key, value in options.items():
        if value is False or value is None:
            continue
        argv.append(f"--{key}")
        if value is not True:
            argv.append(_format_value(value))
    return argv


def _format_value(value):
    if isinstance(value, float):
        return repr(value)
    return str(value)


# The prepare stage's settings, per kind (a misspelt key would otherwise be ignored silently).
TEXT_PREPARE_KEYS = (
    "model_type", "vocab_size", "joint", "joined_dictionary", "spm_sentences",
    "min_length", "max_length", "length_ratio",
)  # fmt: skip
SPEECH_PREPARE_KEYS = ("model_type", "vocab_size", "specaugment")
# Lines sentencepiece samples from a big corpus to learn its model (its own sampling).
DEFAULT_SPM_SENTENCES = 10_000_000
SPEECH_TASKS = ("asr", "st")
# fairseq's MuST-C example (examples/speech_to_text/docs/mustc_example.md): unigram
# sentencepiece of 5,000 pieces for ASR and 8,000 for ST, and the LB SpecAugment policy that its
# prep_mustc_data.py writes into both configs.
SPEECH_DEFAULTS = {"model_type": "unigram", "vocab_size": {"asr": 5000, "st": 8000},
                   "specaugment": "lb"}  # fmt: skip


def prepare_settings(recipe):
    """The recipe's prepare settings, checked against the keys its kind knows."""
    prepare = dict(recipe.get("prepare") or {})
    known = SPEECH_PREPARE_KEYS if recipe["kind"] == "speech" else TEXT_PREPARE_KEYS
    unknown = sorted(set(prepare) - set(known))
    if unknown:
        raise RecipeError(
            f"recipe {recipe['name']}: unknown prepare setting {', '.join(unknown)} "
            f"(known: {', '.join(known)})"
        )
    if recipe["kind"] == "speech":
        prepare = {**SPEECH_DEFAULTS, **prepare}
        prepare["vocab_size"] = speech_vocab_sizes(prepare["vocab_size"])
    else:
        # sentencepiece samples no fewer than 101 lines (its input_sentence_size)
        for key, meaning, least, example in (
            ("vocab_size", "the sentencepiece vocabulary size", 1, 8000),
            ("spm_sentences", "the lines sentencepiece samples to learn from", 101, 1000000),
        ):
            value = prepare.get(key, least)
            if not is_positive_int(value) or value < least:
                raise RecipeError(
                    f"prepare.{key} {value!r}: {meaning}, a whole number of at least {least} "
                    f"(e.g. --override prepare.{key}={example})"
                )
    return prepare


def is_positive_int(value):
    """Whether a setting read from YAML is a count of at least 1 (``true`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def speech_vocab_sizes(value):
    """{asr: size, st: size} from one size for both tasks or a mapping per task."""
    sizes = value if isinstance(value, dict) else {task: value for task in SPEECH_TASKS}
    if set(sizes) != set(SPEECH_TASKS) or not all(is_positive_int(n) for n in sizes.values()):
        raise RecipeError(
            f"prepare.vocab_size {value!r}: a positive size, or one per task {{asr: N, st: N}}"
        )
    return sizes


def joined_dictionary(prepare):
    """Whether fairseq-preprocess builds one dictionary for both sides. A joint sentencepiece
    model implies one unless ``joined_dictionary: false`` asks for a dictionary per side (the
    pieces each side uses, as a joint BPE with per-language vocabularies gives)."""
    return bool(prepare.get("joint")) and prepare.get("joined_dictionary", True) is not False


def prepared_data_settings(recipe):
    """What the prepared data is made with besides its raw source: the data set and every
    prepare setting, defaults filled in, so that recipes preparing alike give equal values
    (``data_name`` names them; the prepare stage records them beside the data)."""
    prepare = prepare_settings(recipe)
    if recipe["kind"] == "speech":
        return {"data": recipe["data"]["name"], **prepare}
    settings = {
        "data": recipe["data"],
        "model_type": prepare.get("model_type", "bpe"),
        "vocab_size": prepare.get("vocab_size", 32000),
        "joint": bool(prepare.get("joint")),
        "joined_dictionary": joined_dictionary(prepare),
        "spm_sentences": prepare.get("spm_sentences", DEFAULT_SPM_SENTENCES),
    }
    for key in ("min_length", "max_length", "length_ratio"):
        settings[key] = prepare.get(key) or None
    return settings


def data_name(recipe):
    """The prepared data's directory name: recipes that prepare a corpus alike share it, and
    data prepared otherwise (another vocabulary, filter, sample or SpecAugment policy) is never
    reused. Every setting of ``prepared_data_settings`` is in it (defaults left out)."""
    settings = prepared_data_settings(recipe)
    if recipe["kind"] == "speech":
        sizes = settings["vocab_size"]
        vocab = " ".join(f"{t} {settings['model_type']}{sizes[t]}" for t in SPEECH_TASKS)
        return slug(f"{recipe['data']['name']} {vocab} specaugment {settings['specaugment']}")
    sharing = "separate"
    if settings["joint"]:
        sharing = "joint" if settings["joined_dictionary"] else "joint-spm"
    parts = [settings["data"], f"{settings['model_type']}{settings['vocab_size']}", sharing]
    for key, name in (("min_length", "min"), ("max_length", "max"), ("length_ratio", "ratio")):
        if settings[key]:
            parts.append(f"{name}{settings[key]}")
    if settings["spm_sentences"] != DEFAULT_SPM_SENTENCES:
        parts.append(f"spm-sentences{settings['spm_sentences']}")
    return "_".join(str(p) for p in parts)


def differences(recorded, now, prefix=""):
    """``"key: RECORDED then, NOW now"`` for each setting that differs, nested keys dotted."""
    lines = []
    for key in sorted(set(recorded) | set(now)):
        then_value, now_value = recorded.get(key), now.get(key)
        if isinstance(then_value, dict) and isinstance(now_value, dict):
            lines += differences(then_value, now_value, f"{prefix}{key}.")
        elif then_value != now_value:
            lines.append(f"{prefix}{key}: {_shown(then_value)} then, {_shown(now_value)} now")
    return lines


def _shown(value):
    return "unset" if value is None else json.dumps(value)


def slug(name):
    """A directory name for a row: lower case, runs of other characters as one dash."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "row"
