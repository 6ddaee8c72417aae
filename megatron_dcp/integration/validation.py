"""Start-up checks for DCP: every unsupported setting fails before the first training step with a
``ValueError`` that names the flag, the value and the fix."""

from __future__ import annotations

from typing import Any, Optional

DCP_FLAG = "--dynamic-context-parallel"
SCHEDULER_FLAG = "--sequence-packing-scheduler"
BUDGET_FLAG = "--max-seqlen-per-dp-cp-rank"
DCP_SCHEDULERS = ("default_dynamic_cp", "dp_balanced")


def validate_model_config(config: Any, te_available: Optional[bool] = None) -> None:
    """Reject model settings DCP cannot run with (``config`` is a megatron TransformerConfig)."""
    if not config.calculate_per_token_loss:
        raise ValueError(
            f"{DCP_FLAG} needs --calculate-per-token-loss (calculate_per_token_loss=False): "
            "ranks run different CP groups and micro-batch sizes, so only sums of per-token "
            "losses divided by the global token count give the right gradient. Add "
            "--calculate-per-token-loss."
        )
    if getattr(config, "hybrid_context_parallel", False):
        raise ValueError(
            f"{DCP_FLAG} and --hybrid-context-parallel (megatron's own scheduler) exclude each "
            "other: remove --hybrid-context-parallel."
        )
    if getattr(config, "multi_latent_attention", False):
        raise ValueError(
            f"{DCP_FLAG} does not support multi-latent attention (--multi-latent-attention): "
            "MLA's THD context-parallel path in megatron-core 0.19 ignores per-micro-batch CP "
            "groups. Use standard attention or static context parallelism."
        )
    if config.sequence_parallel and not _te_available(te_available):
        raise ValueError(
            f"{DCP_FLAG} with --sequence-parallel needs Transformer Engine norms and linear "
            "layers (--transformer-impl transformer_engine); the local implementation does not "
            "support sequence parallelism with packed sequences. Install the 'te' extra or drop "
            "--sequence-parallel."
        )


def validate_scheduler_name(name: Optional[str]) -> str:
    """The scheduler DCP runs: ``default_dynamic_cp`` when the flag is absent."""
    if name is None:
        return "default_dynamic_cp"
    if name not in DCP_SCHEDULERS:
        raise ValueError(
            f"{SCHEDULER_FLAG}={name!r} cannot be used with {DCP_FLAG}: choose one of "
            f"{', '.join(DCP_SCHEDULERS)} (or leave it out for default_dynamic_cp)."
        )
    return name


def validate_budget(budget: Optional[int], tp_size: int, sequence_parallel: bool) -> int:
    """``--max-seqlen-per-dp-cp-rank`` must be set, and a multiple of the per-rank padding unit
    (every sequence is padded to a multiple of 2 × CP size, × TP size under sequence
    parallelism), so that a sequence of exactly CP size × budget tokens needs no padding beyond
    its group's budget."""
    unit = 2 * (tp_size if sequence_parallel else 1)
    if budget is None or budget <= 0 or budget % unit:
        raise ValueError(
            f"{BUDGET_FLAG}={budget!r}: {DCP_FLAG} needs a positive per-rank token budget that "
            f"is a multiple of {unit} (sequences are padded to 2 × CP size"
            f"{' × TP size under --sequence-parallel' if unit > 2 else ''}); e.g. "
            f"{BUDGET_FLAG} 4096."
        )
    return budget


def _te_available(te_available: Optional[bool]) -> bool:
    if te_available is not None:
        return te_available
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)
