"""A recipe row's stages run in order, with the rows it starts from trained first."""

import os

from . import averaging, evaluation, speech, text_preparation, training
from .config import RecipeError, get_row, settings_not_from_paper
from .workspace import RecipeWorkspace


class RecipeRun(RecipeWorkspace):
    """One recipe in one work directory, and the stages that prepare, train, average and
    evaluate its rows there."""

    def prepare(self):
        if self.kind == "speech":
            return speech.prepare_speech(self)
        return text_preparation.prepare_text(self)

    def train_argv(self, row):
        return training.train_argv(self, row)

    def train(self, row):
        training.train(self, row)

    def average(self, row):
        averaging.average(self, row)

    def evaluate(self, row):
        return evaluation.evaluate_row(self, row)

    def run_stage(self, stage, row):
        print(f"| {self.recipe['name']} | {row['name']} ({row['table']})")
        for line in settings_not_from_paper(row["chosen"], row["departures"]):
            print(line)
        print(flush=True)
        if stage != "prepare" and not self.dry_run:
            # before any work: the row's checkpoints are of the settings it has now
            training.check_settings(self, row)
        if stage in ("train", "all") and not self.dry_run:
            # and so are those of the rows it starts from, whose results would be reused
            self.check_dependencies(row)
        if stage in ("prepare", "all"):
            self.prepare()
        if stage in ("train", "all"):
            self.require_prepared(row)
            self.ensure_dependencies(row)
            self.train(row)
        if stage in ("average", "all"):
            self.average(row)
        if stage in ("evaluate", "all"):
            return self.evaluate(row)
        return None

    def require_prepared(self, row):
        """A clear RecipeError, before fairseq starts, when the data the row trains on is not
        prepared (the train stage run before the prepare stage, or in another work dir), or
        was prepared from another --raw-dir than the one given."""
        if self.dry_run:
            return
        if self.kind == "speech":
            needed = os.path.join(self.data, speech.task_files(self, row)["config"])
        else:
            needed = self.bin
        if not os.path.exists(needed):
            raise RecipeError(f"{needed} does not exist: run the prepare stage first")
        # a --raw-dir given to this stage must be the one the data was prepared from
        raw_files = {}
        if self.raw_dir and self.kind == "speech":
            raw_files = speech.raw_source(self)
        elif self.raw_dir:
            raw_files = text_preparation.raw_source(self, text_preparation.dataset_of(self))
        self.check_prepared_inputs(raw_files, compare_raw=bool(self.raw_dir))

    def check_dependencies(self, row):
        """Refuse (RecipeError) to start the row from a row, or from a row that row starts
        from, trained in this work dir with other settings than this invocation gives it."""
        for dep_name in (row["base_row"], row["heads_kept_from_row"]):
            if dep_name:
                dep = get_row(self.recipe, dep_name)
                training.check_settings(self, dep, needed_by=row["name"])
                self.check_dependencies(dep)

    def ensure_dependencies(self, row):
        """Train (and average, prune) the rows this row starts from, unless already done."""
        for dep_name, needed in (
            (row["base_row"], self.averaged),
            (row["heads_kept_from_row"], self.heads_kept),
        ):
            if dep_name and (self.dry_run or not os.path.exists(needed(dep_name))):
                dep = get_row(self.recipe, dep_name)
                print(f"| row {row['name']!r} starts from row {dep_name!r}", flush=True)
                self.ensure_dependencies(dep)
                self.train(dep)
                self.average(dep)
