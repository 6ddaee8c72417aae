"""DCP runtime: torch + torch.distributed, no megatron internals (docs/architecture.md)."""
