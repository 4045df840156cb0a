"""Text in, text out: a prompt through the run's own tokenizer, the continuation streamed back
(`memjax.generate` is its command line)."""

import sys
from typing import Optional, TextIO

from absl import logging
import jax
import ml_collections
import numpy as np

from memjax import errors
from memjax.model import memories
from memjax.data.tokenizers import Tokenizer
from memjax.generation.sample import sample
from memjax.generation.sampling import Sampling
from memjax.training import experiment
from memjax.training import restore
from memjax.training import saved_run


def prompt_ids(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """The prompt's ids. Tokenizers that end every line with `<eos>` end the prompt's last line
    only when the text does: a prompt stops mid-line, where the model is to go on."""
    ids = tokenizer.encode(text)
    eos = getattr(tokenizer, 'eos_id', None)
    if eos is not None and len(ids) and ids[-1] == eos and not text.endswith('\n'):
        ids = ids[:-1]
    if not len(ids):
        raise errors.UsageError('the prompt is empty: give --prompt="some text" or --prompt_file=F.')
    unk = getattr(tokenizer, 'unk_id', None)
    if unk is not None:  # Less the unknown token written as such ('<unk>' in WikiText).
        unknown = int(np.sum(ids == unk)) - text.count(tokenizer.decode([unk]))
        if unknown > 0:
            logging.warning('%d of the prompt\'s %d tokens are not in the run\'s vocabulary: the model reads '
                            'each as its unknown token.', unknown, len(ids))
    return ids


# The prompt's last ids that a continuation is decoded after (all of them would make each streamed
# token cost the prompt's length): enough for a word's or a character's boundary.
CONTEXT_IDS = 16


class Continuation:
    """The text of ids that continue a prompt, as it reads after the prompt: decoded together with
    the prompt's last ids, so that a tokenizer that joins its tokens with spaces (words,
    sentencepiece) puts one between the prompt and the first new token. A space the prompt ends
    with, which such tokenizers drop, is not written twice."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids=(), prompt_text: str = ''):
        self.tokenizer = tokenizer
        self.context = [int(i) for i in prompt_ids][-CONTEXT_IDS:]
        self.lead = tokenizer.decode(self.context) if self.context else ''
        if prompt_text.endswith(' ') and self.lead and not self.lead.endswith(' '):
            self.lead += ' '

    def text(self, ids) -> str:
        whole = self.tokenizer.decode(self.context + [int(i) for i in ids])
        return whole[len(self.lead):] if whole.startswith(self.lead) else self.tokenizer.decode(ids)


class TextStream:
    """Writes the text of the ids seen so far as it grows: decoding the whole and writing what is
    new keeps word spacing and byte sequences whole (a partial UTF-8 character waits).

    A terminal sees each token as it comes. Anything else (a notebook, a pipe) is flushed at line
    ends only: a notebook keeps each flush as an output of its own, one per byte otherwise, and its
    kernel sends what is written every fraction of a second anyway."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO, after: Optional[Continuation] = None):
        self.continuation = after or Continuation(tokenizer)
        self.out = out
        self.ids: list[int] = []
        self.shown = ''
        self.live = getattr(out, 'isatty', lambda: False)()

    def add(self, ids) -> None:
        self.ids.extend(int(i) for i in ids)
        self._show(self.continuation.text(self.ids).rstrip(''.join(map(chr, range(0xDC80, 0xDD00)))))

    def close(self) -> None:
        text = self.continuation.text(self.ids)
        if not text.startswith(self.shown):  # A tokenizer whose prefixes decode otherwise: all of it, anew.
            self.out.write('\n')
            self.shown = ''
        self._show(text)
        self.out.write('\n')
        self.out.flush()

    def _show(self, text: str) -> None:
        if text.startswith(self.shown):
            new = text[len(self.shown):]
            self.out.write(new.encode('utf-8', 'replace').decode('utf-8'))
            if new and (self.live or '\n' in new):
                self.out.flush()
            self.shown = text


def check_settings(settings: Sampling, num_samples: int) -> None:
    """Raises a UsageError listing every problem of the sampling settings."""
    problems = settings.problems() + ([] if num_samples >= 1 else [f'num_samples={num_samples} must be >= 1.'])
    if problems:
        raise errors.UsageError(' '.join(problems))


def generate(config: Optional[ml_collections.ConfigDict], workdir: str, text: str, max_new_tokens: int,
             settings: Sampling, seed: int = 0, num_samples: int = 1, out: TextIO = sys.stdout,
             echo: bool = False) -> list[str]:
    """Continues `text` `num_samples` times with the newest checkpoint of `workdir`; streams the first
    continuation to `out` (or all, one after another, when there are several) and returns them, each
    as it reads after the prompt (`Continuation`).
    With `echo` the prompt is written first, once the model has read it: a refused prompt or run is
    one error, with nothing written."""
    check_settings(settings, num_samples)
    if config is None:
        config = saved_run.saved_config(workdir)
    exp = experiment.setup(config, workdir, training=False)
    ids = prompt_ids(exp.tokenizer, text)
    # The samples are rows of one batch: their memory, token ids and each step's log-probs.
    experiment.check_fits(exp, False, jax.local_devices(), batch=num_samples, extra={
        'samples': num_samples * ((len(ids) + max_new_tokens) * 4 + 2 * exp.eval_mcfg.vocab_size * 4)},
        batch_setting='--num_samples')
    step, params = restore.newest_params(exp, workdir)
    logging.info('Continuing a prompt of %d tokens by %d with step %d of %s (%s); the first token includes '
                 'compiling the prompt\'s pass and the one-token step.', len(ids), max_new_tokens, step, workdir,
                 memories.describe(exp.eval_mcfg))
    prompt = [text + ('' if num_samples == 1 else '\n')] if echo else []

    def show_prompt():  # Once a token shows that the model reads the prompt.
        while prompt:
            out.write(prompt.pop())
            out.flush()

    after = Continuation(exp.tokenizer, ids, text)
    stream = TextStream(exp.tokenizer, out, after) if num_samples == 1 else None
    try:
        result = sample(exp.eval_model, params, np.tile(ids, (num_samples, 1)), max_new_tokens, settings,
                        seed=seed, on_token=None if stream is None else lambda new: (show_prompt(), stream.add(new)))
    except ValueError as error:  # A prompt the model cannot read, a kind that cannot decode.
        raise errors.UsageError(str(error)) from error
    texts = [after.text(row) for row in result.tokens]
    show_prompt()
    if stream is not None:
        stream.close()
    else:
        for i, continuation in enumerate(texts):
            out.write(f'--- sample {i + 1} ---\n{continuation}\n')
    return texts
