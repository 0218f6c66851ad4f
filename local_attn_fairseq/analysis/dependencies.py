"""Dependency relations between the word pieces a model reads.

    trees = read_conllu("valid.de.conllu")                   # one DependencyTree per sentence
    alignment = align_pieces(["▁Das", "▁Hau", "s", "</s>"], trees[0])
    alignment.words_of_piece    # [{1}, {2}, {2}, set()]: CoNLL-U word ids each piece spells
    pairs = relation_pairs(trees[0], alignment)                # RelationPair(query, key, ...)
    related = related_matrix(pairs, 4)                         # (4, 4) bool, symmetric

    syntax = SourceSyntax.from_args(args)     # --conllu FILE or --spacy-model NAME, else None
    pairs = syntax.relations(sentence)        # a loading.Sentence; None if it did not align

    sentences = TokenSetSentences(args)       # the model and parses the common options name
    for sentence, positions, sets in sentences:   # sets: token_sets() of the pieces at positions

CoNLL-U (https://universaldependencies.org/format.html): ten tab-separated fields per word
line, sentences separated by blank lines, ``#`` comments. A multiword token (ID ``a-b``, e.g.
German "vom" = "von" + "dem") is one surface token spelling the syntactic words a..b; empty
nodes (ID ``n.m``) belong to enhanced dependencies only and are skipped. Anything malformed
raises ``ValueError("FILE, line N: ...")``.

Aligning pieces with words, by characters. The surface forms of a tree, without whitespace,
must spell the same characters as the sentence's pieces without their markers (sentencepiece's
``▁``, BPE's trailing ``@@``), up to Unicode NFKC normalisation and case. ``<unk>`` matches any
non-empty run of characters; ``</s>`` and other special symbols spell nothing and belong to no
word; a piece made of a marker only (a lone ``▁``) belongs to the word of the piece after it.
A piece belongs to every word whose characters it covers (usually one; two for a piece that
runs over a word boundary, all of a multiword token's words). A sentence whose characters do
not match is not aligned (:class:`SourceSyntax` counts it and warns; it is never guessed).

Relations are carried by ALL pieces of a word (``carrier="all"``, the default): when word u
depends on word v with relation r, every piece of u is related to every piece of v, in both
directions (``dependent->head`` with the query in u, ``head->dependent`` with the query in v).
With ``carrier="first"`` only the first piece of each word carries its relations. Pieces of
one word are not related to each other, and a piece is never related to itself.

Without a parse, :func:`piece_words` groups pieces into whitespace words: a piece starting
with ``▁`` starts a word, a piece ending with ``@@`` continues into the next one, and with
neither marker in the sentence every piece is a word.
"""

import logging
import os
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

import torch

from .loading import (
    AnalysisInputError,
    Sentence,
    encoder_self_attention_modules,
    load_model,
    read_sentences,
    text_lines,
)

logger = logging.getLogger(__name__)

SPM_MARK = "\u2581"  # ▁
BPE_MARK = "@@"
UNKNOWN_PIECE = "<unk>"
SPECIAL_PIECES = frozenset({"<s>", "</s>", "<pad>"})
CARRIERS = ("all", "first")
_INTEGER_ID = re.compile(r"^[1-9]\d*$")
_RANGE_ID = re.compile(r"^([1-9]\d*)-([1-9]\d*)$")
_EMPTY_NODE_ID = re.compile(r"^\d+\.[1-9]\d*$")


@dataclass(frozen=True)
class Word:
    """A syntactic word: CoNLL-U ID (1-based), FORM, HEAD (0 for the root), DEPREL."""

    id: int
    form: str
    head: int
    deprel: str


@dataclass
class DependencyTree:
    words: List[Word]
    tokens: List[Tuple[str, Tuple[int, ...]]]  # surface tokens: (form, ids of the words)
    origin: str = ""  # "FILE, line N" of the sentence's first line
    text: Optional[str] = None  # the "# text = ..." comment

    def arcs(self) -> List[Tuple[int, int, str]]:
        """(dependent id, head id, deprel) of every non-root word."""
        return [(w.id, w.head, w.deprel) for w in self.words if w.head != 0]


# -- CoNLL-U -------------------------------------------------------------------------------
def read_conllu(path: str) -> List[DependencyTree]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--conllu: no file {path}")
    trees, block, start = [], [], 0
    for number, line in text_lines(path, "--conllu"):
        line = line.rstrip("\n").rstrip("\r")
        if line.strip():
            start = start or number
            block.append((number, line))
        elif block:
            trees.append(_parse_sentence(path, block, start))
            block, start = [], 0
    if block:
        trees.append(_parse_sentence(path, block, start))
    if not trees:
        raise AnalysisInputError(f"{path}: no sentences")
    return trees


