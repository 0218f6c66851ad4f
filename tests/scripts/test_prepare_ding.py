import os
import subprocess
import sys

import pytest

from local_attn_fairseq.data import ding as prepare_ding

from ..conftest import REPO


LINES = [
    "# Version :: devel\n",
    "Haus {n} | Das Haus ist alt. [ugs.] | Häuser {pl} :: house | The house is old. | houses\n",
    "gehen {vi} | Wir gehen nach Hause.; Wir gehen heim. :: to go | We are going home.; We go home.\n",
    "Er kommt <kommt> morgen {adv} zurück. :: He is coming back tomorrow.\n",
    "a | Das Haus ist alt. :: b | The house is old.\n",  # duplicate pair
    "x | Zu kurz. :: y | Too short.\n",  # fewer than 4 words
    "p | Ein Satz hier. | mehr :: q | A sentence here.\n",  # misaligned parts
    "kein satz ohne punkt hier :: not a sentence without a stop here\n",
]


def test_extract_pairs_cleans_aligns_and_deduplicates():
    pairs = list(prepare_ding.extract_pairs(LINES))
    assert pairs == [
        ("Das Haus ist alt.", "The house is old."),
        ("Wir gehen nach Hause.", "We are going home."),
        ("Er kommt morgen zurück.", "He is coming back tomorrow."),
    ]


def test_split_is_seeded_and_disjoint():
    pairs = [(f"Satz Nummer {i} hier.", f"Sentence number {i} here.") for i in range(50)]
    a = prepare_ding.split_pairs(pairs, 10, 5, seed=1)
    b = prepare_ding.split_pairs(pairs, 10, 5, seed=1)
    assert a == b and [len(a[k]) for k in ("test", "valid", "train")] == [10, 5, 35]
    assert not set(a["test"]) & set(a["train"])
    with pytest.raises(ValueError, match="not enough"):
        prepare_ding.split_pairs(pairs[:12], 10, 5, seed=1)


def test_real_dictionary_gives_the_documented_corpus(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "prepare_ding.py"), "--out-dir", tmp_path],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "18135 sentence pairs (test 1000, valid 500, train 16635)" in out
    for split, n in (("test", 1000), ("valid", 500), ("train", 16635)):
        for lang in ("de", "en"):
            assert len((tmp_path / f"{split}.{lang}").read_text().splitlines()) == n


def test_missing_dictionary_is_a_clear_error(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "scripts", "prepare_ding.py"),
            "--source",
            tmp_path / "nope",
            "--out-dir",
            tmp_path / "out",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "apt-get install trans-de-en" in proc.stderr
