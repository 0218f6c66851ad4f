"""The L0 penalty's scale: this project's lambda against Voita et al.'s coefficient.

Her released code (``lib/layers/concrete_gate.py``, ``lib/task/seq2seq/problems/concrete.py``)
adds to the per-token cross-entropy ``coef * mean over gated attention modules of
(l0_penalty * sum over the module's heads of clip(P(g != 0), eps, 1 - eps))`` with
l0_penalty = 1 and eps = 1e-6. It is written out here on its own, from the gate parameters."""

import math

import pytest
import torch
from fairseq import options

from ..conftest import TINY_MODEL, USER_DIR
from ..models.helpers import build_model

COEFFICIENT = 0.3  # a coefficient of her scripts
TEMPERATURE = 0.33  # her code's temperature


def voita_penalty(model, coefficient, temperature, stretch=(-0.1, 1.1), eps=1e-6):
    low, high = stretch
    per_module = []
    for name, log_alpha in model.named_parameters():
        if name.endswith("head_gates.log_alpha"):
            p_open = torch.sigmoid(log_alpha.double() - temperature * math.log(-low / high))
            per_module.append(1.0 * p_open.clamp(eps, 1 - eps).sum())
    return coefficient * torch.stack(per_module).mean().item(), len(per_module)


@pytest.fixture(scope="module")
def gated(tiny_data):
    """A tiny transformer_local with gates on all three attention types (6 + 2 + 2 modules),
    its gates set to spread values, the task and a validation batch."""
    model, task, _ = build_model(
        tiny_data / "bin", "transformer_local", *TINY_MODEL, "--head-gates", "enc,dec,cross",
        "--head-gate-temperature", TEMPERATURE, "--dropout", 0,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("head_gates.log_alpha"):
                p.uniform_(-3, 3)
    task.load_dataset("valid")
    dataset = task.dataset("valid")
    sample = dataset.collater([dataset[i] for i in range(8)])
    return model.eval(), task, sample, tiny_data / "bin"


def criterion_options(data_bin, *extra):
    """fairseq-train's arguments with the L0 criterion and these options."""
    parser = options.get_training_parser()
    return options.parse_args_and_arch(
        parser,
        [str(data_bin), "--user-dir", USER_DIR, "--arch", "transformer_local", "--criterion",
         "label_smoothed_cross_entropy_l0", "--label-smoothing", "0.1", *map(str, extra)],
    )  # fmt: skip


def per_token_penalty(gated, *extra):
    """(loss with the penalty - loss without it) / sample size, through the criterion that
    fairseq-train builds from these options."""
    model, task, sample, data_bin = gated
    losses = []
    for overrides in ((), ("--l0-lambda", 0)):
        criterion = task.build_criterion(criterion_options(data_bin, *extra, *overrides))
        with torch.no_grad():
            loss, sample_size, log = criterion(model, sample)
        losses.append(loss.double().item())
    return (losses[0] - losses[1]) / sample_size, log


def test_her_coefficient_as_lambda_under_the_per_layer_mean(gated):
    expected, modules = voita_penalty(gated[0], COEFFICIENT, TEMPERATURE)
    assert modules == 10
    penalty, log = per_token_penalty(
        gated, "--l0-lambda", COEFFICIENT, "--l0-penalty-scale", "per-layer-mean"
    )
    assert penalty == pytest.approx(expected, rel=1e-4)
    assert float(log["l0_penalty"]) == pytest.approx(expected / COEFFICIENT, rel=1e-4)


def test_her_coefficient_divided_by_the_gated_modules_under_the_sum(gated):
    """The documented conversion: lambda = coefficient / number of gated attention modules."""
    expected, modules = voita_penalty(gated[0], COEFFICIENT, TEMPERATURE)
    penalty, _ = per_token_penalty(gated, "--l0-lambda", COEFFICIENT / modules)
    assert penalty == pytest.approx(expected, rel=1e-4)
    # her coefficient taken unchanged as lambda prunes `modules` times harder here
    unconverted, _ = per_token_penalty(gated, "--l0-lambda", COEFFICIENT)
    assert unconverted == pytest.approx(modules * expected, rel=1e-4)


def test_unknown_scale_is_refused_by_the_command_line(gated, capsys):
    with pytest.raises(SystemExit):
        criterion_options(gated[3], "--l0-penalty-scale", "mean")
    assert "--l0-penalty-scale: invalid choice: 'mean'" in capsys.readouterr().err
