"""Reported quantities (bits per character or perplexity), TensorBoard and console output."""

import math
import os
import struct
import sys
from typing import Callable, Mapping, Optional

from absl import logging

from memjax.runtime import storage

# Character-level benchmarks report bits per character; word/subword ones perplexity.
_BITS_UNITS = ('byte', 'char')


def metric_name(unit: str) -> str:
    return 'bpc' if unit in _BITS_UNITS else 'ppl'


def metric_value(mean_nll: float, unit: str) -> float:
    """Mean NLL in nats -> bits per byte/character, or perplexity."""
    if unit in _BITS_UNITS:
        return mean_nll / math.log(2.0)
    return math.exp(min(mean_nll, 700.0))  # exp overflows a float beyond ~709.


def format_duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f'{hours}h{minutes:02d}m{secs:02d}s' if hours else f'{minutes}m{secs:02d}s'


def progress_line(step: int, num_steps: int, scalars: Mapping[str, float], unit: str,
                  eta_seconds: Optional[float]) -> str:
    name = metric_name(unit)
    eta = format_duration(eta_seconds) if eta_seconds is not None else '?'
    return (f'step {step}/{num_steps} | loss {scalars["loss"]:.4f} | {name} {scalars[name]:.4f} | '
            f'{format(scalars["tokens_per_s"], ",.0f") if "tokens_per_s" in scalars else "?"} tok/s | '
            f'lr {scalars["learning_rate"]:.3e} | '
            f'gnorm {scalars["grad_norm"]:.3f} | eta {eta}')


def _tensorboardx():
    """tensorboardX, imported without torch. Its writer imports torch where it is installed (the
    parity extra, most PyTorch users) only to accept torch tensors; memjax writes floats, and torch's
    import is about 2 s of every run's start-up (2 cores of an AMD EPYC). Imported on first use:
    processes other than 0 write nothing."""
    if 'tensorboardX' not in sys.modules and 'torch' not in sys.modules:
        sys.modules['torch'] = None  # Python's way to make `import torch` fail (ImportError).
        try:
            import tensorboardX  # pylint: disable=g-import-not-at-top,unused-import
        finally:
            del sys.modules['torch']
    import tensorboardX.proto.event_pb2  # pylint: disable=g-import-not-at-top
    return tensorboardX


class MetricWriter:
    """TensorBoard event files under `<workdir>/tensorboard`, scalars grouped by prefix."""

    def __init__(self, workdir: str, enabled: bool = True):
        self._writer = None
        if enabled:
            self._writer = _tensorboardx().SummaryWriter(os.path.join(workdir, 'tensorboard'))

    def write_scalars(self, step: int, prefix: str, scalars: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        for key, value in scalars.items():
            self._writer.add_scalar(f'{prefix}/{key}', float(value), step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def read_scalars(workdir: str) -> dict[str, dict[int, float]]:
    """`{'prefix/name': {step: value}}` of every scalar a run wrote under `<workdir>/tensorboard`.

    Reads the event files (TFRecord framing around Event protos) without TensorBoard, so
    scripts and tests can compare runs exactly. Files are read oldest first, so a resumed
    run's values replace those of the run it continued.
    """
    event_pb2 = _tensorboardx().proto.event_pb2
    scalars: dict[str, dict[int, float]] = {}
    # Named events.out.tfevents.<start time in s>.<host>: oldest first by that time.
    files = storage.path(workdir).joinpath('tensorboard').glob('events.out.tfevents.*')
    for path in sorted(files, key=lambda p: (int(p.name.split('.')[3]) if p.name.split('.')[3].isdigit()
                                             else 0, p.name)):
        data = path.read_bytes()
        offset = 0
        while offset + 12 <= len(data):  # length u64, its crc u32, payload, payload crc u32.
            (length,) = struct.unpack_from('<Q', data, offset)
            payload = data[offset + 12:offset + 12 + length]
            offset += 16 + length
            if len(payload) < length:
                break  # A record cut short by a killed writer.
            event = event_pb2.Event.FromString(payload)
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def log_eval(step: int, split: str, mean_nll: float, num_tokens: int, unit: str,
             accuracy: Optional[float] = None) -> None:
    name = metric_name(unit)
    logging.info('eval %s at step %d | loss %.4f | %s %.4f | %s%d tokens scored', split, step,
                 mean_nll, name, metric_value(mean_nll, unit),
                 '' if accuracy is None else f'accuracy {accuracy:.4f} | ', num_tokens)


def announced(step: Callable, message: str) -> Callable:
    """`step` (jitted) that logs `message` before its first call, the one that compiles it."""
    called = False

    def call(*args):
        nonlocal called
        if not called:
            logging.info(message)
            called = True
        return step(*args)

    return call
