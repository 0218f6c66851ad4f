"""Prepare MuST-C, or any corpus in its layout, for fairseq's ``speech_to_text`` task.

Reads ``ROOT/en-LANG/data/<split>/{wav/*.wav, txt/<split>.yaml, txt/<split>.en, txt/<split>.LANG}``
(real MuST-C, or the synthetic corpus of ``speech_corpus.py``), cuts every yaml
segment (``offset``/``duration`` in seconds inside its talk wav) and writes into ``--out-dir``
(default ``ROOT/en-LANG``):

* ``fbank80.zip``: 80-dim log-mel filterbanks (``torchaudio.compliance.kaldi.fbank`` on 16 kHz
  audio), one ``.npy`` per segment in an uncompressed zip, addressed as ``zip:offset:length``;
  or with ``--audio-format wav`` no features at all: the manifests point at the audio (a whole
  16 kHz mono wav directly, any other segment cut into ``wav16k.zip``) and fairseq computes the
  same filterbanks while loading, or feeds the waveform itself with ``--waveform-input``;
* ``<split>_asr.tsv`` / ``<split>_st.tsv``: manifests ``id audio n_frames tgt_text speaker``,
  with the English transcript (ASR) or the LANG translation (ST) as target;
* ``spm_<type><size>_{asr,st}.{model,txt}``: sentencepiece vocabularies trained on the training
  targets, with fairseq's special-symbol ids (``--vocab-size``, or a size per task:
  ``--asr-vocab-size 5000 --st-vocab-size 8000`` as fairseq's MuST-C example);
* ``config_{asr,st}.yaml``: the data configs (``--config-yaml``), with utterance or global CMVN
  (``gcmvn.npz``) and an optional SpecAugment policy for training.

Nothing is dropped silently: a segment whose audio is missing, unreadable or too short, or whose
transcript is empty, is reported with the yaml/text file and line it comes from and counted in
the summary (``--strict`` makes any of them an error). Files that disagree with each other
(different numbers of yaml entries and text lines, malformed yaml) are an error.

One run's files are a set (the manifests address the zip by byte offsets, the configs name the
vocabularies and the CMVN statistics): they are built in a hidden staging folder inside
``--out-dir`` and moved into place only when the run succeeds (:func:`commit_outputs`), the
configs last. A failed or interrupted run leaves the previous set as it was; a re-run with other
settings removes the files of the previous run that it does not write again. The names of the
files of the last run are kept in ``.prepare_mustc_files``: in a folder the script did not
create (MuST-C's ``en-LANG``), it replaces only those, and only while unchanged since.
"""

import argparse
import contextlib
import io
import os
import shutil
import struct
import sys
import tempfile
import zipfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from multiprocessing import Pool

import numpy as np

from ..cli_types import non_negative_int, positive_int
from ..file_safety import (
    OWNER_MARKER,
    atomic_output,
    atomic_write_text,
    claim_output_dir,
    describe_os_error,
    exit_on_os_error,
    folder_owner,
    replace_own_dir,
)
from .text import train_sentencepiece

TOOL = "prepare_mustc"
# Hidden names in --out-dir: the folder a run builds its files in, and the list of the files
# of the last run that completed (with their size and time, to notice a file rewritten since).
STAGING = ".prepare_mustc.partial"
RECORD = ".prepare_mustc_files"
KNOWN_SPLITS = ("train", "dev", "tst-COMMON", "tst-HE")
TASKS = ("asr", "st")
MANIFEST_COLUMNS = ("id", "audio", "n_frames", "tgt_text", "speaker")
SAMPLE_RATE = 16_000
N_MEL_BINS = 80
# Kaldi's default framing (25 ms windows every 10 ms, no partial frames).
WINDOW_SAMPLES, SHIFT_SAMPLES = 400, 160
MIN_FRAMES = 5  # as fairseq's MuST-C recipe: shorter segments give no encoder output
END_TOLERANCE_SECONDS = 0.01  # MuST-C's rounded times may end a hair after the file
# fairseq's speech vocabularies use these ids; its Dictionary is rebuilt from the .txt file.
SPECIAL_IDS = {"bos_id": 0, "pad_id": 1, "eos_id": 2, "unk_id": 3}
SPECAUGMENT_POLICIES = {  # fairseq's speech_to_text recipes' policies
    "lb": (0, 1, 27, 1, 100, 1.0),
    "ld": (0, 2, 27, 2, 100, 1.0),
    "sm": (0, 2, 15, 2, 70, 0.2),
    "ss": (0, 2, 27, 2, 70, 0.2),
}
SPECAUGMENT_KEYS = (
    "time_wrap_W", "freq_mask_N", "freq_mask_F", "time_mask_N", "time_mask_T", "time_mask_p",
)  # fmt: skip


