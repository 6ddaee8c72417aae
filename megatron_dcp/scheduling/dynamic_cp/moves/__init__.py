"""The moves of ``default_dynamic_cp``'s search, one module per move family: each finds its best
candidate (and what it gains), the drivers (``microbatch_search``, ``plan_search``) decide and
apply."""
