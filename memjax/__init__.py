"""memjax: memory-augmented Transformer language models in JAX/Flax."""
