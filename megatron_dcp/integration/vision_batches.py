"""The images of a vision-language global batch under DCP (docs/vlm.md, "Life of a batch").

A vision-language sample carries, beside its per-token fields in combined coordinates
(``tokens``, ``labels``, ``loss_mask``, ``vision_slot``: ``integration.data.vlm_samples``), its
image tiles ``[tiles, C, H, W]``. Per global batch:

1. the tile counts are all-gathered with the lengths (:func:`exchange_tiles`): the planner prices
   each sample's encoder work (``patches``) and every rank knows every tile's size;
2. each tile is routed to the one rank of its CP group that encodes it (:func:`tile_plan`: the
   group's tiles in pack order, a contiguous ``⌈n/c⌉`` per rank), by the text's routing method;
3. per micro-batch, each rank stacks its tiles (:func:`micro_batch_images`) and the samples'
   ``vision_slot`` numbers are shifted to the group's image order (:func:`offset_slots`).

Every figure is a host integer taken before any tensor moves: nothing here reads a device tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import torch

from megatron_dcp.runtime.exchange import all_gather_seqlens
from megatron_dcp.runtime.routing import (
    LANE_ALL_GATHER,
    SampleSchema,
    route_by_lane_all_gather,
    route_samples,
)
from megatron_dcp.scheduling import CPGroup, Plan
from megatron_dcp.scheduling.plan import MicroBatch

Sample = Dict[str, torch.Tensor]
IMAGES = "images"
PIXELS = "pixels"
VISION_SLOT = "vision_slot"
VLM_FIELDS = ("tokens", "labels", "loss_mask", VISION_SLOT, IMAGES)
PIXEL_SCHEMA = SampleSchema.of({PIXELS: torch.empty(0, dtype=torch.float32)})


@dataclass(frozen=True)
class VisionSpec:
    """What the model makes of a tile: its pixel shape ``(C, H, W)``, the language-model positions
    it fills (``tokens_per_tile``, LLaVA's ``img_seq_len``) and the encoder tokens it costs
    (``patches_per_tile``, class tokens included)."""

    tile_shape: Tuple[int, int, int]
    tokens_per_tile: int
    patches_per_tile: int

    @property
    def pixels_per_tile(self) -> int:
        channels, height, width = self.tile_shape
        return channels * height * width


@dataclass(frozen=True)
class VisionShare:
    """This rank's part of its CP group's image tiles in one micro-batch: the group holds
    ``group_tiles`` tiles, rank ``rank`` of the ``size`` ranks encodes tiles
    ``[rank·per_rank, (rank+1)·per_rank)`` of them; ``group`` is the micro-batch's CP group
    (None at size 1). Host integers: nothing is read from a device tensor."""

    group_tiles: int
    per_rank: int
    rank: int
    size: int
    group: Any = None

    @classmethod
    def of(cls, group_tiles: int, size: int, rank: int, group: Any) -> "VisionShare":
        return cls(group_tiles, -(-group_tiles // size), rank, size, group)

    @property
    def bounds(self) -> Tuple[int, int]:
        """This rank's tiles, as [start, end) within the group's tiles."""
        start = min(self.rank * self.per_rank, self.group_tiles)
        return start, min(start + self.per_rank, self.group_tiles)

    @property
    def local_tiles(self) -> int:
        start, end = self.bounds
        return end - start


@dataclass(frozen=True)
class BatchTiles:
    """The tile counts of a global batch, per sample id, and each sample's first global tile id
    (tiles are numbered in sample-id order)."""

    tiles: Tuple[int, ...]
    first: Tuple[int, ...]

    @classmethod
    def of(cls, tiles: Sequence[int]) -> "BatchTiles":
        first, total = [], 0
        for count in tiles:
            first.append(total)
            total += count
        return cls(tuple(tiles), tuple(first))

    @property
    def total(self) -> int:
        return sum(self.tiles)

    def tile_ids(self, sample_ids: Sequence[int]) -> List[int]:
        """The global tile ids of ``sample_ids``' images, in that order (a group's pack order)."""
        return [t for i in sample_ids for t in range(self.first[i], self.first[i] + self.tiles[i])]

    def owner(self, owner_of: Callable[[int], int]) -> Callable[[int], int]:
        """The DP rank holding each tile: its sample's."""
        sample_of = [i for i, count in enumerate(self.tiles) for _ in range(count)]
        return lambda tile: owner_of(sample_of[tile])


def vision_images(item: Mapping[str, Any]) -> torch.Tensor:
    """A vision-language sample's tiles ``[tiles, C, H, W]`` (collated ``[1, tiles, C, H, W]``)."""
    if IMAGES not in item or VISION_SLOT not in item:
        raise ValueError(
            f"a vision-language DCP sample needs the fields {VLM_FIELDS}; "
            f"got {sorted(item)}: build it with integration.data.vlm_samples.make_vlm_sample."
        )
    images = torch.as_tensor(item[IMAGES])
    return images[0] if images.dim() == 5 else images


@dataclass(frozen=True)
class RoutedImages:
    """A vision-language batch's tiles: the counts of every sample, and those this rank
    encodes (global tile id -> flat pixels)."""

    tiles: BatchTiles
    routed: Mapping[int, torch.Tensor]
    bytes_received: int


