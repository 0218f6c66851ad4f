"""``--criterion label_smoothed_cross_entropy_l0``: label-smoothed cross-entropy plus lambda times
the L0 relaxation of the head gates, L = L_xent + lambda L_C (Voita et al. 2019, Section 6.1),
for translation, speech translation and language modelling; ``l0_penalty`` says how the penalty
is weighed and logged."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from ..locality.head_gates import DEFAULT_L0_PENALTY_SCALE
from .l0_penalty import L0Penalty, L0PenaltyConfig


@dataclass
class LabelSmoothedCrossEntropyL0Config(LabelSmoothedCrossEntropyCriterionConfig, L0PenaltyConfig):
    pass


@register_criterion("label_smoothed_cross_entropy_l0", dataclass=LabelSmoothedCrossEntropyL0Config)
class LabelSmoothedCrossEntropyL0Criterion(L0Penalty, LabelSmoothedCrossEntropyCriterion):
    def __init__(
        self,
        task,
        sentence_avg,
        label_smoothing,
        ignore_prefix_size=0,
        report_accuracy=False,
        l0_lambda=0.01,
        l0_penalty_scale=DEFAULT_L0_PENALTY_SCALE,
    ):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.set_l0_penalty(l0_lambda, l0_penalty_scale)
