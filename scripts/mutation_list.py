"""The mutants of ``scripts/mutation_check.py``: one realistic one-line mistake each.

``original`` is an exact snippet of ``path`` that must occur there exactly once (a few carry
their neighbouring line to be unique); ``replacement`` takes its place; ``tests`` are the test
files or node ids a developer would expect to catch the mistake (run with ``-x``, so narrow and
fast to fail). ``tests/unit/test_mutation_check.py`` checks every entry against its file; when
the code changes, update the entry (or drop it, saying why in tests/README.md).
"""

from __future__ import annotations

from mutation_list_rl import RL_MODEL_MUTANTS
from mutation_list_tools import CHECK_MUTANTS, COST_MUTANTS
from mutation_list_vlm import VLM_MUTANTS
from mutation_types import PATCHES, Mutant


RUNTIME = "megatron_dcp/runtime/"
PACKING_TESTS = ("tests/distributed/test_packing.py",)
EXCHANGE_TESTS = ("tests/distributed/test_exchange.py",)
ROUTING_TESTS = ("tests/distributed/test_routing.py", "tests/distributed/test_exchange.py")
ATTENTION_TESTS = ("tests/integration/test_reference_attention.py",)
GROUPS_TESTS = ("tests/distributed/test_groups.py",)
PATCH_TESTS = "tests/integration/test_patches.py"
MTP_ORACLE = "tests/integration/test_mtp_oracle.py"
DCP_ORACLE = "tests/integration/test_dcp_oracle.py"
ORACLE_CP2 = f"{DCP_ORACLE}::test_dcp_step_equals_single_process[tp1pp1dp2cp2-default_dynamic_cp]"
ORACLE_SFT = f"{DCP_ORACLE}::test_sft_masks_divide_by_the_assistant_tokens[tp1pp1dp2cp2]"
RL_TESTS = ("tests/integration/test_rl_adapter.py",)
HYBRID_DCP = "tests/integration/test_dcp_hybrid.py::test_hybrid_step_equals_single_process"
VALIDATE_TESTS = ("tests/unit/scheduling/test_plan_validate.py",)
BF16_ORACLE = "tests/integration/test_bf16_oracle.py::"

