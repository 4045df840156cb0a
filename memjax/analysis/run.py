"""A trained run's model and parameters, its text segment by segment, and the values its layers sow."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import traverse_util

from memjax import errors
from memjax import model as model_lib
from memjax.data.tokenizers import Tokenizer
from memjax.model import memories
from memjax.training import evaluation
from memjax.training import experiment
from memjax.training import restore
from memjax.training import saved_run


@dataclasses.dataclass(frozen=True)
class LoadedRun:
    """A workdir's newest checkpoint, ready to apply: `model` is the evaluation model (the run's
    `config.eval.model` overrides applied: a longer memory, TRAMS over an XL run)."""

    exp: experiment.Experiment
    params: Any
    step: int
    workdir: str = ''

    @property
    def model(self) -> model_lib.MemoryLM:
        return self.exp.eval_model

    @property
    def config(self) -> model_lib.ModelConfig:
        return self.exp.run.eval_model

    @property
    def tokenizer(self) -> Tokenizer:
        return self.exp.tokenizer


def load(workdir: str, config: Optional[ml_collections.ConfigDict] = None, **eval_model: Any) -> LoadedRun:
    """The run in `workdir` (its saved config, or `config`), with `eval_model` fields set on
    `config.eval.model` (mem_len=..., memory='trams', ...). In one process: the analyses read every
    stream of the text themselves."""
    if jax.process_count() > 1:
        raise errors.UsageError(f'memjax.analysis reads a run in one process, not {jax.process_count()}: load '
                                f'{workdir} in a single process (a notebook, or python on one host).')
    config = saved_run.saved_config(workdir) if config is None else config.copy_and_resolve_references()
    for name, value in eval_model.items():
        config.eval.model[name] = value
    exp = experiment.setup(config, workdir, training=False)
    step, params = restore.newest_params(exp, workdir)
    return LoadedRun(exp, params, step, workdir)


def with_eval_model(run: LoadedRun, clamp_setting: str = memories.EVAL_CLAMP_SETTING,
                    **eval_model: Any) -> LoadedRun:
    """`run`'s parameters evaluated with other `config.eval.model` fields (mem_len=..., same_length=...):
    the checkpoint is not read again. `clamp_setting`: as experiment.setup's."""
    config = run.exp.run.as_config_dict()
    config.eval.model.update(eval_model)
    return dataclasses.replace(run, exp=experiment.setup(config, run.workdir, training=False,
                                                         clamp_setting=clamp_setting))


@dataclasses.dataclass(frozen=True)
class Segment:
    """One segment of B streams: inputs, targets [B, T] int32, mask [B, T] (1: a real target),
    reset [B] bool (start that stream's memory afresh)."""

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    reset: np.ndarray


def text_batches(run: LoadedRun, split: str = 'validation', num_segments: int = -1) -> Iterator[Segment]:
    """The split as evaluation reads it (`config.eval` batch and segment length), one segment at a
    time from its start; `num_segments` -1: all."""
    streams = evaluation.eval_streams(run.exp.run, run.tokenizer, split)
    count = 0
    for batch in streams.iterator():
        for s in range(batch['inputs'].shape[0]):
            if 0 <= num_segments <= count:
                return
            yield Segment(*(np.asarray(batch[name][s]) for name in ('inputs', 'targets', 'mask', 'reset')))
            count += 1


def sown_over_text(run: LoadedRun, name: str, num_segments: int = -1, split: str = 'validation',
                   **apply_kwargs) -> Iterator[tuple[Segment, model_lib.ModelOutput, Any]]:
    """(segment, the model's output, the value sown under `name` per layer as numpy) for the run's
    text read as evaluation reads it: the memory carried from segment to segment, reset where a
    document starts."""
    @jax.jit
    def step(params, inputs, memory, targets, reset):
        # Only `name` leaves the compiled step: every layer also sows its attention's parts.
        output, memory, sown = apply_sown(run.model, params, inputs, memory, targets=targets, reset=reset,
                                          **apply_kwargs)
        return output, memory, per_layer(sown, name)

    memory = model_lib.init_memory(run.config, run.exp.run.eval.batch_size)
    for segment in text_batches(run, split, num_segments):
        output, memory, value = step(run.params, segment.inputs, memory, segment.targets, segment.reset)
        yield segment, output, jax.tree.map(np.asarray, value)


def apply_sown(model: model_lib.MemoryLM, params: Any, inputs, memory, **kwargs):
    """(ModelOutput, next memory, sown): one segment, with everything the layers sow (`per_layer`
    reads it). Evaluation mode unless `deterministic=False` and `rngs` are given."""
    (output, new_memory), variables = model.apply({'params': params}, inputs, memory, mutable=['intermediates'],
                                                  **kwargs)
    return output, new_memory, variables.get('intermediates', {})


def per_layer(sown: dict, name: str) -> Any:
    """The value sown under `name` by every layer, stacked on a leading [n_layer] axis (either
    layer layout); a dict of such arrays when the value was a dict. ValueError when no layer sowed it."""
    found = {}
    for path, value in traverse_util.flatten_dict(sown, is_leaf=lambda _, x: isinstance(x, tuple)).items():
        if path[-1] == name:
            found[path[0]] = value[0]
    if not found:
        raise ValueError(f'no layer sowed {name!r}: this model does not compute it (sown here: '
                         f'{sorted({p[-1] for p in traverse_util.flatten_dict(sown, is_leaf=lambda _, x: isinstance(x, tuple))})}).')
    if 'layers' in found:  # scan_layers: already stacked over the layers.
        return found['layers']
    return jax.tree.map(lambda *xs: jnp.stack(xs), *(found[f'layer_{i}'] for i in range(len(found))))
