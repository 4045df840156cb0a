"""Sampling text from a trained memory model: the prompt in segments, then one token per jitted
step over a fixed-shape memory and a cache of the current segment's keys (`decoder.py`), the next
token chosen from the output distribution (`sampling.py`); `sample` puts them together."""

from memjax.generation.sample import Generated, sample  # noqa: F401
from memjax.generation.sampling import Sampling  # noqa: F401
