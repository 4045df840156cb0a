"""Memory-transformer language models (Transformer-XL and the variants built on its layer stack)."""

from memjax.model.config import ModelConfig
from memjax.model.memory import Memory, init_memory
from memjax.model.transformer import ModelOutput, TransformerXL, lm_loss

__all__ = ['Memory', 'ModelConfig', 'ModelOutput', 'TransformerXL', 'init_memory', 'lm_loss']
