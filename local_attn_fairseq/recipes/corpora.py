"""Raw text for a recipe: fetch the official files (or take them from ``--raw-dir``), unpack them
and write ``{train,valid,test}.{LANG}``, one sentence a line, as ``datasets.yaml`` describes.

``--raw-dir`` may instead hold those split files already (the simple layout); they are used as
they are, and nothing is downloaded.
"""

import glob
import gzip
import hashlib
import os
import random
import re
import shutil
import tarfile
import urllib.request
import zipfile

from ..file_safety import describe_os_error
from .config import RecipeError

SPLITS = ("train", "valid", "test")
# Checksum fields a download may carry, checked after downloading (hashlib names).
CHECKSUMS = ("sha256", "md5")
DOWNLOAD_KEYS = ("url", "file", "manual", "directory", *CHECKSUMS)
_SEGMENT = re.compile(r"<seg[^>]*>(.*)</seg>", re.IGNORECASE)


def languages(dataset):
    return [lang for lang in (dataset["source"], dataset.get("target")) if lang]


def simple_layout(raw_dir, langs):
    """True when ``raw_dir`` holds every ``{split}.{lang}``; False when it holds none of them."""
    if not raw_dir:
        return False
    wanted = [os.path.join(raw_dir, f"{s}.{lang}") for s in SPLITS for lang in langs]
    present = [p for p in wanted if os.path.exists(p)]
    if present and len(present) < len(wanted):
        missing = sorted(set(wanted) - set(present))
        raise RecipeError(f"--raw-dir {raw_dir} has some split files but not {', '.join(missing)}")
    return bool(present)


def source_names(dataset, raw_dir):
    """The names in ``raw_dir`` that the preparation reads: the split files of the simple
    layout, else the local copies of the downloads (files or folders) that it holds."""
    if not raw_dir:
        return []
    langs = languages(dataset)
    if simple_layout(raw_dir, langs):
        return [f"{split}.{lang}" for split in SPLITS for lang in langs]
    names = [d.get("file") or d.get("directory") or os.path.basename(d.get("url", ""))
             for d in dataset["downloads"].values()]  # fmt: skip
    return [n for n in names if n and _local_copy(raw_dir, n)]


def check_sources(dataset, raw_dir):
    """Refuse (RecipeError) a raw source that cannot be prepared, before anything is written:
    a split file of the simple layout that is empty or no file, a hand-made download missing."""
    langs = languages(dataset)
    if simple_layout(raw_dir, langs):
        for split in SPLITS:
            for lang in langs:
                _check_split_file(os.path.join(raw_dir, f"{split}.{lang}"))
    else:
        check_downloads(dataset["downloads"], raw_dir)


def assemble(dataset, raw_dir, download_dir, out_dir, seed=1):
    """Write ``out_dir/{split}.{lang}`` for every split and language of ``dataset``."""
    langs = languages(dataset)
    simple = simple_layout(raw_dir, langs)
    check_sources(dataset, raw_dir)  # all of them before any is copied
    os.makedirs(out_dir, exist_ok=True)
    if simple:
        for split in SPLITS:
            for lang in langs:
                _copy_checked(os.path.join(raw_dir, f"{split}.{lang}"), out_dir, split, lang)
        _check_parallel(out_dir, langs)
        return
    roots = fetch_all(dataset["downloads"], raw_dir, download_dir)
    for split in SPLITS:
        spec = dataset[split]
        if isinstance(spec, dict) and "from_train" in spec:
            continue
        _write_parts(split, spec, roots, langs, out_dir)
    valid = dataset["valid"]
    if isinstance(valid, dict) and "from_train" in valid:
        hold_out(out_dir, langs, int(valid["from_train"]), seed)
    _check_parallel(out_dir, langs)


