"""``megatron-dcp bench-train``: real training steps of several planners on identical global
batches, timed side by side (``command``: the subcommand and its runs; ``worker``: what each
rank runs; ``arms``: the planners and the order they take turns in; ``stats``: paired
intervals; ``report``: table, JSON and picture). See docs/performance.md."""
