"""Run keys, convergence, resumed early stopping, the report's place in a tracked document, and
the models and ablations the study trains."""

import json
import os
import types

import pytest
import torch
from fairseq import checkpoint_utils, options, tasks
from fairseq_cli import train

from local_attn_fairseq.experiments import demo, fairseq_train, small_scale_study, study
from local_attn_fairseq.experiments import study_report
from local_attn_fairseq.experiments.small_scale_study import TINY_WIDTHS
from local_attn_fairseq.experiments.fairseq_runner import USER_DIR, RunFailed
from local_attn_fairseq.experiments.training_progress import Validation
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention

from ..conftest import run_script


def test_run_key_depends_on_settings_not_on_the_budget():
    argv = ["data", "--arch", "transformer", "--seed", "1", "--lr", "3e-3"]
    key = study.run_key(argv)
    budget = ["--max-update", "100", "--patience", "3", "--save-dir", "/x"]
    assert study.run_key(argv + budget) == key
    assert study.run_key(["data", "--arch", "transformer", "--seed", "2", "--lr", "3e-3"]) != key
    assert study.run_key(argv + ["--dropout", "0.3"]) != key
    run = study.TrainingRun("baseline", "b", argv, "/work")
    assert run.save_dir == f"/work/runs/baseline-{key}"


def test_run_key_is_the_same_wherever_the_study_lies():
    def argv(work):
        return [f"{work}/data_spm4000/bin", "--user-dir", USER_DIR, "--seed", "1"]

    here, there = "/home/a/study/ding-de-en", "/tmp/b/ding-de-en"
    assert study.run_key(argv(here), here) == study.run_key(argv(there), there)
    # the corpus is the work folder's name; data outside the work folder is named as given
    assert study.run_key(argv(here), here) != study.run_key(argv("/x/bible-en-es"), "/x/bible-en-es")
    assert study.run_key(argv("/data"), here) != study.run_key(argv("/data2"), here)
    run = study.TrainingRun("baseline", "b", argv(there), there)
    assert run.key == study.run_key(argv(here), here) and run.seed == 1


# A scored run's result, as ``study_report.score_run`` gives it.
RESULT = {
    "seed": 1, "bleu": 7.5, "updates_trained": 8, "updates_to_convergence": 8, "converged": False,
    "train_words_per_s": 1000.0, "encoder_attention_params": 4096, "validations": [],
}  # fmt: skip


def test_records_are_read_only_under_the_same_budget(tmp_path):
    run = study.TrainingRun("baseline", "b", ["data", "--seed", "3"], str(tmp_path / "ding-de-en"))
    path = study.record_path(str(tmp_path / "records"), "ding-de-en", run)
    assert path.endswith(f"ding-de-en-baseline-seed3-{run.key}.json")
    assert study.read_record(path, 100, 3) is None
    result = dict(RESULT, bleu=7.5, save_dir="/this/machine")
    study.write_record(path, result, run, max_update=100, patience=3)
    record = study.read_record(path, 100, 3)
    assert record["bleu"] == 7.5 and "save_dir" not in record and record["key"] == run.key
    for other_budget in ((200, 3), (100, 2)):  # refused: a run under it would replace the record
        with pytest.raises(RunFailed, match="another budget .max_update 100, patience 3"):
            study.read_record(path, *other_budget)
        # in the work folder's own records the run under the other budget replaces it
        assert study.read_record(path, *other_budget, pass_over_others=True) is None
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(RunFailed, match="not a record of a study run"):
        study.read_record(path, 100, 3)


