"""What every analysis subcommand shares: the checkpoint, the sentences, the attention weights.

    parser = argparse.ArgumentParser()
    add_common_arguments(parser)                 # --path --data --gen-subset --source-text ...
    args = parser.parse_args()
    loaded = load_model(args.path, args.data, cpu=args.cpu)
    for sentence in read_sentences(loaded, args):           # one sentence per batch, tqdm bar
        weights = attention_weights(loaded.model, sentence.sample)
        weights[("encoder_self", 0)]             # (heads, src_len, src_len), float32, on CPU

``load_model`` reads a checkpoint of this plugin or of plain fairseq (``transformer``, ...)
through ``fairseq.checkpoint_utils.load_model_ensemble_and_task`` and puts it in eval mode.

``read_sentences`` yields :class:`Sentence` objects, in data order, from fairseq binarised data
(``--data DIR --gen-subset test``) or from raw text (``--source-text FILE [--target-text FILE]``,
one sentence a line, encoded with ``--sentencepiece-model`` when given, else split on
whitespace, then mapped through the model's own dictionaries). Each carries a fairseq batch of
that one sentence (``sample["net_input"]``: src_tokens, src_lengths and, with a target,
prev_output_tokens for teacher forcing) and the strings of its word pieces, so that analyses can
group pieces into words (see ``dependencies.py``). The source ends with ``</s>``, as fairseq
feeds it; one sentence per batch means no padding.

``attention_weights`` runs the model once with teacher forcing (the encoder only when the
sentence has no target) and returns the per-head weights of every attention module, keyed by
``(attention type, layer)`` with the attention types ``encoder_self``, ``decoder_self`` and
``decoder_cross``. Hooks ask each module for ``need_head_weights=True``, so plugin modules
(``LocalMultiheadAttention``, weights after their head masks and windows) and fairseq's
``MultiheadAttention`` are read the same way; :func:`attention_inputs` records what each
module was called with instead (the input of its query projection: after the pre-LN, if the
layers normalise first).
"""

import argparse
import contextlib
import functools
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import sentencepiece
import torch
from fairseq import checkpoint_utils
from fairseq.data import LanguagePairDataset
from fairseq.modules import MultiheadAttention
from torch import Tensor, nn
from tqdm import tqdm

from ..checkpoint_files import UnreadableCheckpointError, read_checkpoint
from ..modules.local_multihead_attention import LocalMultiheadAttention
from .output import claim_output_folder, staged_results

logger = logging.getLogger(__name__)

ATTENTION_TYPES = ("encoder_self", "decoder_self", "decoder_cross")
AttentionKey = Tuple[str, int]  # (attention type, layer index)
# fairseq's module names: encoder.layers.3.self_attn, decoder.layers.0.encoder_attn, ...
_ATTENTION_NAME = re.compile(r"(?:^|\.)(encoder|decoder)\.(?:.*\.)?layers\.(\d+)\.(\w+)$")
_TYPE_OF_NAME = {
    ("encoder", "self_attn"): "encoder_self",
    ("decoder", "self_attn"): "decoder_self",
    ("decoder", "encoder_attn"): "decoder_cross",
}
# Sentences whose pieces are mostly unknown to the dictionary were encoded with the wrong model.
MAX_UNKNOWN_FRACTION = 0.5


class AnalysisInputError(ValueError):
    """Bad input (a file, a line of it, an option): reported in one line, without traceback."""


# What a user's input can cause, reported in one line by the command line: a checkpoint or
# data folder that is not there or not readable, an output folder that is not the tool's.
EXPECTED_ERRORS = (
    AnalysisInputError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    UnreadableCheckpointError,
)


