"""argparse types shared by the package's command-line tools: a count that makes no sense (no
epochs, no training pairs, no parallel jobs) is refused with the option's name before any work
starts, instead of failing later inside fairseq or silently training nothing."""

import argparse
import os


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
