"""argparse types and option syntaxes shared by the package's command-line tools: a count that
makes no sense (no epochs, no training pairs, no parallel jobs) or a selector that selects
nothing (a reversed layer range, an empty list) is refused with the option's name before any
work starts, instead of failing later inside fairseq or silently training nothing."""

import argparse
import functools
import os
from typing import Dict, List

from .locality.layer_selection import layer_selection


def int_at_least(minimum):
    """An argparse ``type``: a whole number, at least ``minimum``."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"int_at_least_{minimum}"  # argparse names the type in some messages
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def output_file(text):
    """An argparse ``type``: the path of a file to write. An existing folder is refused, and so
    is a path under a regular file (its folder cannot be created): either is the user's mistake,
    named before any work instead of as an OSError from the final write."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give the path of a file to write")
    folder = os.path.dirname(os.path.abspath(text))
    while not os.path.exists(folder):  # the nearest part of the path that exists
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(
            f"{text}: {folder} is a file, not a folder; choose a path in a folder"
        )
    return text


def _per_type_entries(value: str, option: str, syntax: str, example: str) -> Dict[str, str]:
    """``"TYPE:REST TYPE:REST ..."`` of a command-line option -> {TYPE: REST}; a value with no
    entry selects nothing and is refused, naming the option."""
    entries = {}
    for entry in value.split():
        attn_type, sep, rest = entry.partition(":")
        if not sep:
            raise ValueError(f"{option} entry {entry!r} is not {syntax} (e.g. {example})")
        entries[attn_type] = rest
    if not entries:
        raise ValueError(f"{option} {value!r} selects nothing; give {syntax} (e.g. {example})")
    return entries


def localness_layers(value: str) -> Dict[str, str]:
    """``--localness-layers``: ``"TYPE:LAYERS ..."`` -> {TYPE: LAYERS}, each selector read by
    :func:`layer_selection` (the spec checks the types and the model's depth)."""
    option = "--localness-layers"
    entries = _per_type_entries(value, option, "ATTENTION_TYPE:LAYERS", "encoder_self:0-2")
    for attn_type, selector in entries.items():
        _check_selector(selector, f"{option} entry {attn_type}:{selector}")
    return entries


def dynamic_windows(value: str) -> Dict[str, str]:
    """``--dynamic-window``: ``"TYPE:METHOD:LAYERS ..."`` (or ``TYPE:none``) -> {TYPE:
    "METHOD:LAYERS" or "none"}, each selector read by :func:`layer_selection` (the spec checks
    the types, the methods and the model's depth)."""
    option, syntax, example = "--dynamic-window", "TYPE:METHOD:LAYERS", "encoder_self:aw:0-2"
    entries = _per_type_entries(value, option, syntax, example)
    for attn_type, rest in entries.items():
        if rest == "none":
            continue
        _, sep, selector = rest.partition(":")
        if not sep:
            raise ValueError(f"{option} entry {attn_type}:{rest} is not {syntax} (e.g. {example})")
        _check_selector(selector, f"{option} entry {attn_type}:{rest}")
    return entries


def _check_selector(selector, where):
    try:
        layer_selection(selector)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def attention_type_list(value: str, option: str) -> List[str]:
    """A comma-separated list of attention types (``--head-gates``,
    ``--relative-positions-attention``); one that names none (``""``, ``","``) is refused rather
    than read as no type or as the default types."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise ValueError(f"{option} {value!r} names no attention type")
    return names


# fairseq-train options of the plugin whose values select layers or attention types, and their
# readers: the recipes check a row's values with them before any stage runs.
SELECTING_OPTIONS = {
    "localness-layers": localness_layers,
    "dynamic-window": dynamic_windows,
    "head-gates": functools.partial(attention_type_list, option="--head-gates"),
    "relative-positions-attention": functools.partial(
        attention_type_list, option="--relative-positions-attention"
    ),
}
