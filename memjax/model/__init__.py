"""Memory-transformer language models (Transformer-XL and the variants built on its layer stack)."""

from memjax.model.config import ModelConfig
from memjax.model.memory import Memory, init_memory
from memjax.model.transformer import (ModelOutput, TransformerXL, convert_layer_layout, init_params, lm_loss,
                                      memory_logical_axes, param_logical_axes)

__all__ = ['Memory', 'ModelConfig', 'ModelOutput', 'TransformerXL', 'convert_layer_layout', 'init_memory',
           'init_params', 'lm_loss', 'memory_logical_axes', 'param_logical_axes']