def test_a_record_the_study_cannot_use_is_named_and_kept(tmp_path):
    """The study's command line, given a records folder whose record of its run lacks "bleu"
    (written by hand, or cut short): one line naming the file and the field, no KeyError; whose
    record of its run is under another cap: one line naming the file and both budgets, the
    record left as it was (a run under this cap would have replaced it)."""
    work, records = tmp_path / "study", tmp_path / "records"
    argv = ["--work-dir", work, "--corpus", "ding-de-en", "--tiny", "--max-train", 2000,
            "--test-size", 20, "--vocab-size", 400, "--seeds", 1, "--models", "baseline",
            "--max-update", 4, "--records", records, "--report-only"]  # fmt: skip
    argv = list(map(str, argv))
    script = os.path.join("scripts", "small_scale_study.py")
    first = run_script(script, *argv)  # prepares the corpus (in this process, as the second)
    assert first.returncode == 0 and "1 runs, 0 recorded" in first.stdout, first.stderr[-2000:]

    # the record this study reads for its one run, as another machine would have written it
    args = small_scale_study.parse_args(argv)
    corpus_dir = str(work / "ding-de-en")
    corpus = small_scale_study.prepare("ding-de-en", corpus_dir, args, args.max_train)
    base = small_scale_study.base_argv(args)
    run = study_report.study_runs(corpus, corpus_dir, base, ["baseline"], [1])["baseline"][0]
    path = study.record_path(str(records), "ding-de-en", run)
    study.write_record(path, RESULT, run, max_update=4, patience=args.patience)
    with open(path) as f:
        record = json.load(f)
    del record["bleu"]
    with open(path, "w") as f:
        json.dump(record, f)

    second = run_script(script, *argv)
    assert second.returncode != 0 and "Traceback" not in second.stderr, second.stderr[-2000:]
    error = second.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and path in error and "lacks bleu" in error

    # the same run recorded under a cap of 4 updates, this study's cap 8: refused, kept as it was
    study.write_record(path, RESULT, run, max_update=4, patience=args.patience)
    with open(path) as f:
        kept = f.read()
    # a study that would train (not --report-only): its run would replace the record
    higher_cap = [value if previous != "--max-update" else "8" for previous, value in
                  zip([None] + argv, argv) if value != "--report-only"]  # fmt: skip
    third = run_script(script, *higher_cap)
    assert third.returncode != 0 and "Traceback" not in third.stderr, third.stderr[-2000:]
    error = third.stderr.strip().splitlines()[-1]
    assert path in error and "another budget (max_update 4" in error and "--records" in error
    with open(path) as f:
        assert f.read() == kept


def test_convergence_counts_validations_since_the_best():
    curve = [Validation(e, 10 * e, loss) for e, loss in enumerate([5.0, 4.0, 4.5, 4.0, 4.2], 1)]
    assert study.bad_validations(curve) == 3  # a tie is no improvement, as fairseq counts it
    assert study.convergence_update(types.SimpleNamespace(validations=curve, num_updates=50)) == 20
    log = types.SimpleNamespace(validations=curve, num_updates=50)
    assert study.is_finished(log, max_update=100, patience=3)
    assert not study.is_finished(log, max_update=100, patience=4)
    assert study.is_finished(log, max_update=50, patience=4)  # the cap
    assert not study.is_finished(log, max_update=100, patience=0)  # no early stopping


def test_resumed_early_stopping_continues_from_the_stored_best():
    cfg = types.SimpleNamespace(
        checkpoint=types.SimpleNamespace(patience=2, maximize_best_checkpoint_metric=False)
    )
    original = train.should_stop_early
    had_best = getattr(checkpoint_utils.save_checkpoint, "best", None)
    try:
        checkpoint_utils.save_checkpoint.best = 1.0  # what loading a checkpoint restores
        fairseq_train.resume_patience(bad_validations=1)
        # one validation without improvement before the restart, one after: patience 2 is spent
        assert train.should_stop_early(cfg, 1.5) is True
        # a fresh run (nothing restored) counts from its own first validation
        del checkpoint_utils.save_checkpoint.best
        fairseq_train.resume_patience(bad_validations=0)
        assert [train.should_stop_early(cfg, loss) for loss in (3.0, 3.5, 2.0)] == [False] * 3
        assert train.should_stop_early(cfg, 2.5) is False and train.should_stop_early(cfg, 2.1)
    finally:
        train.should_stop_early = original
        if had_best:
            checkpoint_utils.save_checkpoint.best = had_best
        elif hasattr(checkpoint_utils.save_checkpoint, "best"):
            del checkpoint_utils.save_checkpoint.best


def test_report_replaces_only_its_own_section(tmp_path):
    document = "# Study\n\nThe old study's numbers.\n"
    once = study_report.replace_section(document, "new table 1")
    assert once.startswith(document.rstrip("\n")) and "new table 1" in once
    twice = study_report.replace_section(once + "\nText after.\n", "new table 2")
    assert "The old study's numbers." in twice and "Text after." in twice
    assert "new table 1" not in twice and twice.count(study_report.REPORT_START) == 1