def _check_split_file(path):
    """Refuse a split file of --raw-dir that is not a file or holds no sentence: every split is
    used (an empty test set would fail only at the evaluate stage, after training)."""
    if not os.path.isfile(path):
        raise RecipeError(f"--raw-dir: {path} is not a file (a split file: one sentence a line)")
    try:
        with open(path, encoding="utf-8", errors="strict") as f:
            if not any(line.strip() for line in f):  # stops at the first sentence
                raise RecipeError(
                    f"--raw-dir: {path} has no sentences; every split needs some (one a line)"
                )
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise RecipeError(f"--raw-dir: {describe_os_error(e)}") from None


def _copy_checked(path, out_dir, split, lang):
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            lines = f.readlines()
        except UnicodeDecodeError as e:
            raise RecipeError(f"{path}: not UTF-8 text ({e})") from None
    with open(os.path.join(out_dir, f"{split}.{lang}"), "w", encoding="utf-8") as out:
        out.writelines(line.rstrip("\n").replace("\r", " ") + "\n" for line in lines)


def _check_parallel(out_dir, langs):
    for split in SPLITS:
        counts = {lang: _count_lines(os.path.join(out_dir, f"{split}.{lang}")) for lang in langs}
        if len(set(counts.values())) > 1:
            sizes = ", ".join(f"{split}.{lang}: {n} lines" for lang, n in counts.items())
            raise RecipeError(f"the {split} split is not parallel ({sizes}) in {out_dir}")


def _count_lines(path):
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def fetch_all(downloads, raw_dir, download_dir):
    """{download name: unpacked directory}; every missing hand-made download reported at once."""
    check_downloads(downloads, raw_dir)
    return {name: _fetch(name, d, raw_dir, download_dir) for name, d in downloads.items()}


def check_downloads(downloads, raw_dir):
    for name, download in downloads.items():
        unknown = sorted(set(download) - set(DOWNLOAD_KEYS))
        if unknown:
            raise RecipeError(
                f"download {name!r} in datasets.yaml has unknown keys {', '.join(unknown)} "
                f"(known: {', '.join(DOWNLOAD_KEYS)})"
            )
    missing = [
        f"  {d.get('file') or d.get('directory')}: {d['manual']}"
        for d in downloads.values()
        if "manual" in d and not _local_copy(raw_dir, d.get("file") or d.get("directory"))
    ]
    if missing:
        where = raw_dir or "a directory given with --raw-dir"
        raise RecipeError(
            "these files cannot be downloaded automatically; put them into "
            f"{where}:\n" + "\n".join(missing)
        )


def _local_copy(raw_dir, name):
    path = os.path.join(raw_dir, name) if raw_dir and name else None
    return path if path and os.path.exists(path) else None


def _fetch(name, download, raw_dir, download_dir):
    if "directory" in download:
        return _local_copy(raw_dir, download["directory"])
    filename = download.get("file") or os.path.basename(download["url"])
    archive = _local_copy(raw_dir, filename)
    if archive is None:
        archive = os.path.join(download_dir, filename)
        if not os.path.exists(archive):
            os.makedirs(download_dir, exist_ok=True)
            print(f"| downloading {download['url']}", flush=True)
            partial = archive + ".part"
            try:
                urllib.request.urlretrieve(download["url"], partial)
            except OSError as e:
                raise RecipeError(
                    f"cannot download {download['url']} ({e}); fetch it by hand into --raw-dir"
                ) from None
            check_checksums(partial, download)
            os.replace(partial, archive)
    return _unpack(archive, os.path.join(download_dir, name))


def check_checksums(path, download):
    """Compare ``path`` with the download's recorded checksums; a mismatch removes ``path`` (the
    partial download, never renamed into place) and raises."""
    for algorithm in CHECKSUMS:
        expected = download.get(algorithm)
        if not expected:
            continue
        digest = hashlib.new(algorithm)
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != str(expected).lower():
            os.remove(path)
            raise RecipeError(
                f"{download['url']}: {algorithm} {digest.hexdigest()} differs from the "
                f"{expected} recorded in datasets.yaml; the download is damaged or the file "
                "changed on the server (fetch it again, or update the recorded checksum after "
                "checking the file)"
            )