def _parse_sentence(path: str, block, start: int) -> DependencyTree:
    words, tokens, text = [], [], None
    covered_until = 0  # last word id inside the current multiword token
    pending_range = None  # (form, first, last, line number) awaiting its words

    def fail(number, message):
        raise AnalysisInputError(f"{path}, line {number}: {message}")

    for number, line in block:
        if line.startswith("#"):
            if line.startswith("# text ="):
                text = line[len("# text =") :].strip()
            continue
        fields = line.split("\t")
        if len(fields) != 10:
            fail(number, f"expected 10 tab-separated fields, found {len(fields)}")
        ident, form, head, deprel = fields[0], fields[1], fields[6], fields[7]
        if _EMPTY_NODE_ID.match(ident):
            continue
        span = _RANGE_ID.match(ident)
        if span:
            first, last = int(span.group(1)), int(span.group(2))
            if first != len(words) + 1 or last < first:
                fail(number, f"multiword token {ident} does not cover the next words")
            pending_range = (form, first, last, number)
            continue
        if not _INTEGER_ID.match(ident):
            fail(number, f"bad ID {ident!r} (expected N, N-M or N.M)")
        if int(ident) != len(words) + 1:
            fail(number, f"word ID {ident} out of order (expected {len(words) + 1})")
        if not _INTEGER_ID.match(head) and head != "0":
            fail(number, f"bad HEAD {head!r} (expected the ID of a word, or 0 for the root)")
        if deprel in ("", "_"):
            fail(number, "missing DEPREL")
        word = Word(int(ident), form, int(head), deprel)
        if word.head == word.id:
            fail(number, f"word {ident} is its own head")
        words.append(word)
        if pending_range is not None:
            range_form, first, last, _ = pending_range
            tokens.append((range_form, tuple(range(first, last + 1))))
            covered_until, pending_range = last, None
        elif word.id > covered_until:
            tokens.append((form, (word.id,)))
    if pending_range is not None or covered_until > len(words):
        number = pending_range[3] if pending_range else start
        fail(number, "multiword token covers words that are missing")
    if not words:
        fail(start, "sentence without word lines")
    for word, (number, _) in zip(words, [(n, l) for n, l in block if _is_word_line(l)]):
        if word.head > len(words):
            fail(number, f"HEAD {word.head} is not a word of this sentence ({len(words)} words)")
    return DependencyTree(words, tokens, f"{path}, line {start}", text)


def _is_word_line(line: str) -> bool:
    return not line.startswith("#") and _INTEGER_ID.match(line.split("\t", 1)[0]) is not None


# -- spaCy -----------------------------------------------------------------------------------
def parse_with_spacy(lines: Sequence[str], model_name: str) -> List[DependencyTree]:
    """Parse sentences with an installed spaCy model; nothing is downloaded."""
    try:
        import spacy
    except ImportError as error:
        raise AnalysisInputError(
            f"--spacy-model {model_name}: spaCy is not installed (pip install spacy, then "
            "install the model package), or give the parses with --conllu FILE"
        ) from error
    try:
        nlp = spacy.load(model_name)
    except OSError as error:
        raise AnalysisInputError(
            f"--spacy-model {model_name}: no such spaCy model installed ({error})"
        ) from error
    return trees_from_spacy(nlp.pipe(lines), origin=f"spaCy {model_name}")


def trees_from_spacy(docs, origin: str = "spaCy") -> List[DependencyTree]:
    """One tree per spaCy ``Doc`` (tokens with ``i``, ``text``, ``head``, ``dep_``); a doc
    spaCy split into several sentences gives one tree with several roots."""
    trees = []
    for number, doc in enumerate(docs, start=1):
        words = [
            Word(t.i + 1, t.text, 0 if t.head.i == t.i else t.head.i + 1, t.dep_.lower())
            for t in doc
        ]
        tokens = [(w.form, (w.id,)) for w in words]
        trees.append(DependencyTree(words, tokens, f"{origin}, sentence {number}"))
    return trees


# -- pieces and words ------------------------------------------------------------------------
def piece_words(pieces: Sequence[str]) -> List[Optional[int]]:
    """Whitespace word index of each piece (None for special symbols such as ``</s>``)."""
    sentencepiece = any(p.startswith(SPM_MARK) for p in pieces)
    result, word, continues = [], -1, False
    for piece in pieces:
        if piece in SPECIAL_PIECES:
            result.append(None)
            continue
        if sentencepiece:
            starts = piece.startswith(SPM_MARK) or word < 0
        else:
            starts = not continues
            continues = piece.endswith(BPE_MARK)
        word += int(starts)
        result.append(word)
    return result


