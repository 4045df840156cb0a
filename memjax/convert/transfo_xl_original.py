"""Read a model trained with the original Transformer-XL PyTorch code (kimiyoung/transformer-xl,
`pytorch/train.py`) and its vocabulary; `python -m memjax.import_transfo_xl` writes them into a
memjax workdir:

    python -m memjax.import_transfo_xl --model=LM-TFM-wt103/model.pt \
        --corpus=data/wikitext-103/cache.pt --workdir=runs/wt103_original
    python -m memjax.generate --workdir=runs/wt103_original --prompt="The castle"
    python -m memjax.evaluate --config=configs/transformer_xl_wt103_large.py --workdir=runs/wt103_original
    (evaluate with a config of the same model shape, whose data and evaluation settings apply)

`model.pt` is `torch.save(model)` of the whole `MemTransformerLM` and `cache.pt` is
`torch.save(corpus)` of the data's `Corpus`: pickles of Python objects, which the general loader
would run arbitrary code from. They are read with torch's `weights_only` loader, which builds only
tensors, plain containers and the classes allowed here, and each allowed class is a stand-in that
only keeps attributes (no original code runs, none needs to be installed). A file that names any
other class is refused in one line.

What the original code does that memjax follows on import:
- the adaptive softmax's head keeps its tail-cluster logits in reverse order (cluster i at -i);
  memjax, like HF and TF, keeps them in order, so the cluster rows are reversed;
- the memory starts empty (memory_start='empty'), where HF and TF attend zero vectors;
- word vocabularies put `<eos>` first and keep `<unk>` where its frequency put it; character
  vocabularies (enwik8: byte values written as numbers; text8: letters with '_' for a space) become
  byte vocabularies in the model's own id order. The enwik8 preprocessing removes line breaks, and
  so does encoding with the imported vocabulary.

The TensorFlow checkpoints (`tf/`, the released pretrained models) are TensorFlow variable bundles,
which no reader outside TensorFlow parses: convert them with HF's
`transformers.models.deprecated.transfo_xl.convert_transfo_xl_original_tf_checkpoint_to_pytorch`
(transformers 4.37) where TensorFlow is installed and import the
result with `python -m memjax.convert.hf_transfo_xl`.
"""

from __future__ import annotations

import os
import pickle
import warnings
from typing import Any

import numpy as np

from memjax.convert import hf_transfo_xl
from memjax.convert.hf_io import CheckpointError, damaged, refusal
from memjax.data.tokenizers import ByteTokenizer, Tokenizer, WordTokenizer
from memjax.model import ModelConfig

# The classes those two files hold, by the names the pickles give them.
_MODEL_CLASSES = tuple(f'mem_transformer.{name}' for name in (
    'MemTransformerLM', 'RelPartialLearnableDecoderLayer', 'RelPartialLearnableMultiHeadAttn', 'PositionwiseFF',
    'PositionalEmbedding', 'AdaptiveEmbedding')) + ('proj_adaptive_softmax.ProjectedAdaptiveLogSoftmax',)
_TORCH_MODULES = tuple(f'torch.nn.modules.{name}' for name in (
    'linear.Linear', 'container.ModuleList', 'container.ParameterList', 'container.Sequential', 'sparse.Embedding',
    'normalization.LayerNorm', 'dropout.Dropout', 'activation.ReLU'))
# Modules saved by PyTorch 1.0 name their backend object.
_OLD_TORCH = ('torch.nn.backends.thnn._get_thnn_function_backend',)
_CORPUS_CLASSES = ('data_utils.Corpus', 'utils.vocabulary.Vocab', 'vocabulary.Vocab')
ALLOWED = _MODEL_CLASSES + _TORCH_MODULES + _OLD_TORCH + _CORPUS_CLASSES
WORD_DATASETS = ('wt103', 'wt2', 'ptb')
CHAR_DATASETS = ('enwik8', 'text8')
# The original's datasets that memjax prepares itself (config.data.name); the others are read as
# text files of the user's ('text').
DATA_NAMES = {'wt103': 'wikitext103', 'enwik8': 'enwik8', 'text8': 'text8'}


def _stand_in(full_name: str) -> type:
    """An inert class carrying the pickled attributes of `full_name`."""
    module, _, name = full_name.rpartition('.')
    return type(name, (), {'__module__': module, '__repr__': lambda self: f'<{full_name}>'})


