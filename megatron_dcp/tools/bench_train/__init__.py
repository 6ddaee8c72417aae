"""``megatron-dcp bench-train``: real training steps of several planners on identical global
batches, timed side by side (``run``: one run of every arm and its fairness check;
``run_flags``: the training flags it passes, defaults included; ``worker``: what each rank
runs; ``arms``: the planners and the order they take turns in; ``stats``: paired intervals;
``report``: table, JSON and picture). The subcommand is ``cli/bench_train.py``. See
docs/performance.md."""
