"""The suite's composition of fairseq's configuration (tests/fairseq_config_composition.py)
gives what hydra composes, for the command lines of every family of models and every tool."""

import warnings

import pytest
from fairseq import options
from fairseq.dataclass import utils as fairseq_config
from omegaconf import OmegaConf

from . import fairseq_config_composition as composition
from .conftest import USER_DIR

TRAIN = ["--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "1000", "--user-dir", USER_DIR]
COMMAND_LINES = {
    "train tied": ("training", ["data", "--arch", "transformer_local_tied", *TRAIN,
                                "--log-format", "json", "--save-dir", "runs/a b"]),
    "train dynwin, BLEU": ("training", ["data", "--arch", "transformer_dynwin", *TRAIN,
                                        "--criterion", "label_smoothed_cross_entropy",
                                        "--label-smoothing", "0.1", "--eval-bleu",
                                        "--eval-bleu-args", '{"beam": 2, "max_len_b": 8}']),
    "train gated, L0": ("training", ["data", "--arch", "transformer_local", *TRAIN,
                                     "--head-gates", "enc,dec,cross",
                                     "--criterion", "label_smoothed_cross_entropy_l0"]),
    "train lm": ("training", ["data", "--arch", "transformer_lm_local", "--task",
                              "language_modeling", "--tokens-per-sample", "64", *TRAIN]),
    "train speech": ("training", ["data", "--arch", "s2t_transformer_local", "--task",
                                  "speech_to_text", "--config-yaml", "config.yaml", *TRAIN]),
    "generate": ("generation", ["data", "--path", "a.pt:b.pt", "--user-dir", USER_DIR,
                                "--beam", "2", "--sampling", "--temperature", "0.5"]),
    "interactive": ("interactive", ["data", "--path", "a.pt", "--user-dir", USER_DIR,
                                    "--constraints", "ordered", "--buffer-size", "3"]),
    "eval-lm": ("eval_lm", ["data", "--path", "a.pt", "--user-dir", USER_DIR,
                            "--task", "language_modeling", "--context-window", "10"]),
}  # fmt: skip
PARSERS = {
    "training": options.get_training_parser,
    "generation": options.get_generation_parser,
    "interactive": options.get_interactive_generation_parser,
    "eval_lm": options.get_eval_lm_parser,
}


@pytest.fixture
def hydra_composes():
    """fairseq's own composition in this test, the suite's again afterwards."""
    composition.uninstall()
    yield
    composition.install()


def converted(args, composed_by):
    composed_by()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fairseq_config.convert_namespace_to_omegaconf(args)


@pytest.mark.parametrize("name", COMMAND_LINES)
def test_the_suites_composition_gives_hydras_config(name, hydra_composes):
    parser, argv = COMMAND_LINES[name]
    args = options.parse_args_and_arch(PARSERS[parser](), argv)
    by_hydra = OmegaConf.to_yaml(converted(args, composition.uninstall))
    for _ in range(2):  # composed, then from what was kept
        assert OmegaConf.to_yaml(converted(args, composition.install)) == by_hydra


def test_a_value_the_config_refuses_is_refused_as_by_hydra(hydra_composes):
    _, argv = COMMAND_LINES["train tied"]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    args.ddp_backend = "no_such_backend"
    errors = []
    for composed_by in (composition.uninstall, composition.install):
        with pytest.raises(Exception) as error:
            converted(args, composed_by)
        errors.append((type(error.value), str(error.value).splitlines()[0]))
    assert errors[0] == errors[1]
