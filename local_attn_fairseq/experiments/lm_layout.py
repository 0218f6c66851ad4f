"""The fairseq-train options that give fairseq's ``transformer_lm`` the layout of
``transformer_lm_local``, so that the two train the same parameters in the same layer order
(the LM demo and the long-context benchmark compare them)."""

from typing import List


def transformer_lm_layout_options(dims: int) -> List[str]:
    """Input and output dims equal to the embedding's, and pre-norm layers.

    ``transformer_lm`` takes these from its dataclass's defaults, not from
    ``base_lm_architecture`` as ``transformer_lm_local`` does: 512-dim input and output
    projections whatever the embedding's width, and post-norm layers. Given to both models,
    they change nothing in ``transformer_lm_local``.
    """
    return [
        "--decoder-input-dim", str(dims), "--decoder-output-dim", str(dims),
        "--decoder-normalize-before",
    ]  # fmt: skip
