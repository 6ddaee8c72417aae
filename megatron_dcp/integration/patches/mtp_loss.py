"""MTP loss normalisation independent of packing: the ``mtp_loss`` entry of the patch table.

With a per-token loss (``calculate_per_token_loss``), megatron-core 0.19.2's
``process_mtp_loss`` weighs MTP depth ``d`` of one micro-batch by ``n / n_d``: the loss tokens
of *that rank's slice of that micro-batch* before and after rolling the labels ``d`` places.
``finalize_model_grads`` then divides every gradient by the global loss-token count ``N``. The
MTP gradient therefore depends on how the batch was cut into micro-batches and CP slices: a
DCP plan changes it, and a slice whose own tokens are all masked out contributes nothing even
when its rolled tokens carry loss.

With DCP the ratio is the global batch's instead: ``N / N_d``, where ``N_d`` counts the loss
tokens of every sample after rolling ``d`` places (its first ``d`` mask entries drop out). The
DCP wrapper computes both counts once per global batch (:func:`mtp_token_ratios`, one
all-reduce of ``1 + depth`` numbers over DP) and names them in each micro-batch's
``PackedSeqParams``. After the division by ``N``, depth ``d`` contributes
``scale · Σ loss_d / N_d`` whatever the plan: exactly what a single micro-batch holding the whole
global batch gives under megatron's own rule, which is the reference the oracle tests use.

Micro-batches that megatron_dcp does not pack (verl's engine builds its own ``PackedSeqParams``
in ``preprocess_thd_engine``) take the ratios of the forward-backward call that drives them
(:func:`active_mtp_ratios`, set once per global batch by the ``upstream`` group's schedule entry
from the micro-batches verl hands to megatron's schedule) when they name a dynamic CP size.

Micro-batches without the ratios (static CP in plain megatron) and RL-style calls without labels
take megatron's own function unchanged (DCP always runs with a per-token loss).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

import torch

from megatron_dcp.integration.patches.table import Patch

# The DCP wrapper sets this attribute of a micro-batch's PackedSeqParams to (N / N_1, ...,
# N / N_depth) of its global batch.
MTP_RATIOS_ATTRIBUTE = "dcp_mtp_token_ratios"
# The ratios of the global batch the running forward-backward call drives (None outside one):
# for micro-batches whose PackedSeqParams megatron_dcp did not build (verl's).
_ACTIVE_RATIOS: list = [None]


@contextlib.contextmanager
def active_mtp_ratios(ratios: Optional[Tuple[float, ...]]) -> Iterator[None]:
    """While the block runs, dynamic-CP micro-batches that carry no ratios of their own (no
    ``MTP_RATIOS_ATTRIBUTE``; ``local_cp_size`` set) are weighted by ``ratios``."""
    previous, _ACTIVE_RATIOS[0] = _ACTIVE_RATIOS[0], ratios
    try:
        yield
    finally:
        _ACTIVE_RATIOS[0] = previous


def ratios_of(packed_seq_params: Any) -> Optional[Tuple[float, ...]]:
    """The global ratios a micro-batch's MTP loss uses: its own (megatron_dcp packed it), else
    those of the forward-backward call driving a dynamic-CP micro-batch, else None (megatron's
    rule)."""
    ratios = getattr(packed_seq_params, MTP_RATIOS_ATTRIBUTE, None)
    if ratios is None and getattr(packed_seq_params, "local_cp_size", None) is not None:
        return _ACTIVE_RATIOS[0]
    return ratios


def loss_token_counts(loss_masks: Sequence[torch.Tensor], depth: int) -> torch.Tensor:
    """``[N, N_1, ..., N_depth]`` of ``loss_masks`` (one 1-D mask per sample): the summed masks,
    then the summed masks without each sample's first ``d`` entries (float64)."""
    counts = torch.zeros(depth + 1, dtype=torch.float64)
    for mask in loss_masks:
        mask = mask.reshape(-1).double()
        for d in range(depth + 1):
            counts[d] += mask[d:].sum()
    return counts


def mtp_token_ratios(
    loss_masks: Sequence[torch.Tensor], depth: int, dp_group: Any, device: torch.device
) -> Tuple[float, ...]:
    """``(N / N_1, ..., N / N_depth)`` of the global batch whose samples this DP rank holds
    ``loss_masks`` of: the counts summed over ``dp_group`` (each sample is held by exactly one
    DP rank before routing); a depth without loss tokens gets ratio 0."""
    counts = loss_token_counts(loss_masks, depth).to(device)
    torch.distributed.all_reduce(counts, group=dp_group)
    return token_ratios(counts)


