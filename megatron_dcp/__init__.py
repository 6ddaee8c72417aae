"""megatron_dcp: Dynamic Context Parallelism for Megatron-Core."""

from typing import List

__version__ = "0.1.0"


def install_upstream_api() -> List[str]:
    """Make megatron-core dev's dynamic-CP API (``DefaultDynamicCPScheduler``,
    ``initialize_model_parallel(dynamic_context_parallel=True)``,
    ``get_dynamic_data_context_parallel_groups``, the ``dynamic_context_parallel`` config field)
    available on megatron-core 0.19.x, backed by megatron_dcp; see docs/rl.md. Call it
    before megatron's model parallelism is initialised; it may be the process's first megatron
    import (also on a CPU machine without triton). Idempotent; returns the patch-table entries
    this call applied."""
    from megatron_dcp.integration.megatron_dev_api import INSTALL
    from megatron_dcp.integration.megatron_import import require_megatron_core

    require_megatron_core(INSTALL)  # before the patch table, which imports megatron-core
    from megatron_dcp.integration.patches import install_upstream_api as install

    return install()
