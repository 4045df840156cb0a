"""Config files, command-line overrides and up-front validation."""

import glob
import os
import subprocess
import sys

from absl import flags
import jax
from ml_collections import config_flags
import pytest

from memjax import config_lib
from memjax import model as model_lib
from memjax.model import memories
from memjax.model.config import TRAINING_FIELDS
from memjax.training import loop as trainer
from memjax.training import experiment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(glob.glob(os.path.join(REPO, 'configs', '*.py'))) + [
    os.path.join(REPO, 'configs', name) for name in (
        'inftyformer_pg19.py:smoke', 'inftyformer_pg19.py:sticky', 'inftyformer_wt103.py:smoke,sticky',
        'inftyformer_sorting.py:16000', 'inftyformer_sorting.py:4000,xl', 'lamemo_wt103.py:smoke,no_interp',
        'lamemo_wt103.py:no_look_ahead,xl_encoding', 'lamemo_enwik8.py:smoke', 'trams_wt103.py:xl',
        'trams_wt103.py:released', 'trams_enwik8.py:xl', 'skip_cross_head_wt103.py:smoke',
        'skip_cross_head_wt103.py:phase1,long', 'skip_cross_head_wt103.py:phase2', 'skip_cross_head_wt103.py:xl',
        'skip_cross_head_enwik8.py:short,no_sch', 'transformer_xl_wt103_base.py:notebook', 'lamemo_wt103.py:notebook',
        'inftyformer_wt103.py:notebook,sticky', 'skip_cross_head_wt103.py:notebook,phase1,no_sch')]
TINY = os.path.join(REPO, 'configs', 'tiny.py')
# Vocabulary sizes the tokenizers give (the word vocabulary of WikiText-103 train).
VOCAB = {'byte': 256, 'char': 256, 'word': 267735, 'sentencepiece': 8000, 'gpt2_bpe': 50257, 'sorting': 22}


def parse(argv):
    """Parses config flags like the train/evaluate commands do, in a private FlagValues."""
    values = flags.FlagValues()
    argv = ['prog'] + argv
    # sys_argv: the overrides are read from this list, not from the test runner's sys.argv.
    holder = config_flags.DEFINE_config_file('config', None, 'config', flag_values=values,
                                             lock_config=True, sys_argv=argv)
    values(argv)
    return holder.value


@pytest.mark.parametrize('path', CONFIG_FILES, ids=os.path.basename)
def test_every_config_is_valid(path):
    config = parse([f'--config={path}'])
    if config.data.name == 'text':  # A text file of the user's, which such a config cannot name.
        with pytest.raises(config_lib.ConfigError, match='--config.data.text_path=FILE'):
            config_lib.resolve(config)
        config = parse([f'--config={path}', '--config.data.text_path=kjv.txt'])
    run = config_lib.resolve(config).with_vocab_size(VOCAB[config.data.tokenizer])
    mcfg, eval_mcfg = run.model, run.eval_model
    want = config.eval.model.mem_len
    assert eval_mcfg.mem_len == (config.model.mem_len if want is None else want)
    # Evaluation overrides must not change the parameter shapes of the trained model: the same
    # fields but run-time ones, or a kind that runs on the trained one's parameters.
    assert eval_mcfg.memory == mcfg.memory or mcfg.memory in memories.kind_class(eval_mcfg.memory).runs_on
    dropped = memories.run_time_fields(mcfg.memory) + memories.run_time_fields(eval_mcfg.memory)
    assert dataclasses_without(mcfg, dropped) == dataclasses_without(eval_mcfg, dropped)


