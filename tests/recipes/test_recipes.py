"""The paper recipes (local_attn_fairseq.recipes) and the small-scale study, end to end on tiny
data.

Every recipe runs prepare -> train -> average -> evaluate through the driver's command line
(``recipes.cli.main``, the function that ``local-attn-recipe`` and
``python scripts/recipes/run_recipe.py`` call; the script also as a separate process), with
``--profile tiny`` (2 updates of narrow models) on a slice of the bundled Ding German-English
corpus given as ``--raw-dir``. Zh-En, En-Ru and En-Fr have no bundled data: their recipes get the
same German-English text with the German side relabelled (zh, ru, fr), which exercises their own
preparation (separate vocabularies, length filter, held-out validation) but not the languages.
LM-1B gets the English side. MuST-C gets the synthetic speech corpus of
scripts/data/synthesize_speech_corpus.py.
"""

import ast
import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch
import yaml

from local_attn_fairseq import recipes
from local_attn_fairseq.recipes import averaging, corpora, scoring, text_preparation
from local_attn_fairseq.recipes import cli as recipe_cli
from local_attn_fairseq.recipes import config as rc
from local_attn_fairseq.recipes.driver import RecipeRun
from tests.conftest import REPO, run_script

DRIVER = os.path.join(REPO, "scripts", "recipes", "run_recipe.py")
CONSOLE_SCRIPT = os.path.join(os.path.dirname(sys.executable), "local-attn-recipe")
SYNTHESIZER = os.path.join(REPO, "scripts", "data", "synthesize_speech_corpus.py")
SIZES = {"train": 200, "valid": 8, "test": 8}
# data set -> {its language: the Ding side standing in for it}
STAND_INS = {
    "wmt14_en_de": {"en": "en", "de": "de"},
    "wmt16_en_de": {"en": "en", "de": "de"},
    "wmt14_en_ru": {"en": "en", "ru": "de"},
    "wmt17_zh_en": {"zh": "de", "en": "en"},
    "wmt14_en_fr": {"en": "en", "fr": "de"},
    "lm1b": {"en": "en"},
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="session")
def ding_pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ding_pairs")
    subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "prepare_ding.py"), "--out-dir", root],
        check=True,
        capture_output=True,
    )
    return root


