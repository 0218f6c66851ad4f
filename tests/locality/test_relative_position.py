import pytest
import torch

from local_attn_fairseq.locality.relative_position import RelativePositions, relative_distance_index


def test_distance_index_is_clipped_and_aligned_to_the_last_keys():
    idx = relative_distance_index(3, 3, 1, "cpu") - 1
    assert idx.tolist() == [[0, 1, 1], [-1, 0, 1], [-1, -1, 0]]
    one_query = relative_distance_index(1, 4, 2, "cpu") - 2
    assert one_query.tolist() == [[-2, -2, -1, 0]]


def test_key_and_value_terms_match_the_sums_written_out():
    torch.manual_seed(0)
    rel = RelativePositions(4, 2, values=True)
    q = torch.randn(2, 3, 5, 4)
    probs = torch.softmax(torch.randn(2, 3, 5, 5), -1)
    idx = rel.index(5, 5, "cpu")
    logits, values = rel.key_logits(q, idx), rel.value_term(probs, idx)
    for i in range(5):
        for j in range(5):
            a_k = rel.key_embeddings[max(-2, min(2, j - i)) + 2]
            torch.testing.assert_close(logits[..., i, j], q[..., i, :] @ a_k)
    expected = torch.zeros(2, 3, 5, 4)
    for i in range(5):
        for j in range(5):
            expected[..., i, :] += (
                probs[..., i, j, None] * rel.value_embeddings[max(-2, min(2, j - i)) + 2]
            )
    torch.testing.assert_close(values, expected)


def test_without_value_embeddings_there_is_no_value_term():
    rel = RelativePositions(4, 3)
    assert rel.value_term(torch.ones(1, 1, 2, 2), rel.index(2, 2, "cpu")) is None


def test_clipping_distance_must_be_positive():
    with pytest.raises(ValueError, match=">= 1"):
        RelativePositions(4, 0)
