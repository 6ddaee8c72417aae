from megatron_dcp.integration.patches.dcp import *  # noqa: F401,F403  (temporary)
from megatron_dcp.integration.patches.dcp import apply_patches, PATCHES  # noqa: F401
