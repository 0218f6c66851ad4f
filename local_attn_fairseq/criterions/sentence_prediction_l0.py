"""``--criterion sentence_prediction_l0``: fairseq's sentence-prediction loss plus lambda times the
L0 relaxation of the head gates (Voita et al. 2019, Section 6.1), for the classifiers
(``roberta_local``, ``roberta_dynwin_classifier``) with ``--head-gates enc``. The sample size is a
sentence here, so lambda weighs L_C against the loss of one sentence; ``l0_penalty`` says how the
penalty is weighed and logged."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.sentence_prediction import (
    SentencePredictionConfig,
    SentencePredictionCriterion,
)

from .l0_penalty import L0Penalty, L0PenaltyConfig


@dataclass
class SentencePredictionL0Config(SentencePredictionConfig, L0PenaltyConfig):
    pass


@register_criterion("sentence_prediction_l0", dataclass=SentencePredictionL0Config)
class SentencePredictionL0Criterion(L0Penalty, SentencePredictionCriterion):
    def __init__(self, cfg: SentencePredictionL0Config, task):
        super().__init__(cfg, task)
        self.set_l0_penalty(cfg.l0_lambda, cfg.l0_penalty_scale)