RUNTIME_MUTANTS = (
    Mutant(
        "packing-pad-multiple",
        RUNTIME + "packing.py",
        "base = 2 * cp_size if cp_size > 1 else 1",
        "base = cp_size if cp_size > 1 else 1",
        PACKING_TESTS,
        "sequences padded to cp_size, not 2·cp_size: the zigzag chunks do not divide them",
    ),
    Mutant(
        "packing-zigzag-mirror",
        RUNTIME + "packing.py",
        "for index in (cp_rank, 2 * cp_size - 1 - cp_rank):",
        "for index in (cp_rank, 2 * cp_size - 2 - cp_rank):",
        PACKING_TESTS,
        "off-by-one in the mirrored zigzag chunk: a rank takes its neighbour's second chunk",
    ),
    Mutant(
        "packing-keep-empty",
        RUNTIME + "packing.py",
        "kept = [(s, n) for s, n in zip(samples, lengths) if n > 0]",
        "kept = [(s, n) for s, n in zip(samples, lengths) if n >= 0]",
        PACKING_TESTS,
        "zero-length samples kept: empty sequences in cu_seqlens",
    ),
    Mutant(
        "packing-padding-carries-loss",
        RUNTIME + "packing.py",
        '"loss_mask": _pad(sample["loss_mask"].reshape(-1).float(), extra, 0),',
        '"loss_mask": _pad(sample["loss_mask"].reshape(-1).float(), extra, 1),',
        PACKING_TESTS,
        "padding tokens padded with loss_mask 1: they enter the loss and the token count",
    ),
    Mutant(
        "packing-num-tokens-counts-padding",
        RUNTIME + "packing.py",
        "        return (self.loss_mask != 0).sum()",
        "        return (self.loss_mask == self.loss_mask).sum()",
        PACKING_TESTS,
        "PackedMicroBatch.loss_tokens counts every local token, padding and masked ones included",
    ),
    Mutant(
        "exchange-ids-of-off-by-one",
        RUNTIME + "exchange.py",
        "start = sum(self.counts[:dp_rank])",
        "start = sum(self.counts[: dp_rank + 1])",
        EXCHANGE_TESTS,
        "a DP rank's global sample ids start after its own samples, not before",
    ),
    Mutant(
        "exchange-padding-leaks",
        RUNTIME + "exchange.py",
        "for n in row[:c].tolist()]",
        "for n in row.tolist()]",
        EXCHANGE_TESTS,
        "the zero padding of the length all-gather becomes extra samples of length 0",
    ),
    Mutant(
        "routing-sender-not-spread",
        RUNTIME + "routing.py",
        "key=lambda p: (sent_tokens[p], p))",
        "key=lambda p: (p, sent_tokens[p]))",
        ROUTING_TESTS,
        "swapped sort key: the lowest CP rank of the owner sends every sample (no load spread)",
    ),
    Mutant(
        "routing-holders-of-sample-id",
        RUNTIME + "routing.py",
        "if dest not in holders(plan, owners[i])",
        "if dest not in holders(plan, i)",
        ROUTING_TESTS,
        "the holders of the sample id instead of its owner: local samples are sent, others not",
    ),
    Mutant(
        "routing-lane-needed-wrong-index",
        RUNTIME + "routing.py",
        "needed = set(needed_samples(plan)[position])",
        "needed = set(needed_samples(plan)[dp_rank])",
        ROUTING_TESTS,
        "lane all-gather keeps the samples of position dp_rank, not of this rank's position",
    ),
    Mutant(
        "attention-causal-excludes-self",
        RUNTIME + "attention.py",
        "mask = (keys[None, :] <= seq.query_positions[:, None])",
        "mask = (keys[None, :] < seq.query_positions[:, None])",
        ATTENTION_TESTS,
        "causal mask off by one: a query no longer attends to its own key",
    ),
    Mutant(
        "attention-kv-grad-not-reduced",
        RUNTIME + "attention.py",
        "dist.all_reduce(grad, group=ctx.group)",
        "pass",
        ATTENTION_TESTS,
        "dropped term: the K/V gradient of other ranks' queries is not summed over the CP group",
    ),
    Mutant(
        "attention-positions-not-relative",
        RUNTIME + "attention.py",
        "positions = global_rows[offset : offset + count] - start",
        "positions = global_rows[offset : offset + count]",
        ATTENTION_TESTS,
        "query positions global in the pack, not in the sequence: wrong causal mask after the "
        "first sequence",
    ),
    Mutant(
        "groups-same-block-modulo",
        RUNTIME + "groups.py",
        "position // size == self.position // size",
        "position % size == self.position % size",
        GROUPS_TESTS,
        "DCPGroups hands out its group for a position of another block",
    ),
    Mutant(
        "groups-no-size-2-blocks",
        RUNTIME + "groups.py",
        "if size > 1 for block in domain.blocks(size)]",
        "if size > 2 for block in domain.blocks(size)]",
        GROUPS_TESTS,
        "no communicators for the CP groups of 2 ranks",
    ),
    Mutant(
        "groups-reuse-one-offer",
        RUNTIME + "groups.py",
        "reused = {c for c, n in zip(candidates, counts) if n == len(c)}",
        "reused = {c for c, n in zip(candidates, counts) if n > 0}",
        GROUPS_TESTS,
        "a block is reused when any one member offers a group (the others then create none)",
    ),
    Mutant(
        "groups-budget-last-block",
        RUNTIME + "groups.py",
        "(position // s + 1) * s <= domain_size)",
        "(position // s + 1) * s < domain_size)",
        ("tests/distributed/test_group_budget.py",),
        "communicator_budget drops the last aligned block of each size",
    ),
    Mutant(
        "attention-output-compute-dtype",
        RUNTIME + "attention.py",
        'return torch.einsum("hqk,khd->qhd", probs, value.to(compute)).to(query.dtype)',
        'return torch.einsum("hqk,khd->qhd", probs, value.to(compute))',
        (f"{BF16_ORACLE}test_bf16_dcp_step_equals_single_process[dp2cp2]",),
        "the attention output left in float32 (its compute dtype) in a bf16 model",
    ),
)