class PreparationError(Exception):
    """Input files that contradict each other: nothing sensible can be written."""


@dataclass
class Segment:
    id: str
    wav_path: str
    offset: float
    duration: float
    speaker: str
    where: str  # "<yaml path>:<line>", for reports
    texts: dict = field(default_factory=dict)  # language -> transcript or translation
    text_where: dict = field(default_factory=dict)  # language -> "<text path>:<line>"


@dataclass
class Drop:
    split: str
    tasks: tuple
    reason: str
    where: str
    detail: str = ""

    def __str__(self):
        tasks = "" if set(self.tasks) == set(TASKS) else f" ({', '.join(self.tasks)} only)"
        return f"{self.where}: {self.reason}{tasks}" + (f": {self.detail}" if self.detail else "")


# ---------------------------------------------------------------- reading the MuST-C layout


def read_text_lines(path):
    if not os.path.isfile(path):
        raise PreparationError(f"{path}: file not found")
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise PreparationError(f"{path}:{line}: not UTF-8 text (byte {data[e.start]:#04x})")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline closing the last line
    return [line.rstrip("\r") for line in lines]


def scalar_fields(node, where):
    import yaml

    if not isinstance(node, yaml.MappingNode):
        raise PreparationError(f"{where}: a segment must be a mapping {{duration, offset, ...}}")
    fields = {}
    for key, value in node.value:
        if not isinstance(value, yaml.ScalarNode):
            raise PreparationError(f"{where}: '{key.value}' must be a single value")
        fields[key.value] = value.value
    return fields


def read_segment_yaml(path):
    """[(fields, line)] of a MuST-C segment list; every value stays a string, as MuST-C's."""
    import yaml

    if not os.path.isfile(path):
        raise PreparationError(f"{path}: file not found")
    with open(path, encoding="utf-8") as f:
        try:
            root = yaml.compose(f, Loader=yaml.BaseLoader)
        except yaml.YAMLError as e:
            raise PreparationError(f"{path}: not valid YAML: {e}") from None
    if root is None:
        return []
    if not isinstance(root, yaml.SequenceNode):
        raise PreparationError(f"{path}: expected a list of segments")
    entries = []
    for node in root.value:
        line = node.start_mark.line + 1
        fields = scalar_fields(node, f"{path}:{line}")
        missing = [k for k in ("wav", "offset", "duration", "speaker_id") if k not in fields]
        if missing:
            raise PreparationError(f"{path}:{line}: segment without {', '.join(missing)}")
        for key in ("offset", "duration"):
            try:
                fields[key] = float(fields[key])
            except ValueError:
                raise PreparationError(
                    f"{path}:{line}: {key} {fields[key]!r} is not a number"
                ) from None
        entries.append((fields, line))
    return entries


def check_counts(yaml_path, entries, text_path, lines):
    if len(entries) == len(lines):
        return
    if len(entries) > len(lines):
        first_unmatched = f"the segment at {yaml_path}:{entries[len(lines)][1]} has no line"
    else:
        first_unmatched = f"{text_path}:{len(entries) + 1} has no segment"
    raise PreparationError(
        f"{text_path} has {len(lines)} lines but {yaml_path} has {len(entries)} segments "
        f"({first_unmatched}); the files of a split must be aligned line by line"
    )


def split_files(root, lang, split):
    split_dir = os.path.join(root, f"en-{lang}", "data", split)
    txt = os.path.join(split_dir, "txt")
    return (
        os.path.join(split_dir, "wav"),
        os.path.join(txt, f"{split}.yaml"),
        {lg: os.path.join(txt, f"{split}.{lg}") for lg in ("en", lang)},
    )