def token_ratios(counts: torch.Tensor) -> Tuple[float, ...]:
    """``(N / N_1, ..., N / N_depth)`` of the counts ``[N, N_1, ...]`` of a whole global batch
    (0 for a depth without loss tokens)."""
    total, rolled = float(counts[0]), counts[1:].tolist()
    return tuple(total / n if n > 0 else 0.0 for n in rolled)


def global_mtp_loss(original: Callable) -> Callable:
    """``process_mtp_loss`` that weighs each depth by the global ratio when the micro-batch
    carries one (see the module docstring); otherwise ``original``."""

    @functools.wraps(original)
    def process_mtp_loss(hidden_states, labels, loss_mask, *args, **kwargs):
        bound = _bind(original, hidden_states, labels, loss_mask, *args, **kwargs)
        ratios = ratios_of(bound["packed_seq_params"])
        if ratios is None or labels is None:
            return original(hidden_states, labels, loss_mask, *args, **kwargs)
        return _weighted_mtp_loss(ratios, **bound)

    return process_mtp_loss


def _bind(original: Callable, *args: Any, **kwargs: Any) -> dict:
    """Every parameter of ``original`` by name, defaults included."""
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _weighted_mtp_loss(
    ratios: Sequence[float],
    hidden_states: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: Optional[torch.Tensor],
    output_layer: Callable,
    output_weight: Optional[torch.Tensor],
    runtime_gather_output: Optional[bool],
    is_training: bool,
    compute_language_model_loss: Callable,
    config: Any,
    cp_group: Any = None,
    tp_group: Any = None,
    packed_seq_params: Any = None,
    scale_logits_fn: Optional[Callable] = None,
    input_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """megatron's MTP loss step by step (labels and mask rolled one place per depth, the depth's
    logits from the shared output layer, its masked per-token loss attached to the main hidden
    states for the backward pass, its mean logged), each depth weighted by ``ratios[d - 1]``."""
    from megatron.core.transformer import multi_token_prediction as mtp

    depth = config.mtp_num_layers
    main, *heads = torch.chunk(hidden_states, 1 + depth, dim=0)
    if config.mtp_detach_heads:
        output_weight = (
            output_weight if output_weight is not None else output_layer.weight
        ).detach()
    mask = torch.ones_like(labels) if loss_mask is None else loss_mask
    scale = config.mtp_loss_scaling_factor / depth
    roll = functools.partial(
        mtp.roll_tensor, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params
    )
    for index, head in enumerate(heads):
        logits, _ = output_layer(
            head, weight=output_weight, runtime_gather_output=runtime_gather_output
        )
        if scale_logits_fn is not None:
            logits = scale_logits_fn(logits)
        labels, _ = roll(labels)
        mask, num_tokens = roll(mask)
        loss = mask * compute_language_model_loss(labels, logits)
        if is_training:
            accepted = mtp._compute_mtp_acceptance_counts(
                logits, labels, mask, output_layer, runtime_gather_output, tp_group
            )
            _track(config, index, loss.sum(), num_tokens, accepted)
        main = mtp.MTPLossAutoScaler.apply(main, scale * ratios[index] * loss)
    return main


def _track(
    config: Any, index: int, loss_sum: torch.Tensor, num_tokens: torch.Tensor, accepted
) -> None:
    """What megatron tracks per depth: this slice's mean MTP loss and acceptance counts."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    mean = loss_sum * (num_tokens > 0).to(loss_sum.dtype) / num_tokens.clamp(min=1)
    MTPLossLoggingHelper.save_metrics_to_tracker(
        mean,
        *accepted,
        index,
        config.mtp_num_layers,
        avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
    )


MTP_PATCHES: Tuple[Patch, ...] = (
    Patch(
        "mtp_loss",
        "dcp",
        (
            "megatron.core.models.gpt.gpt_model:process_mtp_loss",
            "megatron.core.models.hybrid.hybrid_model:process_mtp_loss",
            # verl's MTP postprocess imports it from here (verl.models.mcore.mtp_patch)
            "megatron.core.transformer.multi_token_prediction:process_mtp_loss",
        ),
        "process_mtp_loss weighs each MTP depth by the loss tokens of one rank's slice of one "
        "micro-batch before and after rolling: the MTP gradient depends on the packing and CP "
        "slicing (zero for a slice whose own tokens are masked out). DCP micro-batches use the "
        "global batch's ratio instead.",
        lambda owner, original: global_mtp_loss(original),
    ),
)