PATCH_MUTANTS = (
    Mutant(
        "patch-planned-shapes-ignore-sequence-parallel",
        "megatron_dcp/integration/forward_backward.py",
        "sequence_divisor=config.tensor_model_parallel_size if config.sequence_parallel else 1,",
        "sequence_divisor=1,",
        ("tests/integration/test_pipeline_p2p.py::"
         "test_a_dcp_step_sizes_its_pipeline_messages_from_the_plan[tp2sp]",),
        "pipeline messages sized for the whole sequence under sequence parallelism, where each "
        "TP rank sends its 1/TP share",
    ),
    Mutant(
        "patch-planned-shapes-vpp-order",
        PATCHES + "pipeline_shapes.py",
        "order += [(mb, chunk) for chunk in range(num_chunks) for mb in range(first, end)]",
        "order += [(mb, chunk) for mb in range(first, end) for chunk in range(num_chunks)]",
        ("tests/integration/test_pipeline_p2p.py::"
         "test_a_dcp_step_sizes_its_pipeline_messages_from_the_plan[vpp2]",),
        "the interleaved schedule's forward order taken micro-batch by micro-batch, not each group "
        "through every chunk: messages sized for another micro-batch",
    ),
    Mutant(
        "cpu-type-names-all-float",
        "megatron_dcp/integration/cpu/parallel.py",
        'return name.replace("torch.", "torch.cuda.", 1)',
        'return "torch.cuda.FloatTensor"',
        (BF16_ORACLE + "test_bf16_adam_steps_equal_single_process[distributed_optimizer]",),
        "CudaTypeNames: every CPU tensor answers torch.cuda.FloatTensor, so both mixed-precision "
        "optimizers take bf16 parameters for float32 ones",
    ),
    Mutant(
        "patch-rope-static-cp",
        PATCHES + "cp_switching.py",
        "collection.cp = group",
        "collection.cp = module.pg_collection.cp",
        (PATCH_TESTS, ORACLE_CP2),
        "attention_rope, gpt_mtp_loss: the swapped pg_collection keeps the static CP group",
    ),
    Mutant(
        "patch-gpt-mtp-loss-wrong-target",
        PATCHES + "cp_switching.py",
        '"megatron.core.models.gpt.gpt_model:GPTModel.forward",',
        '"megatron.core.models.gpt.gpt_model:GPTModel.__init__",',
        (MTP_ORACLE,),
        "gpt_mtp_loss wraps GPTModel.__init__: process_mtp_loss rolls over the static CP group",
    ),
    Mutant(
        "patch-mtp-layer-static-cp",
        PATCHES + "cp_switching.py",
        'with swapped_attribute(module, "cp_group", group):',
        'with swapped_attribute(module, "cp_group", module.cp_group):',
        (PATCH_TESTS, MTP_ORACLE),
        "mtp_layer (and mtp_block): the MTP layer rolls input ids and positions over the static "
        "CP group",
    ),
    Mutant(
        "patch-mtp-layer-wrong-target",
        PATCHES + "cp_switching.py",
        '"megatron.core.transformer.multi_token_prediction:MultiTokenPredictionLayer.forward",',
        '"megatron.core.transformer.multi_token_prediction:MultiTokenPredictionLayer.__init__",',
        (MTP_ORACLE,),
        "mtp_layer wraps the layer's __init__: its forward rolls over the static CP group",
    ),
    Mutant(
        "patch-mamba-static-cp",
        PATCHES + "cp_switching.py",
        'with swapped_attribute(mixer, "cp", cache[id(group)][1]):',
        'with swapped_attribute(mixer, "cp", mixer.cp):',
        (PATCH_TESTS, HYBRID_DCP),
        "mamba_mixer: the Mamba all-to-alls keep the static CP group's MambaContextParallel",
    ),
    Mutant(
        "patch-gdn-static-cp",
        PATCHES + "gdn_switching.py",
        "stack.enter_context(swap_pg_collection_cp(module, group))",
        "stack.enter_context(swap_pg_collection_cp(module, module.pg_collection.cp))",
        (PATCH_TESTS, "tests/integration/test_dcp_gdn.py"),
        "gdn_context_parallel: the GDN all-to-alls keep the static CP group",
    ),
    Mutant(
        "patch-moe-router-static-group",
        PATCHES + "cp_switching.py",
        'with swapped_attribute(router, "tp_cp_group", group):',
        'with swapped_attribute(router, "tp_cp_group", static):',
        (PATCH_TESTS, "tests/integration/test_dcp_moe.py"),
        "moe_router_group: the router's statistics reduce over the static TP×CP group",
    ),
    Mutant(
        "patch-te-no-restore",
        PATCHES + "cp_switching.py",
        "            restore_te_group(cls, self, static)",
        "            pass",
        (PATCH_TESTS,),
        "te_attention: TE stays on the last micro-batch's CP group after the forward",
    ),
    Mutant(
        "patch-mtp-roll-guard-inverted",
        PATCHES + "cp_switching.py",
        "if micro_batch_cp_group(params) is not None and params.cu_seqlens_q_padded is not None:",
        "if micro_batch_cp_group(params) is None and params.cu_seqlens_q_padded is not None:",
        ("tests/distributed/test_mtp_roll.py",),
        "mtp_roll_tensor: DCP micro-batches roll by the real lengths, not the padded ones",
    ),
    Mutant(
        "patch-mtp-loss-drops-ratio",
        PATCHES + "mtp_loss.py",
        "main = mtp.MTPLossAutoScaler.apply(main, scale * ratios[index] * loss)",
        "main = mtp.MTPLossAutoScaler.apply(main, scale * loss)",
        (MTP_ORACLE,),
        "mtp_loss: dropped term, the global token ratio N / N_d of each depth",
    ),
    Mutant(
        "patch-p2p-tag-swapped",
        PATCHES + "gloo_pipeline.py",
        "(dist.isend, tensor_send_prev, prev_pipeline_rank, BACKWARD_TAG),",
        "(dist.isend, tensor_send_prev, prev_pipeline_rank, FORWARD_TAG),",
        ("tests/integration/test_pipeline_p2p.py",),
        "pipeline_p2p_tags: gradients sent back carry the forward tag (matched as activations)",
    ),
    Mutant(
        "patch-p2p-shapes-wait-sends",
        PATCHES + "gloo_pipeline.py",
        "        if not send:\n            request.wait()",
        "        if send:\n            request.wait()",
        ("tests/integration/test_pipeline_p2p.py",),
        "pipeline_p2p_shape_tags: waits for the shape sends, not the receives (deadlock, or "
        "shapes read before they arrive)",
    ),
    Mutant(
        "patch-upstream-ratios-guard-inverted",
        PATCHES + "dev_api.py",
        'if kwargs.get("forward_only") or type(data_iterator) is not LIST_ITERATOR:',
        'if kwargs.get("forward_only") or type(data_iterator) is LIST_ITERATOR:',
        ("tests/integration/test_verl_mtp.py",),
        "upstream_mtp_ratios: verl's micro-batch lists run without the global MTP ratios",
    ),
    Mutant(
        "cpu-sequence-parallel-norm-unmarked",
        "megatron_dcp/integration/cpu/parallel.py",
        "param.sequence_parallel = sequence_parallel",
        "param.sequence_parallel = False",
        ("tests/integration/test_sequence_parallel.py",),
        "sequence_parallel_torch_norm: norm gradients are not summed over TP",
    ),
    Mutant(
        "cpu-grad-clip-inverted",
        "megatron_dcp/integration/cpu/parallel.py",
        "factor = max_norm / (total_norm + 1.0e-6)",
        "factor = total_norm / (max_norm + 1.0e-6)",
        ("tests/integration/test_cpu_backend.py",),
        "cpu_grad_clipping: swapped operands, gradients scaled by total / max",
    ),
    Mutant(
        "cpu-mamba-thd-indices-mirrored",
        "megatron_dcp/integration/cpu/hybrid_stack.py",
        "indices = local_token_indices(cu_seqlens.cpu(), cp_size, cp_rank)",
        "indices = local_token_indices(cu_seqlens.cpu(), cp_size, cp_size - 1 - cp_rank)",
        (HYBRID_DCP,),
        "mamba_cp_thd_indices: the zigzag share of the mirrored CP rank",
    ),
    Mutant(
        "cpu-mamba-conv-crosses-sequences",
        "megatron_dcp/integration/cpu/mamba_kernels.py",
        "if seq_idx is not None and shift:",
        "if seq_idx is None and shift:",
        ("tests/integration/test_mamba_kernels.py",),
        "mamba_causal_conv1d_fn: the conv window crosses packed sequence boundaries",
    ),
    Mutant(
        "cpu-gdn-state-crosses-sequences",
        "megatron_dcp/integration/cpu/gdn_kernels.py",
        "bounds = [int(bound) for bound in cu_seqlens.tolist()]",
        "bounds = [0, length]",
        ("tests/integration/test_gdn_kernels.py", "tests/integration/test_dcp_gdn.py"),
        "gdn_chunk_gated_delta_rule: the delta rule's state crosses packed sequence boundaries",
    ),
    Mutant(
        "cpu-moe-split-sizes-guard-inverted",
        "megatron_dcp/integration/cpu/token_dispatcher.py",
        "if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:",
        "if not as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:",
        ("tests/integration/test_dcp_moe.py",),
        "moe_split_sizes_numpy: numpy where megatron wants tensors, tensors where it wants numpy",
    ),
    Mutant(
        "cpu-mixed-precision-optimizer-unpatched",
        PATCHES + "cpu_backend.py",
        'fp32 main copies.",\n        lambda owner, original: cuda_type_names(original),',
        'fp32 main copies.",\n        lambda owner, original: original,',
        (f"{BF16_ORACLE}test_bf16_adam_steps_equal_single_process[float16_optimizer]",),
        "mixed_precision_optimizer_cpu_params: the optimizer refuses the CPU's bf16 parameters",
    ),
)