def load_split(root, lang, split):
    """The split's segments, ids ``<talk>_<i>`` numbered by offset within each talk wav."""
    wav_dir, yaml_path, text_paths = split_files(root, lang, split)
    entries = read_segment_yaml(yaml_path)
    texts = {}
    for lg, path in text_paths.items():
        texts[lg] = read_text_lines(path)
        check_counts(yaml_path, entries, path, texts[lg])
    by_wav = defaultdict(list)  # a talk's segments may be listed apart: group them all
    for index, (fields, line) in enumerate(entries):
        by_wav[fields["wav"]].append((fields, line, index))
    segments = []
    for wav_name, talk in by_wav.items():
        stem = os.path.splitext(os.path.basename(wav_name))[0]
        for i, (fields, line, index) in enumerate(sorted(talk, key=lambda t: t[0]["offset"])):
            segments.append(
                Segment(
                    id=f"{stem}_{i}",
                    wav_path=os.path.join(wav_dir, wav_name),
                    offset=fields["offset"],
                    duration=fields["duration"],
                    speaker=fields["speaker_id"],
                    where=f"{yaml_path}:{line}",
                    texts={lg: texts[lg][index].strip() for lg in texts},
                    text_where={lg: f"{text_paths[lg]}:{index + 1}" for lg in texts},
                )
            )
    return segments


# ---------------------------------------------------------------- audio and features


def fbank_frames(n_samples):
    return 0 if n_samples < WINDOW_SAMPLES else 1 + (n_samples - WINDOW_SAMPLES) // SHIFT_SAMPLES


def log_mel_fbank(waveform):
    """80-dim Kaldi filterbanks of float samples in [-1, 1] at 16 kHz, as fairseq computes them."""
    import torch
    import torchaudio.compliance.kaldi as kaldi

    # Kaldi's fbank expects 16-bit integer amplitudes (its dither and energy floor assume them).
    samples = torch.from_numpy(np.ascontiguousarray(waveform, dtype=np.float32))[None] * 2**15
    return kaldi.fbank(samples, num_mel_bins=N_MEL_BINS, sample_frequency=SAMPLE_RATE).numpy()


def read_talk_audio(path):
    """(mono 16 kHz float32 samples, whether the file on disk is already 16 kHz mono PCM16)."""
    import soundfile as sf
    import torch
    import torchaudio.functional as AF

    info = sf.info(path)
    samples, rate = sf.read(path, dtype="float32", always_2d=True)
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    if rate != SAMPLE_RATE:
        mono = AF.resample(torch.from_numpy(mono), rate, SAMPLE_RATE).numpy()
    native = rate == SAMPLE_RATE and info.channels == 1 and info.subtype == "PCM_16"
    return mono, native


