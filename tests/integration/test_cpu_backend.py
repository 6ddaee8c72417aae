"""CPU backend shims, the tiny-GPT fixtures, and the headline check: a megatron GPT on packed THD
samples with static CP (cp2, tp2·cp2) equals the single-process, un-packed, no-CP run."""

import warnings

import pytest
import torch
import torch.distributed as dist

from megatron_dcp.integration.cpu.core_attention import ReferenceCoreAttention, with_core_attention
from megatron_dcp.integration.cpu.fallback_warnings import ignore_missing_te_apex_warnings
from megatron_dcp.integration.patches import (
    cpu_backend_enabled,
    disable_cpu_backend,
    enable_cpu_backend,
)
from megatron_dcp.runtime.packing import zigzag_slice
from megatron_dcp.testing import run_distributed
from megatron_dcp.testing.dcp_step import DCPStepResult
from megatron_dcp.testing.gpt import (
    TinyGPTOptions,
    build_tiny_gpt,
    gather_full_tensors,
    init_megatron,
    make_samples,
    packed_loss_and_backward,
    parallel_state,
    single_process_reference,
    tiny_gpt_config,
)
from megatron_dcp.testing.oracle import assert_step_matches
from megatron_dcp.testing.plan_coverage import Layout, RanPlan, assert_covers, parallel_layout

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backend only without CUDA")

LENGTHS = [13, 5, 32, 1, 20, 0]


def test_cuda_devices_become_cpu(cpu_backend):
    assert cpu_backend and enable_cpu_backend()  # idempotent
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.arange(3, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert not torch.tensor([1], pin_memory=True, device="cuda").is_pinned()
    assert torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.ones(2).to(device=torch.cuda.current_device()).device.type == "cpu"


def test_streams_events_and_synchronize_are_no_ops(cpu_backend):
    stream = torch.cuda.Stream()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.stream(stream):
        event = torch.cuda.Event()
        event.record()
    event.synchronize()
    torch.cuda.synchronize()


def test_cuda_rng_is_the_cpu_generator(cpu_backend):
    torch.cuda.manual_seed(3)
    state = torch.cuda.get_rng_state()
    first = torch.rand(4)
    torch.cuda.set_rng_state(state)
    assert torch.equal(first, torch.rand(4))


def warning_shown(message: str, module: str) -> bool:
    """Whether ``message``, warned from ``module``, is shown once the CPU backend's filter is in
    place (every warning shown otherwise); the filters are restored afterwards."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ignore_missing_te_apex_warnings()
        warnings.warn_explicit(message, UserWarning, "module.py", 1, module=module)
    return len(seen) == 1


def test_only_megatrons_warnings_that_te_and_apex_are_missing_are_muted(monkeypatch):
    optimizers = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    moe = "Only transformer-engine>=1.7.0 supports MoE experts, but your version is {}. Use local "
    assert not warning_shown(optimizers, "megatron.core.optimizer")
    assert not warning_shown("Apex is not installed. Falling back to Torch Norm", "megatron.core")
    assert not warning_shown(moe.format("0.0.0"), "megatron.core.extensions.te_spec_provider")
    assert warning_shown(moe.format("1.6.0"), "megatron.core.extensions.te_spec_provider")
    assert warning_shown(optimizers, "another_package")
    assert warning_shown("absl.logging is not installed.", "megatron.core.hyper_comm_grid")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert warning_shown(optimizers, "megatron.core.optimizer")


def test_disable_restores_torch_cuda():
    was_enabled = cpu_backend_enabled()
    enable_cpu_backend()
    disable_cpu_backend()
    assert not cpu_backend_enabled()
    assert torch.cuda.current_device.__module__ == "torch.cuda"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    if was_enabled:
        enable_cpu_backend()


def test_grad_clipping_scales_by_max_norm_over_the_total_norm():
    """cpu_grad_clipping, megatron's rule: gradients times max_norm / (total_norm + 1e-6) when
    the total norm exceeds max_norm, unchanged otherwise."""
    from megatron_dcp.integration.cpu.parallel import clip_grad_by_total_norm_cpu
    from megatron_dcp.integration.patches import entries

    grads = [torch.tensor([3.0, 0.0, 4.0]), torch.tensor([1.0, 2.0, 2.0])]
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    clip_grad_by_total_norm_cpu(params, max_norm=20.0, total_norm=10.0)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    clip_grad_by_total_norm_cpu(params, max_norm=1.0, total_norm=10.0)
    for param, grad in zip(params, grads):
        torch.testing.assert_close(param.grad, grad / (10.0 + 1e-6))
    (entry,) = [e for e in entries("cpu_training") if e.name == "cpu_grad_clipping"]
    assert entry.replace(None, None) is clip_grad_by_total_norm_cpu


def _seeded_tracker(rank, world_size):
    """megatron's rng tracker seeds, forks and restores (through the CPU generator)."""
    from megatron.core import tensor_parallel

    init_megatron(seed=7)
    before = torch.get_rng_state()
    with tensor_parallel.get_cuda_rng_tracker().fork():
        inside = torch.rand(3)
    assert torch.equal(before, torch.get_rng_state())
    return inside


def test_model_parallel_cuda_manual_seed_works_on_cpu():
    first, second = run_distributed(_seeded_tracker, 1)[0], run_distributed(_seeded_tracker, 1)[0]
    assert torch.equal(first, second)


def _full_weights(rank, world_size, tp, pp, vpp):
    init_megatron(tp=tp, pp=pp, vpp=vpp)
    chunks = build_tiny_gpt(tp=tp, pp=pp, vpp=vpp, options=TinyGPTOptions(num_layers=4))
    return gather_full_tensors(chunks, select=lambda p: p.detach(), reduce_dp_cp=False)


@pytest.mark.parametrize("tp,pp,vpp", [(2, 2, None), (1, 2, 2)], ids=["tp2pp2", "pp2vpp2"])
def test_every_layout_starts_from_the_same_weights(tp, pp, vpp):
    (single,) = run_distributed(_full_weights, 1, 1, 1, None)
    sharded = run_distributed(_full_weights, tp * pp, tp, pp, vpp)[0]
    assert set(sharded) == set(single)
    for name, tensor in single.items():
        assert torch.equal(sharded[name], tensor), name


def _packed_static_cp(rank, world_size, samples, tp, cp, options):
    init_megatron(tp=tp, cp=cp, seed=options.seed)
    (model,) = build_tiny_gpt(tp=tp, cp=cp, options=options)
    loss, tokens = packed_loss_and_backward(model, samples, tp)
    totals = torch.tensor([loss.item(), float(tokens)], dtype=torch.float64)
    dist.all_reduce(totals, group=parallel_state.get_context_parallel_group())
    ran = RanPlan((parallel_state.get_context_parallel_world_size(),), 1, parallel_layout())
    return totals[0].item(), int(totals[1].item()), gather_full_tensors([model]), ran


def _assert_matches(result, reference):
    """Within the oracle's derived tolerances (``testing.oracle``)."""
    loss, tokens, grads, ran = result
    step = DCPStepResult(loss, tokens, ran.cp_sizes, ran.num_microbatches, grads, ran.layout)
    assert_step_matches(step, reference)


@pytest.mark.parametrize(
    "tp,cp,query_groups,lengths",
    [(1, 2, None, LENGTHS), (2, 2, None, LENGTHS), (1, 2, 2, LENGTHS), (1, 2, None, [0])],
    ids=["cp2", "tp2cp2", "cp2gqa", "cp2empty"],
)
def test_packed_static_cp_equals_single_process(tp, cp, query_groups, lengths):
    options = TinyGPTOptions(num_query_groups=query_groups)
    samples = make_samples(lengths)
    reference = single_process_reference(samples, options)
    results = run_distributed(_packed_static_cp, tp * cp, samples, tp, cp, options)
    assert_covers([r[-1] for r in results], Layout(tp=tp, cp=cp), cp_sizes={cp})  # static CP
    for result in results:
        _assert_matches(result, reference)


def _unpacked_static_cp(rank, world_size, samples, cp, options):
    """Megatron's non-packed CP: each batch row one sequence, zigzag-sliced; no PackedSeqParams."""
    init_megatron(cp=cp, seed=options.seed)
    (model,) = build_tiny_gpt(cp=cp, options=options)
    cp_rank = parallel_state.get_context_parallel_rank()
    cu = torch.tensor([0, samples[0]["tokens"].numel()], dtype=torch.int32)
    local = {
        key: torch.stack([zigzag_slice(sample[key], cu, cp, cp_rank) for sample in samples])
        for key in samples[0]
    }
    positions = zigzag_slice(torch.arange(int(cu[1])), cu, cp, cp_rank).expand_as(local["tokens"])
    losses = model(local["tokens"], positions, None, labels=local["labels"])
    loss = (losses * local["loss_mask"]).sum()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=parallel_state.get_context_parallel_group())
    ran = RanPlan((parallel_state.get_context_parallel_world_size(),), 1, parallel_layout())
    return total.item(), gather_full_tensors([model]), ran


