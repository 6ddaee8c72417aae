"""``megatron-dcp calibrate``: the real model measured on this machine and the cost model the
scheduler plans with fitted to it. ``fit`` (the grid, the held-out split, the fit, the report
and the profile's source), ``rank_timing`` (the ranks that time every point of the grid),
``shaped_link`` (``--link-rate``: the calibration inside a shaped network namespace, the link
figures in the profile). The subcommand is ``cli/calibrate.py``; see docs/cost_model.md."""