def wav_bytes(waveform):
    import soundfile as sf

    buffer = io.BytesIO()
    sf.write(buffer, waveform, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def npy_bytes(features):
    buffer = io.BytesIO()
    np.save(buffer, features.astype(np.float32))
    return buffer.getvalue()


@dataclass
class TalkJob:
    wav_path: str
    segments: list  # [(id, offset, duration)]
    audio_format: str  # "fbank" or "wav"
    waveform_input: bool
    want_features: bool  # features are needed (fbank format, or global CMVN statistics)
    max_frames: int  # 0: no limit


def process_segment(job, seg_id, offset, duration, audio, native):
    """(None, result) for a usable segment, or (reason, detail) for a dropped one."""
    start, n = round(offset * SAMPLE_RATE), round(duration * SAMPLE_RATE)
    talk_seconds = len(audio) / SAMPLE_RATE
    if duration <= 0 or offset < 0:
        return "empty time span", f"offset {offset}, duration {duration}"
    if offset + duration > talk_seconds + END_TOLERANCE_SECONDS:
        return "outside the audio", (
            f"segment {offset:.2f}-{offset + duration:.2f} s, {job.wav_path} lasts "
            f"{talk_seconds:.2f} s"
        )
    segment = audio[start : start + n]
    frames = fbank_frames(len(segment))
    if frames < MIN_FRAMES:
        return "too short", f"{len(segment) / SAMPLE_RATE * 1000:.0f} ms, {frames} frames"
    if job.max_frames and frames > job.max_frames:
        return "too long", f"{frames} frames > --max-frames {job.max_frames}"
    result = {"id": seg_id, "n_frames": frames, "features": None, "blob": None, "path": None}
    if job.want_features:
        result["features"] = log_mel_fbank(segment)
    if job.audio_format == "wav":
        if job.waveform_input:
            result["n_frames"] = len(segment)
        if native and start == 0 and len(segment) == len(audio):
            result["path"] = os.path.abspath(job.wav_path)  # the whole file: read it in place
        else:
            result["blob"] = wav_bytes(segment)
    return None, result


def process_talk(job):
    """[(id, reason or None, detail or result)] for the segments of one talk wav."""
    import soundfile as sf
    import torch

    torch.set_num_threads(1)  # the workers already share the cores
    if not os.path.isfile(job.wav_path):
        return [(s[0], "missing audio", job.wav_path) for s in job.segments]
    try:
        audio, native = read_talk_audio(job.wav_path)
    except (RuntimeError, sf.LibsndfileError, ValueError) as e:
        return [(s[0], "unreadable audio", str(e)) for s in job.segments]
    outcomes = []
    for seg_id, offset, duration in job.segments:
        reason, detail = process_segment(job, seg_id, offset, duration, audio, native)
        outcomes.append((seg_id, reason, detail))
    return outcomes


# ---------------------------------------------------------------- writing fairseq's files


def stored_zip_index(zip_path, address_path=None):
    """{member stem: "zip:byte offset:byte length"}, the addresses fairseq reads members by;
    ``zip`` is `address_path` (where the zip will be read from), by default `zip_path`."""
    address_path = os.path.abspath(address_path or zip_path)
    index = {}
    with zipfile.ZipFile(zip_path) as archive, open(zip_path, "rb") as raw:
        for info in archive.infolist():
            raw.seek(info.header_offset + 26)  # the local header's name and extra-field lengths
            name_length, extra_length = struct.unpack("<HH", raw.read(4))
            data_offset = info.header_offset + 30 + name_length + extra_length
            stem = os.path.splitext(info.filename)[0]
            index[stem] = f"{address_path}:{data_offset}:{info.file_size}"
    return index


def tsv_field(text):
    # fairseq reads manifests with csv.QUOTE_NONE: a tab or newline inside a field would shift
    # the columns, so such whitespace becomes a space.
    return " ".join(str(text).split())


def write_manifest(path, rows):
    lines = ["\t".join(MANIFEST_COLUMNS)]
    lines += ["\t".join(tsv_field(row[c]) for c in MANIFEST_COLUMNS) for row in rows]
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def read_manifest(path):
    """The rows of a manifest written by ``write_manifest``, as {column: text}."""
    with open(path, encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        return [dict(zip(header, line.rstrip("\n").split("\t"))) for line in f if line.strip()]


def train_vocabulary(texts, prefix, vocab_type, vocab_size):
    """A sentencepiece model and the fairseq dictionary (``prefix.txt``) of its pieces, each
    renamed into place whole (``train_sentencepiece``, ``atomic_write_text``)."""
    import sentencepiece as spm

    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt") as corpus:
        corpus.write("".join(t + "\n" for t in texts))
        corpus.flush()
        try:
            model_path = train_sentencepiece(
                [corpus.name], prefix, vocab_size, vocab_type,
                exact_size=False,  # a small corpus gets the vocabulary it supports
                special_ids=SPECIAL_IDS,
            )  # fmt: skip
        except RuntimeError as e:  # e.g. fewer pieces than the text has characters
            raise PreparationError(
                f"sentencepiece on {len(texts)} training targets for {os.path.basename(prefix)} "
                f"failed (--vocab-type {vocab_type} --vocab-size {vocab_size}): {e}"
            ) from None
    model = spm.SentencePieceProcessor(model_file=model_path)
    pieces = range(len(SPECIAL_IDS), model.get_piece_size())
    atomic_write_text(prefix + ".txt", "".join(f"{model.id_to_piece(i)} 1\n" for i in pieces))
    return model.get_piece_size()


def data_config(spm_prefix, cmvn, specaugment, waveform_input):
    name = os.path.basename(spm_prefix)
    config = {
        "input_channels": 1,
        "input_feat_per_channel": N_MEL_BINS,
        "vocab_filename": f"{name}.txt",
        # relative names: fairseq resolves them against the config's directory
        "bpe_tokenizer": {"bpe": "sentencepiece", "sentencepiece_model": f"{name}.model"},
    }
    if waveform_input:
        # fairseq applies no feature transform to waveforms (CMVN, SpecAugment are for fbanks)
        config.update(use_audio_input=True, use_sample_rate=SAMPLE_RATE)
        return config
    transforms = {"*": [f"{cmvn}_cmvn"]}
    if specaugment != "none":
        transforms["_train"] = [f"{cmvn}_cmvn", "specaugment"]
        config["specaugment"] = dict(zip(SPECAUGMENT_KEYS, SPECAUGMENT_POLICIES[specaugment]))
    config["feature_transforms"] = transforms
    if cmvn == "utterance":
        # fairseq's S2T hub interface (S2TTransformerModel.from_pretrained(...).predict(wav))
        # computes these very features from an audio file: Kaldi filterbanks, utterance CMVN
        config["hub"] = {"input_type": "fbank80_w_utt_cmvn"}
    if cmvn == "global":
        # read by the transform itself, which does not resolve relative paths
        config["global_cmvn"] = {
            "stats_npz_path": os.path.join(os.path.dirname(spm_prefix), "gcmvn.npz")
        }
    return config


class GlobalCmvn:
    """Running per-dimension mean and standard deviation of training filterbanks."""

    def __init__(self, max_utterances):
        self.max_utterances, self.utterances = max_utterances, 0
        self.count, self.sum, self.sum_sq = 0, np.zeros(N_MEL_BINS), np.zeros(N_MEL_BINS)

    def add(self, features):
        if self.utterances >= self.max_utterances:
            return
        self.utterances += 1
        self.count += features.shape[0]
        self.sum += features.sum(axis=0, dtype=np.float64)
        self.sum_sq += (features.astype(np.float64) ** 2).sum(axis=0)

    def save(self, path):
        mean = self.sum / self.count
        std = np.sqrt(np.maximum(self.sum_sq / self.count - mean**2, 1e-8))
        # to an open file: given a name, np.savez would add ".npz" to the temporary's
        with atomic_output(path) as temporary, open(temporary, "wb") as handle:
            np.savez(handle, mean=mean.astype(np.float32), std=std.astype(np.float32))


# ---------------------------------------------------------------- the pipeline


def talk_jobs(segments, args, split, want_features):
    by_wav = defaultdict(list)
    for s in segments:
        by_wav[s.wav_path].append((s.id, s.offset, s.duration))
    max_frames = args.max_frames if split.startswith("train") else 0
    return [
        TalkJob(path, segs, args.audio_format, args.waveform_input, want_features, max_frames)
        for path, segs in by_wav.items()
    ]


def zip_name(args):
    return "fbank80.zip" if args.audio_format == "fbank" else "wav16k.zip"


def task_vocab_size(args, task):
    """The task's own size (--asr-vocab-size, --st-vocab-size), else --vocab-size."""
    return getattr(args, f"{task}_vocab_size", None) or args.vocab_size


def spm_prefix(out_dir, args, task):
    size_name = "" if args.vocab_type == "char" else str(task_vocab_size(args, task))
    return os.path.join(out_dir, f"spm_{args.vocab_type}{size_name}_{task}")


def output_names(args, splits):
    """The files ``prepare`` writes into the output folder."""
    names = [zip_name(args)] + (["gcmvn.npz"] if args.cmvn == "global" else [])
    for task in args.tasks:
        names += [f"{split}_{task}.tsv" for split in splits] + [f"config_{task}.yaml"]
        prefix = os.path.basename(spm_prefix("", args, task))
        names += [f"{prefix}.{ext}" for ext in ("model", "vocab", "txt")]
    return names


# -- the output folder: whose files may be replaced, and one run's files moved in together ------


def read_record(out_dir):
    """{name: (size, mtime_ns) or None} of the files the last runs wrote in `out_dir`; None for
    a file a run was moving in when it stopped."""
    path = os.path.join(out_dir, RECORD)
    if not os.path.isfile(path):
        return {}
    record = {}
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            name, *stat = line.rstrip("\n").split("\t")
            # plain names only: a hand-edited line must never reach outside the folder
            if name and name == os.path.basename(name) and name not in (".", ".."):
                record[name] = tuple(map(int, stat)) if len(stat) == 2 else None
    return record


def write_record(out_dir, record):
    lines = [name + "".join(f"\t{n}" for n in stat or ()) for name, stat in sorted(record.items())]
    atomic_write_text(os.path.join(out_dir, RECORD), "".join(f"{line}\n" for line in lines))


def file_stat(path):
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def is_own_file(out_dir, name, record, owned_folder):
    """Whether this script wrote `out_dir/name`: every file of a folder it created, else a
    recorded file that nobody has rewritten since (e.g. fairseq's own MuST-C preparation)."""
    if owned_folder:
        return True
    if name not in record:
        return False
    path = os.path.join(out_dir, name)
    return record[name] is None or not os.path.isfile(path) or file_stat(path) == record[name]


def check_out_dir(out_dir, names, overwrite):
    """Whether `out_dir` is the script's own folder (absent, empty or marked by it); raises
    PreparationError, changing nothing, if a run would replace a file of `names` that the
    script did not write and `overwrite` is not set."""
    owned = not os.path.isdir(out_dir) or not os.listdir(out_dir) or folder_owner(out_dir) == TOOL
    record = read_record(out_dir)
    taken = [
        n
        for n in names
        if os.path.lexists(os.path.join(out_dir, n))
        and not is_own_file(out_dir, n, record, owned)
    ]
    if taken and not overwrite:
        raise PreparationError(
            f"{out_dir} already holds {', '.join(taken)}, not written by {TOOL}.py (or changed "
            "since); pass --overwrite to replace them, or choose another --out-dir"
        )
    return owned


@contextlib.contextmanager
def staged_outputs(out_dir, owned):
    """Yield an empty staging folder inside `out_dir`; when the block ends without an exception,
    its files replace the previous run's (:func:`commit_outputs`). A failed block removes it
    and, if it created `out_dir`, `out_dir` too. Only a folder of the script's own is marked."""
    existed = os.path.isdir(out_dir)
    staging = os.path.join(out_dir, STAGING)
    with exit_on_os_error("--out-dir"):  # refused before any audio is read
        if owned:
            claim_output_dir(out_dir, TOOL)
        replace_own_dir(staging, TOOL)  # a killed run's staging folder is emptied
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if not existed and sorted(os.listdir(out_dir)) == [OWNER_MARKER]:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    commit_outputs(out_dir, staging, owned)


def commit_order(name):
    """Features, CMVN statistics and vocabularies first, then the manifests addressing them,
    the configs (naming all of them) last: the configs are what fairseq is given, and what
    callers take as the sign of a prepared folder."""
    return (name.endswith(".tsv") + 2 * name.endswith(".yaml"), name)


def commit_outputs(out_dir, staging, owned):
    """Move a run's files from `staging` into `out_dir`, so that no manifest or config is ever
    beside features or vocabularies of another run:

    1. the record lists the old run's files and the new ones (a kill from here on leaves
       nothing the next run may not replace or remove);
    2. the manifests and configs of the old run, and those about to be replaced, are removed;
    3. the old run's other files that this run does not write are removed;
    4. the new files are moved in (one rename each) in `commit_order`, the configs last;
    5. the record is rewritten with the new files and the staging folder removed.

    A kill before 2 leaves the old set whole, after 4 the new one; in between there is no
    config and every manifest there addresses the new zip. Files of the old run that someone
    else has rewritten since (in a folder the script did not create) are left alone.
    """
    new = sorted((n for n in os.listdir(staging) if n != OWNER_MARKER), key=commit_order)
    old = read_record(out_dir)
    old_own = [n for n in old if n not in new and is_own_file(out_dir, n, old, owned)]
    write_record(out_dir, {**{n: old[n] for n in old_own}, **dict.fromkeys(new)})
    consumers = [n for n in old_own + new if commit_order(n)[0]]
    for name in sorted(consumers, key=commit_order, reverse=True) + old_own:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, name))
    for name in new:
        os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    write_record(out_dir, {n: file_stat(os.path.join(out_dir, n)) for n in new})
    shutil.rmtree(staging, ignore_errors=True)


