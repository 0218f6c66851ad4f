"""The rolling window cache through the models and fairseq's tools: decoder layers whose every
head is causal-local keep only the last window of keys while decoding, and every way of decoding
(beam search, --prefix-size, sampling, ensembles, shallow fusion, fairseq-interactive, the hub
interface, LM prompts of different lengths, lengths beyond the training blocks) gives what the
full cache (LOCAL_ATTN_FULL_DECODER_CACHE=1) gives."""

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.dataclass.configs import GenerationConfig

from local_attn_fairseq.modules.rolling_cache import FULL_CACHE_VARIABLE

from ..conftest import TINY_MODEL, USER_DIR, fairseq_cli, train_tiny
from .helpers import build_model, target_side_lm_data
from .test_language_model import LM_TINY, LM_TRAIN

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Decoder layer 0 rolls (every head causal-local, one borrowing head 0's Wq/Wk), layer 1 has
# global heads and keeps the full cache.
MT_DECODER = (
    "{decoder_self: {0: [local-1, local-1@0, local-2, local-2, local-3-0, local-3-0, local-4,"
    " local-1]}}"
)
# LM layers 0 and 2 roll, layer 1 is global.
LM_DECODER = (
    "{decoder_self: {0: [local-1, local-2, local-3-0, local-4],"
    " 2: [local-2, local-2@0, local-1, local-0]}}"
)
PROMPTS = "Er\nThe student was writing on the board and\nIt is\n"


def rolling_layers(model):
    return [layer.self_attn.rolling_cache is not None for layer in model.decoder.layers]


def decoded(proc):
    """What fairseq printed of each hypothesis (H-, D-, P- lines): words exactly, scores as
    numbers (printed to 4 decimals)."""
    lines = []
    for line in proc.stdout.splitlines():
        if line[:2] in ("H-", "D-", "P-"):
            fields = line.split("\t")
            if line.startswith("P-"):
                lines.append((fields[0], [float(s) for s in fields[1].split()]))
            else:
                lines.append((fields[0], [float(fields[1])], fields[2]))
    assert lines, proc.stdout[-2000:]
    return lines


def assert_same_decoding(rolling, full):
    assert [line[::2] for line in rolling] == [line[::2] for line in full]  # ids and words
    for (_, scores, *_), (_, expected, *_) in zip(rolling, full):
        torch.testing.assert_close(scores, expected, atol=2e-4, rtol=0)


def assert_same_hypotheses(rolling, full):
    """The sequence generator's hypotheses of each sentence: same tokens, same token scores."""
    assert len(rolling) == len(full)
    for hypotheses, expected in zip(rolling, full):
        assert [h["tokens"].tolist() for h in hypotheses] == [
            h["tokens"].tolist() for h in expected
        ]
        for h, e in zip(hypotheses, expected):
            torch.testing.assert_close(h["positional_scores"], e["positional_scores"])


def rolling_and_full(monkeypatch, run):
    """``run()`` with the rolling cache, then with the full cache."""
    monkeypatch.delenv(FULL_CACHE_VARIABLE, raising=False)
    rolling = run()
    monkeypatch.setenv(FULL_CACHE_VARIABLE, "1")
    full = run()
    monkeypatch.delenv(FULL_CACHE_VARIABLE)
    return rolling, full


@pytest.fixture(scope="module")
def mt_checkpoints(tiny_data, tmp_path_factory):
    """A translation model with a rolling decoder layer, saved after each of its two updates
    (two models for an ensemble)."""
    save_dir = tmp_path_factory.mktemp("mt_rolling")
    train_tiny(tiny_data, save_dir, "--locality-config", MT_DECODER, "--save-interval-updates", 1)
    return save_dir / "checkpoint_1_1.pt", save_dir / "checkpoint_1_2.pt"


@pytest.fixture(scope="module")
def fusion_data(tiny_data, tmp_path_factory):
    return target_side_lm_data(tiny_data, tmp_path_factory.mktemp("rolling_lm_data"))


@pytest.fixture(scope="module")
def lm_checkpoint(fusion_data, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("lm_rolling")
    fairseq_cli(
        "fairseq-train", fusion_data[1], "--user-dir", USER_DIR, "--arch",
        "transformer_lm_local_tiny", *LM_TINY, *LM_TRAIN, "--locality-config", LM_DECODER,
        "--save-dir", save_dir,
    )  # fmt: skip
    return save_dir / "checkpoint_last.pt"


def test_the_checkpoints_have_rolling_and_full_layers(mt_checkpoints, lm_checkpoint):
    for checkpoint, expected in ((mt_checkpoints[1], [True, False]),
                                 (lm_checkpoint, [True, False, True])):  # fmt: skip
        [model], _ = checkpoint_utils.load_model_ensemble([str(checkpoint)])
        assert rolling_layers(model) == expected


# Each long enough (at least 12 tokens) for the windows to roll.
GENERATE_OPTIONS = {
    "beam": ["--beam", 3, "--min-len", 12, "--max-len-b", 16],
    "sampling": ["--sampling", "--sampling-topk", 5, "--beam", 2, "--nbest", 2, "--seed", 7,
                 "--min-len", 12, "--max-len-b", 14],
    "prefix_ensemble_fusion": ["--beam", 3, "--prefix-size", 2, "--min-len", 12,
                               "--max-len-b", 14, "--lm-weight", 0.3],
}  # fmt: skip


@pytest.mark.parametrize("case", GENERATE_OPTIONS)
def test_fairseq_generate_decodes_as_with_the_full_cache(
    case, mt_checkpoints, lm_checkpoint, fusion_data, monkeypatch
):
    path = str(mt_checkpoints[1])
    options = list(GENERATE_OPTIONS[case])
    if case == "prefix_ensemble_fusion":
        path = f"{mt_checkpoints[0]}:{mt_checkpoints[1]}"
        options += ["--lm-path", lm_checkpoint]

    def run():
        return decoded(fairseq_cli(
            "fairseq-generate", fusion_data[0], "--user-dir", USER_DIR, "--path", path,
            "--gen-subset", "test", "--batch-size", 40, "--required-batch-size-multiple", 1,
            "--num-workers", 0, *options,
        ))  # fmt: skip

    rolling, full = rolling_and_full(monkeypatch, run)
    assert_same_decoding(rolling, full)
    nbest = 2 if case == "sampling" else 1
    assert sum(line[0].startswith("H-") for line in rolling) == 40 * nbest


def test_fairseq_interactive_translates_as_with_the_full_cache(
    mt_checkpoints, tiny_data, monkeypatch
):
    def run():
        return decoded(fairseq_cli(
            "fairseq-interactive", tiny_data / "bin", "--user-dir", USER_DIR, "--path",
            mt_checkpoints[1], "--source-lang", "de", "--target-lang", "en", "--beam", 2,
            "--min-len", 12, "--max-len-b", 14, "--buffer-size", 3, "--batch-size", 3,
            stdin="Das ist ein Haus .\nEr kommt heute nicht .\nJa\n",
        ))  # fmt: skip

    assert_same_decoding(*rolling_and_full(monkeypatch, run))


def test_lm_prompts_continue_beyond_the_training_blocks_as_with_the_full_cache(
    lm_checkpoint, fusion_data, monkeypatch
):
    """fairseq-interactive continues three prompts of different lengths in one batch, to 100
    tokens: beyond the 64-token blocks the LM was trained on (its sinusoidal positions allow
    it once --max-target-positions is raised)."""

    def run():
        return decoded(fairseq_cli(
            "fairseq-interactive", fusion_data[0], "--user-dir", USER_DIR, "--task",
            "language_modeling", "--path", lm_checkpoint, "--beam", 2, "--min-len", 100,
            "--max-len-b", 100, "--buffer-size", 3, "--batch-size", 3,
            "--model-overrides", "{'max_target_positions': 256}", stdin=PROMPTS,
        ))  # fmt: skip

    rolling, full = rolling_and_full(monkeypatch, run)
    assert_same_decoding(rolling, full)
    lengths = [len(line[1]) for line in rolling if line[0].startswith("P-")]
    assert min(lengths) > 100


def test_hub_interface_generates_as_with_the_full_cache(
    mt_checkpoints, lm_checkpoint, fusion_data, monkeypatch
):
    """``from_pretrained`` + ``generate`` (beam search and sampling) of a translation model and
    an LM; the switch is read at every step, so one loaded model decodes both ways."""
    from fairseq.models.transformer import TransformerModel
    from fairseq.models.transformer_lm import TransformerLanguageModel

    mt = TransformerModel.from_pretrained(
        str(mt_checkpoints[1].parent), checkpoint_file=mt_checkpoints[1].name,
        data_name_or_path=str(fusion_data[0]), source_lang="de", target_lang="en",
    ).eval()  # fmt: skip
    lm = TransformerLanguageModel.from_pretrained(
        str(lm_checkpoint.parent), checkpoint_file=lm_checkpoint.name,
        data_name_or_path=str(fusion_data[0]),
    ).eval()  # fmt: skip
    sources = [mt.encode(s) for s in ("Das ist ein Haus .", "Er kommt heute nicht .")]
    prompts = [lm.encode(p) for p in PROMPTS.split("\n") if p]
    length = dict(min_len=12, max_len_b=14)

    def run():
        torch.manual_seed(3)
        return [
            mt.generate(sources, beam=2, **length),
            lm.generate(prompts, beam=2, **length),
            lm.generate(prompts, beam=2, sampling=True, sampling_topk=5, **length),
        ]

    rolling, full = rolling_and_full(monkeypatch, run)
    assert_same_hypotheses(sum(rolling, []), sum(full, []))


def assert_generator_decodes_as_with_the_full_cache(model, task, sample, config, monkeypatch):
    generator = task.build_generator([model], config)
    rolling, full = rolling_and_full(
        monkeypatch, lambda: task.inference_step(generator, [model], sample)
    )
    assert_same_hypotheses(rolling, full)


ROLLING_AND_FULL_LAYERS = {
    "local": ("transformer_local", []),
    "dynwin": ("transformer_dynwin", ["--dynamic-window", "decoder_self:mw:1"]),
    "localness": ("transformer_localness", ["--localness-layers", "decoder_self:1"]),
    "relative_gated": ("transformer_local", ["--relative-positions", 4,
                       "--relative-positions-attention", "decoder_self", "--head-gates", "dec"]),
}  # fmt: skip


@pytest.mark.parametrize("family", ROLLING_AND_FULL_LAYERS)
def test_each_translation_family_generates_as_with_the_full_cache(
    family, tiny_data, monkeypatch
):
    """A rolling layer beside a layer of each mechanism that keeps the full cache (dynamic
    windows, Gaussian localness, relative positions with gated heads), through fairseq's
    sequence generator with left-padded sources."""
    arch, extra = ROLLING_AND_FULL_LAYERS[family]
    model, task, _ = build_model(
        tiny_data / "bin", arch, *TINY_MODEL, "--locality-config", MT_DECODER, *extra
    )
    model.eval()
    assert rolling_layers(model) == [True, False]
    d = task.source_dictionary
    sentences = ("Das ist ein gutes Buch .", "Er kommt .")
    lines = [d.encode_line(s, add_if_not_exist=False).long() for s in sentences]
    batch = torch.full((2, len(lines[0])), d.pad())
    for i, line in enumerate(lines):
        batch[i, -len(line) :] = line  # left-padded, as fairseq batches sources
    lengths = torch.tensor([len(line) for line in lines])
    sample = {"net_input": {"src_tokens": batch, "src_lengths": lengths}}
    config = GenerationConfig(beam=3, max_len_a=0, max_len_b=20, min_len=16)
    assert_generator_decodes_as_with_the_full_cache(model, task, sample, config, monkeypatch)


@pytest.mark.parametrize("arch", ["transformer_lm_local_tiny", "transformer_lm_dynwin_tiny"])
def test_each_lm_family_continues_prompts_as_with_the_full_cache(arch, tiny_data, fusion_data,
                                                                 monkeypatch):  # fmt: skip
    """Rolling layers beside a dynamic-window layer (transformer_lm_dynwin) or with relative
    positions (transformer_lm_local), continuing prompts of different lengths in one batch: the
    prefixes are padded, and fairseq lets the shorter prompts' rows choose freely."""
    extra = ["--dynamic-window", "decoder_self:mw:1"] if "dynwin" in arch else [
        "--relative-positions", 3, "--relative-positions-attention", "decoder_self"]  # fmt: skip
    model, task, _ = build_model(
        fusion_data[1], arch, *LM_TINY, "--locality-config", LM_DECODER, *extra,
    )  # fmt: skip
    model.eval()
    assert rolling_layers(model) == [True, False, True]
    d = task.source_dictionary
    prompts = [d.encode_line(p, add_if_not_exist=False, append_eos=False).long()
               for p in PROMPTS.split("\n") if p]  # fmt: skip
    src = torch.full((len(prompts), 1 + max(map(len, prompts))), d.pad())
    for i, prompt in enumerate(prompts):  # eos + prompt, right-padded (build_dataset_for_inference)
        src[i, : 1 + len(prompt)] = torch.cat([torch.tensor([d.eos()]), prompt])
    sample = {"net_input": {"src_tokens": src, "src_lengths": (src != d.pad()).sum(1)}}
    config = GenerationConfig(beam=2, max_len_a=0, max_len_b=24, min_len=20)
    assert_generator_decodes_as_with_the_full_cache(model, task, sample, config, monkeypatch)
