"""THD packing and zigzag CP slicing of one CP group's samples for one rank of the group.

Every rank of a CP group of size ``c`` packs the same samples in the same order. Each sequence is
padded to a multiple of ``pad_multiple`` (padding: token 0, label 0, loss_mask 0, so it carries no
loss) and cut into ``2c`` equal chunks; rank ``r`` keeps chunks ``r`` and ``2c-1-r`` (the layout
Transformer Engine expects for THD + CP: it balances causal-attention work across the group).
The local sequences are concatenated in order.

Edge cases: zero-length samples are dropped (they carry neither tokens nor loss); a group left
with no tokens packs one all-padding sequence of ``pad_multiple`` tokens, so every rank still runs
a (loss-free) forward and backward and takes part in the collectives of its peers.

Extra per-token fields (``extra_fields``: integer fields such as a vision-language sample's
``vision_slot``) are packed and sliced like the tokens, padded with 0, and returned in
``PackedMicroBatch.extras``.

A :class:`~megatron_dcp.runtime.pack_padding.PackPadding` pads the whole pack further (an aligned
or fixed local length, a fixed number of ``cu_seqlens`` entries); see that module.

Packing never reads a tensor's values on the host. The samples may already live on a GPU (the
DCP wrapper routes them there), where every such read (``int()``, ``.item()``, ``.tolist()``)
and every plain host-to-device copy makes the host wait for the device: the layout (lengths,
``cu_seqlens``, ``max_seqlen``, the total and local token counts, the zigzag indices) is computed
from host integers, and host tensors reach the device by asynchronous copies (``to_device``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Mapping, Sequence, Tuple, Union

import torch

from megatron_dcp.runtime.pack_padding import NO_PADDING, PackPadding

FIELDS = ("tokens", "labels", "loss_mask", "position_ids")
Sample = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class PackedMicroBatch:
    """One rank's share of a packed micro-batch.

    ``tokens``, ``labels``, ``loss_mask`` and ``position_ids`` are ``[1, T_local]``;
    ``position_ids`` are the positions of the local tokens inside their (padded) sequence.
    ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded`` are global (whole sequences, int32);
    ``max_seqlen`` is the longest padded sequence and ``total_tokens`` the padded tokens of the
    whole group (``cu_seqlens_padded[-1]``): host integers, known without reading a tensor.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    cp_size: int
    cp_rank: int
    total_tokens: int
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)  # ``[1, T_local]`` each

    def to(self, device: torch.device) -> "PackedMicroBatch":
        """The same micro-batch with its tensors on ``device`` (the model's device), copied
        without a host synchronisation (:func:`to_device`)."""
        names = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded")
        moved = {name: to_device(getattr(self, name), device) for name in names}
        extras = {name: to_device(value, device) for name, value in self.extras.items()}
        return replace(self, **moved, extras=extras)

    @property
    def num_local_tokens(self) -> int:
        """T_local: tokens (real and padding) this rank holds."""
        return int(self.tokens.shape[1])

    @property
    def loss_tokens(self) -> torch.Tensor:
        """This rank's tokens that carry loss (``loss_mask != 0``), as a 0-dim tensor on the
        pack's device: counting them needs no host read."""
        return (self.loss_mask != 0).sum()

    @property
    def num_tokens(self) -> int:
        """:attr:`loss_tokens` as an integer. It reads the mask: free for a pack on the host, a
        host synchronisation for one on a GPU (the DCP wrapper never asks for it)."""
        return int(self.loss_tokens)


def to_device(tensor: torch.Tensor, device: Union[torch.device, str]) -> torch.Tensor:
    """``tensor`` on ``device``. A host tensor bound for a GPU goes through pinned memory as an
    asynchronous copy on the current stream: a plain ``.to`` copies synchronously, the host
    waiting for everything queued on the stream before it."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def padding_multiple(cp_size: int, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """The length every sequence is padded to a multiple of: ``2·cp_size`` so it splits into the
    ``2·cp_size`` zigzag chunks (1 without CP), times ``tp_size`` under sequence parallelism so
    the local token count also splits over TP."""
    if cp_size < 1 or tp_size < 1:
        raise ValueError(f"cp_size and tp_size must be >= 1, got {cp_size} and {tp_size}")
    base = 2 * cp_size if cp_size > 1 else 1
    return base * (tp_size if sequence_parallel else 1)


def padded_length(length: int, pad_multiple: int) -> int:
    """``length`` rounded up to a multiple of ``pad_multiple``."""
    return -(-length // pad_multiple) * pad_multiple


def local_token_indices(
    cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Indices, into the global padded packed sequence, of the tokens ``cp_rank`` holds, in local
    order: for each sequence, chunk ``cp_rank`` then chunk ``2·cp_size-1-cp_rank``."""
    bounds = cu_seqlens_padded.tolist()
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if cp_size == 1:
            pieces.append(torch.arange(start, end))
            continue
        assert (end - start) % (2 * cp_size) == 0, "sequence not padded to 2·cp_size"
        chunk = (end - start) // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
    if not pieces:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(pieces)


