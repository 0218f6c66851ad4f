"""What a speech encoder's self-attention costs, global against local windows.

Two views of the same question (Alastruey et al. 2022: restricting an ST encoder's
self-attention to windows makes it cheaper):

* counted: the operations of the attention products (q k^T and the weights times v) and the
  attention weights a layer holds, per utterance, from the lengths of a corpus's utterances
  (``self_attention_cost``), and the operations of every matrix product of the encoder at one
  length (``matmul_flops``, the most a speed-up can be where those products bound the speed);
* measured: one forward + backward of two encoders with the same weights that differ only in
  their windows, alternating so that load from other processes hits both alike (``measure``);
* training memory at long lengths (minutes to an hour of speech): the peak of one forward +
  backward where it fits under a cap, the estimate alone where it would not, never run into
  an out-of-memory kill (``memory_report``).

``benchmarks/speech_encoder.py`` and the speech study (``experiments.speech_study``) use both.
"""

import statistics
import time
from argparse import Namespace
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
from fairseq.data import Dictionary

from ..models.s2t_transformer_local import (
    S2TTransformerLocalModel,
    s2t_transformer_local,
)
from .long_context.memory import estimated_bytes, quadratic_coefficient
from .long_context.settings import GiB
from .measurement import device_seconds_per_call, peak_bytes

FBANK_DIM = 80
FRAMES_PER_SECOND = 100


def build_encoder(windows, device="cpu", dtype=torch.float32, arch=s2t_transformer_local,
                  **options):  # fmt: skip
    """A training-mode ``s2t_transformer_local`` encoder of the architecture ``arch`` sets (the
    paper's s2t_transformer_s by default) with these windows and the model ``options`` given
    (fairseq's names, e.g. ``encoder_embed_dim``); returns it and its options."""
    args = Namespace(
        input_feat_per_channel=FBANK_DIM,
        input_channels=1,
        max_source_positions=100_000,
        max_target_positions=1024,
        encoder_attention_windows=windows,
        **options,
    )
    arch(args)
    model = S2TTransformerLocalModel.build_model(args, Namespace(target_dictionary=Dictionary()))
    return model.encoder.to(device=device, dtype=dtype).train(), args


def encoder_frames(fbank_frames, num_convs=2):
    """Encoder positions after the subsampler: each stride-2 convolution halves the frames."""
    frames = torch.as_tensor(fbank_frames)
    for _ in range(num_convs):
        frames = torch.div(frames - 1, 2, rounding_mode="floor") + 1
    return frames


def attention_keys(frames, window):
    """Query-key pairs one head of one layer scores over `frames` positions: every pair for a
    global layer (window 0), the band of `window` keys centred on each query, cut at the edges,
    for a local one. `frames` is a tensor of lengths; returns one count per length."""
    frames = torch.as_tensor(frames, dtype=torch.long)
    if window == 0:
        return frames * frames
    half = (window - 1) // 2
    # query i of a sentence of T positions scores keys max(0, i - half) .. min(T - 1, i + half)
    positions = torch.arange(int(frames.max()) if frames.numel() else 0)
    inside = positions[None, :] < frames[:, None]
    first = torch.clamp(positions - half, min=0)[None, :]
    last = torch.minimum(positions[None, :] + half, frames[:, None] - 1)
    per_query = (last - first + 1).clamp(min=0)
    return (per_query * inside).sum(dim=1)


def self_attention_cost(fbank_frames, windows, embed_dim, heads, bytes_per_weight=4):
    """Forward operations of the self-attention products (q k^T and weights x v, 2 x 2 x d per
    query-key pair) and the bytes of attention weights held for the backward, summed over the
    layers, per utterance of `fbank_frames` filterbank frames."""
    frames = encoder_frames(fbank_frames)
    keys = sum(attention_keys(frames, w) for w in windows)
    return {
        "flops": (4 * embed_dim * keys).double(),
        "weight_bytes": (heads * bytes_per_weight * keys).double(),
        "encoder_frames": frames,
    }


