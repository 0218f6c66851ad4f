"""The shims the pinned stack (torch 2.11, torchaudio 2.11, numpy 2, fairseq 0.12) needs.

They are applied when the plugin is imported and are idempotent:

* ``torch.load`` defaults to ``weights_only=True`` since torch 2.6, but a fairseq checkpoint
  pickles its configuration (``argparse.Namespace``, OmegaConf containers). Only fairseq's
  ``checkpoint_utils`` module gets a ``torch`` whose ``load`` defaults to ``weights_only=False``;
  the rest of the process keeps torch's safe default. A checkpoint is code: load only your own.
* A checkpoint of an earlier version of the plugin may store a locality option as ``""``, which
  that version read as not given and the option now refuses: fairseq's checkpoint reader reads
  it as before, with a warning (``models.locality_options.read_stored_empty_options``).
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
* fairseq writes a checkpoint and then copies it in place to its other names
  (``checkpoint_best.pt``, ``checkpoint_last.pt``): a run killed during a copy leaves a truncated
  file. Every checkpoint file, first write and copies, now goes to a temporary name in the same
  folder and is renamed into place (``checkpoint_files``).
* fairseq-train resuming from an unreadable ``checkpoint_last.pt`` crashes deep in torch's
  unpickler; it now resumes from the newest intact checkpoint of the save folder with a warning
  naming both files, and names the problem when none is intact. A checkpoint whose parameters
  have other shapes than the model built from the command line is refused naming them.
* fairseq's n-gram blocker without its CUDA extension (which the pinned fairseq does not build:
  every CPU and GPU run) takes the last n-1 tokens of the whole token buffer, padding beyond the
  current step, instead of the last n-1 generated ones, so ``--no-repeat-ngram-size`` blocks
  nothing (fairseq issue 5206). It now sees the tokens generated so far, as the CUDA kernel does.
* fairseq's batching leaves out the last batch of a split when its size is not a multiple of
  ``--required-batch-size-multiple`` (8 by default; fairseq issue 5036): examples go missing
  from fairseq-generate's output and BLEU, from validation and from training, without a word.
  Nothing changes in the batches (a run resumed with the shim trains on the batches it trained
  on before), but the loss is now said, once per split size, with the option that avoids it.
* fairseq-eval-lm skips every block longer than the model's maximum positions (with a warning)
  and, when that leaves nothing, prints loss 0 and perplexity 1 over no token (for instance its
  default ``--tokens-per-sample 1024`` against a model trained on blocks of 512). An evaluation
  of no token now ends in an error naming the option to change.
* fairseq-generate ``--print-alignment`` on ``speech_to_text`` crashes inside fairseq's aligning
  generator (it expands the source as token ids; speech sources are filterbank frames) after the
  model is loaded: it is now refused before decoding, with the reason.
* fairseq's S2T hub interface (``S2TTransformerModel.from_pretrained(...).predict(audio)``)
  with utterance-CMVN filterbanks calls a tensor method on a numpy array for an audio file and
  takes the feature count for the length of a waveform tensor: it fails for every model. It now
  computes the features as ``data/mustc.py`` prepared them for training (mono, 16 kHz, Kaldi
  filterbanks of 16-bit amplitudes, utterance CMVN) from a file or from float samples.
* fairseq-train's ``main`` marks the run, so that the plugin's models know they are built for
  training (and compare the command line with the checkpoint being resumed, see
  ``models/resume_check.py``) and not for fairseq-generate or an analysis tool.
"""

import logging
import os
import sys
import types

import torch

from . import checkpoint_files

logger = logging.getLogger(__name__)

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


_original_load_checkpoint_to_cpu = None  # fairseq's, set by the shim


def _load_checkpoint_to_cpu_reading_old_options(path, arg_overrides=None, *args, **kwargs):
    """fairseq's reader of a checkpoint, the plugin model's stored options read as the version
    that wrote them read them (``models.locality_options.read_stored_empty_options``)."""
    from .models.locality_options import read_stored_empty_options

    state = _original_load_checkpoint_to_cpu(path, arg_overrides, *args, **kwargs)
    model_args = (state.get("cfg") or {}).get("model")
    if model_args is not None:
        read_stored_empty_options(model_args, path, given=arg_overrides or {})
    return state


def read_old_checkpoint_options():
    global _original_load_checkpoint_to_cpu
    from fairseq import checkpoint_utils

    reader = checkpoint_utils.load_checkpoint_to_cpu
    if reader is not _load_checkpoint_to_cpu_reading_old_options:
        _original_load_checkpoint_to_cpu = reader
        checkpoint_utils.load_checkpoint_to_cpu = _load_checkpoint_to_cpu_reading_old_options


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


