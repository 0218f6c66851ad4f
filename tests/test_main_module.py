"""``python -m local_attn_fairseq`` prints the plugin directory that --user-dir takes, anywhere."""

import os
import subprocess
import sys

from .conftest import USER_DIR, fairseq_cli


def test_prints_the_plugin_directory_and_fairseq_loads_it_from_any_folder(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "local_attn_fairseq"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )  # fmt: skip
    plugin_dir = proc.stdout.strip()
    assert proc.stdout.count("\n") == 1 and os.path.samefile(plugin_dir, USER_DIR)

    # fairseq accepts the plugin's arch only once --user-dir has registered it (else: exit 2,
    # "invalid choice")
    help_args = ("--arch", "transformer_local_tiny", "--help")
    fairseq_cli("fairseq-train", "--user-dir", plugin_dir, *help_args, cwd=tmp_path)
    # the relative name resolves against the working directory only
    relative = fairseq_cli(
        "fairseq-train", "--user-dir", "local_attn_fairseq", *help_args, cwd=tmp_path, check=False
    )
    assert relative.returncode != 0
