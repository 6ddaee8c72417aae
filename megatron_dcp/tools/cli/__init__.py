"""The ``megatron-dcp`` command line: ``main`` assembles the parser from one module per
subcommand; ``args`` holds what the subcommands share."""
