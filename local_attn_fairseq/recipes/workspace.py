"""Where one recipe's files live in its work directory, and how its fairseq tools are run.

    WORK/data/DATA_NAME/              the prepared data, shared by recipes that prepare it alike,
                                      and prepare.json (its raw source and prepare settings)
    WORK/rows/RECIPE/ROW/seedS/       one row's checkpoints, logs, averaged (and pruned) model,
                                      heads_kept.json, settings.json (what it trains with)
                                      and results.json

On a dry run every tool's command is printed instead of run.
"""

import json
import os

import torch

from ..experiments import fairseq_runner
from ..file_safety import atomic_write_text
from .config import RecipeError, data_name, differences, prepared_data_settings, slug

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

    def prepare_record(self):
        """What the prepared data was made from (``check_prepared_inputs``)."""
        return os.path.join(self.data, "prepare.json")

    def check_prepared_inputs(self, raw_files, compare_raw=True):
        """Refuse (RecipeError) to use the prepared data when it was made from another raw
        source or with other prepare settings than this run's. ``raw_files``: {name under
        --raw-dir: [size, modification time]} of the raw files the preparation reads
        (``raw_fingerprint``); the same files at another path are the same source. Returns
        whether the data folder has a record (a folder of an earlier version has none)."""
        path = self.prepare_record()
        if not os.path.isfile(path):
            return False
        try:
            with open(path, encoding="utf-8") as f:
                recorded = json.load(f)
            then_settings, then_raw = recorded["settings"], recorded["raw"]
            then_dir, then_files = then_raw["dir"], then_raw["files"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise RecipeError(
                f"{path} cannot be read ({error}); it records what {self.data} was prepared "
                "from: move that folder away to prepare it again, or use another --work-dir"
            ) from None
        changed = differences({"prepare": then_settings}, {"prepare": self.prepared_settings()})
        if compare_raw and then_files != raw_files:
            changed.insert(0, _raw_change(then_dir, then_files, self.raw_dir, raw_files))
        if changed:
            raise RecipeError(
                f"{self.data} was prepared from other inputs ({'; '.join(changed)}; recorded "
                f"in {path}); it is not replaced: use another --work-dir, or move that folder "
                "away to prepare it again"
            )
        return True

    def record_prepared_inputs(self, raw_files):
        """Record this run's raw source and prepare settings beside the data it is about to
        prepare, refusing a data folder that holds files but no record (nothing says what
        they were made from). Call it where ``check_prepared_inputs`` found no record."""
        if os.path.isdir(self.data) and os.listdir(self.data):
            raise RecipeError(
                f"{self.data} holds data prepared without a record of its raw source and "
                "settings (by an earlier version of the recipes); it is not reused: move that "
                "folder away to prepare it again, or use another --work-dir"
            )
        record = {
            "settings": self.prepared_settings(),
            "raw": {"dir": self.raw_dir, "files": raw_files},
        }
        atomic_write_text(self.prepare_record(), json.dumps(record, indent=2) + "\n")

    def prepared_settings(self):
        # as JSON stores them, so that a record compares equal to the settings it was made of
        return json.loads(json.dumps(prepared_data_settings(self.recipe), default=str))

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


def raw_fingerprint(raw_dir, names):
    """{name: [size, modification time in ns]} of the files ``names`` (relative to
    ``raw_dir``; a folder stands for every file under it): a cheap check that the raw source
    is the one the data was prepared from. Names that do not exist are left out."""
    files = {}
    for name in names:
        path = os.path.join(raw_dir, name)
        if os.path.isdir(path):
            for folder, _, entries in os.walk(path, followlinks=True):  # linked audio too
                for entry in entries:
                    full = os.path.join(folder, entry)
                    files[os.path.relpath(full, raw_dir)] = _size_and_time(full)
        elif os.path.exists(path):
            files[name] = _size_and_time(path)
    return dict(sorted(files.items()))


def _size_and_time(path):
    status = os.stat(path)
    return [status.st_size, status.st_mtime_ns]


def _raw_change(then_dir, then_files, now_dir, now_files):
    """One phrase naming how the raw source differs from the recorded one."""
    def shown(folder):
        return folder or "the downloads"

    if then_dir != now_dir:
        return f"raw source: {shown(then_dir)} then, {shown(now_dir)} now"
    changed = sorted(n for n in set(then_files) | set(now_files)
                     if then_files.get(n) != now_files.get(n))  # fmt: skip
    listed = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return f"raw source {shown(now_dir)}: {listed} changed since"
