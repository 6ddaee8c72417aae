"""``python -m megatron_dcp.tools``: the ``megatron-dcp`` command line."""

import sys

from megatron_dcp.tools.cli.main import main

sys.exit(main())