def extract_audio(split_segments, args, write_dir, pool, out_dir):
    """Features or audio of every segment into one stored zip in `write_dir`, addressed as it
    will be read from `out_dir`; {split: {id: (audio, n)}}, drops."""
    zip_path = os.path.join(write_dir, zip_name(args))
    extension = ".npy" if args.audio_format == "fbank" else ".wav"
    cmvn = GlobalCmvn(args.gcmvn_max_num) if args.cmvn == "global" else None
    kept, drops, direct = {}, [], {}
    with atomic_output(zip_path) as partial, zipfile.ZipFile(
        partial, "w", zipfile.ZIP_STORED
    ) as archive:
        for split, segments in split_segments.items():
            where = {s.id: s.where for s in segments}
            want_features = args.audio_format == "fbank" or (cmvn is not None and split == "train")
            jobs = talk_jobs(segments, args, split, want_features)
            kept[split] = {}
            for outcomes in pool.imap(process_talk, jobs):
                for seg_id, reason, detail in outcomes:
                    if reason is not None:
                        drops.append(Drop(split, TASKS, reason, where[seg_id], detail))
                        continue
                    if cmvn is not None and split == "train":
                        cmvn.add(detail["features"])
                    if args.audio_format == "fbank":
                        archive.writestr(seg_id + extension, npy_bytes(detail["features"]))
                    elif detail["blob"] is not None:
                        archive.writestr(seg_id + extension, detail["blob"])
                    else:
                        direct[seg_id] = detail["path"]
                    kept[split][seg_id] = detail["n_frames"]
            print(f"| {split}: {len(kept[split])} of {len(segments)} segments have usable audio")
    if cmvn is not None:
        if cmvn.count == 0:
            raise PreparationError("no usable training audio: global CMVN has nothing to estimate")
        cmvn.save(os.path.join(write_dir, "gcmvn.npz"))
    addresses = {**stored_zip_index(zip_path, os.path.join(out_dir, zip_name(args))), **direct}
    audio = {
        split: {i: (addresses[i], n) for i, n in frames.items()} for split, frames in kept.items()
    }
    return audio, drops


