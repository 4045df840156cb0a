"""Importing the original Transformer-XL PyTorch code's model.pt and cache.pt.

The files are written here as the original code writes them (`torch.save` of the whole model and
of the corpus), with stand-in classes under the original module names, from a random HF model:
memjax's import must then compute HF's log-probs, which tests the reversed cluster order, and its
tokenizer must give the original vocabulary's ids.
"""

import io
import os
import subprocess
import sys
import types

import warnings

import jax
import numpy as np
import pytest

torch = pytest.importorskip('torch', reason="the import reads torch files; pip install -e '.[parity]'")
transformers = pytest.importorskip('transformers', reason="the peer is HF TransfoXL; pip install -e '.[parity]'")

from memjax import errors  # noqa: E402  pylint: disable=g-import-not-at-top
from memjax import evaluate  # noqa: E402
from memjax.generation import text as generation_text  # noqa: E402
from memjax.bench.suites import peer  # noqa: E402
from memjax import import_transfo_xl  # noqa: E402
from memjax.convert import hf_io  # noqa: E402
from memjax.convert import transfo_xl_original as original  # noqa: E402
from memjax.data import factory  # noqa: E402
from memjax.data import tokenizers  # noqa: E402
from memjax.generation import Sampling, sample  # noqa: E402
from memjax.model import lm  # noqa: E402
from memjax.training import saved_run  # noqa: E402
import cli_fixtures  # noqa: E402
import disks  # noqa: E402
import training_fixtures  # noqa: E402

SHAPE = peer.Shape(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, tgt_len=6, mem_len=6, batch_size=2)
VOCAB = peer.Vocab('adaptive', 40, (10, 20), 2)  # Three clusters: the order of the two tail logits matters.


def _module(name: str) -> types.ModuleType:
    if name not in sys.modules:
        sys.modules[name] = types.ModuleType(name)
        parent, _, child = name.rpartition('.')
        if parent:  # Pickle imports the package first.
            setattr(_module(parent), child, sys.modules[name])
    return sys.modules[name]


def _original_class(full_name: str, base=torch.nn.Module) -> type:
    """A class pickled under the original code's name (pickle finds it in sys.modules)."""
    module, _, name = full_name.rpartition('.')
    cls = type(name, (base,), {'__module__': module})
    setattr(_module(module), name, cls)
    return cls


CLASSES = {name.rpartition('.')[2]: _original_class(name) for name in original._MODEL_CLASSES}  # pylint: disable=protected-access
Corpus = _original_class('data_utils.Corpus', object)
Vocab = _original_class('utils.vocabulary.Vocab', object)


def as_original(hf_module, cls_name: str, **attributes):
    """`hf_module`'s parameters and children under a stand-in of the original class."""
    out = CLASSES[cls_name]()
    out._parameters.update(hf_module._parameters)  # pylint: disable=protected-access
    out._buffers.update(hf_module._buffers)  # pylint: disable=protected-access
    out._modules.update(hf_module._modules)  # pylint: disable=protected-access
    out.__dict__.update(attributes)
    return out


