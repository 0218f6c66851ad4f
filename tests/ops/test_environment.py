"""environment_value reads os.environ as os.environ.get does, changes made at run time included."""

import os

import pytest

from local_attn_fairseq.ops.environment import environment_value

NAME = "LOCAL_ATTN_TEST_ENVIRONMENT_VALUE"


@pytest.mark.parametrize("value", [None, "", "auto", "tensor-core", "é ü", "a=b"])
def test_it_reads_what_os_environ_holds(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, value)
    assert environment_value(NAME) == os.environ.get(NAME) == value


def test_changes_take_effect_at_the_next_read(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert environment_value(NAME) is None
    os.environ[NAME] = "torch"
    try:
        assert environment_value(NAME) == "torch"
        os.environ[NAME] = "auto"
        assert environment_value(NAME) == "auto"
    finally:
        del os.environ[NAME]
    assert environment_value(NAME) is None