@pytest.mark.parametrize('arg, memory, own', [
    ('transformer_xl_wt103_base.py:notebook', 'xl', {}),
    ('lamemo_wt103.py:notebook', 'lamemo', {'lamemo_eps': 1e-6}),
    ('inftyformer_wt103.py:notebook,sticky', 'infinity', {'ltm_sticky': True, 'ltm_basis': 64, 'ltm_tau': 0.5}),
    ('skip_cross_head_wt103.py:notebook,phase1,no_sch', 'xl', {'skip_rule': 'linear', 'skip_until': -1, 'sch_beta': 0.0}),
])
def test_notebook_runs_keep_their_method_at_the_quickstart_size_on_a_text_file(arg, memory, own):
    """The notebooks' larger runs (docs/notebooks.md): one size for every method, the method's own fields."""
    run = config_lib.resolve(parse([f'--config={os.path.join(REPO, "configs", arg)}',
                                    '--config.data.text_path=kjv.txt'])).with_vocab_size(256)
    assert (run.data.name, run.data.tokenizer, run.data.text_path) == ('text', 'byte', 'kjv.txt')
    assert (run.model.memory, run.model.n_layer, run.model.d_model, run.model.mem_len, run.train.tgt_len,
            run.train.num_steps) == (memory, 4, 128, 64, 64, 8000)
    assert {field: getattr(run.model, field) for field in own} == own
    assert run.eval_model.mem_len == 64 and run.eval.tgt_len == 64  # Evaluated as trained.


