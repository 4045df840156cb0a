"""Command line: continue a prompt with a trained model, streaming the text as it is produced.

`python -m memjax.generate --workdir=DIR --prompt="In the beginning" --max_new_tokens=200
[--temperature=0.8 --top_k=40 --top_p=0.95 --seed=1 --num_samples=4 --prompt_file=F]`

The model, tokenizer and evaluation settings are the workdir's own (the config saved with its
newest checkpoint, with `config.eval`'s overrides such as a longer memory); `--config=configs/X.py`
with `--config.a.b=v` overrides replaces it. From Python: `memjax.generation.sample`.
"""

import sys
from typing import Optional, TextIO

from absl import flags
import ml_collections
from ml_collections import config_flags
import numpy as np

from memjax import cli
from memjax import errors
from memjax.data.tokenizers import Tokenizer
from memjax.generation import Sampling, sample
from memjax.training import loop as trainer

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Path to a configs/*.py file (default: the workdir\'s '
                                          'saved config).', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Training workdir holding checkpoints/.')
_PROMPT = flags.DEFINE_string('prompt', None, 'Text to continue.')
_PROMPT_FILE = flags.DEFINE_string('prompt_file', None, 'File whose text to continue (UTF-8).')
_MAX_NEW_TOKENS = flags.DEFINE_integer('max_new_tokens', 100, 'Tokens to produce.')
_TEMPERATURE = flags.DEFINE_float('temperature', 1.0, 'Softmax temperature; 0: greedy.')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample among the k most probable tokens; 0: all.')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Sample in the nucleus of this probability; 1: all.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the draws.')
_NUM_SAMPLES = flags.DEFINE_integer('num_samples', 1, 'Continuations of the prompt, produced side by side.')
flags.mark_flags_as_required(['workdir'])
flags.adopt_module_key_flags(cli)


def prompt_ids(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """The prompt's ids. Tokenizers that end every line with `<eos>` end the prompt's last line
    only when the text does: a prompt stops mid-line, where the model is to go on."""
    ids = tokenizer.encode(text)
    eos = getattr(tokenizer, 'eos_id', None)
    if eos is not None and len(ids) and ids[-1] == eos and not text.endswith('\n'):
        ids = ids[:-1]
    if not len(ids):
        raise errors.UsageError('the prompt is empty: give --prompt="some text" or --prompt_file=F.')
    return ids


class TextStream:
    """Writes the text of the ids seen so far as it grows: decoding the whole and writing what is
    new keeps word spacing and byte sequences whole (a partial UTF-8 character waits)."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO):
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.shown = ''

    def add(self, ids) -> None:
        self.ids.extend(int(i) for i in ids)
        self._show(self.tokenizer.decode(self.ids).rstrip(''.join(map(chr, range(0xDC80, 0xDD00)))))

    def close(self) -> None:
        self._show(self.tokenizer.decode(self.ids))
        self.out.write('\n')
        self.out.flush()

    def _show(self, text: str) -> None:
        if text.startswith(self.shown):
            new = text[len(self.shown):]
            self.out.write(new.encode('utf-8', 'replace').decode('utf-8'))
            self.out.flush()
            self.shown = text


def _read_prompt() -> str:
    if (_PROMPT.value is None) == (_PROMPT_FILE.value is None):
        raise errors.UsageError('give the text to continue with exactly one of --prompt="..." and --prompt_file=F.')
    if _PROMPT.value is not None:
        return _PROMPT.value
    try:
        with open(_PROMPT_FILE.value, encoding='utf-8') as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as error:
        raise errors.UsageError(f'cannot read --prompt_file={_PROMPT_FILE.value}: {error}') from error


def generate(config: Optional[ml_collections.ConfigDict], workdir: str, text: str, max_new_tokens: int,
             settings: Sampling, seed: int = 0, num_samples: int = 1, out: TextIO = sys.stdout) -> list[str]:
    """Continues `text` `num_samples` times with the newest checkpoint of `workdir`; streams the first
    continuation to `out` (or all, one after another, when there are several) and returns them."""
    problems = settings.problems() + ([] if num_samples >= 1 else [f'num_samples={num_samples} must be >= 1.'])
    if problems:
        raise errors.UsageError(' '.join(problems))
    if config is None:
        config = trainer.saved_config(workdir)
    exp = trainer.setup(config, workdir, training=False)
    ids = prompt_ids(exp.tokenizer, text)
    _, params = trainer.newest_params(exp, workdir)
    stream = TextStream(exp.tokenizer, out) if num_samples == 1 else None
    try:
        result = sample(exp.eval_model, params, np.tile(ids, (num_samples, 1)), max_new_tokens, settings,
                        seed=seed, on_token=None if stream is None else stream.add)
    except ValueError as error:  # A prompt the model cannot read, a kind that cannot decode.
        raise errors.UsageError(str(error)) from error
    texts = [exp.tokenizer.decode(row) for row in result.tokens]
    if stream is not None:
        stream.close()
    else:
        for i, continuation in enumerate(texts):
            out.write(f'--- sample {i + 1} ---\n{continuation}\n')
    return texts


def main(argv):
    if len(argv) > 1:
        raise errors.UsageError(f'unexpected arguments: {argv[1:]}')
    settings = Sampling(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value)
    if _MAX_NEW_TOKENS.value < 1:
        raise errors.UsageError(f'--max_new_tokens={_MAX_NEW_TOKENS.value} must be >= 1.')
    text = _read_prompt()
    cli.run(lambda: generate(cli.load_config(_CONFIG), _WORKDIR.value, text, _MAX_NEW_TOKENS.value, settings,
                             _SEED.value, _NUM_SAMPLES.value))


if __name__ == '__main__':
    cli.main(main)
