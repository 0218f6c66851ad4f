"""Resuming fairseq-train rebuilds the model stored in the checkpoint.

fairseq builds the model of a resumed run from the command line and then loads the weights, so
a locality option left out or changed on resume would silently train another model with the
same parameters (masks and windows have none). Each plugin model calls
``use_stored_options_on_resume`` first thing in ``build_model``. Under fairseq-train, when the
run resumes (``checkpoint_last.pt`` in --save-dir, or --restore-file), the model options this
plugin registers are compared with those stored in the checkpoint:

* none given (the arch's defaults): the stored options and spec are used, and logged;
* the same ones (a file they name may have been deleted since: the stored spec is its content):
  resumed as they are;
* others: refused, naming each option, stored and given, and how to start a new run.

Fine-tuning (--finetune-from-model, first launch) starts a new model from the weights: its
options may differ, which is logged; parameters of another shape are refused when the weights
are loaded (``compat``). fairseq-generate and the analysis tools are not affected.
"""

import argparse
import copy
import json
import logging
import os
from typing import Optional

from fairseq.models import ARCH_CONFIG_REGISTRY, BaseFairseqModel

from ..checkpoint_files import current_fairseq_train_run, read_checkpoint, resume_source
from ..locality.spec import LocalitySpecError, load_spec_config
from .locality_options import read_stored_empty_options, with_command_line_settings

logger = logging.getLogger(__name__)

# Options a resumed run may change: they do not change what the model computes (LayerDrop only
# skips layers in training, as fairseq's transformer lets a resumed run change it).
CHANGEABLE_ON_RESUME = (
    "freeze_decoder", "load_pretrained_encoder_from", "local_attention_form", "decoder_layerdrop",
)  # fmt: skip
_SPEC_OPTION = "locality_config"
_SPEC_META_KEYS = ("name", "description")
_SPEC_FILE_ENDINGS = (".yaml", ".yml", ".json")


class ResumeOptionsError(ValueError):
    """Locality options of a resumed run that would build another model than the stored one."""


def model_options(model_cls) -> dict:
    """{dest: default} of the options `model_cls` adds to the fairseq model it extends, but those
    a resumed run may change."""
    base = next(
        c
        for c in model_cls.__mro__[1:]
        if issubclass(c, BaseFairseqModel) and not c.__module__.startswith(__package__)
    )
    own, inherited = _option_defaults(model_cls.add_args), _option_defaults(base.add_args)
    return {
        dest: default
        for dest, default in own.items()
        if dest not in inherited and dest not in CHANGEABLE_ON_RESUME
    }


def _option_defaults(add_args) -> dict:
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    return {action.dest: action.default for action in parser._actions}


def use_stored_options_on_resume(model_cls, args) -> None:
    """Under fairseq-train resuming a checkpoint, make `args` build the stored model or refuse
    (see the module doc); anywhere else, do nothing."""
    run = current_fairseq_train_run()
    if run is None or not isinstance(args, argparse.Namespace):
        return
    source = resume_source(run, getattr(run, "checkpoint_suffix", "") or "")
    if source is None:
        return
    stored_args = _stored_model_args(source.path)
    if stored_args is None:
        return
    options = model_options(model_cls)
    stored = {dest: _value(stored_args, dest, default) for dest, default in options.items()}
    given = {dest: getattr(args, dest, default) for dest, default in options.items()}
    differing = [dest for dest in options if not _same(dest, stored, given, stored_args)]
    if source.finetune:
        if differing:
            logger.warning(
                f"fine-tuning from {source.path} into a model with other locality options "
                f"(the command line's):\n{_differences(differing, stored, given)}"
            )
        return
    if getattr(args, "load_pretrained_encoder_from", None):
        logger.info("--load-pretrained-encoder-from is ignored: the checkpoint holds the weights")
        args.load_pretrained_encoder_from = None
    if differing:
        _resume_with_stored_options(args, source.path, options, stored, given, differing)


def _stored_model_args(path):
    state = read_checkpoint(path)
    stored = (state.get("cfg") or {}).get("model") or state.get("args")
    if stored is not None:  # an earlier version's "" read as it read it, as when loaded
        read_stored_empty_options(stored, path)
    return stored