def original_model(hf_model) -> torch.nn.Module:
    """The original code's MemTransformerLM holding the HF model's tensors (tied ones stay tied)."""
    cfg, t = hf_model.config, hf_model.transformer
    layers = torch.nn.ModuleList()
    for layer in t.layers:
        attn = as_original(layer.dec_attn, 'RelPartialLearnableMultiHeadAttn', pre_lnorm=cfg.pre_lnorm,
                           n_head=cfg.n_head, d_head=cfg.d_head, d_model=cfg.d_model)
        ff = as_original(layer.pos_ff, 'PositionwiseFF', d_inner=cfg.d_inner, dropout=cfg.dropout,
                         pre_lnorm=cfg.pre_lnorm)
        out = CLASSES['RelPartialLearnableDecoderLayer']()
        out.dec_attn, out.pos_ff = attn, ff
        layers.append(out)
    crit = as_original(hf_model.crit, 'ProjectedAdaptiveLogSoftmax', cutoffs=list(cfg.cutoffs) + [cfg.vocab_size],
                       div_val=cfg.div_val)
    with torch.no_grad():  # The original keeps cluster i's logit at -i.
        crit.cluster_weight = torch.nn.Parameter(hf_model.crit.cluster_weight.flip(0).clone())
        crit.cluster_bias = torch.nn.Parameter(hf_model.crit.cluster_bias.flip(0).clone())
    model = as_original(torch.nn.Module(), 'MemTransformerLM', n_token=cfg.vocab_size, d_model=cfg.d_model,
                        n_layer=cfg.n_layer, n_head=cfg.n_head, d_head=cfg.d_head, d_embed=cfg.d_embed,
                        tgt_len=SHAPE.tgt_len, mem_len=cfg.mem_len, ext_len=0, clamp_len=cfg.clamp_len,
                        same_length=cfg.same_length, attn_type=0, sample_softmax=-1)
    model.word_emb = as_original(t.word_emb, 'AdaptiveEmbedding', div_val=cfg.div_val, d_proj=cfg.d_model)
    model.layers, model.crit = layers, crit
    model.pos_emb = as_original(t.pos_emb, 'PositionalEmbedding', demb=cfg.d_model)
    model.r_w_bias, model.r_r_bias = t.r_w_bias, t.r_r_bias
    model.drop = torch.nn.Dropout(cfg.dropout)
    return model


def original_corpus(dataset: str, symbols: list) -> object:
    corpus, vocab = Corpus(), Vocab()
    vocab.__dict__.update(idx2sym=symbols, sym2idx={s: i for i, s in enumerate(symbols)}, special=['<eos>'],
                          lower_case=dataset == 'ptb', delimiter=None, min_freq=0,
                          max_size=None, vocab_file=None)
    corpus.__dict__.update(dataset=dataset, vocab=vocab, train=torch.zeros(5, dtype=torch.long))
    return corpus


