"""megatron-core's LLaVA on DCP micro-batches: :class:`DCPLLaVAModel`.

A DCP micro-batch of a vision-language model arrives in *combined coordinates*: one position per
language-model input, each image placeholder already widened to its image's tokens
(``integration.data.vlm_samples``), packed as THD and zigzag-sliced over the micro-batch's CP
group like any text. ``vision_slot`` numbers this rank's image positions: slot ``k + 1`` takes
the ``k``-th image token of the group's images, in pack order (0: a text position).

Its forward, on each rank of a CP group of ``c`` ranks:

1. encodes its share of the group's image tiles (``VisionShare``: a contiguous ``⌈n/c⌉`` of the
   group's ``n`` tiles), through the vision encoder and the projector: each tile once per group;
2. all-gathers the projected tiles over the micro-batch's group (``VisionShare.group``: the
   ``cp_group`` of its ``PackedSeqParams``; the backward reduce-scatters their gradients);
3. embeds its text tokens and puts the image tokens at its image positions;
4. runs the language model on that THD pack (sequence-parallel scatter first, with SP).

LLaVA's own ``_preprocess_data`` and ``_process_embedding_token_parallel`` are not used on this
path: they widen and then shard the whole sequence over the static CP group. Anything else
(``vision_slot`` None) is LLaVA's own forward, unchanged.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.integration.vision_batches import VisionShare

import_megatron_core()

from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.models.multimodal.llava_model import LLaVAModel  # noqa: E402


class DCPLLaVAModel(LLaVAModel):
    """megatron-core's ``LLaVAModel`` that also runs DCP micro-batches (module docstring): the
    forward step passes ``vision_slot`` and ``vision_share``; without them it is LLaVA."""

    def forward(
        self,
        *args: Any,
        vision_slot: Optional[torch.Tensor] = None,
        vision_share: Optional[VisionShare] = None,
        **kwargs: Any,
    ) -> Any:
        if vision_slot is None:
            return super().forward(*args, **kwargs)
        return self.dcp_forward(vision_slot=vision_slot, vision_share=vision_share, **kwargs)

    def dcp_forward(
        self,
        *,
        images: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        packed_seq_params: Any,
        vision_slot: torch.Tensor,
        vision_share: VisionShare,
        attention_mask: Any = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Token losses ``[1, T_local]`` of one DCP micro-batch and its loss mask (as LLaVA's
        forward returns them)."""
        embeddings = self.language_model.embedding(input_ids=input_ids, position_ids=position_ids)
        if vision_share.group_tiles:
            image_tokens = self.encode_share(images, vision_share)
            embeddings = place_image_tokens(embeddings, image_tokens, vision_slot)
        if self.config.sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
        output = self.language_model(
            input_ids=None,
            position_ids=None,
            attention_mask=attention_mask,
            decoder_input=embeddings,
            labels=labels,
            packed_seq_params=packed_seq_params,
        )
        return output, loss_mask

    def encode_share(self, images: torch.Tensor, share: VisionShare) -> torch.Tensor:
        """The group's image tokens ``[group_tiles · img_seq_len, hidden]`` in tile order: this
        rank's tiles through the encoder and projector, all-gathered over the group."""
        hidden = self.language_model.config.hidden_size
        local = self.project(images) if share.local_tiles else None
        if local is None:  # a leaf in the graph: the gather's backward is collective
            dtype = self.vision_projection_dtype()
            shape = (0, self.img_seq_len, hidden)
            local = torch.zeros(shape, dtype=dtype, device=images.device, requires_grad=True)
        padded = pad_rows(local, share.per_rank)
        if share.size > 1:
            padded = tensor_parallel.gather_from_sequence_parallel_region(
                padded, tensor_parallel_output_grad=True, group=share.group
            )
        return padded[: share.group_tiles].reshape(-1, hidden)

    def project(self, images: torch.Tensor) -> torch.Tensor:
        """Tiles ``[n, C, H, W]`` through the vision encoder (class tokens dropped as LLaVA
        drops them) and the projector: ``[n, img_seq_len, hidden]``."""
        dtype = self.vision_projection_dtype()
        encoded = self.vision_model(images.to(dtype))  # [n, encoder tokens, vision hidden]
        if self._drop_vision_class_token:
            encoded = encoded[:, self.vision_model.class_token_len :, :]
        projected = self.vision_projection(encoded.permute(1, 0, 2).contiguous())
        return projected.permute(1, 0, 2)

    def vision_projection_dtype(self) -> torch.dtype:
        return next(self.vision_projection.parameters()).dtype


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows`` (every rank gathers the same shape)."""
    missing = rows - tensor.shape[0]
    if missing <= 0:
        return tensor.contiguous()
    filler = tensor.new_zeros((missing, *tensor.shape[1:]))
    return torch.cat([tensor, filler]).contiguous()


def place_image_tokens(
    embeddings: torch.Tensor, image_tokens: torch.Tensor, vision_slot: torch.Tensor
) -> torch.Tensor:
    """``embeddings`` ``[T, 1, h]`` with image token ``slot − 1`` at every position whose slot is
    positive (a select on the device: no host read)."""
    slot = vision_slot.reshape(-1)
    picked = image_tokens.to(embeddings.dtype)[(slot - 1).clamp(min=0)]
    return torch.where((slot > 0).view(-1, 1, 1), picked.unsqueeze(1), embeddings)

