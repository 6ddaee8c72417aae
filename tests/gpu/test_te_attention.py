"""On GPUs: megatron's Transformer Engine attention under DCP equals the pure-torch reference.

``TEDotProductAttention`` (with ``apply_patches()``) and ``ReferenceCoreAttention`` (the CPU
oracle's attention, ``runtime.attention``) run the same packed THD micro-batches, one module
instance each for a whole step: one micro-batch per DCP group size of the domain (1, 2, 4, ...,
the whole domain), one mixing a large group with groups of one, then a static-CP micro-batch
(which must find TE back on the static CP group). Inputs, ``PackedSeqParams``, zigzag slicing and
padding to ``2·cp`` come from the plugin's own code (``pack_samples``, ``packed_seq_params_of``,
``create_dcp_groups``). Layouts: those of the CPU oracle (``tests/integration``), at the level of
one attention layer: PP and VPP only change which layers a rank holds, so ``pp`` is kept (it
changes the groups) and VPP is left out; plus GQA / MQA and a domain without static CP.

Precision: TE runs in bf16; the reference runs in fp32 on the bf16 inputs upcast. Compared on the
real (non-padding) tokens of every rank: the output within ``OUTPUT_TOL`` (rtol = atol, elementwise)
and a relative RMS error ``OUTPUT_RMS``; the q/k/v gradients within ``GRAD_TOL`` (atol scaled by
the largest reference value) and ``GRAD_RMS``. Those are the order of TE's own bf16 attention
tolerances (bf16 keeps 8 significant bits: 3.9e-3 relative rounding per value). Padding rows: TE's
output must be finite (the masked loss multiplies it by 0) and its gradients exactly 0, because the
output gradient there is 0 and any other value would reach the weight gradients through the QKV
projection.

Runs on the NCCL harness, one GPU per rank; a layout needing more GPUs than visible is skipped.
CUDA must not be initialised in the pytest process (the workers are forked): GPU counts come from
``cuda_device_count`` (NVML), and megatron / TE are imported inside the workers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any, Sequence

import pytest
import torch

from megatron_dcp.runtime.packing import zigzag_slice
from megatron_dcp.scheduling import Block, Domain
from megatron_dcp.tools.launching.local_ranks import cuda_device_count, run_distributed

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
GPUS = cuda_device_count()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        GPUS == 0 or not HAVE_TE,
        reason="needs a CUDA GPU and transformer_engine (TE attention vs the reference); "
        f"found {GPUS} GPUs, transformer_engine {'installed' if HAVE_TE else 'not installed'}",
    ),
]

HEADS, HEAD_DIM = 8, 64
# Every window of three (see lengths_for) holds a sequence long enough to give every rank of a
# group of 8 real tokens; odd lengths and 1 exercise the padding to 2·cp.
LENGTHS = (120, 37, 1, 64, 9, 200)
OUTPUT_TOL, OUTPUT_RMS = 2.5e-2, 1e-2
GRAD_TOL, GRAD_RMS = 3.5e-2, 2e-2


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 2
    world: int = 4
    kv_heads: int = HEADS

    @property
    def domain(self) -> int:
        """DP×CP positions: the ranks DCP groups are drawn from."""
        return self.world // (self.tp * self.pp)

    def __str__(self) -> str:
        gqa = f"kv{self.kv_heads}" if self.kv_heads != HEADS else ""
        return f"tp{self.tp}pp{self.pp}dp{self.domain // self.cp}cp{self.cp}{gqa}"


LAYOUTS = [
    Layout(cp=2, world=2),  # dp1·cp2: groups 1 and 2
    Layout(cp=1, world=2),  # dp2·cp1: CP only through DCP (TE's cp stream made by the patch)
    Layout(cp=2, world=4),  # dp2·cp2: groups 1, 2, 4
    Layout(cp=2, world=4, kv_heads=2),  # GQA
    Layout(cp=2, world=4, kv_heads=1),  # MQA
    Layout(tp=2, cp=2, world=4),
    Layout(tp=2, cp=2, world=4, kv_heads=2),  # GQA under TP: one K/V head per TP rank
    Layout(pp=2, cp=2, world=4),
    Layout(cp=2, world=6),  # dp3·cp2: a domain of 6, groups 1, 2, 4, 6
    Layout(cp=4, world=8),  # dp2·cp4: groups up to 8
    Layout(pp=2, cp=2, world=8),
    Layout(tp=2, pp=2, cp=2, world=8),
]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as one rank sees it: its group's packed layout and this rank's share."""

    name: str
    params: Any  # PackedSeqParams, tensors on this rank's GPU
    cu_seqlens: torch.Tensor  # global, CPU
    cu_seqlens_padded: torch.Tensor  # global, CPU
    group_size: int
    group_rank: int
    seed: int  # of the group's global inputs (the same on every rank of the group)


def domain_of(size: int) -> Domain:
    """The scheduling domain of ``size`` positions (its group sizes and aligned blocks)."""
    return Domain(dp_size=size, cp_size=1, max_seqlen_per_dp_cp_rank=1)


