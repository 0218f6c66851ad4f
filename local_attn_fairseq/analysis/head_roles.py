"""What each attention head does (Voita et al. 2019, Sections 4-5): confidence, relevance and
roles, accumulated sentence by sentence.

    stats = HeadStatistics(8, dictionary.count, excluded={eos, pad, bos}, unknown=unk)
    stats.add(weights, query_tokens, key_tokens, relations)   # one sentence, one module
    summary = stats.summary(thresholds)                          # per head: numbers and roles

Which weights count. A head's row (one query token) is divided by its sum first: Pande et al.'s
fixed masks multiply a softmax over all keys, so their rows sum to less than 1, and the head's
choice among the keys it attends to is what the measures are about (a softmax row is unchanged).
EOS is "not a real token": rows of EOS queries are left out and EOS keys are never a head's
choice (the paper excludes EOS from the maximum). A row without weight on any real key
(``prev-1`` at the first token, ``next-1`` at the last) is left out.

* confidence: the mean, over query tokens, of the head's largest weight on a non-EOS key;
* positional: at least ``positional`` (0.9) of the head's choices (its arg-max key) lie at one
  relative position ``key - query``, which is reported;
* syntactic (with dependency parses of the source): for each relation of ``RELATIONS`` and each
  direction, the accuracy of the head is the share of query tokens in the relation whose
  choice is a token they are related to; the baseline always chooses the relation's most
  frequent relative position. A head is syntactic for a relation and direction if its accuracy
  is at least ``syntactic_margin`` (0.10) above the baseline, over at least
  ``min_relation_queries`` queries;
* rare words: in sentences whose rarest token (lowest count in the model's dictionary) is not
  among the ``rare_top_n`` (500) most frequent tokens, the share of the head's choices that
  fall on the rarest token; the head has the role if the share is at least ``rare`` (0.5; the
  paper reports 66% for its rare-words head on OpenSubtitles and "more than 50%" counting the
  two rarest tokens on WMT).
"""

from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

# Voita et al.'s relations (Stanford names); Universal Dependencies v2 calls dobj "obj", and
# subtypes (nsubj:pass) count as their main type.
RELATIONS = ("nsubj", "dobj", "amod", "advmod")
RELATION_ALIASES = {"obj": "dobj"}
ROLES = ("positional", "syntactic", "rare words")


@dataclass(frozen=True)
class Thresholds:
    positional: float = 0.9
    syntactic_margin: float = 0.10
    min_relation_queries: int = 10
    rare: float = 0.5
    rare_top_n: int = 500

    def __post_init__(self):
        for name in ("positional", "syntactic_margin", "rare"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"threshold {name} must lie in [0, 1], got {value}")
        if self.min_relation_queries < 1 or self.rare_top_n < 0:
            raise ValueError("min_relation_queries must be >= 1 and rare_top_n >= 0")


def relation_name(deprel: str) -> Optional[str]:
    """The relation of ``RELATIONS`` a dependency label counts as, or None."""
    main = deprel.split(":")[0].lower()
    main = RELATION_ALIASES.get(main, main)
    return main if main in RELATIONS else None


@dataclass
class HeadChoices:
    """One sentence, one attention module: what each head chose for each query token."""

    choice: Tensor  # (heads, tgt_len) long: arg-max key (non-EOS), per query
    confidence: Tensor  # (heads, tgt_len) float: the weight there, rows divided by their sum
    counted: Tensor  # (heads, tgt_len) bool: a real query with weight on some real key


def head_choices(
    weights: Tensor, query_tokens: Tensor, key_tokens: Tensor, excluded: Sequence[int]
) -> HeadChoices:
    """weights (heads, tgt_len, src_len) of one sentence; tokens are ids; ``excluded``: ids of
    EOS, padding and other special symbols."""
    weights = weights.float()
    excluded_ids = torch.as_tensor(list(excluded), dtype=torch.long, device=weights.device)
    real_queries = ~torch.isin(query_tokens, excluded_ids)
    real_keys = ~torch.isin(key_tokens, excluded_ids)
    totals = weights.sum(-1, keepdim=True)
    shares = weights / torch.where(totals > 0, totals, torch.ones_like(totals))
    shares = shares.masked_fill(~real_keys[None, None, :], -1.0)
    confidence, choice = shares.max(-1)
    counted = real_queries[None, :] & (confidence > 0)
    return HeadChoices(choice, confidence.clamp(min=0.0), counted)