@dataclass
class Alignment:
    words_of_piece: List[FrozenSet[int]]  # CoNLL-U word ids each piece spells
    pieces_of_word: Dict[int, List[int]] = field(default_factory=dict)

    def __post_init__(self):
        if not self.pieces_of_word:
            for piece, words in enumerate(self.words_of_piece):
                for word in sorted(words):
                    self.pieces_of_word.setdefault(word, []).append(piece)


def _normalise(text: str) -> str:
    return unicodedata.normalize("NFKC", text).casefold()


def piece_text(piece: str) -> str:
    text = piece.replace(SPM_MARK, "")
    return text[: -len(BPE_MARK)] if text.endswith(BPE_MARK) else text


def align_pieces(pieces: Sequence[str], tree: DependencyTree) -> Optional[Alignment]:
    """Which words each piece spells (see the module docstring), or None if the characters of
    the pieces and of the tree's surface tokens differ."""
    chars_word: List[Tuple[int, ...]] = []
    spelled = []
    for form, word_ids in tree.tokens:
        text = "".join(_normalise(form).split())
        spelled.append(text)
        chars_word.extend([word_ids] * len(text))
    target = "".join(spelled)
    aligned = [i for i, p in enumerate(pieces) if p not in SPECIAL_PIECES]
    pattern = "".join(
        (
            "(.+?)"
            if pieces[i] == UNKNOWN_PIECE
            else f"({re.escape(_normalise(piece_text(pieces[i])))})"
        )
        for i in aligned
    )
    match = re.fullmatch(pattern, target, flags=re.DOTALL)
    if match is None:
        return None
    words: List[FrozenSet[int]] = [frozenset()] * len(pieces)
    for group, i in enumerate(aligned, start=1):
        begin, end = match.span(group)
        words[i] = frozenset(w for ids in chars_word[begin:end] for w in ids)
    # a lone marker spells nothing: it opens the word of the piece after it
    following: FrozenSet[int] = frozenset()
    for i in reversed(aligned):
        following = words[i] = words[i] or following
    return Alignment(words)


# -- relations -------------------------------------------------------------------------------
@dataclass(frozen=True)
class RelationPair:
    """Piece ``query`` is related to piece ``key`` by ``deprel``; ``direction`` says whether
    the query lies in the dependent word (``dependent->head``) or in the head word."""

    query: int
    key: int
    deprel: str
    direction: str


def relation_pairs(
    tree: DependencyTree, alignment: Alignment, carrier: str = "all"
) -> List[RelationPair]:
    if carrier not in CARRIERS:
        raise ValueError(f"carrier must be one of {CARRIERS}, got {carrier!r}")

    def carriers(word: int) -> List[int]:
        pieces = alignment.pieces_of_word.get(word, [])
        return pieces[:1] if carrier == "first" else pieces

    pairs = set()
    for dependent, head, deprel in tree.arcs():
        for a in carriers(dependent):
            for b in carriers(head):
                if a == b:
                    continue
                pairs.add(RelationPair(a, b, deprel, "dependent->head"))
                pairs.add(RelationPair(b, a, deprel, "head->dependent"))
    return sorted(pairs, key=lambda p: (p.query, p.key, p.deprel, p.direction))


def related_matrix(pairs: Sequence[RelationPair], length: int) -> torch.Tensor:
    """(length, length) bool: [i, j] when pieces i and j are related (symmetric)."""
    related = torch.zeros(length, length, dtype=torch.bool)
    for pair in pairs:
        related[pair.query, pair.key] = True
    return related