def manifest_rows(segments, audio, text_lang, split, task, drops):
    rows = []
    for s in segments:
        if s.id not in audio:
            continue  # already reported with its audio problem
        text = s.texts[text_lang]
        if not text:
            drops.append(Drop(split, (task,), "empty transcript", s.text_where[text_lang]))
            continue
        path, n_frames = audio[s.id]
        rows.append(
            {
                "id": s.id,
                "audio": path,
                "n_frames": n_frames,
                "tgt_text": text,
                "speaker": s.speaker,
            }
        )
    return rows


def print_summary(split_segments, drops, examples_per_reason=10):
    total = sum(len(v) for v in split_segments.values())
    if not drops:
        print(f"| all {total} segments kept")
        return
    counts = Counter((d.reason, d.tasks) for d in drops)
    listed = Counter()
    for drop in drops:
        listed[drop.reason] += 1
        if listed[drop.reason] <= examples_per_reason:
            print(f"| dropped {drop}")
    summary = ", ".join(
        f"{n} {reason}" + ("" if set(tasks) == set(TASKS) else f" ({'/'.join(tasks)})")
        for (reason, tasks), n in sorted(counts.items())
    )
    print(f"| dropped {len(drops)} of {total} segments: {summary}")


def prepare(args):
    lang_dir = os.path.join(args.mustc_root, f"en-{args.lang}")
    if not os.path.isdir(lang_dir):
        raise PreparationError(f"{lang_dir}: not found (--mustc-root holds en-{args.lang}/data/)")
    splits = args.splits or [
        s for s in KNOWN_SPLITS if os.path.isdir(os.path.join(lang_dir, "data", s))
    ]
    if "train" not in splits:
        raise PreparationError(f"{lang_dir}/data/train: not found (vocabularies are trained on it)")
    out_dir = os.path.abspath(args.out_dir or lang_dir)
    with exit_on_os_error("--out-dir"):  # refused before any audio is read
        owned = check_out_dir(out_dir, output_names(args, splits), args.overwrite)
    with staged_outputs(out_dir, owned) as staging:
        write_outputs(args, splits, staging, out_dir)
    print(f"| fairseq speech_to_text data -> {out_dir}")
    return out_dir