def reports_input_errors(run):
    """Wrap a subcommand's ``run(args)``: input errors (a missing or unreadable file, an output
    folder of someone else's) print ``local-attn-analyze: error: ...`` on stderr and give exit
    status 2. Only these expected errors are caught: a bug still shows its traceback.

    The run's files are staged and moved into ``--output-dir`` together when it succeeds
    (:func:`output.staged_results`): a failed or killed run never leaves a mixture of two runs.
    """

    @functools.wraps(run)
    def checked(args):
        try:
            output_dir = getattr(args, "output_dir", None)
            if not output_dir:
                return run(args)
            claim_output_folder(output_dir, getattr(args, "overwrite", False))
            subcommand = getattr(args, "subcommand", None) or run.__module__.rsplit(".", 1)[-1]
            with staged_results(output_dir, subcommand):
                return run(args)
        except EXPECTED_ERRORS as error:
            name = " ".join(filter(None, ["local-attn-analyze", getattr(args, "subcommand", None)]))
            print(f"{name}: error: {error}", file=sys.stderr)
            return 2

    return checked


def add_common_arguments(parser: argparse.ArgumentParser, max_sentences: Optional[int] = 100):
    """The options of the subcommands that read sentences one at a time (``read_sentences``)."""
    group = parser.add_argument_group("model and sentences")
    add_checkpoint_arguments(group)
    add_sentence_arguments(group, max_sentences)
    add_output_arguments(group)


def add_checkpoint_arguments(parser, gen_subset: str = "test", data_required: bool = False):
    """``--path``, ``--data`` and ``--gen-subset``: what ``load_model`` and ``load_subset`` read."""
    parser.add_argument("--path", required=True, metavar="CHECKPOINT", help="checkpoint to analyse")
    own_data = "" if data_required else "; default: the checkpoint's own"
    parser.add_argument(
        "--data",
        required=data_required,
        metavar="DIR",
        help=f"the task's data directory (its dictionaries and subsets){own_data}",
    )
    parser.add_argument(
        "--gen-subset", default=gen_subset, metavar="SPLIT", help="subset of --data to read"
    )


def add_sentence_arguments(parser, max_sentences: Optional[int]):
    """Where ``read_sentences`` and ``SourceSyntax.from_args`` find the sentences and parses."""
    parser.add_argument(
        "--source-text",
        metavar="FILE",
        help="read source sentences from this text file (one a line) instead of --gen-subset",
    )
    parser.add_argument(
        "--target-text",
        metavar="FILE",
        help="target sentences of --source-text, line by line (needed for decoder attention)",
    )
    parser.add_argument(
        "--sentencepiece-model",
        metavar="FILE",
        help="sentencepiece model that encodes --source-text/--target-text (the model's own); "
        "without it the text is taken as already segmented, pieces separated by spaces",
    )
    parser.add_argument(
        "--max-sentences",
        type=positive_int,
        default=max_sentences,
        metavar="N",
        help=f"analyse the first N sentences (default: {max_sentences or 'all'})",
    )
    parser.add_argument(
        "--conllu",
        metavar="FILE",
        help="dependency parses of the source sentences, in their order (CoNLL-U)",
    )
    parser.add_argument(
        "--spacy-model",
        metavar="NAME",
        help="parse --source-text with this installed spaCy model instead of --conllu",
    )


