"""Command line: evaluate the newest checkpoint of a workdir on a split.

Needs a workdir with a checkpoint (written by memjax.train or an import) and the data its config
names; prints the result as JSON.

`python -m memjax.evaluate --workdir=DIR [--config.eval.split=test]` scores every target token
of the split once, in order, carrying the memory, with the config the workdir's run was trained
with and the evaluation overrides given on top of it (config.eval: tgt_len, batch_size, and in
config.eval.model mem_len, clamp_len, same_length, or a kind that runs on the trained parameters
such as `--config.eval.model.memory=trams` with its fields). `--config=configs/X.py` replaces the
workdir's config.
"""

from memjax.runtime import host_memory

if __name__ == '__main__':  # The command: importing this module must not re-execute a process.
    host_memory.keep_host_buffers_first()  # Before the imports below: it may re-execute the command.

# pylint: disable=g-import-not-at-top,wrong-import-position
import json
import os

from absl import flags
from absl import logging
import ml_collections

from memjax import cli
from memjax import config_lib
from memjax.runtime import distributed
from memjax import errors
from memjax.model import memories
from memjax.training import evaluation
from memjax.training import metrics as metrics_lib
from memjax.training import experiment
from memjax.training import run_files
from memjax.training import restore
from memjax.training import workdir as workdir_lib

# Also the flags of memjax.sweep, which evaluates over a grid of settings.
CONFIG, WORKDIR = cli.define_workdir_flags()
flags.adopt_module_key_flags(cli)
flags.adopt_module_key_flags(distributed)


def evaluate_checkpoint(config: ml_collections.ConfigDict | config_lib.RunConfig, workdir: str,
                        out_path: str | None = None, max_batches: int = -1) -> dict:
    """Restores the newest intact checkpoint's params and scores config.eval.split (its first
    `max_batches` batches of `config.train.segments_per_step` segments; -1: all of it).

    The result is also written to `out_path` (default `<workdir>/eval_<split>.json`); a workdir
    that does not exist, holds no checkpoint or cannot take that file is an error before anything
    runs.
    """
    exp = experiment.setup(config, workdir, training=False)
    out_path = out_path or os.path.join(workdir, f'eval_{exp.run.eval.split}.json')
    if distributed.is_primary():
        workdir_lib.check_writable_file(out_path)  # Before spending the evaluation.
    step, params = restore.newest_params(exp, workdir)
    split = exp.run.eval.split
    with distributed.primary_first('token streams'):  # Prepared data and token caches.
        streams = evaluation.eval_streams(exp.run, exp.tokenizer, split)
    evaluation.same_on_every_process(streams, split)
    logging.info('Evaluating step %d of %s on the %s split: %s target tokens in batches of %d x %d; %s.', step,
                 workdir, split, f'{int(streams.num_target_tokens):,}', exp.run.eval.batch_size, exp.run.eval.tgt_len,
                 memories.describe(exp.eval_mcfg))
    eval_step = metrics_lib.announced(experiment.make_eval_step(exp), 'Compiling the evaluation step: the first batch '
                                      'includes it.')
    result = evaluation.evaluate_streams(eval_step, params, exp.eval_mcfg, streams,
                                         evaluation.local_eval_batch(exp.run), max_batches=max_batches,
                                         partitioner=exp.partitioner, key=evaluation.eval_key(exp.run))
    name = metrics_lib.metric_name(exp.unit)
    summary = {
        'split': split,
        'step': step,
        'loss': result.mean_nll,
        name: metrics_lib.metric_value(result.mean_nll, exp.unit),
        'num_tokens': result.num_tokens,
        'num_target_tokens_of_split': int(streams.num_target_tokens),
        'tokens_per_s': result.tokens_per_s,  # After the first batch, which compiles.
        'settings': {'memory': exp.eval_mcfg.memory,
                     **{k: getattr(exp.run.eval, k) for k in ('batch_size', 'tgt_len')},
                     **{k: getattr(exp.eval_mcfg, k) for k in memories.run_time_fields(exp.eval_mcfg.memory)}},
    }
    metrics_lib.log_eval(step, split, result.mean_nll, result.num_tokens, exp.unit)
    run_files.write_result(out_path, summary)
    return summary


def main(argv):
    if len(argv) > 1:
        raise errors.UsageError(f'unexpected arguments: {argv[1:]}')
    summary = cli.run(lambda: evaluate_checkpoint(cli.load_run(CONFIG), WORKDIR.value))
    if distributed.is_primary():
        print(json.dumps(summary, indent=2, sort_keys=True))


if __name__ == '__main__':
    cli.main(main, config_from_workdir=True)