class _PathManagerCopyingAtomically:
    """Stands for fairseq's ``PathManager`` in its checkpoint module: local copies are atomic."""

    def __init__(self, path_manager):
        self._path_manager = path_manager

    def copy(self, src_path, dst_path, overwrite=False):
        if not self._path_manager.supports_rename(dst_path):  # remote storage: fairseq's copy
            return self._path_manager.copy(src_path, dst_path, overwrite=overwrite)
        if os.path.exists(dst_path) and not overwrite:
            return False
        checkpoint_files.copy_checkpoint(src_path, dst_path)
        return True

    def __getattr__(self, name):
        return getattr(self._path_manager, name)


_original_torch_persistent_save = None


def _atomic_torch_persistent_save(obj, filename, async_write: bool = False):
    from fairseq import checkpoint_utils

    path_manager = checkpoint_utils.PathManager
    if async_write or not path_manager.supports_rename(filename):
        return _original_torch_persistent_save(obj, filename, async_write=async_write)
    # fairseq's own writer, with its retries, into the temporary file
    checkpoint_files.write_checkpoint(
        lambda handle: checkpoint_utils._torch_persistent_save(obj, handle), filename
    )


def make_checkpoint_writes_atomic():
    global _original_torch_persistent_save
    from fairseq import checkpoint_utils

    if not isinstance(checkpoint_utils.PathManager, _PathManagerCopyingAtomically):
        checkpoint_utils.PathManager = _PathManagerCopyingAtomically(checkpoint_utils.PathManager)
    if checkpoint_utils.torch_persistent_save is not _atomic_torch_persistent_save:
        _original_torch_persistent_save = checkpoint_utils.torch_persistent_save
        checkpoint_utils.torch_persistent_save = _atomic_torch_persistent_save


_original_load_checkpoint = None  # fairseq's, set by the shim


def _load_checkpoint_with_fallback(cfg, trainer, **passthrough_args):
    """fairseq's ``load_checkpoint`` after checking the file it will read (see the module doc)."""
    suffix = trainer.checkpoint_suffix
    checkpoint_files.remove_partial_checkpoints(cfg.save_dir)
    source = checkpoint_files.resume_source(cfg, suffix)
    if source is not None:
        if source.unreadable:
            checkpoint_files.log_fallback(source)
            cfg = checkpoint_files.with_restore_file(cfg, source, suffix)
        stored = checkpoint_files.read_checkpoint(source.path).get("model") or {}
        mismatches = checkpoint_files.parameter_shape_mismatches(trainer.get_model(), stored)
        if mismatches:
            listed = "; ".join(mismatches[:4]) + ("; ..." if len(mismatches) > 4 else "")
            raise ValueError(
                f"the model built from the command line does not fit {source.path}: "
                f"{len(mismatches)} parameters have other shapes ({listed}). Give the "
                "dimensions and locality options the checkpoint was trained with (tied and "
                "pruned heads change the shapes of Wq/Wk), or train the new shape from scratch "
                "in a new --save-dir"
            )
    return _original_load_checkpoint(cfg, trainer, **passthrough_args)


def fall_back_to_intact_checkpoints():
    global _original_load_checkpoint
    from fairseq import checkpoint_utils

    if checkpoint_utils.load_checkpoint is not _load_checkpoint_with_fallback:
        _original_load_checkpoint = checkpoint_utils.load_checkpoint
        checkpoint_utils.load_checkpoint = _load_checkpoint_with_fallback


_original_no_repeat_ngram = None  # fairseq's, set by the shim


def _no_repeat_ngram_of_generated_tokens(self, tokens, lprobs, bsz, beam_size, step):
    """fairseq's blocker given only the step + 1 tokens generated so far (the first one the
    start of sentence): its n-1 last tokens are then the hypothesis' own."""
    return _original_no_repeat_ngram(self, tokens[:, : step + 1], lprobs, bsz, beam_size, step)


def block_ngrams_of_generated_tokens():
    global _original_no_repeat_ngram
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    if NGramRepeatBlock._no_repeat_ngram is not _no_repeat_ngram_of_generated_tokens:
        _original_no_repeat_ngram = NGramRepeatBlock._no_repeat_ngram
        NGramRepeatBlock._no_repeat_ngram = _no_repeat_ngram_of_generated_tokens


_original_batch_by_size = None  # fairseq's, set by the shim
_dropped_batches_said = set()  # (examples, left out, multiple): each said once


def _batch_by_size_saying_what_it_leaves_out(indices, *args, **kwargs):
    batches = _original_batch_by_size(indices, *args, **kwargs)
    left_out = len(indices) - sum(len(batch) for batch in batches)
    if left_out > 0:
        multiple = kwargs.get("required_batch_size_multiple", args[4] if len(args) > 4 else 1)
        said = (len(indices), left_out, multiple)
        if said not in _dropped_batches_said:
            _dropped_batches_said.add(said)
            logger.warning(
                f"fairseq leaves out {left_out} of {len(indices)} examples, its last batch (the "
                f"last in its order, usually the longest), whose size is not a multiple of "
                f"--required-batch-size-multiple {multiple}; pass --required-batch-size-multiple "
                f"1 to keep every example"
            )
    return batches