def add_output_arguments(parser, output_dir: Optional[str] = "analysis"):
    """``--output-dir`` (required where ``output_dir`` is None) and ``--cpu``."""
    parser.add_argument(
        "--output-dir",
        default=output_dir,
        required=output_dir is None,
        metavar="DIR",
        help="where JSON and PNG files go",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --output-dir that local-attn-analyze did not create "
        "(files of the same names are replaced; nothing else in it is touched)",
    )
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even if CUDA is there")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def float_between(low: float, high: float):
    """An argparse ``type``: a number in [low, high] (a share, a fraction); NaN is refused."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not low <= value <= high:  # also false for NaN
            raise argparse.ArgumentTypeError(f"must lie in [{low:g}, {high:g}], got {text}")
        return value

    parse.__name__ = f"number in [{low:g}, {high:g}]"  # argparse names the type in messages
    return parse


def text_lines(path: str, option: str = "") -> Iterator[Tuple[int, str]]:
    """(line number, line) of a UTF-8 text file, as ``open(path, encoding="utf-8")`` gives
    them; a byte that is not UTF-8 is an :class:`AnalysisInputError` naming the option, the file
    and the line, instead of a UnicodeDecodeError traceback in the middle of a run."""
    # surrogateescape turns each undecodable byte into one lone surrogate (U+DC80..U+DCFF),
    # which valid UTF-8 never decodes to: the line and column are then known exactly
    with open(path, encoding="utf-8", errors="surrogateescape") as lines:
        for number, line in enumerate(lines, start=1):
            bad = next((i for i, c in enumerate(line) if "\udc80" <= c <= "\udcff"), None)
            if bad is not None:
                byte = ord(line[bad]) - 0xDC00
                named = f"{option} {path}" if option else path
                raise AnalysisInputError(
                    f"{named}, line {number}: not UTF-8 text (byte 0x{byte:02x} at character "
                    f"{bad + 1}); save the file as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)"
                )
            yield number, line


@dataclass
class LoadedModel:
    model: nn.Module
    task: object
    cfg: object
    device: torch.device

    @property
    def source_dictionary(self):
        return self.task.source_dictionary

    @property
    def target_dictionary(self):
        return self.task.target_dictionary


@dataclass
class Sentence:
    """One sentence, ready to run: ``sample`` is a fairseq batch of it alone, on the device."""

    index: int  # line of --source-text, or id in --gen-subset (0-based)
    source: Tensor  # (src_len,) token ids ending with eos, on the CPU
    source_pieces: List[str]  # dictionary strings of ``source`` ("</s>" last)
    target: Optional[Tensor]
    target_pieces: Optional[List[str]]
    sample: dict


def load_model(
    path: str, data: Optional[str] = None, cpu: bool = False, config_yaml: Optional[str] = None
) -> LoadedModel:
    """The checkpoint's model in eval mode, and its task (dictionaries from ``data``, or from
    the data directory the checkpoint was trained on; a speech task's data config
    ``config_yaml``, in ``data`` or a path of its own)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--path: no checkpoint file {path}")
    # read (its tensors mapped, not loaded) before fairseq does: a truncated or empty file is
    # then named in one line instead of failing deep inside fairseq
    state = read_checkpoint(path)
    overrides = {}
    if data is not None:
        if not os.path.isdir(data):
            raise FileNotFoundError(f"--data: no directory {data}")
        if not os.listdir(data):
            raise AnalysisInputError(
                f"--data: {data} is empty; give the task's data directory (the one holding "
                "the model's dict.*.txt and the binarised subsets)"
            )
        overrides["data"] = data
    else:
        data = _saved_data_dir(state)
        if data is None or not all(os.path.isdir(d) for d in data.split(":")):
            raise FileNotFoundError(
                f"{path} was trained on data directory {data!r}, which is not here; "
                "pass --data DIR (the directory holding the model's dict.*.txt)"
            )
    if config_yaml:
        if not any(os.path.isfile(f) for f in (os.path.join(data, config_yaml), config_yaml)):
            raise FileNotFoundError(f"--config-yaml: no file {config_yaml} in {data}")
        overrides["config_yaml"] = config_yaml
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([path], overrides)
    device = torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")
    model = models[0].to(device).eval()
    return LoadedModel(model, task, cfg, device)


# fairseq tasks -> what a model trained on them does, in the words of report titles
TASK_DESCRIPTIONS = {
    "translation_multi_simple_epoch": "translation",
    "multilingual_translation": "translation",
    "language_modeling": "language model",
    "sentence_prediction": "sentence classification",
    "masked_lm": "masked language model",
}
# Words in the names of speech_to_text data (MuST-C's train_asr / config_st.yaml, the recipes'
# and the speech pipeline's manifests) saying which of its two tasks a model was trained on.
SPEECH_TASK_WORDS = {"asr": "speech recognition", "st": "speech translation"}


