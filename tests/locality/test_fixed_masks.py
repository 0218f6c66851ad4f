import pytest
import torch

from local_attn_fairseq.locality.fixed_masks import MaskBounds, offset_mask, parse_mask


def mask_of(name, length=5):
    return offset_mask([parse_mask(name)], length, length)[0].int().tolist()


def test_identity():
    assert mask_of("identity", 3) == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]


def test_prev_looks_back():
    # token i attends to i-1; the first token has nothing to attend to
    assert mask_of("prev-1", 4) == [[0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]
    assert mask_of("prev-2", 4) == [[0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]]


def test_next_looks_ahead():
    assert mask_of("next-1", 4) == [[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert mask_of("next-2", 4) == [[0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]]


def test_band():
    assert mask_of("band-1", 5) == [
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 1, 1, 1, 0],
        [0, 0, 1, 1, 1],
        [0, 0, 0, 1, 1],
    ]
    assert mask_of("band-2", 5)[2] == [1, 1, 1, 1, 1]
    assert mask_of("band-2", 5)[0] == [1, 1, 1, 0, 0]


def test_global_is_all_ones():
    assert torch.tensor(mask_of("global", 4)).all()


def test_band_longer_than_sequence_is_global():
    assert torch.tensor(mask_of("band-9", 3)).all()


def test_incremental_query_is_the_newest_position():
    # one query over 4 keys: it sits at position 3
    m = offset_mask([parse_mask("prev-1"), parse_mask("band-1"), parse_mask("identity")], 1, 4)
    assert m[:, 0].int().tolist() == [[0, 0, 1, 0], [0, 0, 1, 1], [0, 0, 0, 1]]


@pytest.mark.parametrize(
    "name,bounds",
    [
        ("global", MaskBounds(None, None)),
        ("identity", MaskBounds(0, 0)),
        ("band-3", MaskBounds(-3, 3)),
        ("prev-2", MaskBounds(-2, -2)),
        ("next-1", MaskBounds(1, 1)),
    ],
)
def test_parse(name, bounds):
    assert parse_mask(name) == bounds


@pytest.mark.parametrize(
    "name,message",
    [
        ("band--1", "negative window"),
        ("prev--2", "negative window"),
        ("bnd-2", "unknown mask"),
        ("band", "unknown mask"),
        ("band-x", "unknown mask"),
        ("", "unknown mask"),
    ],
)
def test_parse_rejects(name, message):
    with pytest.raises(ValueError, match=message):
        parse_mask(name)


def test_all_heads_at_once_match_each_mask_entry_by_entry():
    gen = torch.Generator().manual_seed(0)
    choices = [None, -3, -1, 0, 2, 5]
    for tgt_len, src_len in [(7, 7), (1, 9), (4, 11), (12, 12)]:
        bounds = []
        for _ in range(6):
            lo, hi = (choices[int(i)] for i in torch.randint(len(choices), (2,), generator=gen))
            if lo is not None and hi is not None and lo > hi:
                lo, hi = hi, lo
            bounds.append(MaskBounds(lo, hi))
        masks = offset_mask(bounds, tgt_len, src_len)
        assert masks.shape == (len(bounds), tgt_len, src_len) and masks.dtype == torch.bool
        for h, b in enumerate(bounds):
            for t in range(tgt_len):
                for j in range(src_len):
                    offset = j - (src_len - tgt_len + t)
                    allowed = (b.lo is None or offset >= b.lo) and (b.hi is None or offset <= b.hi)
                    assert bool(masks[h, t, j]) == allowed, (b, t, j)


def test_masks_are_built_once_and_usable_in_training_after_inference():
    bounds = [MaskBounds(-1, 1), MaskBounds(None, None), MaskBounds(-2, -2)]
    with torch.inference_mode():  # as fairseq-generate may run a model before it trains
        first = offset_mask(bounds, 7, 9)
    assert not first.is_inference()
    assert offset_mask(tuple(bounds), 7, 9, "cpu") is first  # one tensor per bounds and lengths
    assert offset_mask(bounds, 7, 10) is not first
    x = torch.randn(3, 7, 9, requires_grad=True)
    (x * first).sum().backward()  # a normal tensor: saved for backward without complaint
    assert torch.equal(x.grad, first.float())
