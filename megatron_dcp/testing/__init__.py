"""Test support shared by tests/ and functional_tests/: the distributed harness and fixtures."""

from megatron_dcp.tools.launching.local_ranks import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