LOSS_MUTANTS = (
    Mutant(
        "loss-sum-unmasked",
        "megatron_dcp/integration/training/forward_step.py",
        "loss_sum = (losses.float().view(-1) * loss_mask.view(-1)).sum()",
        "loss_sum = losses.float().view(-1).sum()",
        (ORACLE_CP2,),
        "dropped term: the loss sums padding and masked tokens too",
    ),
    Mutant(
        "loss-token-count-numel",
        "megatron_dcp/integration/training/forward_step.py",
        "num_tokens = loss_mask.sum().to(torch.int)",
        "num_tokens = torch.tensor(loss_mask.numel(), dtype=torch.int)",
        (ORACLE_CP2,),
        "the token count megatron divides by counts every local token, not the loss tokens",
    ),
    Mutant(
        "loss-wrapper-microbatch-count",
        "megatron_dcp/integration/forward_backward.py",
        "num_microbatches=len(batches),",
        "num_microbatches=num_microbatches,",
        (ORACLE_CP2,),
        "megatron's schedule runs this rank's sample count, not the plan's micro-batch count",
    ),
    Mutant(
        "loss-adapter-scale-swapped",
        "megatron_dcp/adapters/loss.py",
        'return (domain_size if grad_reduce == "mean" else 1) / num_tokens',
        'return (1 if grad_reduce == "mean" else domain_size) / num_tokens',
        RL_TESTS,
        "token_mean_scale: the domain-size factor on the summing all-reduce, not the averaging",
    ),
    Mutant(
        "loss-adapter-token-count-unmasked",
        "megatron_dcp/adapters/split.py",
        'return sum(int((torch.as_tensor(s["loss_mask"]) != 0).sum()) for s in samples)',
        'return sum(int(torch.as_tensor(s["loss_mask"]).numel()) for s in samples)',
        RL_TESTS,
        "the RL adapter's mini-batch token count includes masked tokens",
    ),
    Mutant(
        "loss-mtp-ratio-inverted",
        PATCHES + "mtp_loss.py",
        "return tuple(total / n if n > 0 else 0.0 for n in rolled)",
        "return tuple(n / total if n > 0 else 0.0 for n in rolled)",
        (MTP_ORACLE,),
        "swapped operands: MTP depth weighted by N_d / N instead of N / N_d",
    ),
    Mutant(
        "loss-mtp-counts-drop-last",
        PATCHES + "mtp_loss.py",
        "counts[d] += mask[d:].sum()",
        "counts[d] += mask[: mask.numel() - d].sum()",
        (MTP_ORACLE,),
        "N_d drops each sample's last d mask entries instead of its first d",
    ),
    Mutant(
        "loss-mtp-counts-not-reduced",
        PATCHES + "mtp_loss.py",
        "torch.distributed.all_reduce(counts, group=dp_group)",
        "pass",
        (MTP_ORACLE,),
        "dropped term: each DP rank weighs MTP by its own samples' ratio, not the global batch's",
    ),
)

