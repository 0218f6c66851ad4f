"""``local-attn-recipe --override KEY=VALUE`` reads VALUE as YAML: a value YAML cannot read ends
in one line naming the override and where the reading stopped, not in PyYAML's traceback."""

import pytest

from local_attn_fairseq.recipes import config as rc

from .test_recipe_inputs import one_line_error, recipe


@pytest.mark.parametrize(
    "override, problem",
    [
        ("prepare.vocab_size={asr: 60", "expected ',' or '}'"),  # a parser error
        ("max-update=a: b: c", "mapping values are not allowed here"),  # a scanner error
        ('dropout="0.3', "found unexpected end of stream"),
    ],
)
def test_an_override_that_is_not_yaml_is_refused_in_one_line(tmp_path, override, problem, capsys):
    value = override.partition("=")[2]
    assert recipe("--work-dir", tmp_path / "w", "--dry-run", "--override", override) == 2
    line = one_line_error(capsys.readouterr().err, f"--override {override!r}", repr(value), problem)
    assert "at character" in line
    assert not (tmp_path / "w").exists()


def test_an_override_over_several_lines_names_the_line():
    with pytest.raises(rc.RecipeError, match=r"at line 2, character \d+\)"):
        rc.parse_override("prepare.sizes={asr: 60,\n st: [100}")


def test_readable_overrides_keep_their_yaml_values():
    assert rc.parse_override("prepare.vocab_size={asr: 60, st: 100}") == {
        "prepare": {"vocab_size": {"asr": 60, "st": 100}}
    }
    assert rc.parse_override("dropout=0.3") == {"train": {"args": {"dropout": 0.3}}}
    assert rc.parse_override("max-update=") == {"train": {"args": {"max-update": ""}}}