@pytest.mark.parametrize(
    "converged,title",
    [
        ([True, True, True], "## Study to convergence"),
        ([False, False, False], "## Study at a fixed budget (every run stopped at its cap)"),
        ([True, False, False], "## Study to convergence or a cap (1 of 3 runs converged)"),
    ],
)
def test_the_reports_title_says_what_stopped_its_runs(converged, title):
    """A study whose runs stopped at the cap is not called a study to convergence."""
    results = [
        {"models": {"baseline": {"runs": [{"converged": c} for c in converged[:2]]}}},
        {"models": {"local_tied": {"runs": [{"converged": c} for c in converged[2:]]}}},
    ]
    assert study_report.heading(results) == title
    assert study_report.heading(results, "lr") == f"{title} (`--section lr`)"


def test_write_report_writes_markdown_curves_and_json(tmp_path):
    runs = [
        {"bleu": b, "updates_to_convergence": 20, "updates_trained": 50, "converged": True,
         "train_words_per_s": 1000.0, "encoder_attention_params": 393216,
         "validations": [{"epoch": 1, "num_updates": 10, "loss": 5.0, "wall": 30.0},
                         {"epoch": 2, "num_updates": 20, "loss": 4.0, "wall": 1800.0}]}
        for b in (10.0, 12.0)
    ]  # fmt: skip
    result = {
        "corpus": "bible-en-es", "description": "Bible en-es", "train_pairs": 1000,
        "test_sentences": 100, "max_update": 100,
        "models": {"baseline": dict(study.summarise(runs), label="transformer (baseline)", runs=runs)},
    }  # fmt: skip
    settings = {"command": "python scripts/small_scale_study.py", "minutes": 1.0, "machine": "2 CPU cores",
                "model": "128 dims", "patience": 3, "seeds": [1, 2], "jobs": 1}  # fmt: skip
    tracked = tmp_path / "docs" / "study.md"
    tracked.parent.mkdir()
    tracked.write_text("# Small-scale study\n\nEarlier numbers.\n")
    targets = [(str(tmp_path / "work" / "study.md"), str(tmp_path / "work" / "images")),
               (str(tracked), str(tmp_path / "docs" / "images"))]  # fmt: skip
    section = study_report.write_report([result], settings, targets, str(tmp_path / "s.json"))
    assert "| transformer (baseline) | 11.00 ± 1.41 | 10.00-12.00 | 20 | 50 (2/2) | 1,000 |" in section
    assert "Earlier numbers." in tracked.read_text() and section in tracked.read_text()
    assert "1 run side by side" in section  # each run's last validation: 1,800 s
    assert "the reported runs trained for 1.0 hours, each run's time summed" in section
    for folder in ("work", "docs"):
        png = tmp_path / folder / "images" / "small_scale_study_bible-en-es.png"
        assert png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "s.json").read_text())["corpora"][0]["corpus"] == "bible-en-es"
    # a corpus of a study in progress with nothing recorded yet: a line, no empty table or plot
    empty = dict(result, corpus="ding-de-en", description="Ding de-en", models={}, missing_runs=18)
    section = study_report.write_report([empty, result], settings, targets, str(tmp_path / "s.json"))
    ding = section.split("### Ding de-en")[1].split("###")[0]
    assert "No run of this corpus is recorded yet (18 to train)." in ding
    assert "| model |" not in ding and "![" not in ding
    assert not (tmp_path / "work" / "images" / "small_scale_study_ding-de-en.png").exists()


