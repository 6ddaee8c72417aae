"""Tools beside the training plugin: the ``megatron-dcp`` command line (one module per
subcommand), the simulator, workloads, the fuzzer, plots, peer schedulers and the quick-start.
Tools may import every other package; nothing in the core imports ``tools`` (a test enforces it).
"""