def _resume_with_stored_options(args, path, options, stored, given, differing) -> None:
    """Set the stored options on `args` when the command line gives none (or only files that
    are gone); refuse other options."""
    if given == _arch_defaults(args, options):
        _adopt(args, stored)
        logger.info(
            f"no locality options given: resuming {path} with the options stored in it:\n"
            + _differences(differing, stored, given)
        )
        return
    missing = {dest for dest, value in given.items() if _names_missing_file(value)}
    if missing and set(differing) <= missing | {_SPEC_OPTION}:
        _adopt(args, stored)
        logger.warning(
            f"{', '.join(str(given[d]) for d in sorted(missing))}: no such file; resuming "
            f"{path} with the locality spec stored in it (what the file said when the run "
            "started)"
        )
        return
    raise ResumeOptionsError(
        f"fairseq-train is resuming {path}, whose model was built with other locality "
        f"options:\n{_differences(differing, stored, given)}\nA resumed run continues the "
        "stored model: repeat its options, or leave all locality options out to use the stored "
        "ones. To train the new options, start a new run in a new --save-dir (add "
        f"--finetune-from-model {path} to start from these weights); --reset-optimizer "
        "and the other --reset-* options still load the stored model."
    )


def _value(stored_args, dest, default):
    if isinstance(stored_args, dict):
        return stored_args.get(dest, default)
    return getattr(stored_args, dest, default)


def _same(dest, stored, given, stored_args) -> bool:
    """Whether option `dest` builds the same model. The stored spec option holds the canonical
    JSON of the whole spec, the other options' settings written in: a given spec is compared by
    its content, with the stored options written into it the same way."""
    if stored[dest] == given[dest]:
        return True
    if dest != _SPEC_OPTION or stored[dest] is None:
        return False
    if isinstance(stored_args, dict):
        stored_args = argparse.Namespace(**stored_args)
    try:
        given_spec = with_command_line_settings(load_spec_config(given[dest]), stored_args)
        stored_spec = load_spec_config(stored[dest])
    except LocalitySpecError:
        return False
    return _comparable(given_spec) == _comparable(stored_spec)


def _comparable(config: dict) -> dict:
    """A spec as JSON would store it (string keys, lists), without its name and description."""
    data = json.loads(json.dumps(config, sort_keys=True))
    return {k: v for k, v in data.items() if k not in _SPEC_META_KEYS}


def _arch_defaults(args, options: dict) -> Optional[dict]:
    """The option values the arch gives a command line that sets none of them; None when the
    arch has no defaults for this model's shape (the options must then have been given)."""
    bare = copy.copy(args)
    for dest, default in options.items():
        setattr(bare, dest, default)
    try:
        ARCH_CONFIG_REGISTRY[args.arch](bare)
    except (ValueError, LocalitySpecError):
        return None
    return {dest: getattr(bare, dest, default) for dest, default in options.items()}


def _adopt(args, stored: dict) -> None:
    """Set the stored options; one naming a file that is gone is dropped when a stored spec
    holds what the file said (the spec option folds the other options' content in)."""
    for dest, value in stored.items():
        if dest != _SPEC_OPTION and _SPEC_OPTION in stored and _names_missing_file(value):
            value = None
        setattr(args, dest, value)


def _names_missing_file(value) -> bool:
    return (
        isinstance(value, str)
        and (os.sep in value or value.endswith(_SPEC_FILE_ENDINGS))
        and "\n" not in value
        and not value.lstrip().startswith("{")
        and not os.path.exists(value)
    )


def _differences(differing, stored: dict, given: dict) -> str:
    return "\n".join(
        f"  --{dest.replace('_', '-')}: stored {_shown(stored[dest])}, given {_shown(given[dest])}"
        for dest in differing
    )


def _shown(value) -> str:
    """An option's value for a message; a stored spec (canonical JSON) by its name."""
    if isinstance(value, str) and value.startswith("{"):
        try:
            name = json.loads(value).get("name")
        except (ValueError, AttributeError):
            name = None
        if name:
            return f"spec {name!r}"
        return repr(value if len(value) <= 120 else value[:117] + "...")
    return repr(value)