def task_description(loaded: LoadedModel) -> str:
    """What the loaded model was trained to do, for the titles of reports: "translation (de-en)",
    "speech recognition", "speech translation", "language model", ...; fairseq's task name
    when it is none of these. fairseq's speech_to_text task serves both speech tasks: the names
    of the model's training subset and data config tell them apart (``train_asr``,
    ``config_st.yaml``), else it is "speech to text"."""
    name = loaded.cfg.task._name
    if name == "speech_to_text":
        names = [loaded.cfg.dataset.train_subset, loaded.cfg.task.config_yaml]
        words = set(re.split(r"[^a-z0-9]+", " ".join(map(str, names)).lower()))
        found = {text for word, text in SPEECH_TASK_WORDS.items() if word in words}
        return found.pop() if len(found) == 1 else "speech to text"
    description = TASK_DESCRIPTIONS.get(name, name)
    pair = [getattr(loaded.task.cfg, side, None) for side in ("source_lang", "target_lang")]
    if description == "translation" and all(pair):
        description += f" ({pair[0]}-{pair[1]})"
    return description


def _saved_data_dir(state) -> Optional[str]:
    cfg = state.get("cfg")
    if cfg is not None and cfg.get("task") is not None:
        return cfg["task"].get("data")
    args = state.get("args")
    return getattr(args, "data", None)


# -- sentences -------------------------------------------------------------------------------
def read_sentences(loaded: LoadedModel, args, progress: bool = True) -> Iterator[Sentence]:
    """The sentences the common options name, in data order, with a progress bar."""
    if args.target_text and not args.source_text:
        raise AnalysisInputError("--target-text needs --source-text")
    if args.source_text:
        dataset = text_dataset(loaded, args)
    else:
        dataset = load_subset(loaded.task, args.gen_subset)
    count = len(dataset) if args.max_sentences is None else min(len(dataset), args.max_sentences)
    bar = _progress(range(count), progress)
    for index in bar:
        yield _sentence(loaded, dataset, index)


def _progress(items, enabled: bool):
    if not enabled:
        return items
    # disable=None: a bar on a terminal, nothing in logs and pipes
    return tqdm(items, desc="sentences", unit="sent", disable=None)


def load_subset(task, subset: str):
    """The task's dataset of ``subset``, or a one-line error naming it; an empty subset too,
    whose report would describe no sentence."""
    try:
        task.load_dataset(subset)
    except FileNotFoundError as error:
        raise AnalysisInputError(f"cannot load subset {subset!r}: {error}") from None
    dataset = task.dataset(subset)
    if len(dataset) == 0:
        raise AnalysisInputError(f"subset {subset!r} holds no sentences; choose another")
    return dataset


def text_dataset(loaded: LoadedModel, args) -> LanguagePairDataset:
    """A fairseq dataset of the raw text files, encoded as the model's training data was."""
    encode = piece_encoder(args.sentencepiece_model)
    src_dict, tgt_dict = loaded.source_dictionary, loaded.target_dictionary
    sources = encode_lines(args.source_text, encode, src_dict, option="--source-text")
    targets = None
    if args.target_text:
        targets = encode_lines(args.target_text, encode, tgt_dict, option="--target-text")
        if len(targets) != len(sources):
            raise AnalysisInputError(
                f"--target-text {args.target_text} has {len(targets)} lines but --source-text "
                f"{args.source_text} has {len(sources)}"
            )
    task_cfg = getattr(loaded.task, "cfg", None)
    return LanguagePairDataset(
        sources,
        [len(s) for s in sources],
        src_dict,
        targets,
        None if targets is None else [len(t) for t in targets],
        tgt_dict,
        left_pad_source=getattr(task_cfg, "left_pad_source", True),
        left_pad_target=getattr(task_cfg, "left_pad_target", False),
        shuffle=False,
    )


def piece_encoder(model_file: Optional[str]):
    """line -> list of pieces: sentencepiece when a model is given, else whitespace."""
    if model_file is None:
        return str.split
    if not os.path.isfile(model_file):
        raise FileNotFoundError(f"--sentencepiece-model: no file {model_file}")
    processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
    return lambda line: processor.encode(line, out_type=str)