def zigzag_slice(
    tensor: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 0
) -> torch.Tensor:
    """This rank's share of a globally packed (padded) tensor along ``dim``."""
    indices = local_token_indices(cu_seqlens_padded, cp_size, cp_rank).to(tensor.device)
    return tensor.index_select(dim, indices)


def unzigzag(
    parts: Sequence[torch.Tensor], cu_seqlens_padded: torch.Tensor, dim: int = 0
) -> torch.Tensor:
    """Inverse of ``zigzag_slice``: the global padded packed tensor from the shares of all
    ``len(parts)`` ranks of the group (rank order)."""
    cp_size = len(parts)
    gathered = torch.cat(list(parts), dim=dim)
    order = torch.cat(
        [local_token_indices(cu_seqlens_padded, cp_size, rank) for rank in range(cp_size)]
    )
    assert order.numel() == gathered.shape[dim], "parts do not match cu_seqlens_padded"
    return gathered.index_select(dim, torch.argsort(order).to(gathered.device))


def _check_sample(index: int, sample: Sample, extra_fields: Tuple[str, ...] = ()) -> int:
    """Length of a sample; raises ``ValueError`` on missing fields or unequal lengths."""
    for name in (*FIELDS[:3], *extra_fields):
        if name not in sample:
            needs = ", ".join((*FIELDS[:3], *extra_fields))
            raise ValueError(f"sample {index} lacks '{name}' (needs {needs})")
    names = (*FIELDS, *extra_fields)
    lengths = {name: int(sample[name].numel()) for name in names if name in sample}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"sample {index}: fields differ in length: {lengths}")
    return lengths["tokens"]


def _pad_sample(
    sample: Sample, length: int, padded: int, extra_fields: Tuple[str, ...] = ()
) -> Dict[str, torch.Tensor]:
    """One sample's four fields (and its ``extra_fields``, padded with 0) padded to ``padded``
    tokens (padding carries no loss), on the sample's device."""
    extra = padded - length
    positions = sample.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=sample["tokens"].device)
    return {
        "tokens": _pad(sample["tokens"].reshape(-1).long(), extra, 0),
        "labels": _pad(sample["labels"].reshape(-1).long(), extra, 0),
        "loss_mask": _pad(sample["loss_mask"].reshape(-1).float(), extra, 0),
        "position_ids": _continued(positions.reshape(-1).long(), length, padded),
        **{name: _pad(sample[name].reshape(-1).long(), extra, 0) for name in extra_fields},
    }


def _continued(positions: torch.Tensor, length: int, padded: int) -> torch.Tensor:
    """``positions`` followed by ``length .. padded - 1`` (the padding's), on their device."""
    tail = torch.arange(length, padded, dtype=torch.long, device=positions.device)
    return torch.cat([positions, tail])


def _pad(values: torch.Tensor, extra: int, fill: float) -> torch.Tensor:
    return torch.cat([values, values.new_full((extra,), fill)])


def _cumulative(lengths: Sequence[int]) -> List[int]:
    cumulative = [0]
    for length in lengths:
        cumulative.append(cumulative[-1] + length)
    return cumulative


def _padding_only(
    padded: int, device: torch.device, extra_fields: Tuple[str, ...] = ()
) -> Dict[str, torch.Tensor]:
    """A sequence of ``padded`` padding tokens and no real one, no loss, on ``device``: the
    stand-in of an empty group, or a pack's dummy tail."""
    empty = {name: torch.zeros(0, device=device) for name in (*FIELDS[:3], *extra_fields)}
    return _pad_sample(empty, 0, padded, extra_fields)


