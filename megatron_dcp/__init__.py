"""megatron_dcp: Dynamic Context Parallelism for Megatron-Core."""

__version__ = "0.1.0"
