"""jaxformer: the Transformer from first principles in JAX / Flax NNX."""
__version__ = "0.1.0"
