"""scripts/prepare_classification.py replaces its raw/, input0/ and label/ as one set: a re-run
with another --seed gives that seed's data whole, and an interrupted run leaves the previous
run's outputs as they were."""

import os

import pytest

from local_attn_fairseq.data import agreement, ding

from ..conftest import run_script, snapshot

SCRIPT = os.path.join("scripts", "prepare_classification.py")


@pytest.fixture(scope="module")
def ding_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ding") / "splits"
    ding.main(["--out-dir", str(out), "--test-size", "40", "--valid-size", "40",
               "--max-train", "200"])  # fmt: skip
    return out


def prepare(ding_dir, out, seed):
    proc = run_script(SCRIPT, "--ding-dir", ding_dir, "--out-dir", out, "--seed", seed)
    assert proc.returncode == 0, proc.stderr[-3000:]


def data_files(folder):
    """The files of a prepared set, without fairseq-preprocess's log (it names the paths)."""
    return {
        name: data
        for name, data in snapshot(folder).items()
        if os.path.basename(name) != "preprocess.log"
    }


def test_a_rerun_with_another_seed_killed_or_not_never_mixes_two_runs(
    ding_dir, tmp_path, monkeypatch
):
    out = tmp_path / "sva"
    prepare(ding_dir, out, 1)
    first = snapshot(out)
    binarize = agreement.binarize

    def killed_at_label(raw_dir, dest, field, workers):
        if field == "label":  # input0 binarised, raw written: the process dies
            (tmp_path / "killed").write_text("")
            raise KeyboardInterrupt
        return binarize(raw_dir, dest, field, workers)

    with monkeypatch.context() as patched:
        patched.setattr(agreement, "binarize", killed_at_label)
        with pytest.raises(KeyboardInterrupt):
            run_script(SCRIPT, "--ding-dir", ding_dir, "--out-dir", out, "--seed", 7)
    assert (tmp_path / "killed").exists()
    assert snapshot(out) == first  # seed 1's raw/ and binaries, untouched
    assert sorted(os.listdir(out)) == [".local_attn_fairseq_output", "input0", "label", "raw"]
    # the next run replaces them whole with seed 7's, as a new folder has them
    prepare(ding_dir, out, 7)
    prepare(ding_dir, tmp_path / "fresh", 7)
    assert data_files(out) == data_files(tmp_path / "fresh")
    assert snapshot(out)["raw/train.input0"] != first["raw/train.input0"]
    assert sorted(os.listdir(out)) == [".local_attn_fairseq_output", "input0", "label", "raw"]


def test_a_users_raw_folder_in_a_folder_written_with_overwrite_is_refused(ding_dir, tmp_path):
    out = tmp_path / "mine"
    (out / "raw").mkdir(parents=True)
    (out / "raw" / "notes.txt").write_text("mine\n")
    proc = run_script(
        SCRIPT, "--ding-dir", ding_dir, "--out-dir", out, "--seed", 1, "--overwrite"
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "raw' was not written by scripts/prepare_classification.py" in proc.stderr
    assert os.listdir(out) == ["raw"] and os.listdir(out / "raw") == ["notes.txt"]