def _unpack(archive, target):
    done = os.path.join(target, ".unpacked")
    if os.path.exists(done):
        return target
    os.makedirs(target, exist_ok=True)
    print(f"| unpacking {archive}", flush=True)
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            z.extractall(target)
    elif tarfile.is_tarfile(archive):
        with tarfile.open(archive) as t:
            t.extractall(target, filter="data")
    else:
        shutil.copy(archive, target)
    open(done, "w").close()
    return target


def _write_parts(split, parts, roots, langs, out_dir):
    outs = {
        lang: open(os.path.join(out_dir, f"{split}.{lang}"), "w", encoding="utf-8")
        for lang in langs
    }
    try:
        for part in parts:
            root = roots[part["from"]]
            for columns in _part_lines(part, root, langs):
                for lang, text in zip(langs, columns):
                    outs[lang].write(text + "\n")
    finally:
        for f in outs.values():
            f.close()


def _part_lines(part, root, langs):
    """Tuples of one line per language from one part of a split."""
    if "text" in part:
        for path in _find(root, part["text"]):
            for line in _read_lines(path):
                yield (line,)
    elif "pairs" in part:
        (path,) = _find(root, part["pairs"])
        order = [part["columns"][lang] for lang in langs]
        for number, line in enumerate(_read_lines(path), 1):
            fields = line.split(part["separator"])
            if len(fields) <= max(order):
                raise RecipeError(f"{path}:{number}: no {part['separator']!r}-separated pair")
            yield tuple(fields[i].strip() for i in order)
    else:
        (src,), (tgt,) = _find(root, part["src"]), _find(root, part["tgt"])
        src_lines, tgt_lines = list(_read_lines(src)), list(_read_lines(tgt))
        if len(src_lines) != len(tgt_lines):
            raise RecipeError(
                f"{src} ({len(src_lines)} lines) and {tgt} ({len(tgt_lines)}) are not parallel"
            )
        yield from zip(src_lines, tgt_lines)


def _find(root, pattern):
    """The files matching ``pattern`` under ``root``: at that path, or anywhere below it (some
    archives wrap their files in one more directory)."""
    matches = sorted(glob.glob(os.path.join(root, pattern)))
    if not matches:
        matches = sorted(glob.glob(os.path.join(root, "**", pattern), recursive=True))
    if not matches:
        raise RecipeError(f"{pattern} not found in {root} (is the download complete?)")
    if "*" not in pattern and len(matches) > 1:
        raise RecipeError(f"{pattern} is ambiguous in {root}: {', '.join(matches)}")
    return matches


def _read_lines(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        if ".sgm" in os.path.basename(path):
            for line in f:
                match = _SEGMENT.search(line)
                if match:
                    # kept escaped, as sacreBLEU reads these references
                    yield match.group(1).strip()
        else:
            for line in f:
                yield line.rstrip("\n").replace("\r", " ").strip()


def hold_out(out_dir, langs, n, seed):
    """Move ``n`` random training pairs into the valid split (a held-out development set)."""
    columns = []
    for lang in langs:
        with open(os.path.join(out_dir, f"train.{lang}"), encoding="utf-8") as f:
            columns.append(f.readlines())
    total = len(columns[0])
    if n >= total:
        raise RecipeError(f"valid: from_train {n} leaves no training data ({total} pairs)")
    chosen = set(random.Random(seed).sample(range(total), n))
    for lang, lines in zip(langs, columns):
        with open(os.path.join(out_dir, f"valid.{lang}"), "w", encoding="utf-8") as valid, open(
            os.path.join(out_dir, f"train.{lang}"), "w", encoding="utf-8"
        ) as train:
            for i, line in enumerate(lines):
                (valid if i in chosen else train).write(line)
