"""Weight importers from other Transformer-XL implementations, and memjax's saved-params format.

    from memjax.convert import load_imported
    config, params = load_imported(directory)   # written by python -m memjax.convert.hf_transfo_xl

Names resolve lazily so that `python -m memjax.convert.hf_transfo_xl` does not import its own
module twice (runpy warns when a package has already imported the module it is asked to run).
"""

import importlib

_EXPORTS = ('CheckpointError', 'check_params', 'load_hf_checkpoint', 'load_imported',
            'model_config_from_hf', 'params_from_hf_state_dict', 'save_imported')
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module('memjax.convert.hf_transfo_xl'), name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
