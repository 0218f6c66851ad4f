"""The L0 penalty on the head gates (Voita et al. 2019, Section 6.1), L = L_task + lambda L_C, as
one mix-in that the plugin's ``*_l0`` criteria put in front of a fairseq criterion.

fairseq sums a criterion's loss over the batch and divides the gradient by the sample size, so
the penalty enters as lambda * L_C * sample_size: lambda weighs L_C against the task loss per
unit of the sample size (a target token for translation and language modelling, a sentence for
sentence prediction), as in the paper. ``--l0-penalty-scale`` says what L_C is: ``sum``
(default), the paper's sum over every gated head of the model; ``per-layer-mean``, that sum
divided by the number of gated attention modules, as Voita et al.'s code computes it, so that a
coefficient from her scripts is lambda here unchanged (under ``sum``, lambda = her coefficient /
that number). The model is asked for its penalty (``head_gate_penalty``); the logs show the
penalty lambda multiplies and the number of heads open under the test-time gates, per attention
type.
"""

from dataclasses import dataclass, field

from fairseq.criterions import CRITERION_REGISTRY
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.logging import metrics

from ..locality.head_gates import DEFAULT_L0_PENALTY_SCALE, L0_PENALTY_SCALES, open_head_counts

ATTENTION_TYPE_LOG_NAMES = {
    "encoder_self": "open_enc",
    "decoder_self": "open_dec",
    "decoder_cross": "open_cross",
}


@dataclass
class L0PenaltyConfig(FairseqDataclass):
    l0_lambda: float = field(
        default=0.01,
        metadata={"help": "weight lambda of the L0 penalty on the head gates (Voita et al.)"},
    )
    l0_penalty_scale: ChoiceEnum(L0_PENALTY_SCALES) = field(
        default=DEFAULT_L0_PENALTY_SCALE,
        metadata={
            "help": "L_C that lambda multiplies: 'sum' over every gated head (the paper), or "
            "'per-layer-mean', the sum divided by the number of gated attention modules "
            "(Voita et al.'s code: use her coefficient as --l0-lambda)"
        },
    )


class L0Penalty:
    """Mixed in before a fairseq criterion: its loss plus lambda * L_C * sample_size, and the
    penalty and the open heads in its logs. The criterion's ``__init__`` calls
    ``set_l0_penalty`` with the two options."""

    def set_l0_penalty(self, l0_lambda, l0_penalty_scale):
        if l0_lambda < 0:
            raise ValueError(f"--l0-lambda must be >= 0, got {l0_lambda}")
        scale = str(l0_penalty_scale)
        if scale not in L0_PENALTY_SCALES:
            raise ValueError(
                f"--l0-penalty-scale must be one of {', '.join(L0_PENALTY_SCALES)}, got {scale!r}"
            )
        self.l0_lambda = l0_lambda
        self.l0_penalty_scale = scale

    def forward(self, model, sample, reduce=True):
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        if not hasattr(model, "head_gate_penalty"):
            raise ValueError(
                f"{type(model).__name__} has no head gates; the L0 criteria "
                f"({', '.join(l0_criterion_names())}) need a local_attn_fairseq model trained "
                "with --head-gates"
            )
        penalty = model.head_gate_penalty(self.l0_penalty_scale)
        loss = loss + self.l0_lambda * penalty * sample_size
        logging_output["loss"] = loss.data
        logging_output["l0_penalty"] = penalty.data
        logging_output["nbatches"] = 1
        for attn_type, count in open_head_counts(model).items():
            logging_output[ATTENTION_TYPE_LOG_NAMES[attn_type]] = count
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        batches = sum(log.get("nbatches", 0) for log in logging_outputs)
        if not batches:
            return
        penalty = sum(float(log.get("l0_penalty", 0)) for log in logging_outputs)
        metrics.log_scalar("l0_penalty", penalty / batches, batches, round=2)
        for name in ATTENTION_TYPE_LOG_NAMES.values():
            if any(name in log for log in logging_outputs):
                total = sum(log.get(name, 0) for log in logging_outputs)
                metrics.log_scalar(name, total / batches, batches, round=1)


def l0_criterion_names():
    """The registered criteria that add the head gates' L0 penalty."""
    return sorted(name for name, c in CRITERION_REGISTRY.items() if issubclass(c, L0Penalty))


def adds_l0_penalty(criterion_name) -> bool:
    return str(criterion_name) in l0_criterion_names()