def write_outputs(args, splits, staging, out_dir):
    """Every file of the run into `staging`; paths inside them name their place in `out_dir`."""
    split_segments = {split: load_split(args.mustc_root, args.lang, split) for split in splits}
    with Pool(args.workers) as pool:
        audio, drops = extract_audio(split_segments, args, staging, pool, out_dir)

    text_langs = {"asr": "en", "st": args.lang}
    manifests = {}
    for task in args.tasks:
        for split, segments in split_segments.items():
            rows = manifest_rows(segments, audio[split], text_langs[task], split, task, drops)
            manifests[task, split] = rows
    print_summary(split_segments, drops)
    if args.strict and drops:
        raise PreparationError(f"{len(drops)} segments dropped and --strict was given")
    for (task, split), rows in manifests.items():
        if not rows:
            raise PreparationError(f"{split}: no usable segment left for {task}")
        write_manifest(os.path.join(staging, f"{split}_{task}.tsv"), rows)

    for task in args.tasks:
        texts = [row["tgt_text"] for row in manifests[task, "train"]]
        size = train_vocabulary(
            texts, spm_prefix(staging, args, task), args.vocab_type, task_vocab_size(args, task)
        )
        config = data_config(
            spm_prefix(out_dir, args, task), args.cmvn, args.specaugment, args.waveform_input
        )
        write_yaml(os.path.join(staging, f"config_{task}.yaml"), config)
        counts = ", ".join(f"{split} {len(manifests[task, split])}" for split in splits)
        print(f"| {task}: {counts} segments; vocabulary {size} pieces; config_{task}.yaml")


