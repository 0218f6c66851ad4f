"""Where one recipe's files live in its work directory, and how its fairseq tools are run.

    WORK/data/DATA_NAME/              the prepared data, shared by recipes that prepare it alike
    WORK/rows/RECIPE/ROW/seedS/       one row's checkpoints, logs, averaged (and pruned) model,
                                      heads_kept.json, settings.json (what it trains with)
                                      and results.json

On a dry run every tool's command is printed instead of run.
"""

import os

import torch

from ..experiments import fairseq_runner
from .config import data_name, slug

# The owner named in the work dir's marker (file_safety): a work dir is the recipes' own.
WORK_DIR_OWNER = "run_recipe"


class RecipeWorkspace:
    """One recipe in one work directory: data shared by its rows, one directory per row."""

    def __init__(
        self, recipe, work_dir, raw_dir=None, gpus=None, seed=1, dry_run=False,
        settings_given=None,
    ):  # fmt: skip
        self.recipe, self.kind = recipe, recipe["kind"]
        # what the command line changed ({profile, overrides}), for the rows' records
        self.settings_given = settings_given or {"profile": None, "overrides": []}
        self.work = os.path.abspath(work_dir)
        self.raw_dir = os.path.abspath(raw_dir) if raw_dir else None
        self.gpus, self.seed, self.dry_run = gpus, seed, dry_run
        self.data = os.path.join(self.work, "data", data_name(recipe))
        self.bin = os.path.join(self.data, "bin")

    def row_dir(self, row_name):
        return os.path.join(
            self.work, "rows", self.recipe["name"], slug(row_name), f"seed{self.seed}"
        )

    def averaged(self, row_name):
        return os.path.join(self.row_dir(row_name), "averaged.pt")

    def settings_record(self, row_name):
        """The settings the row's checkpoints were trained with (``training.record_settings``)."""
        return os.path.join(self.row_dir(row_name), "settings.json")

    def heads_kept(self, row_name):
        """The heads a pruned row kept, {attention type: [[head, ...] per layer]}."""
        return os.path.join(self.row_dir(row_name), "heads_kept.json")

    def final_checkpoint(self, row):
        name = "pruned.pt" if row["prune"] else "averaged.pt"
        return os.path.join(self.row_dir(row["name"]), name)

    def data_path(self, row):
        """What fairseq's tools take as data: the binarised text, or the speech data directory
        (speech_to_text reads its manifests and configs there)."""
        return self.data if self.kind == "speech" else self.bin

    def gpu_count(self):
        if self.gpus is None:
            self.gpus = max(1, torch.cuda.device_count())
        return self.gpus

    def run_tool(self, tool, argv, log_path):
        """Run a fairseq tool in this process (see fairseq_runner.run_in_process); on a dry run,
        print its command."""
        if self.dry_run:
            print(fairseq_runner.command_line(tool, [str(a) for a in argv]))
            return None
        return fairseq_runner.run_in_process(tool, argv, log_path)
