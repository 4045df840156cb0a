"""Memory-transformer language models: one skeleton, the memory kind chosen by config.model.memory."""

from memjax.model.config import ModelConfig
from memjax.model.lm import (MemoryLM, ModelOutput, abstract_params, build_model, convert_layer_layout, init_memory,
                             init_params, lm_loss, memory_logical_axes, param_logical_axes)
from memjax.model.memories import MemoryState

__all__ = ['MemoryLM', 'MemoryState', 'ModelConfig', 'ModelOutput', 'abstract_params', 'build_model', 'convert_layer_layout',
           'init_memory', 'init_params', 'lm_loss', 'memory_logical_axes', 'param_logical_axes']
