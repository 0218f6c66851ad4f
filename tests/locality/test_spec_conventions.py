"""The spec's settings for the authors'-code conventions: Gaussian centre and gate init."""

from argparse import Namespace

import pytest

from local_attn_fairseq.locality.spec import LocalitySpec, LocalitySpecError
from local_attn_fairseq.models.locality_options import with_command_line_settings

LAYERS = {"encoder_self": 6, "decoder_self": 6, "decoder_cross": 6}
HEADS = {"encoder_self": 8, "decoder_self": 8, "decoder_cross": 8}


def spec(config):
    return LocalitySpec(config, LAYERS, HEADS)


def test_a_spec_without_the_settings_has_the_papers_conventions():
    """What a checkpoint written before the options existed stores."""
    s = spec({"localness": {"layers": {"encoder_self": "0-2"}}, "head_gates": {"attention": "enc"}})
    assert s.localness["centre"] == "paper"
    assert s.gate_settings("encoder_self") == {
        "temperature": 2 / 3, "log_alpha_init": 3.0, "init": "constant"
    }  # fmt: skip


def test_the_settings_are_read():
    gates = {"attention": "enc", "init": "glorot"}
    s = spec({"localness": {"centre": "code"}, "head_gates": gates})
    assert s.localness["centre"] == "code"
    assert s.gate_settings("encoder_self")["init"] == "glorot"


@pytest.mark.parametrize(
    "config,message",
    [
        ({"localness": {"centre": "middle"}}, "localness: unknown centre convention 'middle'"),
        ({"head_gates": {"attention": "enc", "init": "xavier"}}, "head_gates: unknown init"),
    ],
)
def test_unknown_values_are_refused(config, message):
    with pytest.raises(LocalitySpecError, match=message):
        spec(config)


def test_command_line_options_are_written_into_the_spec_once():
    cfg = Namespace(localness_centre="code", head_gate_init="glorot", head_gates="enc")
    config = with_command_line_settings({}, cfg)
    assert config["localness"] == {"centre": "code"}
    assert config["head_gates"] == {"attention": ["enc"], "init": "glorot"}
    assert with_command_line_settings(config, cfg) == config  # a checkpoint rebuilds the same
    assert with_command_line_settings(config, Namespace()) == config  # an older option set
