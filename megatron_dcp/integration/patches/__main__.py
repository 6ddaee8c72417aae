"""``python -m megatron_dcp.integration.patches``: print the patch table."""

from megatron_dcp.integration.patches import describe

print(describe())
