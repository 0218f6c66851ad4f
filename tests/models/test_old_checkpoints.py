"""Checkpoints of earlier versions load: they may store a locality option as ``""``, which those
versions read as not given (no layers, no gates, the default attention types) and a new command
line now refuses. A model trained by fairseq-train gets ``""`` written into its stored arguments
as such a version wrote them; fairseq-generate, fairseq's checkpoint reader and a resumed
fairseq-train then read it as that version did, with one warning per setting."""

import json
import shutil

import pytest
import torch
from fairseq import checkpoint_utils

from local_attn_fairseq.models.locality_options import EMPTY_MEANS_UNSET

from ..conftest import USER_DIR, fairseq_cli, train_tiny
from .helpers import generate

# band heads in the first encoder layer, and the spec's own "no gates"
SPEC = {
    "encoder_self": {"0": ["band-1", "band-2", "prev-1", "next-1", "global", "global", "global",
                           "global"]},
    "head_gates": {"attention": []},
}  # fmt: skip
# Shaw's relative positions: "" of --relative-positions-attention must keep both default types
TRAINED_WITH = ["--locality-config", json.dumps(SPEC), "--relative-positions", "4"]
STORED_EMPTY = [f"--{option.replace('_', '-')} ''" for option in EMPTY_MEANS_UNSET]
SETTINGS = STORED_EMPTY + ["spec's head_gates attention ''"]


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """checkpoint_last.pt of a tiny model trained by fairseq-train with TRAINED_WITH."""
    save_dir = tmp_path_factory.mktemp("before_empty")
    train_tiny(tiny_data, save_dir, *TRAINED_WITH)
    return save_dir / "checkpoint_last.pt"


def as_an_earlier_version_stored_it(checkpoint, path):
    """``checkpoint`` with every option of EMPTY_MEANS_UNSET stored as "" and the spec's head
    gates as "": how an earlier version stored a model given those options empty."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    model_args = state["cfg"]["model"]
    for option in EMPTY_MEANS_UNSET:
        setattr(model_args, option, "")
    spec = json.loads(model_args.locality_config)
    spec["head_gates"]["attention"] = ""
    model_args.locality_config = json.dumps(spec, sort_keys=True)
    torch.save(state, path)
    return path


def warnings_of(log, checkpoint):
    return {
        setting: [
            line for line in log.splitlines()
            if "WARNING" in line and f"{checkpoint}: the stored {setting} " in line
        ]
        for setting in SETTINGS
    }  # fmt: skip


def test_fairseq_generate_reads_a_stored_empty_option_as_none(tiny_data, trained, tmp_path):
    old = as_an_earlier_version_stored_it(trained, tmp_path / "old.pt")
    before, after = generate(tiny_data, trained), generate(tiny_data, old)
    hypotheses = [
        [line for line in proc.stdout.splitlines() if line[:2] in ("H-", "P-")]
        for proc in (before, after)
    ]
    assert hypotheses[0] == hypotheses[1]
    for setting, lines in warnings_of(after.stdout, old).items():
        assert len(lines) == 1, (setting, after.stdout[-3000:])
        assert "is read as none" in lines[0] and "a new command line refuses ''" in lines[0]
    assert not any(warnings_of(before.stdout, trained).values())


def encoder_heads(model):
    return [[h.token for h in layer.self_attn.head_specs] for layer in model.encoder.layers]


def test_the_checkpoint_reader_rebuilds_the_same_model_and_warns_once(
    tiny_data, trained, tmp_path, caplog
):
    old = as_an_earlier_version_stored_it(trained, tmp_path / "old.pt")
    (before,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(trained)])
    with caplog.at_level("WARNING"):
        (after,), cfg, _ = checkpoint_utils.load_model_ensemble_and_task([str(old)])
        checkpoint_utils.load_model_ensemble_and_task([str(old)])  # a second load: no new word
    said = [r.getMessage() for r in caplog.records if "earlier version's empty" in r.message]
    assert sorted(said) == sorted(
        f"{old}: the stored {s} (an earlier version's empty value) is read as none "
        f"({'[], no gates' if 'spec' in s else 'the option not given'}), as that version read "
        "it; a new command line refuses ''"
        for s in SETTINGS
    )
    for option in EMPTY_MEANS_UNSET:
        assert getattr(cfg.model, option) is None
    assert encoder_heads(after) == encoder_heads(before)
    assert encoder_heads(after)[0][:4] == ["band-1", "band-2", "prev-1", "next-1"]
    assert after.open_heads() == before.open_heads() == {}
    # the same function: relative positions on both self-attention types, as trained
    src_dict = task.source_dictionary
    src = src_dict.encode_line("Das ist ein gutes Buch .", add_if_not_exist=False).long()[None]
    prev = torch.cat([torch.tensor([[src_dict.eos()]]), src[:, :-1]], dim=1)
    with torch.no_grad():
        outputs = [
            model.eval()(src, torch.tensor([src.size(1)]), prev)[0] for model in (before, after)
        ]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)


def test_a_resumed_training_continues_an_old_checkpoint(tiny_data, trained, tmp_path):
    save_dir = tmp_path / "resumed"
    save_dir.mkdir()
    old = as_an_earlier_version_stored_it(trained, save_dir / "checkpoint_last.pt")
    # no locality option given: the stored ones are used, "" read as the version read it
    proc = train_tiny(tiny_data, save_dir, max_update=3)
    assert "done training" in proc.stdout
    state = checkpoint_utils.load_checkpoint_to_cpu(str(save_dir / "checkpoint_last.pt"))
    assert state["optimizer_history"][-1]["num_updates"] == 3
    for setting, lines in warnings_of(proc.stdout, old).items():
        assert len(lines) == 1, (setting, proc.stdout[-3000:])


def test_an_empty_value_given_anew_is_still_refused(tiny_data, trained, tmp_path):
    copy = shutil.copy(trained, tmp_path / "given.pt")
    proc = fairseq_cli(
        "fairseq-generate", tiny_data / "bin", "--user-dir", USER_DIR, "--path", copy,
        "--gen-subset", "test", "--model-overrides", "{'head_gates': ''}", check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--head-gates '' names no attention type" in proc.stderr + proc.stdout
