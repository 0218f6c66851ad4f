"""fairseq's configuration composed once per choice of its registries, for a process that runs
fairseq's tools hundreds of times (the test suite).

Every tool run turns its parsed arguments into a config (``convert_namespace_to_omegaconf``):
hydra composes ``fairseq/config/config.yaml`` with one override per option (about 250), and
spends 0.3 s a run on it (0.45 s on a loaded machine; 470 runs in the suite, 210 s of its worker
time): it parses every override with its grammar, copies its config repository and builds the
defaults list again. Only the choices of the config groups (``task=translation``,
``model=transformer_lm``: the overrides without a dot) decide which configs are merged; the
rest set values. So the config composed for one choice of groups is kept, and each run applies
its value overrides to a copy of it with hydra's own function, as hydra's compose does after
merging. The result is the config hydra composes (tests/test_fairseq_config_composition.py
compares both on the command lines of every family of models and tools).
"""

import contextlib
import copy
import functools
import os

import fairseq
import fairseq.dataclass.utils as fairseq_config
from hydra import initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

HYDRA_COMPOSE = fairseq_config.compose
HYDRA_INITIALIZE = fairseq_config.initialize
# What fairseq's ``initialize(config_path="../config")`` finds beside fairseq/dataclass/utils.py.
FAIRSEQ_CONFIG_DIR = os.path.join(os.path.dirname(fairseq.__file__), "config")


def is_group_choice(override):
    return "." not in override.partition("=")[0]


@functools.lru_cache(maxsize=None)
def parsed_override(line):
    return OverridesParser.create().parse_override(line)


@functools.lru_cache(maxsize=None)
def composed_for_choices(config_name, choices, strict):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=FAIRSEQ_CONFIG_DIR):
        return HYDRA_COMPOSE(config_name, overrides=list(choices), strict=strict)


def compose(config_name, overrides, strict=None):
    """hydra's compose as fairseq calls it: the config of ``config_name`` with ``overrides``."""
    choices = tuple(o for o in overrides if is_group_choice(o))
    cfg = copy.deepcopy(composed_for_choices(config_name, choices, strict))
    values = [parsed_override(o) for o in overrides if not is_group_choice(o)]
    OmegaConf.set_struct(cfg, True)  # as hydra applies them: an unknown key is an error
    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    OmegaConf.set_struct(cfg, strict)
    return cfg


@contextlib.contextmanager
def initialized_when_composed(config_path):
    """``compose`` above initializes hydra when it composes, given the config folder's path:
    hydra then does not read the call stack for its caller's file (0.1 s under pytest's frames)."""
    yield


def install():
    fairseq_config.compose = compose
    fairseq_config.initialize = initialized_when_composed


def uninstall():
    fairseq_config.compose = HYDRA_COMPOSE
    fairseq_config.initialize = HYDRA_INITIALIZE
