"""Adapters for engines that drive megatron-core without its data loader (see ``adapters.rl``)."""

from megatron_dcp.adapters.rl import *  # noqa: F401,F403
from megatron_dcp.adapters.rl import __all__  # noqa: F401
