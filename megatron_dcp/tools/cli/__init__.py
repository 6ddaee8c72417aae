"""The ``megatron-dcp`` command line: ``main`` assembles the parser from one module per
subcommand; ``args`` holds what their parsers share. Only the command-line wiring lives here:
what a subcommand runs lives in the rest of ``tools``, which never imports ``cli``."""