def partition(domain: Domain, largest: int) -> tuple[Block, ...]:
    """The domain cut, left to right, into the largest group blocks of at most ``largest``."""
    blocks: list[Block] = []
    while not blocks or blocks[-1].stop < domain.size:
        start = blocks[-1].stop if blocks else 0
        fits = [s for s in domain.group_sizes if s <= largest]
        size = max(s for s in fits if domain.is_group_block(Block(start, s)))
        blocks.append(Block(start, size))
    return tuple(blocks)


def step_partitions(size: int) -> list[tuple[Block, ...]]:
    """The micro-batches of one step: the whole domain, a large group beside groups of one, then
    every group size ascending; so TE switches between groups of every size and no CP."""
    domain = domain_of(size)
    first = max((s for s in domain.group_sizes if s < size), default=size)
    mixed = (Block(0, first),) + tuple(Block(p, 1) for p in range(first, size))
    steps = [partition(domain, size), mixed]
    steps += [partition(domain, s) for s in domain.group_sizes]
    return list(dict.fromkeys(steps))  # unique, in order


def lengths_for(index: int, start: int) -> tuple[int, ...]:
    """Sample lengths of one group: three of LENGTHS, rotated by micro-batch and block."""
    return tuple(LENGTHS[(index + start + i) % len(LENGTHS)] for i in range(3))


def dummy_samples(lengths: Sequence[int]) -> list[dict[str, torch.Tensor]]:
    """Samples of the given lengths: only their lengths matter to attention."""
    return [
        {
            "tokens": torch.zeros(n, dtype=torch.long),
            "labels": torch.zeros(n, dtype=torch.long),
            "loss_mask": torch.ones(n),
        }
        for n in lengths
    ]


def device() -> torch.device:
    """This rank's GPU (the harness set it from the rank)."""
    return torch.device("cuda", torch.cuda.current_device())


def on_device(params: Any) -> Any:
    """``PackedSeqParams`` with its ``cu_seqlens*`` on this rank's GPU, where TE needs them."""
    moved = {
        field.name: getattr(params, field.name).to(device())
        for field in dataclasses.fields(params)
        if field.name.startswith("cu_seqlens") and getattr(params, field.name) is not None
    }
    return dataclasses.replace(params, **moved)


def micro_batch(
    name: str, lengths: Sequence[int], size: int, rank: int, group: Any, dynamic: bool, seed: int
) -> MicroBatch:
    """Pack and describe one micro-batch exactly as ``integration.forward_backward`` does."""
    from megatron_dcp.integration.forward_backward import packed_seq_params_of
    from megatron_dcp.runtime.packing import pack_samples, padding_multiple

    packed = pack_samples(dummy_samples(lengths), size, rank, padding_multiple(size))
    params = on_device(packed_seq_params_of(packed, group, dynamic=dynamic))
    return MicroBatch(name, params, packed.cu_seqlens, packed.cu_seqlens_padded, size, rank, seed)


def dcp_micro_batches(groups: Any) -> list[MicroBatch]:
    """This rank's micro-batch of every partition of ``step_partitions``, on its DCP group."""
    from megatron_dcp.scheduling import CPGroup

    batches = []
    for index, blocks in enumerate(step_partitions(groups.domain_size)):
        block = next(b for b in blocks if b.start <= groups.position < b.stop)
        group = groups.group_for(CPGroup(block.positions, ()))
        name = f"micro-batch {index} (groups {[b.size for b in blocks]}, this one {block.size})"
        lengths = lengths_for(index, block.start)
        rank = groups.position - block.start
        seed = 1000 * index + block.start
        batches.append(micro_batch(name, lengths, block.size, rank, group, True, seed))
    return batches