def encode_lines(path: str, encode, dictionary, option: str = "") -> List[Tensor]:
    """The lines of a text file (named by `option` in errors) as the dictionary's token ids."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{option + ': ' if option else ''}no text file {path}")
    encoded, unknown, total = [], 0, 0
    for number, line in text_lines(path, option):
        pieces = encode(line.strip())
        if not pieces:
            raise AnalysisInputError(
                f"{path}, line {number}: empty line (every line is a sentence)"
            )
        ids = dictionary.encode_line(
            " ".join(pieces), add_if_not_exist=False, append_eos=True
        ).long()
        unknown += int((ids == dictionary.unk()).sum())
        total += len(pieces)
        encoded.append(ids)
    if not encoded:
        raise AnalysisInputError(f"{path} has no sentences")
    if unknown > MAX_UNKNOWN_FRACTION * total:
        raise AnalysisInputError(
            f"{path}: {unknown} of {total} pieces are unknown to the model's dictionary; encode "
            "the text with the model's own --sentencepiece-model (or segment it as its data was)"
        )
    if unknown:
        logger.warning(f"{path}: {unknown} of {total} pieces are unknown to the dictionary")
    return encoded


def _sentence(loaded: LoadedModel, dataset, index: int) -> Sentence:
    item = dataset[index]
    sample = dataset.collater([item])
    source, target = item["source"], item.get("target")
    src_dict, tgt_dict = loaded.source_dictionary, loaded.target_dictionary
    return Sentence(
        index=int(item["id"]),
        source=source,
        source_pieces=[src_dict[int(t)] for t in source],
        target=target,
        target_pieces=None if target is None else [tgt_dict[int(t)] for t in target],
        sample=_to_device(sample, loaded.device),
    )


def _to_device(sample, device):
    if torch.is_tensor(sample):
        return sample.to(device)
    if isinstance(sample, dict):
        return {k: _to_device(v, device) for k, v in sample.items()}
    return sample


# -- attention modules and hooks -------------------------------------------------------------
def attention_modules(model: nn.Module, types=ATTENTION_TYPES) -> Dict[AttentionKey, nn.Module]:
    """(attention type, layer) -> module, for the plugin's and fairseq's attention modules."""
    found = {}
    for name, module in model.named_modules():
        key = attention_key(name, module)
        if key is not None and key[0] in types and key not in found:
            found[key] = module
    return dict(sorted(found.items(), key=lambda kv: (ATTENTION_TYPES.index(kv[0][0]), kv[0][1])))


def encoder_self_attention_modules(loaded: "LoadedModel", path: str):
    """The encoder self-attention modules of a loaded model, or a clear error without any."""
    modules = attention_modules(loaded.model, types=("encoder_self",))
    if not modules:
        raise AnalysisInputError(f"{path}: the model has no encoder self-attention to analyse")
    return modules


def attention_key(name: str, module: nn.Module) -> Optional[AttentionKey]:
    if isinstance(module, LocalMultiheadAttention) and module.attention_type is not None:
        return module.attention_type, module.layer_index
    if not isinstance(module, (LocalMultiheadAttention, MultiheadAttention)):
        return None
    match = _ATTENTION_NAME.search(name)
    if match is None:
        return None
    side, layer, attribute = match.groups()
    kind = _TYPE_OF_NAME.get((side, attribute))
    return None if kind is None else (kind, int(layer))


@contextlib.contextmanager
def attention_hooks(model: nn.Module, pre_hook=None, hook=None, types=ATTENTION_TYPES):
    """Install a forward pre-hook ``pre_hook(key, module, args, kwargs)`` (may return new
    ``(args, kwargs)``) and/or a forward hook ``hook(key, module, args, kwargs, output)`` on
    every attention module; removed on exit."""
    handles = []
    try:
        for key, module in attention_modules(model, types).items():
            if pre_hook is not None:
                handles.append(
                    module.register_forward_pre_hook(_bind(pre_hook, key), with_kwargs=True)
                )
            if hook is not None:
                handles.append(module.register_forward_hook(_bind(hook, key), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _bind(function, key):
    return lambda *hook_args: function(key, *hook_args)


def run_model(model: nn.Module, sample: dict, types=ATTENTION_TYPES):
    """Teacher-forced forward pass, or the encoder alone for a sentence without a target (or
    when only encoder attention is asked for); a language model reads the sentence itself."""
    net_input = sample["net_input"]
    if getattr(model, "encoder", None) is None:
        # a decoder-only language model: the sentence is its input, read left to right
        return model(net_input["src_tokens"], src_lengths=net_input["src_lengths"])
    if "prev_output_tokens" in net_input and set(types) != {"encoder_self"}:
        return model(**net_input)
    return model.encoder(net_input["src_tokens"], src_lengths=net_input["src_lengths"])


@torch.no_grad()
def attention_weights(
    model: nn.Module, sample: dict, types=ATTENTION_TYPES
) -> Dict[AttentionKey, Tensor]:
    """Per-head weights of every attention module for a one-sentence ``sample``: float32 CPU
    tensors (heads, tgt_len, src_len) (with a batch of several sentences: (bsz, heads, tgt, src)).
    Modules that did not run (the decoder without a target) are absent."""
    recorded: Dict[AttentionKey, Tensor] = {}

    def ask_for_head_weights(key, module, args, kwargs):
        return args, {**kwargs, "need_weights": True, "need_head_weights": True}

    def keep(key, module, args, kwargs, output):
        weights = output[1]  # (heads, bsz, tgt, src)
        recorded[key] = weights.detach().float().transpose(0, 1).cpu()

    modules = attention_modules(model, types).values()
    with attention_hooks(model, ask_for_head_weights, keep, types), explicit_path(modules):
        run_model(model, sample, types)
    single = sample["net_input"]["src_tokens"].size(0) == 1
    return {key: w[0] if single else w for key, w in recorded.items()}


@contextlib.contextmanager
def explicit_path(modules):
    """fairseq's MultiheadAttention hands self-attention to PyTorch's fused function, which
    returns head-averaged weights whatever need_head_weights says; ``skip_embed_dim_check``
    (which only relaxes a shape assertion) keeps it on its own path, which does not."""
    fairseq_modules = [m for m in modules if _is_fairseq_attention(m)]
    saved = [m.skip_embed_dim_check for m in fairseq_modules]
    try:
        for module in fairseq_modules:
            module.skip_embed_dim_check = True
        yield
    finally:
        for module, value in zip(fairseq_modules, saved):
            module.skip_embed_dim_check = value


def _is_fairseq_attention(module: nn.Module) -> bool:
    return isinstance(module, MultiheadAttention) and hasattr(module, "skip_embed_dim_check")


def self_attention(
    module: nn.Module,
    inputs: Tensor,
    key_padding_mask: Optional[Tensor] = None,
    attn_mask: Optional[Tensor] = None,
    head_weights: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    """An attention module on ``inputs`` (len, bsz, dim) as the encoder layers call it: its
    output and, with ``head_weights``, its per-head weights (heads, bsz, len, len)."""
    with explicit_path([module] if head_weights else []):
        return module(
            query=inputs,
            key=inputs,
            value=inputs,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            need_weights=head_weights,
            need_head_weights=head_weights,
        )


@dataclass
class AttentionCall:
    """What an attention module was called with: enough to call it again on its own."""

    query: Tensor  # (len, bsz, dim), the input the Q/K/V projections read
    key_padding_mask: Optional[Tensor]
    attn_mask: Optional[Tensor]


@torch.no_grad()
def attention_inputs(
    model: nn.Module, sample: dict, types=("encoder_self",)
) -> Dict[AttentionKey, AttentionCall]:
    """The inputs of the self-attention modules of the given types in one forward pass."""
    calls: Dict[AttentionKey, AttentionCall] = {}

    def keep(key, module, args, kwargs):
        query = kwargs["query"] if "query" in kwargs else args[0]
        calls[key] = AttentionCall(
            query.detach(), kwargs.get("key_padding_mask"), kwargs.get("attn_mask")
        )

    with attention_hooks(model, pre_hook=keep, types=types):
        run_model(model, sample, types)
    return calls


def head_numbers(module: nn.Module) -> List[int]:
    """The heads whose weights a module returns, in the unpruned numbering (a pruned plugin
    layer returns only its kept heads)."""
    kept = getattr(module, "kept_heads", None)
    return list(kept) if kept is not None else list(range(module.num_heads))
