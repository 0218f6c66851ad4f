"""fairseq-train for runs that resume: early stopping that survives a restart, timed validations.

    python -m local_attn_fairseq.experiments.fairseq_train [--bad-validations K] [--wall-offset S] \
        -- <fairseq-train options>

fairseq's ``--patience`` counter lives in the process: a resumed run would start counting
again from zero, against the first loss it sees, and so train longer than a run that was never
stopped. Here the counter starts from the best loss the checkpoint stores and from the K
validations without improvement that the run's log shows since that best. Every validation
line also gets the run's wall time (``valid_wall``): this session's seconds plus S, the time
earlier sessions had taken at their last validation (fairseq's own wall meter restarts at zero
on a resume).
"""

import argparse
import sys
import time

from fairseq import checkpoint_utils
from fairseq_cli import train

from .training_progress import console_logging


def resume_patience(bad_validations):
    """Make fairseq's early stopping continue from the checkpoint's best loss."""
    original = train.should_stop_early

    # fairseq's function keeps its counter on whatever its module's global name holds: this one
    def should_stop_early(cfg, valid_loss):
        resumed_best = getattr(checkpoint_utils.save_checkpoint, "best", None)
        if not hasattr(should_stop_early, "best") and resumed_best is not None:
            should_stop_early.best = resumed_best
            should_stop_early.num_runs = bad_validations
        return original(cfg, valid_loss)

    train.should_stop_early = should_stop_early


def time_validations(wall_offset):
    """Log the run's wall time, `wall_offset` s from earlier sessions included, with every
    validation."""
    original = train.get_valid_stats
    started = time.monotonic()

    def get_valid_stats(cfg, trainer, stats, tracking_best):
        stats = original(cfg, trainer, stats, tracking_best)
        stats["wall"] = round(wall_offset + time.monotonic() - started, 0)
        return stats

    train.get_valid_stats = get_valid_stats


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: fairseq_train [--bad-validations K] -- <fairseq-train options>")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="fairseq_train")
    parser.add_argument("--bad-validations", type=int, default=0)
    parser.add_argument("--wall-offset", type=float, default=0.0)
    own = parser.parse_args(argv[:split])
    console_logging()
    resume_patience(own.bad_validations)
    time_validations(own.wall_offset)
    sys.argv = ["fairseq-train", *argv[split + 1 :]]
    train.cli_main()


if __name__ == "__main__":
    main()