def hf_peer():
    """A random HF Transformer-XL with the original code's shared position biases (untie_r=False),
    perturbed beyond its init, which zeroes every bias (the clusters' too): a bias mapped to the wrong
    place or cluster changes the log-probabilities."""
    torch.manual_seed(0)
    with warnings.catch_warnings():  # TransfoXL is deprecated in transformers 4.37; it still works.
        warnings.simplefilter('ignore')
        config = transformers.TransfoXLConfig(
            vocab_size=VOCAB.vocab_size, cutoffs=list(VOCAB.cutoffs), div_val=VOCAB.div_val, d_model=SHAPE.d_model,
            d_embed=SHAPE.d_model, n_head=SHAPE.n_head, d_head=SHAPE.d_head, d_inner=SHAPE.d_inner,
            n_layer=SHAPE.n_layer, mem_len=SHAPE.mem_len, clamp_len=-1, same_length=False, dropout=0.0,
            dropatt=0.0, untie_r=False)
        model = transformers.TransfoXLLMHeadModel(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():  # Shared (tied) tensors come once, so ties survive.
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    assert model.crit.cluster_bias.abs().min() > 0
    return model


@pytest.fixture(scope='module')
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp('original')
    hf_model = hf_peer()
    torch.save(original_model(hf_model), folder / 'model.pt')
    words = ['<eos>', 'the', 'and', '<unk>'] + [f'w{i}' for i in range(VOCAB.vocab_size - 4)]
    torch.save(original_corpus('wt103', words), folder / 'cache.pt')
    return hf_model, str(folder / 'model.pt'), str(folder / 'cache.pt')


def test_the_imported_model_computes_hf_log_probs_with_the_clusters_in_order(files):
    hf_model, model_path, _ = files
    config, params = original.read_model(model_path)
    assert config.memory_start == 'empty'  # The original starts with no memory, HF with zeros.
    assert config.cutoffs == VOCAB.cutoffs and config.segment_len == SHAPE.tgt_len
    tokens = peer.random_tokens(VOCAB.vocab_size, SHAPE.batch_size, 2 * SHAPE.tgt_len + 1, seed=4)
    # The reversed rows matter: tail tokens are scored through their cluster's logit.
    assert (tokens >= VOCAB.cutoffs[0]).mean() > 0.5
    diff = peer.max_logprob_difference(hf_model, config.replace(memory_start='zeros'), params, tokens, SHAPE.tgt_len)
    assert diff < 1e-5


def test_a_model_that_keeps_extra_context_rows_is_refused(files, tmp_path):
    """The original's ext_len > 0 keeps ext_len rows of the segment out of the memory it passes on;
    memjax's memory has no such rows: refused rather than imported to compute otherwise."""
    hf_model, _, _ = files
    model = original_model(hf_model)
    model.ext_len = 4
    torch.save(model, tmp_path / 'model.pt')
    with pytest.raises(errors.CheckpointError, match='ext_len=4'):
        original.read_model(str(tmp_path / 'model.pt'))


@pytest.mark.parametrize('dataset,symbols,text,ids', [
    ('enwik8', ['101', '32', '116', '104'], 'the\nte', [2, 3, 0, 2, 0]),  # Line breaks were never symbols.
    ('text8', ['_', 'e', 't', 'h'], 'the the', [2, 3, 1, 0, 2, 3, 1]),  # '_' was the space.
])
def test_character_vocabularies_become_byte_vocabularies_in_their_own_order(tmp_path, dataset, symbols, text, ids):
    torch.save(original_corpus(dataset, symbols), tmp_path / 'cache.pt')
    tok, data_name = original.read_corpus(str(tmp_path / 'cache.pt'), len(symbols))
    assert data_name == dataset  # memjax prepares both under the same names.
    assert tok.encode(text).tolist() == ids
    assert tok.decode(ids) == text.replace('\n', '')
    with pytest.raises(errors.DataError, match='not in this imported byte vocabulary'):
        tok.encode('x')


def test_word_vocabulary_of_the_original_order_and_a_mismatch_is_refused(files, tmp_path):
    _, _, corpus_path = files
    tok, data_name = original.read_corpus(corpus_path, VOCAB.vocab_size)
    assert (tok.eos_id, tok.unk_id) == (0, 3) and data_name == 'wikitext103'
    words = ['<eos>', 'the', 'and', '<unk>'] + [f'w{i}' for i in range(VOCAB.vocab_size - 4)]
    torch.save(original_corpus('ptb', words), tmp_path / 'ptb.pt')  # One memjax does not prepare: text files.
    ptb, data_name = original.read_corpus(str(tmp_path / 'ptb.pt'), VOCAB.vocab_size)
    assert data_name == 'text'
    assert tok.encode('the zebra and').tolist() == [1, 3, 2, 0]
    # WikiText's vocabulary keeps case; PTB's lower-cases every line first (the original's get_lm_corpus),
    # also as the workdir's tokenizer file reads it back.
    assert tok.encode('The AND').tolist() == [3, 3, 0]
    assert ptb.encode('The AND').tolist() == [1, 2, 0]
    ptb.save(tmp_path / 'saved')
    assert factory.load_tokenizer(tmp_path / 'saved' / tokenizers.TOKENIZER_FILE).encode('The AND').tolist() == [1, 2, 0]
    assert tokenizers.WordTokenizer(words).fingerprint != ptb.fingerprint
    with pytest.raises(errors.CheckpointError, match='different runs'):
        original.read_corpus(corpus_path, VOCAB.vocab_size + 1)


class _Marker:
    """A pickle that would create a file if it were ever unpickled with the general loader."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, 'w'))


def test_a_file_naming_any_other_callable_is_refused_and_never_run(tmp_path):
    marker = tmp_path / 'ran'
    torch.save({'model': _Marker(str(marker))}, tmp_path / 'model.pt')
    torch.save({'weight': _Marker(str(marker))}, tmp_path / 'pytorch_model.bin')
    with pytest.raises(errors.CheckpointError, match='reads safely') as original_refused, \
            warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter('always')
        original.read_model(str(tmp_path / 'model.pt'))
    assert not warned  # torch's own warnings do not precede the refusal.
    with pytest.raises(errors.CheckpointError, match='reads safely') as hf_refused:
        hf_io._read_weights_file(str(tmp_path / 'pytorch_model.bin'))
    for refused in (original_refused, hf_refused):
        # The callable torch's loader refused is named; its advice to load the file unsafely is not passed on.
        assert 'GLOBAL io.open' in str(refused.value)
        assert 'weights_only' not in str(refused.value) and 'safe_globals' not in str(refused.value)
    assert not marker.exists()


def test_the_command_writes_a_workdir_that_generate_reads(files, tmp_path, capsys):
    _, model_path, corpus_path = files
    workdir = str(tmp_path / 'imported')
    import_transfo_xl.main([f'--model={model_path}', f'--corpus={corpus_path}', f'--workdir={workdir}'])
    assert 'Imported' in capsys.readouterr().out
    out = io.StringIO()
    texts = generation_text.generate(None, workdir, 'the and', 8, Sampling(temperature=0), out=out)
    config, params = original.read_model(model_path)
    tok = original.read_corpus(corpus_path, config.vocab_size)[0]
    prompt = generation_text.prompt_ids(tok, 'the and')
    expected = sample(lm.build_model(config), params, prompt, 8, Sampling(temperature=0)).tokens[0]
    assert ['the and' + text for text in texts] == [tok.decode(np.concatenate([prompt, expected]))]
    before = {path: os.stat(os.path.join(root, path)).st_mtime_ns
              for root, _, names in os.walk(workdir) for path in names}
    with pytest.raises(SystemExit):  # Never into a workdir that holds something.
        import_transfo_xl.main([f'--model={model_path}', f'--corpus={corpus_path}', f'--workdir={workdir}'])
    assert 'is not empty' in capsys.readouterr().err
    assert before == {path: os.stat(os.path.join(root, path)).st_mtime_ns
                      for root, _, names in os.walk(workdir) for path in names}


@pytest.mark.parametrize('dataset', ['wt103', 'ptb'])
def test_the_workdir_names_the_data_its_vocabulary_came_from(files, tmp_path, dataset):
    """Evaluated with its own config, an imported run reads its corpus: WikiText-103 is one memjax
    prepares; PTB's files the user names (one line asks for them), never the embedded corpus."""
    _, model_path, _ = files
    words = ['<eos>', 'the', 'and', '<unk>'] + [f'w{i}' for i in range(VOCAB.vocab_size - 4)]
    torch.save(original_corpus(dataset, words), tmp_path / 'cache.pt')
    workdir = str(tmp_path / 'imported')
    import_transfo_xl.main([f'--model={model_path}', f'--corpus={tmp_path / "cache.pt"}', f'--workdir={workdir}'])
    config = saved_run.saved_config(workdir)
    if dataset == 'wt103':
        assert (config.data.name, config.data.tokenizer) == ('wikitext103', 'word')
    else:
        with pytest.raises(errors.ConfigError, match="config.data.name='text' reads a text file of yours: give it "
                                                     "as --config.data.text_path=FILE"):
            evaluate.evaluate_checkpoint(config, workdir)


def test_evaluate_scores_a_split_with_the_imported_model_as_a_segment_loop(files, tmp_path):
    """memjax.evaluate on the imported workdir with a config of its shape, data given: the loss of the
    original model on the split, memory carried from an empty start as the original code does."""
    _, model_path, corpus_path = files
    workdir = str(tmp_path / 'imported')
    import_transfo_xl.main([f'--model={model_path}', f'--corpus={corpus_path}', f'--workdir={workdir}'])
    rng = np.random.RandomState(0)
    vocabulary = ['the', 'and', 'zebra'] + [f'w{i}' for i in range(10)]  # zebra: <unk>.
    corpus = tmp_path / 'text'
    corpus.mkdir()
    for name, count in (('train.txt', 40), ('valid.txt', 30), ('test.txt', 10)):
        (corpus / name).write_text(' '.join(rng.choice(vocabulary, count)) + '\n')
    config = saved_run.saved_config(workdir)
    # As a config file of the model's shape gives them (configs/transformer_xl_wt103_large.py): the
    # segment length from the data's tgt_len, another initialisation; neither shapes a parameter.
    config.model.update(segment_len=-1, init_std=0.005, proj_init_std=0.02)
    config.data.update(name='text', text_path=str(corpus), data_dir=str(corpus / 'tfds'))
    config.eval.update(batch_size=1, split='validation')
    summary = evaluate.evaluate_checkpoint(config, workdir)

    mcfg, params = original.read_model(model_path)
    model = lm.build_model(mcfg)
    tokens = original.read_corpus(corpus_path, mcfg.vocab_size)[0].encode((corpus / 'valid.txt').read_text())
    # Jitted (once per segment length): op by op, the model would compile each of its operations.
    apply = jax.jit(lambda p, x, m, t: model.apply({'params': p}, x, m, targets=t))
    memory, total, seg = lm.init_memory(mcfg, 1), 0.0, mcfg.segment_len
    for start in range(0, len(tokens) - 1, seg):
        targets = tokens[start + 1:start + 1 + seg]
        out, memory = apply(params, tokens[None, start:start + len(targets)], memory, targets[None])
        total -= float(np.sum(np.asarray(out.target_logprobs, np.float64)))
    assert summary['num_tokens'] == len(tokens) - 1
    assert summary['loss'] == pytest.approx(total / (len(tokens) - 1), abs=1e-5)


def test_a_truncated_file_a_bare_model_and_a_missing_path_are_one_line_naming_the_file(files, tmp_path, monkeypatch):
    _, model_path, _ = files
    with open(model_path, 'rb') as f:
        data = f.read()
    truncated = tmp_path / 'truncated.pt'
    truncated.write_bytes(data[:len(data) // 2])
    with pytest.raises(errors.CheckpointError, match=f'{truncated} could not be read .*: it is truncated or damaged'):
        original.read_model(str(truncated))
    # A corpus cache cut short, in torch's zip format and in the legacy one of the original code's
    # torch: damaged, not refused as unsafe.
    words = ['<eos>', 'the', 'and', '<unk>']
    for n, zipped in enumerate((True, False)):
        cache = tmp_path / f'cache{n}.pt'
        torch.save(original_corpus('wt103', words), cache, _use_new_zipfile_serialization=zipped)
        for size in (cache.stat().st_size // 2, 10):
            cache.write_bytes(cache.read_bytes()[:size])
            with pytest.raises(errors.CheckpointError, match=f'{cache} could not be read .*: it is truncated or damaged'):
                original.read_corpus(str(cache), len(words))
    bare = tmp_path / 'bare.pt'
    torch.save(CLASSES['MemTransformerLM'](), bare)  # The class, none of a trained model's attributes.
    with pytest.raises(errors.CheckpointError, match=f'{bare} holds a MemTransformerLM without the parts'):
        original.read_model(str(bare))
    monkeypatch.setitem(sys.modules, 'torch', None)  # torch not installed: the path is still checked first.
    with pytest.raises(errors.CheckpointError, match='missing.pt does not exist'):
        original.read_model(str(tmp_path / 'missing.pt'))


def test_a_full_disk_during_the_import_is_one_line(files, tmp_path):
    """The probe: the workdir on a disk too small for the checkpoint (a tmpfs; skipped where this
    machine cannot mount one). Orbax's failing threads print nothing ahead of the one line."""
    _, model_path, corpus_path = files
    with disks.small_disk(tmp_path / 'disk', 96) as disk:
        result = subprocess.run([sys.executable, '-m', 'memjax.import_transfo_xl', f'--model={model_path}',
                                 f'--corpus={corpus_path}', f'--workdir={disk}/run'], env=cli_fixtures.cpu_env(1),
                                capture_output=True, text=True, timeout=300, cwd=training_fixtures.REPO)
        left = os.listdir(disk)
    lines = [line for line in result.stderr.splitlines() if line.strip() and not (line[:1] in 'IWE' and line[1:5].isdigit())]
    assert result.returncode == errors.EXIT_RUNTIME and len(lines) == 1, result.stderr[-3000:]
    assert 'Traceback' not in result.stderr and 'RESOURCE_EXHAUSTED' in lines[0]
    assert 'the half-written workdir was removed' in lines[0] and left == []  # The import can simply run again.
