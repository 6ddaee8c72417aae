"""Integration with megatron.core / megatron.training: the only package touching their internals."""