def test_an_explicit_segment_len_is_training_s_and_evaluation_runs_at_eval_tgt_len():
    """An imported workdir's config names its segment length; evaluation's segments are still
    config.eval.tgt_len long, and a state sized by the segment (the infinity-former's) must be too.
    A segment_len that training's segments do not have is refused, naming both fields."""
    base = parse([f'--config={TINY}'])
    tgt_len = base.train.tgt_len
    run = config_lib.resolve(parse([f'--config={TINY}', '--config.model.memory=infinity', '--config.model.mem_len=0',
                                    f'--config.model.segment_len={tgt_len}', f'--config.eval.tgt_len={tgt_len // 2}']))
    assert (run.model.segment_len, run.eval_model.segment_len) == (tgt_len, tgt_len // 2)
    config = parse([f'--config={TINY}', f'--config.model.segment_len={tgt_len * 2}'])
    with pytest.raises(config_lib.ConfigError, match=rf'config.model.segment_len={tgt_len * 2} differs from '
                                                     rf'config.train.tgt_len={tgt_len}.*segment_len=-1'):
        config_lib.validate_config(config)


def dataclasses_without(mcfg, dropped):
    fields = dict(vars(mcfg))
    # segment_len: that of eval.tgt_len; the training switches are off in evaluation.
    for name in set(dropped) | {'segment_len', 'memory'} | set(TRAINING_FIELDS):
        fields.pop(name)
    return fields


def test_eval_model_overrides_are_checked_against_the_memory_kind():
    """config.eval.model is merged over config.model; a field the memory kind does not run
    with (mem_len for 'none') is refused, with the fields that may be set."""
    config = parse([f'--config={TINY}', '--config.eval.model.mem_len=20', '--config.eval.model.clamp_len=7'])
    eval_mcfg = config_lib.resolve(config).with_vocab_size(256).eval_model
    assert (eval_mcfg.mem_len, eval_mcfg.clamp_len, eval_mcfg.same_length) == (20, 7, config.model.same_length)
    config = parse([f'--config={TINY}', '--config.model.memory=none', '--config.model.mem_len=0',
                    '--config.eval.model.mem_len=20'])
    with pytest.raises(config_lib.ConfigError, match=r"config.eval.model: \['mem_len'\] cannot differ"):
        config_lib.validate_config(config)
    config = parse([f'--config={TINY}', '--config.model.memory=none'])
    with pytest.raises(config_lib.ConfigError, match="memory='none' keeps nothing but mem_len=8"):
        config_lib.validate_config(config)
    config = parse([f'--config={TINY}', '--config.model.memory=lamemmo'])
    with pytest.raises(config_lib.ConfigError, match=r"memory='lamemmo' must be one of \(.*'none'.*'xl'"):
        config_lib.validate_config(config)


def test_paper_evaluation_settings():
    """Attention lengths at evaluation as published (Dai et al. 2019 and reference scripts)."""
    expected = {
        'transformer_xl_wt103_base.py': (64, 640, 400),
        'transformer_xl_wt103_large.py': (128, 1600, 1000),
        'transformer_xl_enwik8_large.py': (128, 3800, 1000),
    }
    for name, (tgt_len, mem_len, clamp_len) in expected.items():
        config = parse([f'--config={os.path.join(REPO, "configs", name)}'])
        assert (config.eval.tgt_len, config.eval.model.mem_len, config.eval.model.clamp_len) == (
            tgt_len, mem_len, clamp_len), name
        assert config.eval.model.same_length is True, name
    rpe = parse([f'--config={os.path.join(REPO, "configs", "transformer_rpe_wt103.py")}'])
    assert rpe.model.memory == 'none' and rpe.model.mem_len == 0 and rpe.eval.model.mem_len is None


def test_lamemo_configs_follow_appendix_c():
    """Ji et al. 2022, appendix C: tgt = mem, the paper's batch and steps, evaluation as in training;
    the table 3 ablations are arguments."""
    expected = {'lamemo_wt103.py': (16, 410, 150, 64, 250_000, 'word'),
                'lamemo_enwik8.py': (12, 512, 512, 40, 100_000, 'byte'),
                'lamemo_text8.py': (12, 512, 512, 40, 100_000, 'char')}
    for name, (n_layer, d_model, length, batch, steps, tokenizer) in expected.items():
        config = parse([f'--config={os.path.join(REPO, "configs", name)}'])
        m, t = config.model, config.train
        assert (m.memory, m.n_layer, m.d_model, m.mem_len, t.tgt_len, t.batch_size, t.num_steps) == (
            'lamemo', n_layer, d_model, length, length, batch, steps), name
        assert (t.learning_rate, t.warmup_steps, t.min_lr_ratio, t.clip_norm) == (2.5e-4, 0, 0.0, 0.25), name
        assert (m.lamemo_look_ahead, m.lamemo_interpolate, m.lamemo_encoding, m.lamemo_eps) == (
            True, True, 'disentangled', 1e-6), name
        assert config.data.tokenizer == tokenizer and config_lib.eval_model_overrides(config) == {}, name
        assert config_lib.resolve(config).eval.tgt_len == length, name
    wt103 = os.path.join(REPO, 'configs', 'lamemo_wt103.py')
    ablated = parse([f'--config={wt103}:no_interp,no_look_ahead,xl_encoding']).model
    assert (ablated.lamemo_interpolate, ablated.lamemo_look_ahead, ablated.lamemo_encoding) == (False, False, 'xl')
    with pytest.raises(ValueError, match=r"lamemo_wt103.py: unknown arguments \['no_interp_'\]; use smoke, no_interp"):
        config_lib.config_options(wt103, 'no_interp_,smoke', ('smoke', 'no_interp'))


def test_infinity_former_configs_follow_the_paper():
    """Martins et al. 2022, section 4 and appendices C-D (and the reference notes' figures)."""
    configs = os.path.join(REPO, 'configs')
    pg19 = parse([f'--config={os.path.join(configs, "inftyformer_pg19.py")}'])
    m, t = pg19.model, pg19.train
    assert (m.memory, m.block, m.positions, m.n_layer, m.n_head, m.d_model, m.n_positions, t.tgt_len) == (
        'infinity', 'gpt2', 'learned_absolute', 12, 12, 768, 1024, 512)
    assert (m.ltm_basis, tuple(m.ltm_widths), m.ltm_ridge, m.ltm_tau, m.ltm_reset_tokens) == (
        512, (0.005, 0.01), 0.5, 0.5, 2048)
    assert (m.ltm_kl_weight, m.ltm_kl_sigma, m.ltm_min_variance) == (1e-6, 0.05, 1e-4)
    assert (t.batch_size, t.learning_rate, t.memory_learning_rate) == (1, 5e-5, 2.5e-4)
    assert (pg19.data.tokenizer, pg19.data.train_documents, m.ltm_sticky) == ('gpt2_bpe', 2000, False)
    # Where the paper is silent, the released GPT-2 runs (their config.json; reference notes).
    assert (m.ltm_kl_mu0, m.ltm_padding, m.ltm_sticky_within_bin) == (-1.0, 'released', 'left_edge')
    assert parse([f'--config={os.path.join(configs, "inftyformer_pg19.py")}:sticky']).model.ltm_sticky
    sorting = os.path.join(configs, 'inftyformer_sorting.py')
    for length, segments, learning_rate in ((4000, 4, 2.5e-4), (8000, 8, 2.5e-4), (16000, 16, 2e-4)):
        config = parse([f'--config={sorting}:{length}'])
        m, t = config.model, config.train
        assert (config.data.sort_length, m.n_layer, m.n_head, m.d_head, m.d_model, t.tgt_len, m.mem_len) == (
            length, 3, 6, 50, 300, 1024, 1024)
        assert (m.ltm_basis, tuple(m.ltm_widths), m.ltm_ridge, m.ltm_tau, m.ltm_kl_sigma) == (
            1024, (0.01, 0.05), 1.0, 0.75, 0.05)
        # One sequence (its 20-token answer and separator after `length` symbols) per dispatch.
        assert (t.segments_per_step, t.batch_size, t.learning_rate) == (segments, 8, learning_rate)
        assert t.num_steps == 20 * 1000 * segments and config.eval.accuracy
    xl = parse([f'--config={sorting}:8000,xl']).model
    assert (xl.memory, xl.mem_len) == ('xl', 2048)
    wt103 = parse([f'--config={os.path.join(configs, "inftyformer_wt103.py")}'])
    m, t = wt103.model, wt103.train
    assert (m.n_layer, m.n_head, m.d_model, m.d_inner, m.mem_len, t.tgt_len, t.batch_size, t.num_steps) == (
        16, 10, 410, 2100, 150, 150, 40, 250_000)
    assert (m.ltm_basis, m.ltm_reset_tokens, m.ltm_tau, m.ltm_kl_weight, m.ltm_kl_sigma) == (150, 900, 0.5, 1e-5, 0.1)


def test_override_is_applied_and_typed():
    # An optional field unset by default takes a typed value from the command line.
    assert parse([f'--config={TINY}']).model.ltm_kl_mu0 is None
    assert parse([f'--config={TINY}', '--config.model.ltm_kl_mu0=-1']).model.ltm_kl_mu0 == -1.0
    config = parse([f'--config={TINY}', '--config.train.num_steps=6',
                    '--config.eval.model.same_length=True', '--config.model.cutoffs=(10,20)'])
    assert config.train.num_steps == 6
    assert config.eval.model.same_length is True
    assert tuple(config.model.cutoffs) == (10, 20)


def test_unknown_override_is_rejected():
    with pytest.raises(Exception, match='not_a_field'):
        parse([f'--config={TINY}', '--config.train.not_a_field=3'])


def test_cli_rejects_unknown_override(tmp_path):
    result = subprocess.run(
        [sys.executable, '-m', 'memjax.train', f'--config={TINY}', f'--workdir={tmp_path}',
         '--config.train.lerning_rate=0.1'],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert 'lerning_rate' in result.stderr
    assert not os.path.exists(os.path.join(tmp_path, 'checkpoints'))


@pytest.fixture
def no_compilation(monkeypatch):
    """Fails the test if the trainer gets as far as building or compiling a step."""
    def forbidden(*args, **kwargs):
        raise AssertionError('the trainer compiled before rejecting the config')
    monkeypatch.setattr(experiment, 'make_train_step', forbidden)
    monkeypatch.setattr(experiment, 'make_eval_step', forbidden)
    monkeypatch.setattr(experiment, 'init_state', forbidden)


@pytest.mark.parametrize('overrides, field', [
    ({'train.batch_size': 6, 'train.grad_accum_steps': 4}, 'config.train.batch_size=6'),
    ({'train.warmup_steps': 9}, 'config.train.warmup_steps=9'),
    ({'train.tgt_len': 0}, 'config.train.tgt_len=0'),
    ({'train.num_steps': 7}, 'config.train.num_steps=7'),  # Not a multiple of S=2.
    ({'train.log_every': 3}, 'config.train.log_every=3'),
    ({'eval.tgt_len': -5}, 'config.eval.tgt_len=-5'),
    ({'eval.split': 'dev'}, 'config.eval.split'),
    ({'data.train_documents': -1}, 'config.data.train_documents=-1'),
    ({'data.word_max_size': 1}, 'config.data.word_max_size=1 must be 0 (no cap) or >= 2'),
    ({'data.word_min_freq': 0}, 'config.data.word_min_freq=0 must be >= 1'),
    ({'data.tokenizer': 'sorting'}, "the 'sorting' tokenizer reads only the generated sorting task"),
    ({'data.name': 'sorting', 'data.tokenizer': 'sorting', 'data.sort_length': 0}, 'config.data.sort_length'),
    ({'model.n_head': 0}, 'n_head=0'),
    ({'model.mem_len': 0, 'eval.model.same_length': True}, 'same_length'),
    ({'model.mem_len': 2**31}, 'positions are int32'),
    ({'model.positions': 'learned_absolute', 'model.n_positions': 4}, 'segments of 8 tokens'),
    ({'model.positions': 'learned_absolute', 'model.n_positions': 8, 'eval.tgt_len': 16},
     'config.eval.model: Invalid model config: segments of 16 tokens'),
])
def test_invalid_config_names_the_field_before_compiling(tmp_path, no_compilation, overrides,
                                                         field):
    config = parse([f'--config={TINY}'] + [f'--config.{k}={v}' for k, v in overrides.items()])
    with pytest.raises(config_lib.ConfigError) as error:
        trainer.train_and_evaluate(config, str(tmp_path))
    assert field in str(error.value)


def test_all_problems_are_reported_at_once():
    config = parse([f'--config={TINY}', '--config.train.b1=1.5', '--config.train.eps=0'])
    with pytest.raises(config_lib.ConfigError) as error:
        config_lib.validate_config(config)
    assert 'config.train.b1=1.5' in str(error.value)
    assert 'config.train.eps=0' in str(error.value)


def test_zero_sizes_are_named_not_divided_by():
    """Sizes the mesh checks divide by are refused in the same one-line way, with devices known."""
    config = parse([f'--config={TINY}', '--config.train.grad_accum_steps=0'])
    with pytest.raises(config_lib.ConfigError, match=r'config.train.grad_accum_steps=0 must be >= 1'):
        config_lib.validate_config(config, device_count=1)


def test_a_model_without_its_vocabulary_size_is_not_built():
    run = config_lib.resolve(parse([f'--config={TINY}']))
    assert run.model.vocab_size == -1
    with pytest.raises(ValueError, match='vocabulary size is not known yet'):
        model_lib.init_params(run.model, jax.random.PRNGKey(0))
    assert model_lib.build_model(run.with_vocab_size(256).model).config.vocab_size == 256


def test_batch_must_split_over_processes():
    config = parse([f'--config={TINY}'])
    config_lib.validate_config(config, process_count=2)
    with pytest.raises(config_lib.ConfigError, match='process count'):
        config_lib.validate_config(config, process_count=3)


def test_model_config_field_layout_matches_model():
    """Every config.model field is a ModelConfig field, so from_config_dict accepts them all."""
    names = set(model_lib.ModelConfig.defaults())
    assert set(config_lib.base_config().model.keys()) == names