def _device_of(samples: Sequence[Sample]) -> torch.device:
    """Where the samples' tensors live (the CPU when there are none): the pack is built there."""
    return samples[0]["tokens"].device if samples else torch.device("cpu")


def pack_samples(
    samples: Sequence[Sample],
    cp_size: int,
    cp_rank: int,
    pad_multiple: int,
    padding: PackPadding = NO_PADDING,
    extra_fields: Sequence[str] = (),
) -> PackedMicroBatch:
    """Pack ``samples`` (dicts of equal-length 1-D tensors: ``tokens``, ``labels``,
    ``loss_mask``, optionally ``position_ids``, and the integer ``extra_fields``) as THD and keep
    rank ``cp_rank``'s zigzag share of a CP group of size ``cp_size``. ``pad_multiple`` comes
    from ``padding_multiple``; ``padding`` pads the whole pack (default: nothing more)."""
    _check_layout(cp_size, cp_rank, pad_multiple)
    extra_fields = tuple(extra_fields)
    lengths = [_check_sample(index, sample, extra_fields) for index, sample in enumerate(samples)]
    kept = [(s, n) for s, n in zip(samples, lengths) if n > 0]
    device = _device_of([s for s, _ in kept])
    padded = [_pad_sample(s, n, padded_length(n, pad_multiple), extra_fields) for s, n in kept]
    real = [n for _, n in kept]
    if not padded:
        padded, real = [_padding_only(pad_multiple, device, extra_fields)], [0]
    _pad_tail(padded, real, cp_size, padding, device, extra_fields)
    bounds = _cumulative([int(p["tokens"].numel()) for p in padded])  # host integers
    local = local_token_indices(torch.tensor(bounds, dtype=torch.int32), cp_size, cp_rank)
    index = to_device(local, device)
    names = (*FIELDS, *extra_fields)
    fields = {name: torch.cat([p[name] for p in padded])[index].unsqueeze(0) for name in names}
    return PackedMicroBatch(
        **{name: fields.pop(name) for name in FIELDS},
        extras=fields,
        cu_seqlens=_fixed(_cumulative(real), padding),
        cu_seqlens_padded=_fixed(bounds, padding),
        max_seqlen=max(end - start for start, end in zip(bounds, bounds[1:])),
        cp_size=cp_size,
        cp_rank=cp_rank,
        total_tokens=bounds[-1],
    )


def _pad_tail(
    padded: list,
    real: list,
    cp_size: int,
    padding: PackPadding,
    device: torch.device,
    extra_fields: Tuple[str, ...] = (),
) -> None:
    """Add the tail ``padding`` asks for to the global layout (before CP slicing, so each rank
    of the group receives ``tail / cp_size`` of it): a dummy sequence or a longer last one, on
    the pack's ``device``."""
    local = sum(p["tokens"].numel() for p in padded) // cp_size
    tail = (padding.local_target(local) - local) * cp_size
    if tail % (2 * cp_size if cp_size > 1 else 1):
        raise ValueError(
            f"a tail of {tail} tokens does not split into the {2 * cp_size} zigzag chunks of CP "
            f"size {cp_size}: the alignment must be even (got {padding.alignment})"
        )
    if not tail:
        return
    if padding.tail_policy == "append_dummy_seq":
        padded.append(_padding_only(tail, device, extra_fields))
        real.append(0)
    else:
        last = padded[-1]
        length = int(last["tokens"].numel())
        padded[-1] = {
            **{name: _pad(last[name], tail, 0) for name in (*FIELDS[:3], *extra_fields)},
            "position_ids": _continued(last["position_ids"], length, length + tail),
        }


def _fixed(bounds: List[int], padding: PackPadding) -> torch.Tensor:
    """``bounds`` with ``padding.max_sequences + 1`` entries (the last one repeated), as a host
    tensor."""
    return torch.tensor(padding.fixed_entries(list(bounds)), dtype=torch.int32)


def _check_layout(cp_size: int, cp_rank: int, pad_multiple: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must lie in [0, cp_size), got {cp_rank} and {cp_size}")
    if pad_multiple < 1 or (cp_size > 1 and pad_multiple % (2 * cp_size) != 0):
        raise ValueError(
            f"pad_multiple={pad_multiple} must be a positive multiple of 2·cp_size="
            f"{2 * cp_size}; compute it with padding_multiple(cp_size, tp_size, sequence_parallel)"
        )
