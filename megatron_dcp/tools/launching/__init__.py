"""Processes the tools start: ``training_runs`` (training jobs launched with torchrun, one agent
per emulated node, and their logs read back) and ``local_ranks`` (``run_distributed``: one
function on fork-started local ranks, with timeouts and dead-worker detection)."""