def static_micro_batch() -> MicroBatch:
    """A micro-batch without DCP parameters, on megatron's static CP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    size = parallel_state.get_context_parallel_world_size()
    rank = parallel_state.get_context_parallel_rank()
    first = dist.get_process_group_ranks(parallel_state.get_context_parallel_group())[0]
    name = f"static-CP micro-batch (cp {size}) after the DCP ones"
    return micro_batch(name, LENGTHS[:4], size, rank, None, False, 99_000 + first)


def real_rows(cu_seqlens_padded: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool over the global padded packed sequence: True on real tokens."""
    real = torch.zeros(int(cu_seqlens_padded[-1]), dtype=torch.bool)
    starts = cu_seqlens_padded[:-1].tolist()
    for start, length in zip(starts, (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()):
        real[start : start + length] = True
    return real


def local_inputs(batch: MicroBatch, layout: Layout) -> tuple[list[torch.Tensor], torch.Tensor]:
    """This rank's bf16 q, k, v (``[t, h, d]``, its TP heads, its zigzag share) and output
    gradient (``[t, h*d]``, 0 on padding rows), cut from the group's global random tensors."""
    from megatron.core import parallel_state

    total = int(batch.cu_seqlens_padded[-1])
    generator = torch.Generator().manual_seed(batch.seed)
    heads = (HEADS, layout.kv_heads, layout.kv_heads, HEADS)
    q, k, v, grad = (torch.randn(total, h, HEAD_DIM, generator=generator) for h in heads)
    grad[~real_rows(batch.cu_seqlens_padded, batch.cu_seqlens)] = 0
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    local = []
    for tensor in (q, k, v, grad):
        mine = tensor.chunk(layout.tp, dim=1)[tp_rank]
        share = zigzag_slice(mine, batch.cu_seqlens_padded, batch.group_size, batch.group_rank)
        local.append(share.to(device=device(), dtype=torch.bfloat16).contiguous())
    return local[:3], local[3].flatten(1)


def forward_backward(
    module: torch.nn.Module, qkv: Sequence[torch.Tensor], grad: torch.Tensor, params: Any
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output ``[t, h*d]`` and q/k/v gradients of one core-attention call, as fp32."""
    from megatron.core.transformer.enums import AttnMaskType

    leaves = [tensor.detach().clone().requires_grad_() for tensor in qkv]
    output = module(
        *leaves, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params
    ).reshape(leaves[0].shape[0], -1)
    output.backward(grad.to(output.dtype))
    return output.detach().float(), [leaf.grad.float() for leaf in leaves]


def assert_bf16_close(
    actual: torch.Tensor, expected: torch.Tensor, tol: float, rms: float, what: str
) -> None:
    """Elementwise (atol scaled by the largest expected value) and relative-RMS agreement."""
    if expected.numel() == 0:
        return
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(
        actual, expected, rtol=tol, atol=tol * scale, msg=lambda message: f"{what}: {message}"
    )
    error = (actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp(1e-12)
    assert error.item() <= rms, f"{what}: relative RMS error {error.item():.2e} > {rms}"


def compare(
    te: torch.nn.Module, reference: torch.nn.Module, batch: MicroBatch, layout: Layout
) -> None:
    """TE (bf16) vs the reference (fp32, same inputs) on one micro-batch; see the docstring."""
    qkv, grad = local_inputs(batch, layout)
    te_out, te_grads = forward_backward(te, qkv, grad, batch.params)
    qkv32 = [tensor.float() for tensor in qkv]
    ref_out, ref_grads = forward_backward(reference, qkv32, grad.float(), batch.params)
    real = real_rows(batch.cu_seqlens_padded, batch.cu_seqlens)
    real = zigzag_slice(real, batch.cu_seqlens_padded, batch.group_size, batch.group_rank)
    real = real.to(device())
    where = f"{layout} {batch.name}"
    assert_bf16_close(te_out[real], ref_out[real], OUTPUT_TOL, OUTPUT_RMS, f"{where}: output")
    assert torch.isfinite(te_out[~real]).all(), f"{where}: non-finite TE output on padding"
    for name, te_grad, ref_grad in zip("qkv", te_grads, ref_grads):
        what = f"{where}: d{name}"
        assert_bf16_close(te_grad[real], ref_grad[real], GRAD_TOL, GRAD_RMS, what)
        padding = te_grad[~real].abs()
        assert padding.count_nonzero() == 0, f"{what} on padding rows: max {padding.max()}, not 0"


def attention_config(layout: Layout) -> Any:
    """One bf16 attention layer's TransformerConfig for ``layout`` (no dropout)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=layout.pp,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=layout.kv_heads,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        pipeline_dtype=torch.bfloat16,
        params_dtype=torch.bfloat16,
        bf16=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )


def build_te_attention(config: Any) -> torch.nn.Module:
    """megatron's ``TEDotProductAttention``, causal self-attention, built as ``Attention`` does."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    return TEDotProductAttention(config, 1, AttnMaskType.causal, "self", cp_comm_type="p2p")


def build_reference(config: Any) -> torch.nn.Module:
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dcp.integration.cpu.core_attention import ReferenceCoreAttention

    return ReferenceCoreAttention(config, 1, AttnMaskType.causal, "self")


def compare_worker(rank: int, world_size: int, layout: Layout) -> list[int]:
    """Every micro-batch of a step on this rank, TE vs the reference; returns the sizes of the
    DCP groups this rank ran on."""
    from megatron_dcp.integration.megatron_import import import_megatron_core

    import_megatron_core()
    from megatron.core import parallel_state

    from megatron_dcp.integration.patches import apply_patches
    from megatron_dcp.integration.process_groups import create_dcp_groups

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
    )
    apply_patches()
    config = attention_config(layout)
    te, reference = build_te_attention(config), build_reference(config)
    groups = create_dcp_groups()
    batches = dcp_micro_batches(groups) + [static_micro_batch()]
    for batch in batches:
        compare(te, reference, batch, layout)
    groups.destroy()
    return [batch.group_size for batch in batches[:-1]]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_te_attention_equals_reference(layout: Layout) -> None:
    if layout.world > GPUS:
        pytest.skip(f"{layout} needs {layout.world} GPUs (one per rank), {GPUS} visible")
    results = run_distributed(compare_worker, layout.world, layout, backend="nccl", timeout_s=600)
    expected = set(domain_of(layout.domain).group_sizes)
    assert {size for sizes in results for size in sizes} == expected
