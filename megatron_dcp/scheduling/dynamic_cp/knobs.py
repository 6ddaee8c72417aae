"""Every tuning constant of ``default_dynamic_cp`` in one frozen dataclass, grouped by the phase
that reads it. The planner reads them from its :class:`~.search_state.Context` (``ctx.knobs``),
never from module globals, so a caller (a test, an experiment) can plan with other values
without patching modules.

The search is bounded by counted work only (steps, passes, samples and partners examined),
never by wall time: every rank of a domain computes the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Knobs:
    """The planner's constants; the defaults are the shipped planner (pinned by
    ``tests/unit/scheduling/test_plan_digests.py``)."""

    # --- Float comparisons --------------------------------------------------------------
    # Relative slack of float comparisons of loads (a move must lower a load by more).
    eps: float = 1e-9
    # Relative margin by which static CP's lower bound must exceed DCP's path for the static
    # plan to be skipped: far above the rounding of sums of 10⁵ costs (~10⁻¹¹), far below a
    # real gap.
    static_bound_slack: float = 1e-9

    # --- Construction: which micro-batches the samples form -----------------------------
    # A sample is heavy (opens a micro-batch of its own level) when it costs more per rank
    # than ``heavy`` × the mean level and reaching that level would cost it ``heavy_waste``
    # more CP overhead.
    heavy: float = 1.25
    heavy_waste: float = 0.02
    # CP sizes tried for the sample that opens a micro-batch, and the efficiency (useful work
    # over N × peak) that ends the trials early.
    trials: int = 3
    good_efficiency: float = 0.965
    # Trials whose efficiencies differ by at most this much tie (then fewer leftovers win).
    score_tie: float = 1e-4
    # The last micro-batch may exceed its level by this fraction to save one more micro-batch.
    last_slack: float = 0.02
    # The builder's filling pass stops after ``fail_limit`` consecutive samples that fit
    # nowhere (once no rank is free) per ``fail_span`` ranks of the domain: a domain k times
    # larger draws k times more samples of each kind, so runs of misses grow k times longer.
    fail_limit: int = 48
    fail_span: int = 64
    # Groups skipped per CP size when the least-loaded ones lack token room for a sample.
    skip_limit: int = 8

    # --- Which plans are searched, and selection ----------------------------------------
    # Batches of at most this many samples try the all-levels and packing variants and are
    # searched across micro-batches.
    search_samples: int = 512
    # Batches of more samples (up to ``polish_samples``) get only the polish of the micro-batches
    # whose peak exceeds their mean per-rank load by more than ``polish_imbalance`` of the peak
    # (the whole search costs too much there; the polish pays where a micro-batch is far from
    # balanced: the short-sample micro-batches beside long samples).
    polish_samples: int = 1024
    polish_imbalance: float = 0.02
    # Plans of more micro-batches are neither varied nor searched by sample moves across
    # micro-batches (block swaps still run): such a search costs O(K²) for K micro-batches (the
    # fuzzer's tiny budgets make hundreds).
    search_microbatches: int = 32
    # A plan within this factor of the lower bound is good enough: fewer micro-batches win
    # then, and pairs are not re-formed.
    good_plan: float = 1.02
    # A move across the plan must lower Σ peaks by at least this fraction of the larger peak
    # of the micro-batches it touches.
    min_gain: float = 1e-4

    # --- Moves inside a micro-batch ------------------------------------------------------
    # Rebalance (while forming): moves per micro-batch, samples of the top group examined,
    # lightest groups examined as partners.
    rebalance_steps: int = 8
    rebalance_items: int = 12
    rebalance_partners: int = 4
    # Polish (shift, redeal, merge, split): moves per micro-batch; samples of the top group
    # examined; lightest groups examined as partners; samples of a partner examined for a
    # trade; merge partners tried; shifts relieving a merged group.
    polish_steps: int = 32
    polish_items: int = 8
    polish_partners: int = 8
    trade_items: int = 4
    merge_trials: int = 3
    shed_steps: int = 8

    # --- Moves across the plan -----------------------------------------------------------
    # Dissolve: micro-batches of at most this many samples are tried; groups of one
    # micro-batch examined per sample, least-loaded first.
    dissolve_samples: int = 64
    dissolve_scan: int = 16
    # Relocate and swap: exchanges per micro-batch and pass, passes (of block swaps too); samples
    # of a top group examined; samples of a tied top group examined to break the tie; for
    # swaps, receiving groups per CP size and partner samples per receiving group.
    exchange_steps: int = 4
    exchange_passes: int = 3
    exchange_items: int = 6
    tie_items: int = 2
    swap_groups: int = 2
    swap_partners: int = 2
    # Swap tiled blocks: rounds of tiled-block swaps, each followed by relocate and swap on a
    # copy of the plan (kept when shorter; the rounds end at the first that is not).
    tile_rounds: int = 3
    # Re-form a pair: the most imbalanced micro-batches tried as the pair's first; trials per
    # micro-batch of the plan; a re-formed pair is polished only when its Σ peaks is within
    # ``promising`` of the old pair's.
    reform_sources: int = 12
    reform_attempts: int = 6
    promising: float = 1.02


DEFAULT_KNOBS = Knobs()