def write_yaml(path, config):
    import yaml

    atomic_write_text(path, yaml.safe_dump(config, sort_keys=False))


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mustc-root", required=True, help="directory holding en-LANG/data/")
    parser.add_argument("--lang", default="de", help="target language: de, es, it, fr, ...")
    parser.add_argument("--out-dir", help="where the manifests go (default: ROOT/en-LANG)")
    parser.add_argument("--splits", nargs="+", help="default: every MuST-C split present")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--vocab-type", choices=("unigram", "bpe", "char"), default="unigram")
    parser.add_argument(
        "--vocab-size",
        type=positive_int,
        default=8000,
        help="largest vocabulary (smaller corpora get less)",
    )
    for task, example in (("asr", 5000), ("st", 8000)):
        parser.add_argument(
            f"--{task}-vocab-size",
            type=positive_int,
            help=f"the {task.upper()} vocabulary's own size (default: --vocab-size; fairseq's "
            f"MuST-C example uses {example})",
        )
    parser.add_argument("--cmvn", choices=("utterance", "global"), default="utterance")
    parser.add_argument(
        "--gcmvn-max-num",
        type=positive_int,
        default=150_000,
        help="training utterances for global CMVN",
    )
    parser.add_argument(
        "--specaugment",
        choices=("none", *SPECAUGMENT_POLICIES),
        default="none",
        help="SpecAugment policy applied to training batches (fairseq's recipes use lb)",
    )
    parser.add_argument(
        "--audio-format",
        choices=("fbank", "wav"),
        default="fbank",
        help="fbank: precomputed filterbanks; wav: manifests of raw audio",
    )
    parser.add_argument(
        "--waveform-input",
        action="store_true",
        help="with --audio-format wav: feed waveforms, not filterbanks (use_audio_input)",
    )
    parser.add_argument(
        "--max-frames",
        type=non_negative_int,
        default=3000,
        help="drop longer training segments (0: keep all)",
    )
    parser.add_argument("--workers", type=positive_int, default=2, help="parallel audio processes")
    parser.add_argument("--strict", action="store_true", help="fail when any segment is dropped")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace output files of the same names in an --out-dir this script did not write",
    )
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.waveform_input and args.audio_format != "wav":
        parser.error("--waveform-input needs --audio-format wav")
    if args.waveform_input and args.cmvn == "global":
        parser.error("--cmvn global normalises filterbanks; --waveform-input feeds waveforms")
    try:
        prepare(args)
    except PreparationError as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # an unreadable corpus file, a full disk: the path and the problem
        sys.exit(f"error: {describe_os_error(e)}")


if __name__ == "__main__":
    main()