_STAND_INS = [(_stand_in(name), name) for name in ALLOWED]


def safe_load(path: str, what: str) -> Any:
    """The objects of a `torch.save` file built by torch's weights-only loader from tensors,
    containers and the stand-ins of ALLOWED; anything else is a one-line CheckpointError."""
    if not os.path.isfile(path):  # Before torch: a wrong path is not a missing dependency.
        raise CheckpointError(f'{path} does not exist; give the {what} file.')
    try:
        import torch  # pylint: disable=g-import-not-at-top
    except ImportError as error:
        raise CheckpointError(f'reading {what} needs torch: pip install -e \'.[parity]\' ({error}).') from error
    try:
        # torch's warnings about the file (its format, its age) come before a refusal that says more.
        with torch.serialization.safe_globals(_STAND_INS), warnings.catch_warnings():
            warnings.simplefilter('ignore')
            return torch.load(path, map_location='cpu', weights_only=True)
    except (OSError, pickle.UnpicklingError, RuntimeError, AttributeError, EOFError, ValueError) as error:
        if damaged(error):
            raise CheckpointError(f'{path} could not be read as a torch.save file ({refusal(error).split(". ")[0]}): '
                                  f'it is truncated or damaged; copy the {what} again.') from error
        raise CheckpointError(f'{path} is not a {what} this importer reads safely ({refusal(error)}); it only builds '
                              f'the original code\'s own classes, never arbitrary ones.') from error


def _attributes(obj: Any) -> dict:
    return vars(obj) if hasattr(obj, '__dict__') else {}


def _tensors(module: Any, prefix: str = '') -> dict[str, Any]:
    """name -> tensor of every parameter and buffer under `module`, named as its state_dict names
    them; a tensor reachable under two names (tied) is listed under both."""
    found = {}
    attrs = _attributes(module)
    for group in ('_parameters', '_buffers'):
        for name, tensor in (attrs.get(group) or {}).items():
            if tensor is not None:
                found[prefix + name] = tensor
    for name, child in (attrs.get('_modules') or {}).items():
        if child is not None:
            found.update(_tensors(child, f'{prefix}{name}.'))
    return found


def _child(module: Any, *path: str) -> Any:
    for name in path:
        module = _attributes(module)['_modules'][name]
    return module


def _param(module: Any, name: str) -> Any:
    return _attributes(module)['_parameters'][name]


def model_config(model: Any) -> ModelConfig:
    """The memjax config computing what the original `MemTransformerLM` computes."""
    attrs = _attributes(model)
    if type(model).__name__ != 'MemTransformerLM':
        raise CheckpointError(f'the model file holds a {type(model).__name__}, not the original code\'s '
                              'MemTransformerLM (torch.save(model) of pytorch/train.py).')
    if attrs.get('attn_type', 0) != 0 or attrs.get('sample_softmax', -1) > 0:
        raise CheckpointError(f'attn_type={attrs.get("attn_type")}, sample_softmax={attrs.get("sample_softmax")}: '
                              'only the default relative attention with a (adaptive) softmax is imported.')
    if attrs.get('ext_len', 0) > 0:
        raise CheckpointError(f'ext_len={attrs["ext_len"]}: the model keeps extra context rows out of its memory, '
                              'which memjax does not; only models trained with ext_len=0 (the default) are imported.')
    layer0 = _child(model, 'layers', '0')
    attn, ff = _child(layer0, 'dec_attn'), _child(layer0, 'pos_ff')
    emb, crit = _child(model, 'word_emb'), _child(model, 'crit')
    crit_attrs = _attributes(crit)
    n_clusters = len(crit_attrs['cutoffs'])
    out_layers = [_child(crit, 'out_layers', str(i)) for i in range(len(_attributes(_child(crit, 'out_layers'))['_modules']))]
    emb_layers = [_child(emb, 'emb_layers', str(i)) for i in range(len(out_layers))]
    tie_weight = all(_param(o, 'weight') is _param(e, 'weight') for o, e in zip(out_layers, emb_layers))
    out_projs = _attributes(_child(crit, 'out_projs'))['_parameters']
    emb_projs = list(_attributes(_child(emb, 'emb_projs'))['_parameters'].values())
    tie_projs = [out_projs.get(str(i)) is not None and any(out_projs[str(i)] is p for p in emb_projs)
                 for i in range(n_clusters)]
    fields = {
        'vocab_size': attrs['n_token'], 'd_model': attrs['d_model'], 'n_layer': attrs['n_layer'],
        'n_head': attrs['n_head'], 'd_head': attrs['d_head'], 'd_embed': attrs['d_embed'],
        'd_inner': _attributes(ff)['d_inner'], 'dropout': _attributes(ff)['dropout'],
        'dropatt': _attributes(_child(attn, 'dropatt'))['p'], 'mem_len': attrs['mem_len'],
        'clamp_len': attrs['clamp_len'], 'same_length': attrs['same_length'],
        'pre_lnorm': _attributes(attn)['pre_lnorm'], 'untie_r': False,
        'cutoffs': list(crit_attrs['cutoffs'][:-1]), 'div_val': crit_attrs['div_val'], 'tie_projs': tie_projs,
        'tie_word_embeddings': tie_weight,
        'layer_norm_epsilon': _attributes(_child(attn, 'layer_norm'))['eps'],
    }
    config = hf_transfo_xl.model_config_from_hf(fields)
    return config.replace(memory_start='empty', segment_len=int(attrs['tgt_len']))