def test_claims_table_compares_each_paper_model_with_the_baseline():
    def model(bleus, heads=()):
        runs = [{"bleu": b, "updates_to_convergence": 1, "updates_trained": 1, "converged": True,
                 "train_words_per_s": 1.0, "encoder_attention_params": 1,
                 **({"encoder_heads_kept": h} if h else {})}
                for b, h in zip(bleus, heads or [None] * len(bleus))]  # fmt: skip
        return dict(study.summarise(runs), runs=runs)

    result = {"models": {
        "baseline": model([5.0, 6.0]),
        "local_tied": model([4.2, 5.2]),  # 0.8 below: within the margin
        "localness": model([7.0, 8.0]),  # 2 above, spread ~1
        "dynwin": model([5.0, 6.5]),  # 0.25 above: inside the spread
        "gates_l0": model([5.0, 6.0], heads=[18, 22]),  # no BLEU lost, but 20 of 48 heads kept
        "banded": model([3.0, 4.0]),  # 2 below
    }}  # fmt: skip
    table = "\n".join(study_report.claims_lines(result))
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}
    assert rows["Pande et al."].endswith("(-0.80) | holds |")
    assert rows["Yang et al. 2018"].endswith("(+2.00) | holds |")
    assert rows["Nguyen et al. 2020"].endswith("(+0.25) | not shown (within the seeds' spread) |")
    assert rows["Voita et al. 2019"].endswith("18-22 of 48 encoder heads kept | does not hold |")
    assert rows["Alastruey et al. 2022"].endswith("(-2.00) | does not hold |")
    assert "BLEU mean ± std over 2 seeds, model vs baseline" in table
    # a study in progress: one model has a seed fewer than the others, which the header says
    result["models"]["banded"] = model([3.0])
    assert "over 1-2 seeds, model vs baseline" in study_report.claims_lines(result)[0]
    assert "provisional" in study_report.claims_lines(result)[0]
    only_baseline = {"models": {"baseline": result["models"]["baseline"]}}
    assert study_report.claims_lines(only_baseline) == []  # no claim to test: no empty table
    del result["models"]["baseline"]
    assert study_report.claims_lines(result) == []


def summary_of(bleus, best_losses):
    """A model's summary over seeds, each run with its BLEU and a validation curve reaching
    its best loss."""
    runs = [{"bleu": b, "updates_to_convergence": 1, "updates_trained": 1, "converged": True,
             "train_words_per_s": 1.0, "encoder_attention_params": 1,
             "validations": [{"loss": loss + 1.0}, {"loss": loss}]}
            for b, loss in zip(bleus, best_losses)]  # fmt: skip
    return dict(study.summarise(runs), runs=runs, label="model")


def test_each_model_takes_the_rate_of_its_lower_validation_loss_not_of_its_bleu():
    models = {
        "baseline": summary_of([5.0, 6.0], [4.0, 4.2]),
        "baseline_lr1e-3": summary_of([9.0, 9.0], [4.5, 4.5]),  # higher BLEU, higher loss
        "localness": summary_of([3.0, 3.0], [4.6, 4.6]),
        "localness_lr1e-3": summary_of([6.0, 7.0], [4.0, 4.0]),
        "dynwin": summary_of([5.0, 6.0], [4.1, 4.1]),  # one rate only
    }
    chosen = study_report.at_better_rate(models)
    assert {name: rate for name, (_, rate) in chosen.items()} == {
        "baseline": "3e-3", "localness": "1e-3",
    }  # fmt: skip
    assert chosen["localness"][0] is models["localness_lr1e-3"]
    table = "\n".join(study_report.claims_lines({"models": models}))
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}
    # at 3e-3 localness trails the baseline; at its better rate it is ahead by 1.0 BLEU
    assert "| does not hold | " in rows["Yang et al. 2018"]
    assert rows["Yang et al. 2018"].endswith("| not shown (within the seeds' spread): lr 1e-3 "
                                             "vs 3e-3, 6.50 ± 0.71 vs 5.50 ± 0.71 (+1.00) |")
    rates = "\n".join(study_report.rate_lines(models))
    assert "| model | 1e-3 (better) | 4.000 | 6.50 ± 0.71 | 1 |" in rates
    assert "dynwin" not in chosen


def test_claims_show_the_verdicts_of_another_budget_beside():
    models = {"baseline": summary_of([5.0, 6.0], [4.0, 4.0]),
              "local_tied": summary_of([8.0, 9.0], [3.5, 3.5])}  # fmt: skip
    compared = {"max_update": 8000, "models": {"baseline": summary_of([4.0], [4.0]),
                                               "local_tied": summary_of([2.0], [4.0])}}
    line = study_report.claims_lines({"models": models}, compared)[-2]
    assert line.endswith("| holds | does not hold: 2.00 ± 0.00 vs 4.00 ± 0.00 (-2.00) |")
    assert "at a cap of 8,000 updates" in study_report.claims_lines({"models": models}, compared)[2]
    compared["models"].pop("local_tied")
    assert study_report.claims_lines({"models": models}, compared)[-2].endswith("| not run |")


def test_a_named_section_has_its_own_markers(tmp_path):
    start, end = study_report.section_markers("convergence")
    assert start == "<!-- small-scale study report (convergence): start -->"
    document = study_report.replace_section("# Doc\n", "main")
    document = study_report.replace_section(document, "to convergence", start, end)
    document = study_report.replace_section(document, "main, again")
    assert "main, again" in document and "to convergence" in document and "main\n" not in document


