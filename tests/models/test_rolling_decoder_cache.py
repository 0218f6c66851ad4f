"""The rolling window cache through the models and fairseq's tools: decoder layers whose every
head is causal-local keep only the last window of keys while decoding, and every way of decoding
(beam search, --prefix-size, sampling, ensembles, shallow fusion, fairseq-interactive, the hub
interface, LM prompts of different lengths, lengths beyond the training blocks) gives what the
full cache (LOCAL_ATTN_FULL_DECODER_CACHE=1) gives. Both caches share the step path, so the
decoder's steps are also checked against the full pass over the whole sequence (teacher
forcing), which takes no step at all."""

import math

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


# Two printed roundings to 4 decimals, and float32 logits of the same computation over the same
# keys, whose rounding alone differs (about 1e-6)
PRINTED = 2e-4


def positional_score_tolerance(scores):
    """How far two runs' printed positional scores (base 2) of the same tokens may differ when
    their logits differ by rounding alone: fairseq's generator keeps each hypothesis's running
    score in float32 and prints the differences of consecutive running scores, so each carries
    the rounding of two running sums, up to one float32 ulp of the running score at that point
    (1/32 nat past 262,144 nats: a prompt of ~30,000 tokens), whatever the logits' precision."""
    running = (torch.tensor(scores, dtype=torch.float64).cumsum(0) * math.log(2)).abs().float()
    ulp = torch.nextafter(running, torch.tensor(math.inf)) - running
    return PRINTED + 2 * ulp.double() / math.log(2)


def assert_same_decoding(rolling, full):
    assert [line[::2] for line in rolling] == [line[::2] for line in full]  # ids and words
    for (tag, scores, *_), (_, expected, *_) in zip(rolling, full):
        tolerance = positional_score_tolerance(expected) if tag.startswith("P-") else PRINTED
        difference = (torch.tensor(scores) - torch.tensor(expected)).abs()
        beyond = (difference > tolerance).nonzero().flatten().tolist()
        assert not beyond, [(i, scores[i], expected[i]) for i in beyond[:5]]


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


# -- against the full pass: teacher forcing ------------------------------------------------------


def words(dictionary, count, seed):
    """``count`` ids of ordinary words of ``dictionary`` (no special symbol), drawn at random."""
    return torch.randint(dictionary.nspecial, len(dictionary), (count,),
                         generator=torch.Generator().manual_seed(seed))  # fmt: skip


def cached_keys(model, state):
    """The keys each decoder layer's self-attention holds in ``state``."""
    return [layer.self_attn._get_input_buffer(state)["prev_key"].size(2)
            for layer in model.decoder.layers]  # fmt: skip


def assert_steps_equal_the_full_pass(model, tokens, encoder_out, reorder_at, new_order):
    """fairseq's decoder fed ``tokens`` (bsz, T) one step at a time, with the rolling cache and
    the beam reordered after step ``reorder_at``, gives at every position the output of the full
    pass over the whole sequence without incremental state (teacher forcing): before the
    reordering over ``tokens``, after it over the rows the reordering made (each row's first
    steps from the row it now continues)."""
    reordered = tokens.clone()
    reordered[:, : reorder_at + 1] = tokens[new_order, : reorder_at + 1]
    moved_encoder_out = None
    if encoder_out is not None:
        moved_encoder_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
    with torch.no_grad():
        before = model.decoder(tokens, encoder_out=encoder_out)[0]
        after = model.decoder(reordered, encoder_out=moved_encoder_out)[0]
        state, steps, stepped = {}, [], encoder_out
        for t in range(tokens.size(1)):
            prefix = (tokens if t <= reorder_at else reordered)[:, : t + 1]
            steps.append(model.decoder(prefix, encoder_out=stepped, incremental_state=state)[0])
            if t == reorder_at:  # as fairseq's sequence generator reorders its beams
                model.decoder.reorder_incremental_state_scripting(state, new_order)
                stepped = moved_encoder_out
    steps = torch.cat(steps, dim=1)
    torch.testing.assert_close(steps[:, : reorder_at + 1], before[:, : reorder_at + 1],
                               atol=1e-5, rtol=1e-4)  # fmt: skip
    torch.testing.assert_close(steps[:, reorder_at + 1 :], after[:, reorder_at + 1 :],
                               atol=1e-5, rtol=1e-4)  # fmt: skip
    return cached_keys(model, state)


def test_mt_decoding_step_by_step_equals_the_full_pass(mt_checkpoints, monkeypatch):
    """The translation model's decoder over 20 target tokens for two left-padded sources: the
    rolling layer keeps its window's keys, the global layer every key."""
    monkeypatch.delenv(FULL_CACHE_VARIABLE, raising=False)
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(mt_checkpoints[1])])
    model.eval()
    d = task.source_dictionary
    lines = [d.encode_line(s, add_if_not_exist=False).long()
             for s in ("Das ist ein gutes Buch .", "Er kommt .")]  # fmt: skip
    src = torch.full((2, len(lines[0])), d.pad())
    for i, line in enumerate(lines):
        src[i, -len(line) :] = line
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=torch.tensor([len(x) for x in lines]))
    eos = task.target_dictionary.eos()
    targets = torch.stack([words(task.target_dictionary, 19, seed) for seed in (1, 2)])
    tokens = torch.cat([torch.full((2, 1), eos), targets], dim=1)
    cached = assert_steps_equal_the_full_pass(
        model, tokens, encoder_out, reorder_at=9, new_order=torch.tensor([1, 1])
    )
    assert cached == [model.decoder.layers[0].self_attn.rolling_cache.reach, 20]


def test_lm_decoding_step_by_step_equals_the_full_pass(lm_checkpoint, monkeypatch):
    """The language model over 40 tokens of two rows: its two rolling layers keep their
    windows' keys, the global layer every key."""
    monkeypatch.delenv(FULL_CACHE_VARIABLE, raising=False)
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(lm_checkpoint)])
    model.eval()
    d = task.source_dictionary
    tokens = torch.stack([torch.cat([torch.tensor([d.eos()]), words(d, 39, seed)])
                          for seed in (3, 4)])  # fmt: skip
    cached = assert_steps_equal_the_full_pass(
        model, tokens, None, reorder_at=24, new_order=torch.tensor([1, 0])
    )
    reach = [layer.self_attn.rolling_cache for layer in model.decoder.layers]
    assert cached == [reach[0].reach, 40, reach[2].reach]