def hf_state_dict(model: Any) -> dict[str, np.ndarray]:
    """The original's tensors under HF TransfoXLLMHeadModel's names, the cluster rows in order."""
    state = {}
    for name, tensor in _tensors(model).items():
        value = tensor.detach().float().numpy()
        if name in ('crit.cluster_weight', 'crit.cluster_bias'):
            value = value[::-1].copy()  # Cluster i's logit sits at -i in the original head.
        state[name if name.startswith('crit.') else f'transformer.{name}'] = value
    return state


def read_model(path: str) -> tuple[ModelConfig, dict]:
    """(memjax config, memjax params) of the original code's `model.pt`."""
    model = safe_load(path, 'original Transformer-XL model.pt')
    try:
        config = model_config(model)
    except (KeyError, TypeError, AttributeError, IndexError) as error:
        raise CheckpointError(f'{path} holds a MemTransformerLM without the parts of a trained model ({type(error).__name__}: '
                              f'{error}): give the model.pt that pytorch/train.py saved.') from error
    return config, hf_transfo_xl.params_from_hf_state_dict(hf_state_dict(model), config, source=path)


def read_corpus(path: str, vocab_size: int) -> tuple[Tokenizer, str]:
    """(the memjax tokenizer giving the ids the original `Corpus` in `cache.pt` gives, the
    config.data.name of its dataset)."""
    corpus = _attributes(safe_load(path, 'original Transformer-XL corpus cache.pt'))
    return _tokenizer(path, corpus, vocab_size), DATA_NAMES.get(corpus.get('dataset'), 'text')


def _tokenizer(path: str, corpus: dict, vocab_size: int) -> Tokenizer:
    dataset, vocab = corpus.get('dataset'), _attributes(corpus.get('vocab'))
    symbols = vocab.get('idx2sym')
    if not isinstance(symbols, list):
        raise CheckpointError(f'{path} holds no vocabulary (Corpus.vocab.idx2sym): give the cache.pt of the '
                              'data the model was trained on.')
    if len(symbols) != vocab_size:
        raise CheckpointError(f'{path} has {len(symbols)} symbols but the model {vocab_size}: the two come from '
                              'different runs.')
    if dataset in WORD_DATASETS:
        if vocab.get('delimiter') is not None:
            raise CheckpointError(f'{path}: a vocabulary that splits on {vocab.get("delimiter")!r} ({dataset}) is not '
                                  'supported; memjax splits words on whitespace.')
        return WordTokenizer(symbols, lower_case=bool(vocab.get('lower_case')))
    if dataset == 'enwik8':
        return ByteTokenizer([int(s) for s in symbols], dropped=(ord('\n'),))
    if dataset == 'text8':
        return ByteTokenizer([ord(' ') if s == '_' else ord(s) for s in symbols])
    raise CheckpointError(f'{path} is a {dataset!r} corpus; the importer reads {WORD_DATASETS + CHAR_DATASETS}.')
