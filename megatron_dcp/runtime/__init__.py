"""DCP runtime: torch + torch.distributed, no megatron internals (DESIGN.md, "Layers")."""