class SourceSyntax:
    """The dependency trees of the analysed source sentences (``--conllu`` or
    ``--spacy-model``), by sentence index, with a record of what did not align."""

    def __init__(self, trees: List[DependencyTree], origin: str, carrier: str = "all"):
        self.trees, self.origin, self.carrier = trees, origin, carrier
        self.aligned: List[int] = []
        self.unaligned: List[int] = []

    @classmethod
    def from_args(cls, args, carrier: str = "all") -> Optional["SourceSyntax"]:
        conllu, spacy_model = getattr(args, "conllu", None), getattr(args, "spacy_model", None)
        if conllu and spacy_model:
            raise AnalysisInputError("give either --conllu or --spacy-model, not both")
        if conllu:
            return cls(read_conllu(conllu), conllu, carrier)
        if spacy_model:
            if not args.source_text:
                raise AnalysisInputError(
                    "--spacy-model parses raw text: it needs --source-text FILE"
                )
            if not os.path.isfile(args.source_text):
                raise FileNotFoundError(f"--source-text: no text file {args.source_text}")
            sentences = [line.strip() for _, line in text_lines(args.source_text, "--source-text")]
            return cls(parse_with_spacy(sentences, spacy_model), f"spaCy {spacy_model}", carrier)
        return None

    def tree(self, sentence) -> DependencyTree:
        if sentence.index >= len(self.trees):
            raise AnalysisInputError(
                f"{self.origin} has {len(self.trees)} sentences, but source sentence "
                f"{sentence.index + 1} is analysed; pass --max-sentences {len(self.trees)} or "
                "parse every sentence"
            )
        return self.trees[sentence.index]

    def relations(self, sentence) -> Optional[List[RelationPair]]:
        """Relation pairs between the sentence's source pieces, or None if its pieces do not
        spell the tree's words (counted in :meth:`summary`)."""
        tree = self.tree(sentence)
        alignment = align_pieces(sentence.source_pieces, tree)
        if alignment is None:
            if not self.unaligned:
                logger.warning(
                    f"{tree.origin}: the words do not spell source sentence {sentence.index + 1} "
                    f"({' '.join(sentence.source_pieces)}); such sentences are left out"
                )
            self.unaligned.append(sentence.index)
            return None
        self.aligned.append(sentence.index)
        return relation_pairs(tree, alignment, self.carrier)

    def summary(self) -> dict:
        return {
            "parses": self.origin,
            "carrier": self.carrier,
            "aligned_sentences": len(self.aligned),
            "unaligned_sentences": self.unaligned,
        }


# -- Pande et al.'s token sets ---------------------------------------------------------------
LOCAL_RADIUS = 2  # L_i = [i - 2, i + 2]


def sentence_positions(pieces: Sequence[str]) -> List[int]:
    """Positions of the sentence's own pieces: every piece but ``</s>`` and other specials."""
    return [i for i, piece in enumerate(pieces) if piece not in SPECIAL_PIECES]


def token_sets(
    length: int, related: Optional[torch.Tensor] = None, radius: int = LOCAL_RADIUS
) -> Dict[str, torch.Tensor]:
    """Pande et al.'s sets (Section 3.1) as (length, length) bool masks, row i for token i:
    ``local`` L_i = [i - radius, i + radius] (i included, as in the paper); with the
    ``related`` matrix, ``syntactic`` S_i (related, not local) and ``unrelated`` U_i (neither);
    without it, ``nonlocal`` (everything outside L_i)."""
    position = torch.arange(length)
    local = (position[:, None] - position[None, :]).abs() <= radius
    if related is None:
        return {"local": local, "nonlocal": ~local}
    if related.shape != (length, length):
        raise ValueError(f"related matrix {tuple(related.shape)} for {length} tokens")
    syntactic = related.to(torch.bool) & ~local
    return {"local": local, "syntactic": syntactic, "unrelated": ~(local | syntactic)}


def source_token_sets(
    sentence, syntax: Optional[SourceSyntax]
) -> Optional[Tuple[List[int], Dict[str, torch.Tensor]]]:
    """The positions of a :class:`loading.Sentence`'s own source pieces and their token sets
    (indexed within those positions); None when its parse does not align (it is left out)."""
    positions = sentence_positions(sentence.source_pieces)
    related = None
    if syntax is not None:
        pairs = syntax.relations(sentence)
        if pairs is None:
            return None
        index = torch.tensor(positions)
        related = related_matrix(pairs, len(sentence.source_pieces))[index][:, index]
    return positions, token_sets(len(positions), related)


class TokenSetSentences:
    """What Pande et al.'s analyses (``sensitivity``, ``bias``) read, as the common options
    name it: the model, its encoder self-attention modules, the source parses (None without
    ``--conllu``/``--spacy-model``) and, iterated, every sentence with its source positions and
    token sets (:func:`source_token_sets`). Sentences whose parse does not align are left out;
    none left is an error. ``count``: the sentences analysed so far."""

    def __init__(self, args):
        self.args = args
        self.loaded = load_model(args.path, args.data, cpu=args.cpu)
        self.syntax = SourceSyntax.from_args(args)
        self.modules = encoder_self_attention_modules(self.loaded, args.path)
        self.count = 0

    def __iter__(self) -> Iterator[Tuple[Sentence, List[int], Dict[str, torch.Tensor]]]:
        for sentence in read_sentences(self.loaded, self.args):
            found = source_token_sets(sentence, self.syntax)
            if found is not None:
                self.count += 1
                yield (sentence, *found)
        if self.count == 0:
            raise AnalysisInputError("no sentence could be analysed (see the warnings above)")
