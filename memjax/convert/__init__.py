"""Weight importers from other Transformer-XL implementations, and memjax's saved-params format."""

from memjax.convert.hf_transfo_xl import (
    CheckpointError,
    check_params,
    load_hf_checkpoint,
    load_imported,
    model_config_from_hf,
    params_from_hf_state_dict,
    save_imported,
)

__all__ = ['CheckpointError', 'check_params', 'load_hf_checkpoint', 'load_imported',
           'model_config_from_hf', 'params_from_hf_state_dict', 'save_imported']
