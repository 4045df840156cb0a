"""Command line: continue a prompt with a trained model, streaming the text as it is produced.

Needs a workdir with a checkpoint and its tokenizer (memjax.train or an import); the prompt should
be text of the kind the model was trained on.

`python -m memjax.generate --workdir=DIR --prompt="In the beginning" --max_new_tokens=200
[--temperature=0.8 --top_k=40 --top_p=0.95 --seed=1 --num_samples=4 --prompt_file=F]`

The model, tokenizer and evaluation settings are the workdir's own (the config its run was trained
with, `config.eval`'s settings such as a longer memory included); `--config.a.b=v` overrides apply
on top of it, and `--config=configs/X.py` replaces it. From Python: `memjax.generation.sample`.
"""

from memjax.runtime import host_memory

if __name__ == '__main__':  # The command: importing this module must not re-execute a process.
    host_memory.keep_host_buffers_first()  # Before the imports below: it may re-execute the command.

# pylint: disable=g-import-not-at-top,wrong-import-position
import sys
import time

from absl import flags

from memjax import cli
from memjax import errors
from memjax.generation import Sampling
from memjax.generation.text import check_settings, generate
from memjax import path_flags

_CONFIG, _WORKDIR = cli.define_workdir_flags()
_PROMPT = flags.DEFINE_string('prompt', None, 'Text to continue.')
_PROMPT_FILE = path_flags.define('prompt_file', None, 'File whose text to continue (UTF-8).')
_MAX_NEW_TOKENS = flags.DEFINE_integer('max_new_tokens', 100, 'Tokens to produce.')
_TEMPERATURE = flags.DEFINE_float('temperature', 1.0, 'Softmax temperature; 0: greedy.')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample among the k most probable tokens; 0: all.')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Sample in the nucleus of this probability; 1: all.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the draws.', lower_bound=0, upper_bound=2**32 - 1)
_NUM_SAMPLES = flags.DEFINE_integer('num_samples', 1, 'Continuations of the prompt, produced side by side.')
_ECHO = flags.DEFINE_boolean('echo', True, 'Print the prompt before its continuation (--noecho: the continuation alone).')
flags.adopt_module_key_flags(cli)


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


def main(argv):
    if len(argv) > 1:
        raise errors.UsageError(f'unexpected arguments: {argv[1:]}')
    settings = Sampling(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value)
    check_settings(settings, _NUM_SAMPLES.value)  # Before anything is loaded.
    if _MAX_NEW_TOKENS.value < 1:
        raise errors.UsageError(f'--max_new_tokens={_MAX_NEW_TOKENS.value} must be >= 1.')
    text = _read_prompt()

    def job():
        # The prompt, then the continuation as it is produced (several samples one after another).
        start = time.time()
        generate(cli.load_config(_CONFIG), _WORKDIR.value, text, _MAX_NEW_TOKENS.value, settings, _SEED.value,
                 _NUM_SAMPLES.value, echo=_ECHO.value)
        produced, seconds = _MAX_NEW_TOKENS.value * _NUM_SAMPLES.value, time.time() - start
        print(f'{produced:,} tokens in {seconds:.1f} s, {produced / seconds:,.1f} tokens/s (loading and compilation '
              'included)', file=sys.stderr)

    cli.run(job)


if __name__ == '__main__':
    cli.main(main, config_from_workdir=True)