VALIDATION_MUTANTS = (
    Mutant(
        "validate-coverage-counts-keys",
        "megatron_dcp/scheduling/plan.py",
        "if seen != expected:",
        "if len(seen) != len(expected):",
        VALIDATE_TESTS,
        "a duplicated sample passes as long as no id is missing",
    ),
    Mutant(
        "validate-partition-as-set",
        "megatron_dcp/scheduling/plan.py",
        "if covered != list(range(self.domain.size)):",
        "if set(covered) != set(range(self.domain.size)):",
        VALIDATE_TESTS,
        "overlapping CP groups pass (a position in two groups of one micro-batch)",
    ),
    Mutant(
        "validate-block-check-dropped",
        "megatron_dcp/scheduling/plan.py",
        "if ranks != block.positions or not self.domain.is_group_block(block):",
        "if ranks != block.positions:",
        VALIDATE_TESTS,
        "guard disabled: groups on blocks without a communicator (unaligned, below min_cp) pass",
    ),
    Mutant(
        "validate-idle-group-passes",
        "megatron_dcp/scheduling/plan.py",
        "if not ids:",
        "if ids is None:",
        VALIDATE_TESTS,
        "a CP group without samples (idle ranks) passes",
    ),
    Mutant(
        "validate-sample-cap-off-by-one",
        "megatron_dcp/scheduling/plan.py",
        "if cap is not None and len(ids) > cap:",
        "if cap is not None and len(ids) >= cap:",
        VALIDATE_TESTS + ("tests/unit/scheduling/test_sample_cap.py",),
        "off-by-one: a group holding exactly the sample cap is refused",
    ),
    Mutant(
        "validate-budget-off-by-one",
        "megatron_dcp/scheduling/plan.py",
        "if sum(map(seqlens.__getitem__, ids)) > budget * len(ranks):",
        "if sum(map(seqlens.__getitem__, ids)) >= budget * len(ranks):",
        VALIDATE_TESTS,
        "off-by-one: a group filled exactly to its budget is refused",
    ),
    Mutant(
        "validate-vpp-operands-swapped",
        "megatron_dcp/scheduling/plan.py",
        "if k and self.num_microbatches % k:",
        "if k and k % self.num_microbatches:",
        VALIDATE_TESTS,
        "swapped operands: the micro-batch count is checked as a divisor of the VPP group size",
    ),
)

MUTANTS = (
    RUNTIME_MUTANTS + PATCH_MUTANTS + LOSS_MUTANTS + RL_MODEL_MUTANTS + VALIDATION_MUTANTS
    + CHECK_MUTANTS + COST_MUTANTS + VLM_MUTANTS
)  # fmt: skip