def build_study_model(data_bin, name):
    """The model a study run of ``name`` trains (at the --tiny widths), built by fairseq's own
    argument parsing from the run's options."""
    argv = [str(data_bin), "--user-dir", USER_DIR, *demo.MODEL_DIMS, *TINY_WIDTHS]
    args = options.parse_args_and_arch(
        options.get_training_parser(), [*argv, *study.RUNNABLE[name][1]]
    )
    task = tasks.setup_task(args)
    return task.build_model(args)


def locality_by_module(model):
    """(attention type, layer) -> which mechanisms the module carries."""
    found = {}
    for module in model.modules():
        if isinstance(module, LocalMultiheadAttention):
            found[(module.attention_type, module.layer_index)] = {
                "localness": module.localness is not None,
                "dynamic": bool(module.dynamic_windows),
                "local heads": module.has_local_heads,
            }
    return found


@pytest.mark.parametrize("name", list(study.RUNNABLE))
def test_every_study_model_and_ablation_builds_and_translates(tiny_data, name):
    model = build_study_model(tiny_data / "bin", name)
    model.eval()
    src = torch.tensor([[5, 6, 7, 8, 9, 2]])
    out, _ = model(src, torch.tensor([6]), torch.tensor([[2, 5, 6]]))
    assert torch.isfinite(out).all()


def test_ablations_change_one_setting_of_their_model(tiny_data):
    plain = locality_by_module(build_study_model(tiny_data / "bin", "plain"))
    assert plain and not any(any(m.values()) for m in plain.values())

    dynwin = locality_by_module(build_study_model(tiny_data / "bin", "dynwin"))
    encoder_only = locality_by_module(build_study_model(tiny_data / "bin", "dynwin_enc"))
    assert {k for k, m in dynwin.items() if m["dynamic"]} > {
        k for k, m in encoder_only.items() if m["dynamic"]
    } == {("encoder_self", layer) for layer in range(3)}

    first_layer = locality_by_module(build_study_model(tiny_data / "bin", "localness_layer1"))
    assert {k for k, m in first_layer.items() if m["localness"]} == {("encoder_self", 0)}
    strategies = {
        name: {
            m.localness.strategy + "/" + m.localness.centre
            for m in build_study_model(tiny_data / "bin", name).modules()
            if isinstance(m, LocalMultiheadAttention) and m.localness is not None
        }
        for name in ("localness", "localness_code", "localness_head", "localness_fixed")
    }
    assert strategies == {
        "localness": {"query/paper"},
        "localness_code": {"query/code"},
        "localness_head": {"head/paper"},
        "localness_fixed": {"fixed/paper"},
    }


def test_one_seeds_lead_must_exceed_the_spread_of_the_seeds_under_the_other_budget():
    # at convergence one seed each: dynwin 0.10 above the baseline, localness 1.50 above
    models = {"baseline": summary_of([22.6], [4.0]), "dynwin": summary_of([22.7], [4.0]),
              "localness": summary_of([24.1], [4.0])}  # fmt: skip
    compared = {"max_update": 8000, "models": {
        "baseline": summary_of([17.0, 17.9, 17.1], [5.0] * 3),
        "dynwin": summary_of([17.5, 18.3, 17.9], [5.0] * 3),
        "localness": summary_of([15.0, 13.1, 16.9], [5.0] * 3),
    }}  # fmt: skip
    table = study_report.claims_lines({"models": models}, compared)
    assert "an improvement must exceed the same models' seeds' spread at the cap" in table[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in table[4:-1]}
    # the spread at the cap: sqrt(0.40^2 + 0.49^2) = 0.63 for dynwin, 1.96 for localness
    assert "(+0.10) | not shown (within the seeds' spread at a cap of 8,000 updates, 0.63) |" in (
        rows["Nguyen et al. 2020"]
    )
    assert "(+1.50) | not shown (within the seeds' spread at a cap of 8,000 updates, 1.96) |" in (
        rows["Yang et al. 2018"]
    )
    # without the other budget, one seed's lead stands alone (and the header says provisional)
    alone = study_report.claims_lines({"models": models})
    assert "(+0.10) | holds |" in "\n".join(alone) and "provisional" in alone[0]