def exchange_tiles(images: Sequence[torch.Tensor], dp_group: Any) -> BatchTiles:
    """Every sample's tile count (its tiles ``[tiles, C, H, W]``: a host shape, no read), in
    global sample id order (an all-gather over DP)."""
    return BatchTiles.of(all_gather_seqlens([int(image.shape[0]) for image in images], dp_group))


def split_images(samples: Sequence[Sample]) -> Tuple[List[Sample], List[torch.Tensor]]:
    """The per-token fields of each sample, and its tiles ``[tiles, C, H, W]``."""
    text = [{k: v for k, v in s.items() if k != IMAGES} for s in samples]
    return text, [s[IMAGES] for s in samples]


def tile_shares(group: CPGroup, tiles: BatchTiles) -> Dict[int, List[int]]:
    """The tiles each position of ``group`` encodes: its pack-order tiles cut into ``size``
    contiguous shares of ``⌈n/size⌉`` (the last ones shorter or empty)."""
    ids = tiles.tile_ids(group.sample_ids)
    per_rank = -(-len(ids) // group.size)
    return {
        position: ids[index * per_rank : (index + 1) * per_rank]
        for index, position in enumerate(group.ranks)
    }


def tile_plan(plan: Plan, tiles: BatchTiles, spec: VisionSpec) -> Plan:
    """The routing plan of the tiles: ``plan``'s domain and micro-batches, each position a group
    of its own holding the tiles it encodes; every tile's length is its pixel count."""
    microbatches = []
    for microbatch in plan.microbatches:
        groups = []
        for group in microbatch.groups:
            shares = tile_shares(group, tiles)
            groups.extend(CPGroup((p,), tuple(shares[p])) for p in group.ranks)
        microbatches.append(MicroBatch(tuple(groups)))
    seqlens = (spec.pixels_per_tile,) * tiles.total
    return Plan(seqlens=seqlens, domain=plan.domain, microbatches=tuple(microbatches))


def route_tiles(
    plan: Plan,
    tiles: BatchTiles,
    images: Mapping[int, torch.Tensor],
    spec: VisionSpec,
    route: "TileRoute",
) -> Tuple[Dict[int, torch.Tensor], int]:
    """The tiles this rank encodes in the whole plan (global tile id -> flat pixels), from
    ``images`` (this DP rank's samples' tiles, by sample id) over ``route``, and the bytes it
    received."""
    local = {
        tile: {PIXELS: image.reshape(len(image), -1)[index].float()}
        for sample_id, image in images.items()
        for index, tile in enumerate(tiles.tile_ids([sample_id]))
    }
    routed = route(tile_plan(plan, tiles, spec), local, tiles.owner)
    pixels = {tile: fields[PIXELS] for tile, fields in routed.samples.items()}
    return pixels, routed.bytes_received


@dataclass(frozen=True)
class TileRoute:
    """The text's routing method and groups, applied to tiles."""

    method: str
    position: int
    domain_group: Any
    dp_group: Any
    owner_of: Callable[[int], int]

    def __call__(self, plan: Plan, local: Mapping[int, Sample], owner: Callable) -> Any:
        owner_of = owner(self.owner_of)
        if self.method == LANE_ALL_GATHER:
            return route_by_lane_all_gather(
                plan, local, self.position, self.dp_group, owner_of, schema=PIXEL_SCHEMA
            )
        return route_samples(
            plan, local, self.position, self.domain_group, owner_of, schema=PIXEL_SCHEMA
        )


def micro_batch_images(
    group: CPGroup,
    position: int,
    tiles: BatchTiles,
    routed: Mapping[int, torch.Tensor],
    spec: VisionSpec,
    cp_group: Any,
) -> Tuple[torch.Tensor, VisionShare]:
    """This rank's tiles of one micro-batch ``[n_local, C, H, W]`` and its :class:`VisionShare`."""
    shares = tile_shares(group, tiles)
    mine = shares[position]
    device = next(iter(routed.values())).device if routed else torch.device("cpu")
    if mine:
        stacked = torch.stack([routed[t] for t in mine]).view(len(mine), *spec.tile_shape)
    else:
        stacked = torch.zeros((0, *spec.tile_shape), device=device)
    group_tiles = sum(len(share) for share in shares.values())
    share = VisionShare.of(group_tiles, group.size, group.ranks.index(position), cp_group)
    assert share.local_tiles == len(mine), "tile shares and the vision share disagree"
    return stacked, share


def offset_slots(
    samples: Sequence[Sample], tile_counts: Sequence[int], spec: VisionSpec
) -> List[Sample]:
    """The group's samples (pack order) with ``vision_slot`` numbering the group's image tokens:
    sample ``i``'s slots shifted by the image tokens of the samples before it."""
    shifted, offset = [], 0
    for sample, count in zip(samples, tile_counts):
        slot = sample[VISION_SLOT]
        moved = torch.where(slot > 0, slot + offset, slot) if offset else slot
        shifted.append({**sample, VISION_SLOT: moved})
        offset += count * spec.tokens_per_tile
    return shifted
