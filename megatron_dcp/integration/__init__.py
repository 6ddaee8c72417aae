"""Integration with megatron.core / megatron.training: the only package that touches their internals."""
