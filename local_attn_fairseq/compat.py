"""The shims the pinned stack (torch 2.11, torchaudio 2.11, numpy 2, fairseq 0.12) needs.

They are applied when the plugin is imported and are idempotent:

* ``torch.load`` defaults to ``weights_only=True`` since torch 2.6, but a fairseq checkpoint
  pickles its configuration (``argparse.Namespace``, OmegaConf containers). Only fairseq's
  ``checkpoint_utils`` module gets a ``torch`` whose ``load`` defaults to ``weights_only=False``;
  the rest of the process keeps torch's safe default. A checkpoint is code: load only your own.
* torchaudio 2.9 removed ``torchaudio.sox_effects``, which fairseq's audio utilities import to
  normalise volume, resample and down-mix. We provide the three effects fairseq asks for with
  torchaudio's own functional resampler.
* numpy 2 removed ``numpy.compat``, whose ``long`` (Python's ``int``) fairseq's token-block and
  language-pair datasets still ask for (``--sample-break-mode eos``, language-model generation
  with fairseq-interactive, batching by length).
* fairseq's ``--ddp-backend pytorch_ddp`` (the default) passes ``device_ids=[device_id]`` to
  torch's ``DistributedDataParallel`` even for a ``--cpu`` model, which torch rejects; on a CPU
  model the wrapper now leaves both device arguments out, so ``--cpu --distributed-world-size N
  --distributed-backend gloo`` trains with fairseq's default backend. GPU models are unchanged.
"""

import sys
import types

import torch

_TRUSTED_LOAD_MARK = "_local_attn_fairseq_trusted_load"


class _TorchWithTrustedCheckpoints:
    """``torch`` as seen by fairseq's checkpoint code: everything delegated, ``load`` unpickles."""

    def __init__(self, torch_module):
        self._torch = torch_module
        setattr(self, _TRUSTED_LOAD_MARK, True)

    def load(self, *args, **kwargs):
        kwargs.setdefault("weights_only", False)
        return self._torch.load(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._torch, name)


def patch_checkpoint_loading():
    from fairseq import checkpoint_utils

    if not getattr(checkpoint_utils.torch, _TRUSTED_LOAD_MARK, False):
        checkpoint_utils.torch = _TorchWithTrustedCheckpoints(torch)


def apply_effects_tensor(tensor, sample_rate, effects, channels_first=True):
    """The subset of sox effects fairseq uses: ``gain -n``, ``rate R`` and ``channels 1``."""
    import torchaudio.functional as AF

    wav = tensor if channels_first else tensor.t()
    for effect in effects:
        name, *params = [str(p) for p in effect]
        if name == "gain" and params == ["-n"]:
            peak = wav.abs().max()
            if peak > 0:
                wav = wav / peak  # normalise the peak to 0 dBFS, as sox's `gain -n`
        elif name == "rate" and len(params) == 1:
            new_rate = int(float(params[0]))
            wav = AF.resample(wav, int(sample_rate), new_rate)
            sample_rate = new_rate
        elif name == "channels" and params == ["1"]:
            wav = wav.mean(dim=0, keepdim=True)
        else:
            raise ValueError(
                f"sox effect {effect!r} is not available: torchaudio>=2.9 has no sox, and the "
                "replacement supports only 'gain -n', 'rate R' and 'channels 1'"
            )
    return (wav if channels_first else wav.t()), sample_rate


def provide_sox_effects():
    import torchaudio

    try:
        import torchaudio.sox_effects  # noqa: F401  (still shipped: nothing to do)

        return
    except ImportError:
        pass
    module = types.ModuleType("torchaudio.sox_effects")
    module.__doc__ = "Replacement for the sox effects fairseq uses (see local_attn_fairseq.compat)."
    module.apply_effects_tensor = apply_effects_tensor
    sys.modules["torchaudio.sox_effects"] = module
    torchaudio.sox_effects = module


def provide_numpy_compat():
    import numpy

    if not hasattr(numpy, "compat"):
        numpy.compat = types.SimpleNamespace(long=int)


class _DistributedDataParallelOnModelDevice(torch.nn.parallel.DistributedDataParallel):
    """torch's DDP, without the device arguments that torch refuses for a CPU module."""

    def __init__(self, module, device_ids=None, output_device=None, **kwargs):
        if all(p.device.type == "cpu" for p in module.parameters()):
            device_ids = output_device = None
        super().__init__(module, device_ids=device_ids, output_device=output_device, **kwargs)


def allow_cpu_pytorch_ddp():
    from fairseq.models import distributed_fairseq_model

    distributed_fairseq_model.DistributedDataParallel = _DistributedDataParallelOnModelDevice


def apply():
    patch_checkpoint_loading()
    allow_cpu_pytorch_ddp()
    provide_sox_effects()
    provide_numpy_compat()