@dataclass
class RelationInstance:
    """A query token in one relation and direction, and the positions of the tokens it is
    related to that way."""

    query: int
    keys: frozenset


def relation_instances(pairs) -> Dict[Tuple[str, str], List[RelationInstance]]:
    """Group ``dependencies.RelationPair`` s by (relation, direction) and query token."""
    grouped: Dict[Tuple[str, str, int], set] = {}
    for pair in pairs:
        relation = relation_name(pair.deprel)
        if relation is not None:
            grouped.setdefault((relation, pair.direction, pair.query), set()).add(pair.key)
    instances: Dict[Tuple[str, str], List[RelationInstance]] = {}
    for (relation, direction, query), keys in sorted(grouped.items()):
        instances.setdefault((relation, direction), []).append(
            RelationInstance(query, frozenset(keys))
        )
    return instances


class HeadStatistics:
    """Running counts of one attention module's heads over sentences."""

    def __init__(
        self,
        num_heads: int,
        key_counts: Sequence[int],
        excluded: Sequence[int],
        unknown: Optional[int] = None,
        rare_top_n: int = 500,
    ):
        """``key_counts``: the dictionary counts of the keys' side; ``excluded``: ids that are
        no real token (EOS, padding, BOS); ``unknown``: the unknown token, a key but never the
        rarest (its count says nothing of the word)."""
        self.num_heads = num_heads
        self.excluded = torch.tensor(sorted(set(excluded)), dtype=torch.long)
        self.not_rare = torch.tensor(sorted(set(excluded) | {unknown} - {None}), dtype=torch.long)
        self.counts = torch.tensor(list(key_counts), dtype=torch.long)
        self.frequent = _most_frequent(self.counts, rare_top_n)
        zeros = torch.zeros(num_heads, dtype=torch.float64)
        self.confidence_sum, self.queries = zeros.clone(), zeros.clone()
        self.offsets: List[Counter] = [Counter() for _ in range(num_heads)]
        self.rare_hits, self.rare_queries = zeros.clone(), zeros.clone()
        self.rare_sentences = 0
        self.relation_hits: Dict[Tuple[str, str], Tensor] = {}
        self.relation_queries: Dict[Tuple[str, str], Tensor] = {}
        # every instance's offsets, for the positional baseline
        self.relation_offsets: Dict[Tuple[str, str], List[frozenset]] = {}
        self.relevance: Optional[Tensor] = None

    def add(self, weights: Tensor, query_tokens: Tensor, key_tokens: Tensor, pairs=None):
        """One sentence: weights (heads, tgt_len, src_len); ``pairs``: its source relations
        (``dependencies.RelationPair``, piece positions), for encoder self-attention."""
        query_tokens, key_tokens = query_tokens.cpu(), key_tokens.cpu()
        choices = head_choices(weights.cpu(), query_tokens, key_tokens, self.excluded)
        choice, counted = choices.choice.cpu(), choices.counted.cpu()
        self.confidence_sum += (choices.confidence.cpu().double() * counted).sum(-1)
        self.queries += counted.sum(-1)
        offsets = choice - torch.arange(choice.size(1))[None, :]
        for head in range(self.num_heads):
            self.offsets[head].update(offsets[head][counted[head]].tolist())
        self._add_rare(choice, counted, key_tokens)
        if pairs is not None:
            self._add_relations(choice, counted, pairs)

    def _add_rare(self, choice, counted, key_tokens):
        real = ~torch.isin(key_tokens, self.not_rare)
        if not real.any():
            return
        counts = self.counts[key_tokens]
        rarest_count = counts[real].min()
        rarest = real & (counts == rarest_count)
        if bool(self.frequent[key_tokens[rarest]].any()):
            return  # the paper's filter: the rarest token is a frequent one
        self.rare_sentences += 1
        self.rare_hits += (rarest[choice] & counted).sum(-1)
        self.rare_queries += counted.sum(-1)

    def _add_relations(self, choice, counted, pairs):
        for name, instances in relation_instances(pairs).items():
            hits = self.relation_hits.setdefault(
                name, torch.zeros(self.num_heads, dtype=torch.float64)
            )
            queries = self.relation_queries.setdefault(name, torch.zeros_like(hits))
            offsets = self.relation_offsets.setdefault(name, [])
            for instance in instances:
                keys = torch.tensor(sorted(instance.keys))
                chosen = choice[:, instance.query]
                hits += torch.isin(chosen, keys) & counted[:, instance.query]
                queries += counted[:, instance.query]
                offsets.append(frozenset(k - instance.query for k in instance.keys))

    # -- results ---------------------------------------------------------------------------
    def baselines(self) -> Dict[Tuple[str, str], dict]:
        """Per relation and direction: the most frequent relative position and its accuracy."""
        result = {}
        for name, instances in self.relation_offsets.items():
            frequency = Counter(offset for offsets in instances for offset in offsets)
            offset = min(frequency, key=lambda o: (-frequency[o], abs(o), o))
            hits = sum(offset in offsets for offsets in instances)
            result[name] = {
                "offset": offset,
                "accuracy": hits / len(instances),
                "queries": len(instances),
            }
        return result

    def summary(self, thresholds: Thresholds) -> List[dict]:
        """Per head (in module order): its numbers and its roles."""
        baselines = self.baselines()
        heads = []
        for head in range(self.num_heads):
            queries = int(self.queries[head])
            entry = {
                "confidence": _ratio(self.confidence_sum[head], queries),
                "queries": queries,
                "relevance": None if self.relevance is None else float(self.relevance[head]),
                "positional": self._positional(head),
                "rare_words": {
                    "fraction": _ratio(self.rare_hits[head], self.rare_queries[head]),
                    "queries": int(self.rare_queries[head]),
                    "sentences": self.rare_sentences,
                },
                "syntactic": self._syntactic(head, baselines, thresholds),
            }
            entry["roles"] = roles(entry, thresholds)
            heads.append(entry)
        return heads

    def _positional(self, head: int) -> dict:
        total = sum(self.offsets[head].values())
        if not total:
            return {"offset": None, "fraction": None}
        offset, count = max(self.offsets[head].items(), key=lambda kv: (kv[1], -abs(kv[0])))
        return {"offset": offset, "fraction": count / total}

    def _syntactic(self, head: int, baselines, thresholds: Thresholds) -> Dict[str, dict]:
        result = {}
        for name in sorted(self.relation_hits):
            queries = int(self.relation_queries[name][head])
            accuracy = _ratio(self.relation_hits[name][head], queries)
            baseline = baselines[name]["accuracy"]
            result[f"{name[0]} {name[1]}"] = {
                "accuracy": accuracy,
                "baseline": baseline,
                "queries": queries,
                "syntactic": accuracy is not None
                and queries >= thresholds.min_relation_queries
                and accuracy >= baseline + thresholds.syntactic_margin,
            }
        return result