def test_unpacked_static_cp_equals_single_process():
    options = TinyGPTOptions()
    samples = make_samples([16, 16])
    reference = single_process_reference(samples, options)
    loss, grads, ran = run_distributed(_unpacked_static_cp, 2, samples, 2, options)[0]
    assert_covers(ran, Layout(cp=2), cp_sizes={2})  # static CP
    _assert_matches((loss, reference.num_tokens, grads, ran), reference)


def _module_classes(spec):
    """Every module class named anywhere in a spec tree."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, (list, tuple)):
        return [m for item in spec for m in _module_classes(item)]
    if isinstance(spec, ModuleSpec):
        return [spec.module] + _module_classes(spec.submodules)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return [m for f in dataclasses.fields(spec) for m in _module_classes(getattr(spec, f.name))]
    return [spec] if isinstance(spec, type) else []


def _mtp_spec_classes(rank, world_size):
    """Module classes of the local MTP block spec, before and after patching; and of a built
    tiny GPT with one MTP layer."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )

    init_megatron()
    config = tiny_gpt_config(1, 1, 1, None, TinyGPTOptions(mtp_layers=1))
    mtp_spec = get_gpt_mtp_block_spec(config, get_gpt_layer_local_spec(), False)
    (model,) = build_tiny_gpt(mtp_layers=1)
    built = {type(module) for module in model.mtp.modules()}
    return _module_classes(mtp_spec), _module_classes(with_core_attention(mtp_spec)), built


def test_mtp_block_spec_gets_reference_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    original, patched, built = run_distributed(_mtp_spec_classes, 1)[0]
    assert DotProductAttention in original
    assert DotProductAttention not in patched and ReferenceCoreAttention in patched
    assert ReferenceCoreAttention in built and DotProductAttention not in built


def test_reference_attention_rejects_dropout():
    config = tiny_gpt_config(1, 1, 1, None, TinyGPTOptions())
    config.attention_dropout = 0.1
    from megatron.core.transformer.enums import AttnMaskType

    with pytest.raises(ValueError, match="attention-dropout"):
        ReferenceCoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=object())