@pytest.fixture(scope="session")
def raw_dirs(ding_pairs, tmp_path_factory):
    """{data set: a --raw-dir in the simple layout}, all cut from one slice of the corpus."""
    root = tmp_path_factory.mktemp("recipe_raw")
    dirs = {}
    for dataset, sides in STAND_INS.items():
        dirs[dataset] = root / dataset
        dirs[dataset].mkdir()
        for split, n in SIZES.items():
            for lang, side in sides.items():
                with open(ding_pairs / f"{split}.{side}", encoding="utf-8") as f:
                    lines = [next(f) for _ in range(n)]
                (dirs[dataset] / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    return dirs


@pytest.fixture(scope="session")
def work_dir(tmp_path_factory):
    """One work dir for every recipe: recipes that prepare a corpus alike share it."""
    return tmp_path_factory.mktemp("recipe_work")


def drive(recipe, row, work_dir, raw_dir, *extra):
    argv = [recipe, "--row", row, "--profile", "tiny", "--work-dir", str(work_dir)]
    argv += ["--raw-dir", str(raw_dir), *extra]
    assert recipe_cli.main(argv) == 0


def results(work_dir, recipe, row):
    path = os.path.join(work_dir, "rows", recipe, rc.slug(row), "seed1", "results.json")
    with open(path) as f:
        return json.load(f)


# ---- every recipe, end to end ----------------------------------------------------------------

END_TO_END = [
    ("pande_wmt14_en_ru", "Fully Tied (l)"),
    ("yang_wmt14_en_de", "+ Localness + Rel Pos"),
    ("nguyen_wmt14_en_de", "Enc(AW)-Cr(AW,Seg)-Dec(MW)"),
    ("nguyen_wmt14_en_fr", "Cr(AW,Seg)"),
]


def test_pande_recipe(raw_dirs, work_dir, capsys):
    row = "1LocHead 7TiedLoc All6 (i)"
    drive("pande_wmt14_en_de", row, work_dir, raw_dirs["wmt14_en_de"])
    printed = capsys.readouterr().out
    assert "$ fairseq-train" in printed and "| averaged 2 checkpoints" in printed
    out = results(work_dir, "pande_wmt14_en_de", row)
    # config (i) at 32 dims: per layer full Wv and Wo, and only head 0's rows of Wq and Wk
    assert out["measured"]["encoder_attention_params"] == 6 * (2 * 32 * 32 + 2 * 32 * 4)
    assert 0 <= out["measured"]["bleu"] <= 100
    assert out["paper"]["bleu"] == 30.31


# the words the report gives for each recipe's headline BLEU, as its paper computed it
HEADLINE = {
    "pande_wmt14_en_ru": "sacreBLEU",
    "yang_wmt14_en_de": "Moses-tokenised text",
    "nguyen_wmt14_en_de": "with compound splitting (##AT##-##AT##)",
    "nguyen_wmt14_en_fr": "(hyphens split, Moses -a)",
}


@pytest.mark.parametrize("recipe,row", END_TO_END)
def test_recipe_end_to_end(recipe, row, raw_dirs, work_dir):
    dataset = rc.load_recipe(recipe)["data"]
    drive(recipe, row, work_dir, raw_dirs[dataset])
    out = results(work_dir, recipe, row)
    measured = out["measured"]
    assert 0 <= measured["sacrebleu"] <= 100 and measured["params"] > 0
    # every translation row computes tokenised BLEU (sacremoses is in the set-up); the headline
    # is the paper's own variant
    assert 0 <= measured["tokenized_bleu"] <= 100
    headline = "sacrebleu" if HEADLINE[recipe] == "sacreBLEU" else "tokenized_bleu"
    assert measured["bleu"] == measured[headline] and HEADLINE[recipe] in out["headline"]
    assert out["subset"] == "test" and out["paper"]["bleu"] > 27
    assert out["chosen_not_from_paper"] == rc.get_row(rc.load_recipe(recipe), row)["chosen"]


def test_yang_en_de_has_a_joint_model_and_a_dictionary_per_side(raw_dirs, work_dir):
    """The paper's unshared embeddings of per-side vocabularies (Table 4's parameter counts):
    one sentencepiece model, two fairseq dictionaries, three embedding matrices."""
    recipe, row = "yang_wmt14_en_de", "TRANSFORMER-BASE"
    drive(recipe, row, work_dir, raw_dirs["wmt14_en_de"])
    data = os.path.join(work_dir, "data", "wmt14_en_de_bpe300_joint-spm")
    assert os.listdir(os.path.join(data, "spm")).count("spm.joint.model") == 1
    dicts = {}
    for lang in ("en", "de"):
        with open(os.path.join(data, "bin", f"dict.{lang}.txt"), encoding="utf-8") as f:
            dicts[lang] = [line.split()[0] for line in f]
    assert dicts["en"] != dicts["de"]
    state = torch.load(results(work_dir, recipe, row)["checkpoint"], weights_only=False)
    weights = state["model"]
    rows = {k: v.shape[0] for k, v in weights.items() if k.endswith(("embed_tokens.weight",
                                                                      "output_projection.weight"))}
    assert rows == {"encoder.embed_tokens.weight": len(dicts["en"]) + 4,
                    "decoder.embed_tokens.weight": len(dicts["de"]) + 4,
                    "decoder.output_projection.weight": len(dicts["de"]) + 4}  # fmt: skip
    assert weights["decoder.embed_tokens.weight"] is not weights["decoder.output_projection.weight"]


def test_en_fr_training_pairs_are_cleaned_as_fairseqs_preparation(raw_dirs, work_dir):
    """Nguyen et al.'s 36M En-Fr pairs: fairseq's clean-corpus-n.perl -ratio 1.5 ... 1 250."""
    drive("nguyen_wmt14_en_fr", "Cr(AW,Seg)", work_dir, raw_dirs["wmt14_en_fr"], "--stage",
          "prepare")  # fmt: skip
    spm = os.path.join(work_dir, "data", "wmt14_en_fr_bpe300_joint_min1_max250_ratio1.5", "spm")
    with open(os.path.join(spm, "train.en")) as en, open(os.path.join(spm, "train.fr")) as fr:
        pairs = [(len(a.split()), len(b.split())) for a, b in zip(en, fr)]
    assert 0 < len(pairs) < SIZES["train"]  # the ratio drops some of the Ding pairs
    assert all(1 <= min(n, m) and max(n, m) <= min(250, 1.5 * min(n, m)) for n, m in pairs)


def test_zh_en_recipe_scores_the_dev_set_with_separate_vocabularies(raw_dirs, work_dir):
    recipe, row = "yang_wmt17_zh_en", "Table 2: layers [1-3]"
    drive(recipe, row, work_dir, raw_dirs["wmt17_zh_en"])
    assert results(work_dir, recipe, row)["subset"] == "valid"
    data = os.path.join(work_dir, "data", "wmt17_zh_en_bpe300_separate_max50", "spm")
    assert os.path.exists(os.path.join(data, "spm.zh.model"))
    with open(os.path.join(data, "train.zh")) as f:
        assert all(len(line.split()) <= 50 for line in f)


def test_language_model_recipe(raw_dirs, work_dir):
    drive("nguyen_lm1b", "Dec (MW)", work_dir, raw_dirs["lm1b"])
    out = results(work_dir, "nguyen_lm1b", "Dec (MW)")
    assert out["measured"]["perplexity"] > 1 and out["paper"]["perplexity"] == 44.0


def test_voita_from_scratch_row_trains_its_whole_chain(raw_dirs, work_dir):
    """baseline -> fine-tuning with gates in every attention type -> averaging -> pruning ->
    the pruned shape trained from scratch, from one command."""
    recipe, row = "voita_wmt_en_ru", "sparse heads 14/31/30 (from scratch)"
    drive(recipe, row, work_dir, raw_dirs["wmt14_en_ru"])
    gated = results_dir(work_dir, recipe, "sparse heads 14/31/30 (from trained)")
    with open(os.path.join(gated, "heads_kept.json")) as f:
        kept = json.load(f)
    assert set(kept) == {"encoder_self", "decoder_self", "decoder_cross"}
    assert os.path.exists(os.path.join(gated, "pruned.pt"))
    with open(os.path.join(results_dir(work_dir, recipe, row), "train.log")) as f:
        assert "heads_kept" in f.read()
    assert 0 <= results(work_dir, recipe, row)["measured"]["bleu"] <= 100


def results_dir(work_dir, recipe, row):
    return os.path.join(work_dir, "rows", recipe, rc.slug(row), "seed1")


@pytest.mark.skipif(not shutil.which("espeak-ng"), reason="espeak-ng synthesises the speech")
def test_speech_recipe_asr_then_st(ding_pairs, work_dir, tmp_path):
    mustc = tmp_path / "mustc"
    command = [sys.executable, SYNTHESIZER, "--out-dir", mustc, "--train-size", 24]
    command += ["--dev-size", 8, "--test-size", 8, "--pairs-dir", ding_pairs]
    subprocess.run(list(map(str, command)), check=True, capture_output=True)
    recipe = "alastruey_mustc_en_de"
    # a vocabulary per task, as the recipe's 5,000 (ASR) and 8,000 (ST) at the tiny scale
    sizes = "--override", "prepare.vocab_size={asr: 60, st: 100}"
    drive(recipe, "Ours", work_dir, mustc, *sizes)
    assert results(work_dir, recipe, "Ours")["measured"]["bleu"] >= 0
    drive(recipe, "ASR pre-training (local)", work_dir, mustc, "--stage", "evaluate", *sizes)
    assert results(work_dir, recipe, "ASR pre-training (local)")["measured"]["wer"] >= 0
    with open(os.path.join(results_dir(work_dir, recipe, "Ours"), "train.log")) as f:
        log = f.read()
    assert "loaded pretrained encoder" in log and "0,0,0,5,5,9,13,11,15,19,17,21" in log
    # the data the rows trained on: fairseq's LB SpecAugment on training batches of both tasks
    data = os.path.join(work_dir, "data", "mustc-en-de-asr-unigram60-st-unigram100-specaugment-lb")
    for task, size in (("asr", 60), ("st", 100)):
        with open(os.path.join(data, f"config_{task}.yaml")) as f:
            config = yaml.safe_load(f)
        assert config["specaugment"] == {"time_wrap_W": 0, "freq_mask_N": 1, "freq_mask_F": 27,
                                         "time_mask_N": 1, "time_mask_T": 100, "time_mask_p": 1.0}
        assert config["feature_transforms"]["_train"] == ["utterance_cmvn", "specaugment"]
        assert "specaugment" not in config["feature_transforms"]["*"]
        assert config["vocab_filename"] == f"spm_unigram{size}_{task}.txt"
    # fairseq's training set of the ST row applied it
    assert "config_st.yaml" in log and "SpecAugmentTransform(time_warp_w=0" in log


# ---- the command line refuses what it cannot do ---------------------------------------------


def cli(*argv):
    """scripts/recipes/run_recipe.py with `argv`, in this process (the console script, a
    process of its own, is compared with it below)."""
    return run_script(os.path.relpath(DRIVER, REPO), *argv)


def test_unsupported_row_is_refused_with_its_reason():
    proc = cli("voita_wmt_en_ru", "--row", "OpenSubtitles baseline 48/48/48", "--work-dir", "x")
    assert proc.returncode == 2
    assert "cannot be run" in proc.stderr and "OPUS" in proc.stderr


def test_unknown_row_suggests_the_close_ones():
    proc = cli("pande_wmt14_en_de", "--row", "Fully Tied", "--work-dir", "x", "--dry-run")
    assert proc.returncode == 2 and "did you mean 'Fully Tied (l)'" in proc.stderr


def test_list_rows_shows_the_papers_numbers():
    proc = cli("nguyen_wmt14_en_fr", "--list-rows")
    assert proc.returncode == 0
    assert "Enc(AW)-Cr(AW,Seg)-Dec(MW)" in proc.stdout and "40.32" in proc.stdout
    assert "MW Cross" not in proc.stdout  # Table 2 is En-De only


def test_manual_downloads_are_named(tmp_path):
    proc = cli("voita_wmt_en_ru", "--row", "baseline 48/48/48", "--stage", "prepare",
               "--work-dir", str(tmp_path), "--raw-dir", str(tmp_path))  # fmt: skip
    assert proc.returncode == 2 and "1mcorpus.zip" in proc.stderr
    assert "translate.yandex.ru" in proc.stderr


def test_console_script_runs_the_same_driver():
    proc = subprocess.run([CONSOLE_SCRIPT, "--list"], capture_output=True, text=True)
    assert proc.returncode == 0 and "pande_wmt14_en_de" in proc.stdout
    assert proc.stdout == cli("--list").stdout


# ---- the package's modules import one way only -----------------------------------------------

# stage order: config -> data -> train -> evaluate -> report, then the driver and its CLI
MODULE_ORDER = ["config", "workspace", "corpora", "text_preparation", "speech", "training",
                "averaging", "scoring", "evaluation", "driver", "cli"]  # fmt: skip


def sibling_imports(path):
    """The recipes modules that the module at ``path`` imports, anywhere in it."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    package = "local_attn_fairseq.recipes"
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = (package + "." if node.level == 1 else "") + (node.module or "")
        if module.rstrip(".") == package:
            yield from (alias.name for alias in node.names)
        elif module.startswith(package + "."):
            yield module.split(".")[2]


def test_recipe_modules_import_only_earlier_stages():
    package_dir = os.path.dirname(recipes.__file__)
    modules = {f[: -len(".py")] for f in os.listdir(package_dir) if f.endswith(".py")}
    assert modules - {"__init__"} == set(MODULE_ORDER)
    for position, name in enumerate(MODULE_ORDER):
        for imported in sibling_imports(os.path.join(package_dir, f"{name}.py")):
            assert imported in MODULE_ORDER[:position], f"{name} imports {imported}"


# ---- every row of every recipe is a valid fairseq command ------------------------------------


def all_rows():
    for name in rc.recipe_names():
        recipe = rc.load_recipe(name)
        for row, settings in recipe["rows"].items():
            yield name, row, bool(settings.get("unsupported"))


# Tokens per update as each paper states it (not read from the recipes, which they check):
# Pande 5.1 "25K" (En-Ru) and "32K" (En-De); Yang 4.1 eight GPUs x 4096; Nguyen 5.1 Ott et al.'s
# 8-GPU setup (8 x 3584), the LM "virtually 4 GPUs"; Voita B.1 "approximately 16000";
# Alastruey C 40,000 x update frequency 8.
PAPER_TOKENS_PER_UPDATE = {
    "pande_wmt14_en_de": 32000, "pande_wmt14_en_ru": 25000,
    "yang_wmt14_en_de": 8 * 4096, "yang_wmt17_zh_en": 8 * 4096,
    "nguyen_wmt14_en_de": 8 * 3584, "nguyen_wmt14_en_fr": 8 * 3584, "nguyen_lm1b": 4 * 3584,
    "voita_wmt_en_ru": 16000,
    "alastruey_mustc_en_de": 320000, "alastruey_mustc_en_es": 320000,
    "alastruey_mustc_en_it": 320000,
}  # fmt: skip


def paper_learning_rate(name, row):
    """The peak learning rate of the row's paper (or of the setup it cites, where it is silent)."""
    if name.startswith("pande"):
        return 512**-0.5 * 16000**-0.5  # Vaswani et al.'s formula, warm-up 16k (Section 5.1)
    if name.startswith("yang"):  # Vaswani et al.'s formula, warm-up 4000, base and big
        width = int(row["args"].get("encoder-embed-dim", 512))
        return width**-0.5 * 4000**-0.5
    if name.startswith("nguyen"):  # Ott et al. (2018): fairseq's scaling_nmt at 8 x 3584
        return 5e-4
    if name.startswith("voita"):  # B.3: scale 4, warm-up 16k; fine-tuning: chosen, 5e-4
        return 5e-4 if row["prune"] else 4 * 512**-0.5 * 16000**-0.5
    if name.startswith("alastruey"):  # Appendix C: 1e-3 for ASR, 2e-3 for ST
        return 1e-3 if row["data"] == "asr" else 2e-3
    raise AssertionError(f"no paper learning rate for {name}")


def option(argv, flag):
    return argv[argv.index(flag) + 1]


def test_every_runnable_row_carries_its_papers_batch_and_learning_rate():
    """Every runnable row parses as fairseq-train options, with the paper's peak learning rate
    and, on 1, 2, 4 and 8 GPUs, the paper's tokens per update (max-tokens x update-freq x GPUs
    within 5%)."""
    from fairseq import options

    checked = 0
    for name, row_name, unsupported in all_rows():
        recipe = rc.load_recipe(name)
        if unsupported:
            with pytest.raises(rc.RecipeError, match="cannot be run"):
                rc.get_row(recipe, row_name)
            continue
        row = rc.get_row(recipe, row_name)
        paper = PAPER_TOKENS_PER_UPDATE[name]
        for gpus in (1, 2, 4, 8):
            run = RecipeRun(recipe, "/tmp/unused", gpus=gpus, dry_run=True)
            argv = [str(a) for a in run.train_argv(row)]
            tokens = int(option(argv, "--max-tokens")) * int(option(argv, "--update-freq"))
            assert abs(tokens * gpus - paper) <= 0.05 * paper, (name, row_name, gpus, tokens)
            assert int(option(argv, "--distributed-world-size")) == gpus
        args = options.parse_args_and_arch(options.get_training_parser(), input_args=argv)
        assert args.arch == row["arch"], (name, row_name)
        assert args.lr[0] == pytest.approx(paper_learning_rate(name, row), rel=0.01), row_name
        checked += 1
    assert checked > 90


def test_batch_plan_keeps_the_papers_batch_on_any_gpu_count():
    assert rc.batch_plan(32000, 4096, 1) == (4000, 8)  # one GPU accumulates 8 batches
    assert rc.batch_plan(32000, 4096, 8) == (4000, 1)
    # more GPUs than the batch needs: smaller batches, not a larger update
    assert rc.batch_plan(16000, 4000, 8) == (2000, 1)
    assert rc.batch_plan(14336, 3584, 8) == (1792, 1)
    assert rc.batch_plan(25000, 4096, 1) == (3571, 7)  # 24,997 tokens
    assert rc.batch_plan(25000, 4096, 2) == (3125, 4)
    with pytest.raises(rc.RecipeError):
        rc.batch_plan(32000, 4096, 0)


def test_an_update_freq_given_by_the_user_is_kept():
    recipe = rc.with_settings(rc.load_recipe("voita_wmt_en_ru"), None, ["update-freq=3"])
    run = RecipeRun(recipe, "/tmp/unused", gpus=8, dry_run=True)
    argv = [str(a) for a in run.train_argv(rc.get_row(recipe, "baseline 48/48/48"))]
    assert option(argv, "--update-freq") == "3" and option(argv, "--max-tokens") == "4000"
    assert argv.count("--update-freq") == 1


# ---- the pieces -----------------------------------------------------------------------------


def test_overrides_and_null_deletes():
    recipe = rc.load_recipe("voita_wmt_en_ru")
    changed = rc.with_settings(recipe, None, ["max-update=7", "prepare.vocab_size=123"])
    assert changed["prepare"]["vocab_size"] == 123
    row = rc.get_row(changed, "sparse heads 5/9/12 (from trained)")
    assert row["args"]["max-update"] == 7 and row["args"]["l0-lambda"] == 0.1
    # the fine-tuning rows remove the inherited warm-up options
    assert "warmup-init-lr" not in row["args"] and row["args"]["lr-scheduler"] == "fixed"
    with pytest.raises(rc.RecipeError, match="KEY=VALUE"):
        rc.parse_override("max-update")


def test_averaging_is_the_mean_and_keeps_tied_weights_tied(tmp_path):
    shared = [torch.full((2, 2), float(i)) for i in (1, 3)]
    for i, weight in enumerate(shared, 1):
        state = {"model": {"a": weight, "b": weight, "n": torch.tensor(i)}, "cfg": {"i": i}}
        torch.save(state, tmp_path / f"checkpoint_1_{i * 10}.pt")
    paths = averaging.last_checkpoints(str(tmp_path), 5)
    assert [os.path.basename(p) for p in paths] == ["checkpoint_1_10.pt", "checkpoint_1_20.pt"]
    averaging.average_checkpoints(paths, str(tmp_path / "avg.pt"))
    avg = torch.load(tmp_path / "avg.pt", weights_only=False)
    assert torch.equal(avg["model"]["a"], torch.full((2, 2), 2.0))
    assert avg["model"]["a"] is avg["model"]["b"] and avg["cfg"] == {"i": 2}
    torch.save({"model": {"c": shared[0]}}, tmp_path / "checkpoint_1_30.pt")
    with pytest.raises(ValueError, match="other parameters"):
        averaging.average_checkpoints(
            averaging.last_checkpoints(str(tmp_path), 2), str(tmp_path / "x.pt")
        )


def test_word_error_rate_and_generate_output(tmp_path):
    assert scoring.word_error_rate(["the cat sat"], ["The cat sat down."]) == 25.0
    assert scoring.word_error_rate(["a b"], ["c d"]) == 100.0
    out = tmp_path / "generate-test.txt"
    out.write_text("T-1\tzwei\nD-1\t-0.1\ttwo\nT-0\teins\nD-0\t-0.2\tone\n", encoding="utf-8")
    assert scoring.read_generate_output(out, expected=2) == (["one", "two"], ["eins", "zwei"])
    with pytest.raises(ValueError, match="2 hypotheses for 3"):
        scoring.read_generate_output(out, expected=3)


def test_archives_are_unpacked_and_assembled(tmp_path):
    """The download path with file:// URLs: a tarball with plain, sgm and ' ||| ' files."""
    src = tmp_path / "src"
    (src / "corp").mkdir(parents=True)
    (src / "corp" / "a.en").write_text("one\ntwo\nthree\nfour\n")
    (src / "corp" / "a.ru").write_text("odin\ndva\ntri\nchetyre\n")
    (src / "corp" / "w.ru-en").write_text("pyat ||| five\n")
    sgm = '<srcset>\n<doc>\n<seg id="1">A &amp; B</seg>\n</doc>\n</srcset>\n'
    (src / "corp" / "t-src.en.sgm").write_text(sgm)
    (src / "corp" / "t-ref.ru.sgm").write_text(sgm.replace("A", "Z"))
    archive = tmp_path / "corp.tgz"
    with tarfile.open(archive, "w:gz") as t:
        t.add(src / "corp", arcname="corp")
    dataset = {
        "source": "en",
        "target": "ru",
        "downloads": {"c": {"url": archive.as_uri()}},
        "train": [
            {"from": "c", "src": "corp/a.en", "tgt": "corp/a.ru"},
            {"from": "c", "pairs": "w.ru-en", "separator": " ||| ", "columns": {"ru": 0, "en": 1}},
        ],
        "valid": {"from_train": 2},
        "test": [{"from": "c", "src": "corp/t-src.en.sgm", "tgt": "corp/t-ref.ru.sgm"}],
    }
    out = tmp_path / "out"
    corpora.assemble(dataset, None, str(tmp_path / "dl"), str(out))
    train_en = (out / "train.en").read_text().split("\n")[:-1]
    valid_en = (out / "valid.en").read_text().split("\n")[:-1]
    assert sorted(train_en + valid_en) == ["five", "four", "one", "three", "two"]
    assert len(valid_en) == 2 and (out / "test.en").read_text() == "A &amp; B\n"
    assert (out / "test.ru").read_text() == "Z &amp; B\n"
    dataset["train"][0]["src"] = "corp/missing.en"
    with pytest.raises(rc.RecipeError, match="missing.en not found"):
        corpora.assemble(dataset, None, str(tmp_path / "dl"), str(tmp_path / "out2"))


def test_raw_dir_with_some_split_files_missing_is_refused(tmp_path):
    (tmp_path / "train.en").write_text("a\n")
    with pytest.raises(rc.RecipeError, match="test.de"):
        corpora.simple_layout(str(tmp_path), ["en", "de"])


# ---- what the papers leave unstated, and the scores as they computed them -------------------


def dry_run(recipe, row, *extra):
    """What ``--dry-run`` prints for ``row`` (commands, batch, chosen settings)."""
    argv = [recipe, "--row", row, "--work-dir", "/tmp/unused", "--dry-run", *extra]
    proc = cli(*argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_dry_run_names_the_settings_the_paper_leaves_unstated():
    out = dry_run("voita_wmt_en_ru", "baseline 48/48/48")
    assert "| chosen, not from the paper:" in out
    assert "test set: newstest2014 (a guess: the paper does not name its test set)" in out
    # Pande's two test sets: the recipe says which reading it takes and why
    out = dry_run("pande_wmt14_en_ru", "Baseline (a)")
    assert "newstest2014, the reading of Section 5.1" in out and "newstest2018" in out
    assert "| reported as the paper's number: sacreBLEU" in out
    listed = cli("pande_wmt14_en_de", "--list-rows").stdout
    assert "| chosen, not from the paper:" in listed and "test set: newstest2014" in listed


def test_dry_run_of_nguyen_carries_ott_et_als_settings():
    out = dry_run("nguyen_wmt14_en_de", "Enc(AW)-Cr(AW,Seg)-Dec(MW)", "--gpus", "1")
    train = next(line for line in out.splitlines() if line.startswith("$ fairseq-train"))
    assert "--lr 0.0005 " in train and "--warmup-updates 4000 " in train
    assert "--max-tokens 3584 --update-freq 8 " in train and "wmt16_en_de" in train
    assert ("| reported as the paper's number: case-sensitive BLEU of Moses-tokenised text with "
            "compound splitting (##AT##-##AT##) on test") in out  # fmt: skip
    out = dry_run("nguyen_wmt14_en_fr", "Cr(AW,Seg)")
    assert "(hyphens split, Moses -a) on test" in out and "compound" not in out.split("reported")[1]
    out = dry_run("nguyen_lm1b", "Dec (MW)", "--gpus", "8")
    assert "--lr 0.0005 " in out and "--max-tokens 1792 --update-freq 1 " in out
    assert "--decoder-post-norm" in out and "normalisation: post-norm (--decoder-post-norm)" in out


def test_dry_run_of_alastruey_prepares_fairseqs_mustc_data():
    out = dry_run("alastruey_mustc_en_de", "Baseline")
    prepare = next(line for line in out.splitlines() if "local_attn_fairseq.data.mustc" in line)
    assert "--vocab-type unigram --asr-vocab-size 5000 --st-vocab-size 8000" in prepare
    assert "--specaugment lb" in prepare
    train = [line for line in out.splitlines() if line.startswith("$ fairseq-train")]
    assert "--config-yaml config_asr.yaml" in train[0] and "--lr 0.001 " in train[0]
    assert "--config-yaml config_st.yaml" in train[1] and "--lr 0.002 " in train[1]
    assert all("--max-tokens 40000 --update-freq 8 " in t for t in train)


def test_nguyen_language_model_is_post_norm_as_the_mt_model():
    from fairseq import options
    from fairseq.data import Dictionary

    from local_attn_fairseq.models.transformer_lm_local import LocalTransformerLanguageModel

    recipe = rc.load_recipe("nguyen_lm1b")
    run = RecipeRun(recipe, "/tmp/unused", gpus=1, dry_run=True)
    argv = [str(a) for a in run.train_argv(rc.get_row(recipe, "Vaswani et al. (2017)"))]
    argv += ["--decoder-layers", "1", "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32",
             "--decoder-attention-heads", "2"]  # fmt: skip
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=argv)
    dictionary = Dictionary()
    task = type("Task", (), {"source_dictionary": dictionary, "target_dictionary": dictionary})
    model = LocalTransformerLanguageModel.build_model(args, task)
    assert not model.decoder.layers[0].normalize_before


def test_compound_splitting_is_fairseqs_compound_split_bleu():
    # perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g': non-overlapping, free-standing dashes kept
    assert scoring.split_compounds("Café-Liebhaber a-b-c - x") == (
        "Café ##AT##-##AT## Liebhaber a ##AT##-##AT## b-c - x"
    )
    refs = ["Der Café-Liebhaber trinkt einen Espresso im Stadt-Zentrum ."]
    hyps = ["Der Café Liebhaber trinkt einen Espresso im Stadt Zentrum ."]
    plain = scoring.tokenized_bleu(hyps, refs, "de")
    split = scoring.tokenized_bleu(hyps, refs, "de", compound_split=True)
    assert split > plain  # the compound's halves now match as tokens
    assert scoring.tokenized_bleu(refs, refs, "de", compound_split=True) == 100.0
    dashes = scoring.tokenized_bleu(hyps, refs, "de", aggressive_dashes=True)
    assert dashes == split  # Moses -a splits these hyphens as compound splitting does


def test_tokenised_bleu_without_sacremoses_is_an_error_not_an_empty_score(monkeypatch):
    monkeypatch.setitem(sys.modules, "sacremoses", None)  # import sacremoses -> ImportError
    with pytest.raises(rc.RecipeError, match="sacremoses"):
        scoring.tokenized_bleu(["a"], ["a"], "en")


def test_pair_filter_is_clean_corpus_n():
    clean = text_preparation.PairFilter(min_length=1, max_length=4, length_ratio=1.5)
    assert clean.keeps([2, 3]) and clean.keeps([4, 4])
    assert not clean.keeps([2, 4])  # 4 / 2 > 1.5
    assert not clean.keeps([0, 0]) and not clean.keeps([5, 5])
    assert text_preparation.PairFilter(max_length=50).keeps([1, 50])
    assert text_preparation.PairFilter.from_settings({"vocab_size": 8}) is None


def test_docs_carry_each_papers_settings_tables():
    """docs/reproduction.md holds, per paper, the tables of what each recipe chose where the
    paper is silent and where it departs from the paper, exactly as the recipes say them
    (regenerate a table with config.settings_table(names, "chosen"))."""
    with open(os.path.join(REPO, "docs", "reproduction.md"), encoding="utf-8") as f:
        docs = f.read()
    for paper, names in rc.recipes_by_paper().items():
        for key in ("chosen", "departures"):
            table = rc.settings_table(names, key)
            assert table in docs, f"docs/reproduction.md lacks the {key} table of {paper}"


# ---- nothing of the user's is replaced; downloads are checked -------------------------------


def test_downloads_are_checked_against_their_recorded_checksum(tmp_path):
    import hashlib

    archive = tmp_path / "corpus.txt"
    archive.write_bytes(b"one\ntwo\n")
    download = {"url": archive.as_uri(), "sha256": hashlib.sha256(b"one\ntwo\n").hexdigest()}
    assert os.path.exists(corpora._fetch("c", download, None, str(tmp_path / "dl")))
    assert (tmp_path / "dl" / "corpus.txt").read_bytes() == b"one\ntwo\n"

    archive.write_bytes(b"one\ntwo, changed on the server\n")
    with pytest.raises(rc.RecipeError, match="sha256 .* differs from the"):
        corpora._fetch("c", download, None, str(tmp_path / "dl2"))
    assert os.listdir(tmp_path / "dl2") == []  # neither the file nor its partial download
    md5 = {"url": archive.as_uri(), "md5": "0" * 32}
    with pytest.raises(rc.RecipeError, match="md5"):
        corpora._fetch("c", md5, None, str(tmp_path / "dl3"))
    with pytest.raises(rc.RecipeError, match="unknown keys sha265"):
        corpora.fetch_all({"c": {"url": archive.as_uri(), "sha265": "x"}}, None, str(tmp_path))


def test_every_recipe_url_is_https():
    import yaml

    with open(os.path.join(rc.CONFIG_DIR, "datasets.yaml"), encoding="utf-8") as f:
        text = f.read()
    datasets = yaml.safe_load(text)
    urls = [d["url"] for s in datasets.values() for d in s["downloads"].values() if "url" in d]
    assert len(urls) == 25 and all(u.startswith("https://") for u in urls)
    assert "http://" not in text  # the pages named for manual downloads too


def test_recipes_refuse_a_work_dir_of_someone_else(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.txt").write_text("a user's")
    proc = cli("pande_wmt14_en_de", "--row", "1LocHead 7TiedLoc All6 (i)", "--stage", "prepare",
               "--work-dir", str(tmp_path))  # fmt: skip
    assert proc.returncode == 2 and "--work-dir" in proc.stderr and "--overwrite" in proc.stderr
    assert os.listdir(tmp_path) == ["data"] and os.listdir(tmp_path / "data") == ["mine.txt"]


@pytest.mark.parametrize(
    "stage, missing, advice",
    [("train", "bin", "run the prepare stage first"),
     ("average", "checkpoints", "run the train stage first")],
)  # fmt: skip
def test_a_stage_before_its_inputs_says_which_stage_to_run(tmp_path, stage, missing, advice):
    proc = cli("pande_wmt14_en_de", "--row", "1LocHead 7TiedLoc All6 (i)", "--stage", stage,
               "--work-dir", str(tmp_path))  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and missing in error and advice in error


def test_averaging_refuses_to_write_over_a_checkpoint_it_reads(tmp_path):
    torch.save({"model": {"a": torch.ones(1)}}, tmp_path / "checkpoint_1_10.pt")
    paths = averaging.last_checkpoints(str(tmp_path), 5)
    with pytest.raises(ValueError, match="is the input file"):
        averaging.average_checkpoints(paths, str(tmp_path / "checkpoint_1_10.pt"))
    assert torch.load(tmp_path / "checkpoint_1_10.pt")["model"]["a"].item() == 1.0


def test_a_binarisation_not_written_by_the_recipes_is_not_replaced(tmp_path):
    run = RecipeRun(rc.load_recipe("pande_wmt14_en_de"), str(tmp_path))
    os.makedirs(run.bin)
    (tmp_path / "keep.txt").write_text("x")
    with open(os.path.join(run.bin, "dict.en.txt"), "w") as f:
        f.write("a user's dictionary")
    with pytest.raises(rc.RecipeError, match="no complete binarised data"):
        text_preparation.binarise(run, ["en", "de"], str(tmp_path / "spm"), joint=True)
    with open(os.path.join(run.bin, "dict.en.txt")) as f:
        assert f.read() == "a user's dictionary"