def roles(entry: dict, thresholds: Thresholds) -> List[str]:
    """The roles a head's numbers give it, in the order of ``ROLES``."""
    found = []
    fraction = entry["positional"]["fraction"]
    if fraction is not None and fraction >= thresholds.positional:
        found.append("positional")
    if any(r["syntactic"] for r in entry["syntactic"].values()):
        found.append("syntactic")
    rare = entry["rare_words"]["fraction"]
    if rare is not None and rare >= thresholds.rare:
        found.append("rare words")
    return found


def role_label(entry: dict) -> str:
    """Short text for tables and figures: ``-1`` for a positional head at offset -1, ``syn``,
    ``rare``; several roles joined by ``/``; ``-`` for none."""
    labels = []
    for role in entry["roles"]:
        if role == "positional":
            labels.append(f"{entry['positional']['offset']:+d}")
        elif role == "syntactic":
            labels.append("syn")
        else:
            labels.append("rare")
    return "/".join(labels) or "-"


def _ratio(numerator, denominator) -> Optional[float]:
    denominator = float(denominator)
    return float(numerator) / denominator if denominator > 0 else None


def _most_frequent(counts: Tensor, top_n: int) -> Tensor:
    """(vocabulary,) bool: the ``top_n`` tokens of highest count."""
    frequent = torch.zeros(len(counts), dtype=torch.bool)
    if top_n > 0:
        frequent[torch.topk(counts, min(top_n, len(counts))).indices] = True
    return frequent
