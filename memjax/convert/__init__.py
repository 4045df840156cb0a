"""Weight importers (HF Transformer-XL: hf_transfo_xl; HF GPT-2: hf_gpt2) and memjax's saved-params format.

    from memjax.convert import load_imported
    config, params = load_imported(directory)   # written by python -m memjax.convert.hf_transfo_xl

Names resolve lazily so that `python -m memjax.convert.hf_transfo_xl` does not import its own
module twice (runpy warns when a package has already imported the module it is asked to run).
"""

import importlib

_EXPORTS = {'CheckpointError': 'hf_io', 'check_params': 'hf_io', 'load_imported': 'hf_io',
            'save_imported': 'hf_io', 'load_hf_checkpoint': 'hf_transfo_xl',
            'model_config_from_hf': 'hf_transfo_xl', 'params_from_hf_state_dict': 'hf_transfo_xl'}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f'memjax.convert.{_EXPORTS[name]}'), name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
