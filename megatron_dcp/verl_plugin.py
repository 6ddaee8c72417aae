"""verl's dynamic CP on megatron-core 0.19.x: importing this module calls
:func:`megatron_dcp.install_upstream_api`. verl imports it in every process (driver and Ray
workers) before any engine initialises megatron when the job sets
``VERL_USE_EXTERNAL_MODULES=megatron_dcp.verl_plugin`` (docs/rl.md, section "verl")."""

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.integration.upstream import install_upstream_api

if not import_megatron_core():
    raise ImportError("megatron_dcp.verl_plugin needs megatron-core 0.19.x (see README.md)")

INSTALLED = install_upstream_api()
