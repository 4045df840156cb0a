"""`sample`: continue prompts with a memory model, one token per jitted step.

    from memjax.generation import Sampling, sample
    out = sample(model, params, prompt_ids, max_new_tokens=200, settings=Sampling(top_p=0.9), seed=1)
    out.tokens, out.logprobs  # [B, 200] each
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import numpy as np

from memjax.generation.decoder import Decoder
from memjax.generation.sampling import Sampling, choose
from memjax.model import lm


@dataclasses.dataclass(frozen=True)
class Generated:
    tokens: np.ndarray  # [B, N] int32, the tokens produced after each prompt.
    logprobs: np.ndarray  # [B, N] float32, each token's log-probability under the model (not warped).


def check_prompt(prompt: np.ndarray, vocab_size: int) -> np.ndarray:
    """The prompt as int32 [B, n]; one-line ValueError when it is empty or has ids the model lacks."""
    prompt = np.asarray(prompt)
    if prompt.ndim == 1:
        prompt = prompt[None]
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f'the prompt is empty (ids of shape {prompt.shape}): give at least one token.')
    if not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f'the prompt must be integer token ids, not {prompt.dtype}.')
    bad = prompt[(prompt < 0) | (prompt >= vocab_size)]
    if bad.size:
        raise ValueError(f'prompt ids {sorted(set(bad.tolist()))[:5]} lie outside the vocabulary [0, {vocab_size}): '
                         'encode the prompt with the run\'s own tokenizer.')
    return prompt.astype(np.int32)


@functools.lru_cache(maxsize=16)
def _chooser(model: lm.MemoryLM, settings: Sampling) -> Callable:
    def next_token(params, hidden, key):
        scores = functools.partial(model.apply, {'params': params}, method=model.cluster_logprobs)
        return choose(scores, model.config, hidden, key, settings)

    return jax.jit(next_token)


def sample(model: lm.MemoryLM, params, prompt, max_new_tokens: int, settings: Sampling = Sampling(),
           seed: int = 0, segment_len: Optional[int] = None,
           on_token: Optional[Callable[[np.ndarray], None]] = None) -> Generated:
    """Continues each row of `prompt` (token ids [B, n] or [n]) by `max_new_tokens` tokens.

    The prompt fills the memory segment by segment from a fresh memory; segments are
    `segment_len` tokens (default: the model config's segment_len, the length it was trained or is
    evaluated on). `seed` fixes the draws (and the memory kind's own random streams); `on_token`
    receives each new token column [B] as soon as it is chosen (streaming).
    """
    problems = settings.problems()
    if problems:
        raise ValueError(' '.join(problems))
    if max_new_tokens < 1:
        raise ValueError(f'max_new_tokens={max_new_tokens} must be >= 1.')
    prompt = check_prompt(prompt, model.config.vocab_size)
    streams_key, draw_key = jax.random.split(jax.random.key(seed))
    decoder = Decoder(model, params, prompt.shape[0], segment_len, key=streams_key)
    next_token = _chooser(model, settings)
    hidden = decoder.feed(prompt)
    tokens, logprobs = [], []
    for i in range(max_new_tokens):
        token, logprob = jax.device_get(next_token(params, hidden, jax.random.fold_in(draw_key, i)))
        tokens.append(token)
        logprobs.append(logprob)
        if on_token is not None:
            on_token(token)
        if i + 1 < max_new_tokens:
            hidden = decoder.feed_token(token)
    return Generated(tokens=np.stack(tokens, axis=1), logprobs=np.stack(logprobs, axis=1))
