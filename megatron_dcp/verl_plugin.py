"""verl's dynamic CP on megatron-core 0.19.x: importing this module calls
:func:`megatron_dcp.install_upstream_api`. verl imports it in every process (driver and Ray
workers) before any engine initialises megatron when the job sets
``VERL_USE_EXTERNAL_MODULES=megatron_dcp.verl_plugin`` (docs/rl.md, section "verl"). It may be
the process's first megatron import, also on a machine without triton: the call imports
megatron-core through the package's import path (``integration.megatron_import``) first, and
raises an ``ImportError`` naming the install when megatron-core is missing."""

from megatron_dcp import install_upstream_api

INSTALLED = install_upstream_api()
