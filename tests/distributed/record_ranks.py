"""fairseq-train that also writes, on every rank, the model's parameters before the first and
after every update (``rank{R}-update{N}.pt`` in ``$RECORD_RANKS_DIR``), with the ids of the
sentences the rank trained on. Each rank keeps its own replica, so comparing the files shows
whether data-parallel training kept the replicas identical.

Usage: ``RECORD_RANKS_DIR=DIR python record_ranks.py DATA [fairseq-train options]``.
"""

import os

import torch
from fairseq.trainer import Trainer
from fairseq_cli import train

RECORD_DIR_VARIABLE = "RECORD_RANKS_DIR"


def record(trainer: Trainer, sentence_ids):
    state = {
        "rank": trainer.data_parallel_rank,
        "update": trainer.get_num_updates(),
        "sentence_ids": sentence_ids,
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
    }
    name = f"rank{state['rank']}-update{state['update']}.pt"
    torch.save(state, os.path.join(os.environ[RECORD_DIR_VARIABLE], name))


def train_step_recording_parameters(original):
    def train_step(self, samples, raise_oom=False):
        if self.get_num_updates() == 0:
            record(self, [])
        output = original(self, samples, raise_oom)
        ids = [i for s in samples if s for i in s["id"].tolist()]
        record(self, ids)
        return output

    return train_step


if __name__ == "__main__":
    if RECORD_DIR_VARIABLE not in os.environ:
        raise SystemExit(f"set {RECORD_DIR_VARIABLE} to the directory the ranks write to")
    Trainer.train_step = train_step_recording_parameters(Trainer.train_step)
    train.cli_main()
