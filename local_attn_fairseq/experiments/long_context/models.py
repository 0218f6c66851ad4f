"""The language models of a long-context run, built by fairseq's own argument parsing as
fairseq-train builds them, and what trains them: Adam on one sequence of T tokens."""

import time
from dataclasses import dataclass
from typing import List, Optional

import torch
from fairseq import options as fairseq_options
from fairseq import tasks

from ..lm_layout import transformer_lm_layout_options
from ..measurement import DictionaryFolder
from .settings import Contender, Settings


def lm_arguments(
    data_dir: str,
    arch: str,
    *,
    layers: int,
    dims: int,
    heads: int,
    max_positions: int,
    locality_config: Optional[str] = None,
) -> List[str]:
    """fairseq-train's arguments for a language model of these sizes (FFN 4 x dims, pre-norm),
    of fairseq's ``transformer_lm`` or the plugin's ``transformer_lm_local``, both with the
    same parameters and layer order."""
    arguments = [
        data_dir, "--task", "language_modeling", "--arch", arch,
        "--decoder-layers", str(layers), "--decoder-attention-heads", str(heads),
        "--decoder-embed-dim", str(dims), "--decoder-ffn-embed-dim", str(4 * dims),
        *transformer_lm_layout_options(dims),
        "--tokens-per-sample", str(max_positions), "--max-target-positions", str(max_positions),
        "--criterion", "cross_entropy",
    ]  # fmt: skip
    if locality_config is not None:
        arguments += ["--locality-config", locality_config]
    return arguments


class LanguageModelBuilder(DictionaryFolder):
    """Models of fairseq's language_modeling task built by fairseq's own argument parsing, as
    fairseq-train builds them; the task needs nothing but a dictionary."""

    def __init__(self, settings: Settings):
        super().__init__("long_context_", words=settings.vocab_size)
        self.settings = settings

    def build(self, contender: Contender):
        """(model, criterion, task), the model in training mode."""
        s = self.settings
        arguments = lm_arguments(
            self.path, contender.arch, layers=s.layers, dims=s.dims, heads=s.heads,
            max_positions=s.max_positions, locality_config=contender.locality_config,
        )  # fmt: skip
        parser = fairseq_options.get_training_parser()
        args = fairseq_options.parse_args_and_arch(parser, arguments)
        task = tasks.setup_task(args)
        return task.build_model(args).train(), task.build_criterion(args), task


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def random_words(task, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` ids of ordinary words (no special symbols) of the task's dictionary."""
    dictionary = task.source_dictionary
    return torch.randint(dictionary.nspecial, len(dictionary), (count,), generator=generator)


def one_sequence(task, length: int, seed: int = 0) -> dict:
    """A language_modeling batch of one sequence of ``length`` tokens, as fairseq builds it."""
    tokens = random_words(task, length + 1, torch.Generator().manual_seed(seed))[None]
    return {
        "id": torch.tensor([0]),
        "nsentences": 1,
        "ntokens": length,
        "net_input": {"src_tokens": tokens[:, :-1], "src_lengths": torch.tensor([length])},
        "target": tokens[:, 1:],
    }


@dataclass
class Trainer:
    model: torch.nn.Module
    criterion: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sample: dict

    def step(self) -> float:
        """Seconds of one training step: forward, backward, Adam."""
        start = time.perf_counter()
        loss, _, _ = self.criterion(self.model, self.sample)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start


def build_trainer(builder: LanguageModelBuilder, contender: Contender, length: int) -> Trainer:
    model, criterion, task = builder.build(contender)
    # as benchmarks/training_throughput.py: torch's Adam on the float32 parameters
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98))
    return Trainer(model, criterion, optimizer, one_sequence(task, length))