def matmul_flops(args, fbank_frames: int, batch: int, windows) -> float:
    """Forward + backward (3x forward) operations of the encoder's matrix products."""
    d, ffn = args.encoder_embed_dim, args.encoder_ffn_embed_dim
    kernels = [int(k) for k in args.conv_kernel_sizes.split(",")]
    frames, forward = fbank_frames, 0.0
    channels = [FBANK_DIM, args.conv_channels // 2]
    outputs = [args.conv_channels, 2 * d]
    for k, c_in, c_out in zip(kernels, channels, outputs):
        frames = (frames - 1) // 2 + 1
        forward += 2 * frames * c_in * k * c_out
    for w in windows:
        keys = frames if w == 0 else min(w, frames)
        forward += 2 * frames * (4 * d * d + 2 * d * ffn) + 4 * frames * keys * d
    return 3 * forward * batch


def encoder_loss(encoder, features, lengths):
    return encoder(features, lengths)["encoder_out"][0].sum()


def step(encoder, features, lengths):
    """One forward + backward; gradients dropped so that each step starts alike."""
    encoder_loss(encoder, features, lengths).backward()
    encoder.zero_grad(set_to_none=True)


def timed_step(encoder, features, lengths, clock=time.perf_counter):
    sync = torch.cuda.synchronize if features.is_cuda else (lambda: None)
    sync()
    start = clock()
    step(encoder, features, lengths)
    sync()
    return clock() - start


def peak_memory(encoder, features, lengths):
    # peak_bytes runs fn(*inputs).backward(ones): the loss is already a scalar.
    peak = peak_bytes(lambda f: encoder_loss(encoder, f, lengths), (features,), backward=True)
    encoder.zero_grad(set_to_none=True)
    return peak


def measure(models, frames, batch, rounds, device="cpu", dtype=torch.float32, cpu_time=False):
    """{name: (median seconds of a forward + backward, peak bytes, GPU busy seconds or None)}
    of each encoder on one batch of `batch` utterances of `frames` filterbank frames.

    Seconds are wall-clock time, or with ``cpu_time`` (CPU only) the process's CPU time: with
    one torch thread that is what other processes on a shared machine change least (two
    threads, each waiting for the other whenever another process holds a core, took a local
    encoder from 0.84x the global one's time on idle cores to 1.24x beside two busy ones)."""
    if cpu_time and torch.device(device).type != "cpu":
        raise ValueError("cpu_time measures CPU runs only")
    clock = time.process_time if cpu_time else time.perf_counter
    features = torch.randn(batch, frames, FBANK_DIM, device=device, dtype=dtype)
    lengths = torch.full((batch,), frames, dtype=torch.long, device=device)
    names = list(models)
    for name in names:  # warm-up, not timed
        step(models[name], features, lengths)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(timed_step(models[name], features, lengths, clock))
    memory = {name: peak_memory(models[name], features, lengths) for name in names}
    busy = {name: None for name in names}
    if features.is_cuda:  # the GPU's own share of a step (the rest is the host's)
        for name in names:
            model = models[name]
            busy[name] = device_seconds_per_call(lambda: step(model, features, lengths), 1)
    return {name: (statistics.median(times[name]), memory[name], busy[name]) for name in names}


# ---- training memory at long lengths ------------------------------------------------------

# Short inputs whose peaks give each encoder's T^2 term and its linear growth.
PROBE_SECONDS = (20, 40, 60)


@dataclass
class MemoryPoint:
    """One encoder's training memory on one batch of ``seconds`` of speech."""

    seconds: int
    fbank_frames: int
    encoder_frames: int
    estimated_bytes: float
    peak_bytes: Optional[int] = None  # measured; None where the estimate is over the cap
    step_seconds: Optional[float] = None  # of the measured forward + backward

    @property
    def fits(self) -> bool:
        return self.peak_bytes is not None


def training_peak(encoder, frames, batch, device="cpu", dtype=torch.float32):
    """(peak bytes, seconds) of one forward + backward on random features of ``frames``
    filterbank frames: the peak as ``peak_memory`` measures it (torch's allocations above
    what was live before), the time of that same measured call."""
    features = torch.randn(batch, frames, FBANK_DIM, device=device, dtype=dtype)
    lengths = torch.full((batch,), frames, dtype=torch.long, device=device)
    start = time.perf_counter()
    peak = peak_memory(encoder, features, lengths)
    return peak, time.perf_counter() - start


def memory_growth(encoder, batch, device="cpu", dtype=torch.float32, probe_seconds=PROBE_SECONDS):
    """(bytes per encoder frame squared, {encoder frames: peak bytes}) of an encoder's training,
    from its peaks at the ``probe_seconds`` lengths, as the long-context benchmark finds an LM's
    T^2 term (``long_context.memory.quadratic_coefficient``)."""
    fbank = [s * FRAMES_PER_SECOND for s in probe_seconds]
    peaks = [training_peak(encoder, f, batch, device, dtype)[0] for f in fbank]
    frames = encoder_frames(fbank).tolist()
    return quadratic_coefficient(frames, peaks), dict(zip(frames, peaks))


def memory_report(
    models: Dict[str, torch.nn.Module],
    seconds: Sequence[int],
    batch: int,
    cap_bytes: float,
    device="cpu",
    dtype=torch.float32,
    progress: Callable[[str], None] = lambda line: None,
    probe_seconds: Sequence[int] = PROBE_SECONDS,
) -> Dict[str, List[MemoryPoint]]:
    """{name: [MemoryPoint per duration]}: each encoder's training memory estimated from its
    probes and the longest lengths measured before (T^2 term, parameters' gradients, linear
    rest), then measured where the estimate is within ``cap_bytes``; an encoder over the cap at
    one length is not run there nor at any longer one."""
    report = {}
    for name, encoder in models.items():
        per_square, measured = memory_growth(encoder, batch, device, dtype, probe_seconds)
        progress(f"{name}: {per_square:.1f} training bytes per encoder frame squared")
        points, over_cap = [], False
        for duration in sorted(seconds):
            fbank = duration * FRAMES_PER_SECOND
            frames = int(encoder_frames(fbank))
            point = MemoryPoint(
                duration, fbank, frames, estimated_bytes(frames, per_square, 0, measured)
            )
            over_cap = over_cap or point.estimated_bytes > cap_bytes
            if not over_cap:
                point.peak_bytes, point.step_seconds = training_peak(
                    encoder, fbank, batch, device, dtype
                )
                measured[frames] = point.peak_bytes
            progress(f"{name} at {duration} s: {memory_cell(point)}")
            points.append(point)
        report[name] = points
    return report


def audio_length(seconds: int) -> str:
    return f"{seconds // 60} min" if seconds % 60 == 0 else f"{seconds} s"


def memory_cell(point: MemoryPoint) -> str:
    if point.fits:
        return f"{point.peak_bytes / GiB:.2f} GiB (est. {point.estimated_bytes / GiB:.2f})"
    return f"does not fit (est. {point.estimated_bytes / GiB:.1f} GiB)"


def memory_table(report: Dict[str, List[MemoryPoint]], cap_bytes: float) -> List[str]:
    """The report as Markdown rows, one per duration: each encoder's peak (or its estimate
    over the cap) and the time of its measured step."""
    names = list(report)
    header = "| audio | fbank frames | encoder frames | " + " | ".join(
        f"{n} peak | {n} step s" for n in names
    )
    lines = [header + " |", "|---|---:|---:|" + "---:|---:|" * len(names)]
    for points in zip(*report.values()):
        first = points[0]
        cells = [
            f"{memory_cell(p)} | {p.step_seconds:.1f}" if p.fits else f"{memory_cell(p)} | -"
            for p in points
        ]
        lines.append(
            f"| {audio_length(first.seconds)} | {first.fbank_frames} | {first.encoder_frames} | "
            + " | ".join(cells)
            + " |"
        )
    lines.append(f"\nnot run: estimates over the cap of {cap_bytes / GiB:g} GiB")
    return lines
