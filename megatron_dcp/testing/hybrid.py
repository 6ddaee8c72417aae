"""The tiny hybrid (Mamba + attention + MLP) model of the oracle tests: ``TinyGPTOptions`` with
a ``hybrid_layer_pattern`` builds megatron's ``HybridModel`` from the CPU hybrid stack spec
(reference attention, reference Mamba kernels) instead of a GPT."""

from __future__ import annotations

from typing import Any, Optional

from megatron_dcp.integration.cpu.hybrid_stack import reference_hybrid_stack_spec

# hidden 64 → d_inner 128: 8 heads of 16 channels, 2 groups of B/C states of 8.
MAMBA_FIELDS = dict(mamba_state_dim=8, mamba_head_dim=16, mamba_num_groups=2)


def mamba_fields(options: Any) -> dict:
    """TransformerConfig's Mamba fields (none for a GPT)."""
    return MAMBA_FIELDS if options.hybrid_layer_pattern else {}


def build_hybrid_chunk(config: Any, options: Any, stage: Optional[int]) -> Any:
    """One chunk of the tiny hybrid model (``vp_stage`` ``stage``)."""
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    ignore_virtual = stage is None
    return HybridModel(
        config=config,
        hybrid_stack_spec=reference_hybrid_stack_spec(),
        vocab_size=options.vocab_size,
        max_sequence_length=options.max_sequence_length,
        hybrid_layer_pattern=options.hybrid_layer_pattern,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual, vp_stage=stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual, vp_stage=stage),
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        vp_stage=stage,
    )