def say_what_batching_leaves_out():
    global _original_batch_by_size
    from fairseq.data import data_utils

    if data_utils.batch_by_size is not _batch_by_size_saying_what_it_leaves_out:
        _original_batch_by_size = data_utils.batch_by_size
        data_utils.batch_by_size = _batch_by_size_saying_what_it_leaves_out


_original_eval_lm = None  # fairseq's, set by the shim


def _eval_lm_refusing_an_empty_evaluation(models, source_dictionary, batch_iterator, *a, **kw):
    batches = 0

    def counted():
        nonlocal batches
        for sample in batch_iterator:
            batches += "net_input" in sample
            yield sample

    results = _original_eval_lm(models, source_dictionary, counted(), *a, **kw)
    if batches == 0:
        # fairseq would print loss 0 and perplexity 1 over nothing.
        raise ValueError(
            "fairseq-eval-lm evaluated no token: the split is empty, or fairseq left out each "
            "of its blocks as longer than the model's maximum positions (its warning above says "
            "how many); pass a --tokens-per-sample of at most the model's "
            "--max-target-positions (--context-window keeps each token's context)"
        )
    return results


def refuse_empty_lm_evaluations():
    global _original_eval_lm
    from fairseq_cli import eval_lm

    if eval_lm.eval_lm is not _eval_lm_refusing_an_empty_evaluation:
        _original_eval_lm = eval_lm.eval_lm
        eval_lm.eval_lm = _eval_lm_refusing_an_empty_evaluation


_original_speech_build_generator = None  # fairseq's, set by the shim


def _speech_generator_without_token_alignment(self, models, args, *rest, **kwargs):
    if getattr(args, "print_alignment", None):
        raise ValueError(
            "--print-alignment aligns target tokens with source tokens, and a speech_to_text "
            "source is filterbank frames: leave the option out (fairseq's aligning generator "
            "cannot take speech input)"
        )
    return _original_speech_build_generator(self, models, args, *rest, **kwargs)


def refuse_speech_alignment():
    global _original_speech_build_generator
    from fairseq.tasks.speech_to_text import SpeechToTextTask

    if SpeechToTextTask.build_generator is not _speech_generator_without_token_alignment:
        _original_speech_build_generator = SpeechToTextTask.build_generator
        SpeechToTextTask.build_generator = _speech_generator_without_token_alignment


_original_speech_hub_input = None  # fairseq's, set by the shim
UTTERANCE_CMVN_HUB_INPUT = "fbank80_w_utt_cmvn"  # the hub input_type of data/mustc.py's configs


def _speech_hub_input(cls, task, audio):
    """The hub's model input for one utterance: an audio file's path, or a tensor of float
    samples in [-1, 1] at 16 kHz (mono)."""
    if task.data_cfg.hub.get("input_type") != UTTERANCE_CMVN_HUB_INPUT:
        return _original_speech_hub_input(task, audio)
    from fairseq.data.audio.feature_transforms.utterance_cmvn import UtteranceCMVN

    from .data.mustc import log_mel_fbank, read_talk_audio

    samples = read_talk_audio(audio)[0] if isinstance(audio, str) else audio.reshape(-1).numpy()
    features = torch.from_numpy(UtteranceCMVN()(log_mel_fbank(samples)))
    return {
        "net_input": {
            "src_tokens": features.unsqueeze(0),
            "src_lengths": torch.tensor([features.size(0)]),
            "prev_output_tokens": None,
        },
        "target_lengths": None,
        "speaker": None,
    }


def read_speech_hub_input_as_prepared():
    global _original_speech_hub_input
    from fairseq.models.speech_to_text.hub_interface import S2THubInterface

    if S2THubInterface.get_model_input.__func__ is not _speech_hub_input:
        _original_speech_hub_input = S2THubInterface.get_model_input
        S2THubInterface.get_model_input = classmethod(_speech_hub_input)


_original_train_main = None  # fairseq's, set by the shim


def _train_main_as_marked_run(cfg, **kwargs):
    """fairseq-train's ``main`` (a module-level function: distributed runs pickle it)."""
    with checkpoint_files.fairseq_train_run(cfg.checkpoint):
        return _original_train_main(cfg, **kwargs)


def mark_fairseq_train_runs():
    global _original_train_main
    from fairseq_cli import train

    if train.main is not _train_main_as_marked_run:
        _original_train_main = train.main
        train.main = _train_main_as_marked_run


def apply():
    patch_checkpoint_loading()
    read_old_checkpoint_options()
    make_checkpoint_writes_atomic()
    fall_back_to_intact_checkpoints()
    mark_fairseq_train_runs()
    allow_cpu_pytorch_ddp()
    block_ngrams_of_generated_tokens()
    say_what_batching_leaves_out()
    refuse_empty_lm_evaluations()
    refuse_speech_alignment()
    read_speech_hub_input_as_prepared()
    provide_sox_effects()
    provide_numpy_compat()
