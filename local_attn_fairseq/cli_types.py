"""argparse types shared by the package's command-line tools: a count that makes no sense (no
epochs, no training pairs, no parallel jobs) is refused with the option's name before any work
starts, instead of failing later inside fairseq or silently training nothing."""

import argparse


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
