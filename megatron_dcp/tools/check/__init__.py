"""``megatron-dcp check``: the first command on a new machine. An environment report, then DCP
against static CP on identical global batches (loss and every gradient, a plan that mixes CP
sizes), a smoke figure of speed, and one verdict line (``cli/check.py``; docs/usage.md)."""
