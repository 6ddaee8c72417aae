"""verl 0.9.1's own dynamic-CP path on megatron-core 0.19.2, backed by megatron_dcp (gloo, CPU).

Each rank does what verl's Megatron engine does with a replicated batch (the calls are verl's,
from the installed wheel): ``DynamicCPScheduler.schedule`` (which asks megatron-core for
``DefaultDynamicCPScheduler``) → per micro-batch ``preprocess_thd_engine(local_cp_size=k)``
(which asks for ``get_dynamic_data_context_parallel_groups``) → the tiny megatron GPTModel on the
CPU backend, forward and backward of verl's per-token loss (the global loss-token count, never
all-reduced: the batch is replicated) → ``postprocess_thd_engine`` → ``postprocess_dynamic_cp_batch``.
Per-sample log-probs must equal a single-process no-CP run (1e-5) and so must the gradients
(1e-4); megatron_dcp's own RL adapter must give the same numbers on the same batch. At TP 2
(8 ranks, TP 2 × DP×CP 4) the same holds against the single-process run. Every case checks
verl's padding contract on every rank for every micro-batch (``packing_agrees``: 2·TP·CP).
Dropout is off in the tiny GPT: equality of runs is claimed only so.

Not verl's: the engine object (``MegatronEngine`` needs a model bridge and HF weights to build),
so its ``forward_backward_batch`` is not called; the loss is written here as that method's
per-token regime computes it. No device helper is stubbed: the calls above run on CPU as they are.
"""

import dataclasses
from typing import Sequence

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")
for extra_module in ("verl", "tensordict"):
    pytest.importorskip(
        extra_module, reason="needs the `verl` extra (scripts/setup_env.sh installs it)"
    )

import torch  # noqa: E402
from test_rl_adapter import OPTIONS, adapter_step, random_lengths, reference_step  # noqa: E402
from verl.models.mcore.util import postprocess_thd_engine, preprocess_thd_engine  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.dynamic_cp_scheduler import (  # noqa: E402
    DCP_GROUP_LEADER,
    DCP_LOCAL_NUM_TOKENS,
    DCP_PADDING_MASK,
    DCP_SAMPLE_IDS,
    DynamicCPScheduler,
    postprocess_dynamic_cp_batch,
)

import megatron_dcp  # noqa: E402
from megatron_dcp.integration.patches import enable_cpu_backend  # noqa: E402
from megatron_dcp.runtime.packing import pack_samples, padded_length, padding_multiple  # noqa: E402
from megatron_dcp.testing.gpt import build_tiny_gpt, gather_full_tensors, make_samples  # noqa: E402
from megatron_dcp.testing.plan_coverage import (  # noqa: E402
    Layout,
    RanPlan,
    assert_covers,
    parallel_layout,
)

TIMEOUT_S = 120


@dataclasses.dataclass(frozen=True)
class VerlResult:
    log_probs: list = dataclasses.field(repr=False)
    grads: dict = dataclasses.field(repr=False)
    losses: list
    num_tokens: int
    packing: tuple[dict, ...]  # packing_agrees per micro-batch
    cp_sizes: tuple[int, ...]  # this rank's CP size in each micro-batch of verl's plan
    num_microbatches: int
    layout: Layout


def verl_batch(samples: Sequence[dict]):
    """verl's batch layout: jagged nested tensors, one row per sample."""
    from tensordict import TensorDict

    def nested(name):
        return torch.nested.as_nested_tensor([s[name] for s in samples], layout=torch.jagged)

    fields = {name: nested(name) for name in ("labels", "loss_mask")}
    return TensorDict({"input_ids": nested("tokens"), **fields}, batch_size=[len(samples)])


def init_verl_megatron(cp: int, tp: int = 1) -> None:
    """What verl's engine does on start-up, in its order, with the upstream API installed."""
    from megatron.core import parallel_state, tensor_parallel

    enable_cpu_backend()
    megatron_dcp.install_upstream_api()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp, dynamic_context_parallel=True
    )
    tensor_parallel.model_parallel_cuda_manual_seed(OPTIONS.seed)


def verl_forward_backward(model, samples: Sequence[dict], budget: int):
    """What verl's ``forward_backward_batch`` does under DCP, on this rank: its micro-batches
    and the merged outputs of ``postprocess_dynamic_cp_batch``."""
    from megatron.core import parallel_state as mpu

    batch = verl_batch(samples)
    dcp_group = mpu.get_data_parallel_group(with_context_parallel=True)
    scheduler = DynamicCPScheduler(
        max_seqlen_per_dp_cp_rank=budget,
        dp_size=mpu.get_data_parallel_world_size(),
        cp_size=mpu.get_context_parallel_world_size(),
    )
    micro_batches = scheduler.schedule(
        batch, dcp_group, tp_size=mpu.get_tensor_model_parallel_world_size()
    )
    # verl #5983: under DCP the replicated batch's count is already global (no DP all-reduce).
    num_tokens = int(batch["loss_mask"].values().sum())
    outputs = [micro_batch_step(model, mb, num_tokens) for mb in micro_batches]
    return micro_batches, postprocess_dynamic_cp_batch(outputs, len(batch), dcp_group)


def local_cp_sizes(micro_batches) -> tuple[int, ...]:
    return tuple(tu.get_non_tensor_data(mb, "local_cp_size", None) for mb in micro_batches)


def observe_verl_plans() -> list[RanPlan]:
    """What verl's DCP plans give this rank, one :class:`RanPlan` per call of its scheduler
    (``DynamicCPScheduler.schedule``, wrapped in this forked worker only): the rank's CP size
    in each micro-batch, the micro-batch count and the layout."""
    plans, schedule = [], DynamicCPScheduler.schedule

    def observed(self, *args, **kwargs):
        micro_batches = schedule(self, *args, **kwargs)
        sizes = local_cp_sizes(micro_batches)
        plans.append(RanPlan(sizes, len(micro_batches), parallel_layout()))
        return micro_batches

    DynamicCPScheduler.schedule = observed
    return plans


def verl_step(
    rank: int, world_size: int, samples: Sequence[dict], cp: int, budget: int, tp: int = 1
):
    init_verl_megatron(cp, tp)
    (model,) = build_tiny_gpt(tp=tp, cp=cp, options=OPTIONS)
    micro_batches, merged = verl_forward_backward(model, samples, budget)
    return VerlResult(
        log_probs=list(merged["model_output"]["log_probs"].unbind()),
        grads=gather_full_tensors([model]),
        losses=merged["loss"],
        num_tokens=int(sum(s["loss_mask"].sum() for s in samples)),
        packing=tuple(packing_agrees(samples, mb) for mb in micro_batches),
        cp_sizes=local_cp_sizes(micro_batches),
        num_microbatches=len(micro_batches),
        layout=parallel_layout(),
    )


def micro_batch_step(model, micro_batch, num_tokens: int) -> dict:
    """verl's THD forward of one DCP micro-batch and its per-token loss (global count)."""
    cp_size = tu.get_non_tensor_data(micro_batch, "local_cp_size", None)
    input_ids = micro_batch["input_ids"]
    tokens, packed_seq_params, positions = preprocess_thd_engine(input_ids, local_cp_size=cp_size)
    labels, _, _ = preprocess_thd_engine(micro_batch["labels"], local_cp_size=cp_size)
    losses = model(
        input_ids=tokens,
        position_ids=positions,
        attention_mask=None,
        labels=labels,
        packed_seq_params=packed_seq_params,
    )
    log_probs = postprocess_thd_engine(
        -losses, packed_seq_params, input_ids, len(micro_batch), local_cp_size=cp_size
    )
    masks = micro_batch["loss_mask"].unbind()
    loss = -sum((lp * mask).sum() for lp, mask in zip(log_probs.unbind(), masks)) / num_tokens
    loss.backward()
    return {
        "loss": loss.item(),
        "model_output": {"log_probs": log_probs.detach()},
        DCP_SAMPLE_IDS: tu.get_non_tensor_data(micro_batch, DCP_SAMPLE_IDS, None),
        DCP_GROUP_LEADER: tu.get_non_tensor_data(micro_batch, DCP_GROUP_LEADER, False),
    }


def packing_agrees(samples: Sequence[dict], micro_batch) -> dict:
    """verl's padding contract on this rank, check by check (each True when it holds):

    - ``padded``: verl pads every sequence to a multiple of 2·TP·CP (TP without CP), and this
      rank holds 1/CP of the padded micro-batch;
    - ``tokens``, ``positions``: megatron_dcp's packing at that multiple
      (``padding_multiple(cp, tp, sequence_parallel=True)``) gives this rank the tokens verl's
      preprocessing gives it, and the same positions for the real ones (verl numbers the
      padding of a back chunk 0, megatron_dcp continues counting: padding is never attended);
    - ``padding mask``, ``local tokens``: verl's router padding mask marks exactly the padding,
      and its local token count is the number of real tokens."""
    from megatron.core import parallel_state as mpu

    cp_size = tu.get_non_tensor_data(micro_batch, "local_cp_size", None)
    tp_size = mpu.get_tensor_model_parallel_world_size()
    group = mpu.get_dynamic_data_context_parallel_groups(group_size=cp_size)
    ids = tu.get_non_tensor_data(micro_batch, DCP_SAMPLE_IDS, None)
    lengths = [len(samples[i]["tokens"]) for i in ids]
    multiple = padding_multiple(cp_size, tp_size, sequence_parallel=True)
    ours = pack_samples(
        [samples[i] for i in ids], cp_size, torch.distributed.get_rank(group), multiple
    )
    theirs, params, positions = preprocess_thd_engine(
        micro_batch["input_ids"], local_cp_size=cp_size
    )
    row_lengths = torch.tensor(
        [n for n in lengths for _ in range(padded_length(n, multiple) // cp_size)]
    )
    real = ours.position_ids[0] < row_lengths
    padded = params.cu_seqlens_q_padded.diff().tolist()
    align = 2 * tp_size * cp_size if cp_size > 1 else tp_size
    return {
        "padded": padded == [padded_length(n, align) for n in lengths]
        and theirs.shape[1] * cp_size == sum(padded),
        "tokens": torch.equal(ours.tokens, theirs),
        "positions": torch.equal(ours.position_ids[0][real], positions[0][real]),
        "padding mask": torch.equal(
            tu.get_non_tensor_data(micro_batch, DCP_PADDING_MASK, None), ~real
        ),
        "local tokens": tu.get_non_tensor_data(micro_batch, DCP_LOCAL_NUM_TOKENS, None)
        == int(real.sum()),
    }


def assert_padding_contract(result: "VerlResult") -> None:
    for index, checks in enumerate(result.packing):
        failed = [name for name, holds in checks.items() if not holds]
        assert not failed, f"micro-batch {index}: the padding contract fails on {failed}"


def masked_loss(samples: Sequence[dict], log_probs: Sequence[torch.Tensor]) -> float:
    """verl's per-token loss of the whole batch: −Σ log-prob × mask / Σ mask."""
    total = sum(-(lp * s["loss_mask"]).sum() for lp, s in zip(log_probs, samples))
    return float(total / sum(s["loss_mask"].sum() for s in samples))


def assert_close_results(got_log_probs, got_grads, want_log_probs, want_grads, tokens):
    assert len(got_log_probs) == len(want_log_probs)
    for sample, (got, want) in enumerate(zip(got_log_probs, want_log_probs)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"sample {sample}")
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():  # at the summed-loss scale (test_rl_adapter.py)
        torch.testing.assert_close(
            got_grads[name] * tokens, grad * tokens, rtol=1e-4, atol=1e-5, msg=name
        )


def run_verl(lengths, world: int, cp: int, budget: int, silent_sample=None):
    """verl's path on every rank, megatron_dcp's adapter and the single-process reference."""
    samples = make_samples(lengths, OPTIONS.vocab_size, seed=len(lengths))
    if silent_sample is not None:  # a zero-length response: no loss token
        samples[silent_sample]["loss_mask"].zero_()
    verl = run_distributed(verl_step, world, samples, cp, budget, timeout_s=TIMEOUT_S)
    adapter = run_distributed(adapter_step, world, samples, cp, budget, timeout_s=TIMEOUT_S)
    (reference,) = run_distributed(reference_step, 1, samples, timeout_s=TIMEOUT_S)
    return samples, verl, adapter, reference


# (lengths, world, static cp, budget, sample with no loss token). Budgets leave the longest
# sequence more than one rank's budget, so plans mix CP sizes.
CASES = [
    pytest.param(random_lengths(8, seed=4), 4, 2, 48, None, id="world4-8seqs"),
    pytest.param(random_lengths(3, seed=2), 4, 2, 32, 1, id="world4-fewer-seqs-than-ranks"),
    pytest.param(random_lengths(9, seed=7), 8, 2, 48, None, id="world8-9seqs-over-4-cp-groups"),
    pytest.param(random_lengths(12, seed=6), 8, 4, 64, 5, id="world8-12seqs"),
]


@pytest.mark.parametrize("lengths, world, cp, budget, silent", CASES)
def test_verl_path_equals_single_process_and_the_adapter(lengths, world, cp, budget, silent):
    samples, verl, adapter, reference = run_verl(lengths, world, cp, budget, silent)
    layout = Layout(dp=world // cp, cp=cp)
    assert_covers(verl, layout)  # verl's plan mixes CP sizes
    assert_covers(adapter, layout)  # and so does the adapter's
    for result, ours in zip(verl, adapter):
        assert result.num_tokens == reference.num_tokens
        assert_padding_contract(result)
        assert sum(result.losses) == pytest.approx(masked_loss(samples, reference.log_probs))
        assert_close_results(
            result.log_probs, result.grads, reference.log_probs, reference.grads, result.num_tokens
        )
        assert_close_results(
            result.log_probs, result.grads, ours.log_probs, ours.grads, result.num_tokens
        )


# (lengths, static cp, budget, sample with no loss token) at 8 ranks, TP 2 × DP×CP 4. Odd
# lengths: verl pads them to 2·TP·CP (TP alone in a CP-1 group), not to megatron_dcp's 2·CP.
TP2_CASES = [
    pytest.param(random_lengths(9, seed=7), 2, 48, None, id="tp2-dp2cp2-9seqs"),
    pytest.param(random_lengths(12, seed=6), 4, 48, 5, id="tp2-cp4-12seqs"),
]


@pytest.mark.parametrize("lengths, cp, budget, silent", TP2_CASES)
def test_verl_path_at_tp2_equals_single_process(lengths, cp, budget, silent):
    """verl's path at TP 2 (dropout off, so the runs can be equal): every rank's log-probs and
    full gradients (TP shards gathered) equal the single-process run, and verl's padding contract
    (2·TP·CP) holds on every rank for every micro-batch."""
    samples = make_samples(lengths, OPTIONS.vocab_size, seed=len(lengths))
    if silent is not None:
        samples[silent]["loss_mask"].zero_()
    assert any(n % (4 * cp) for n in lengths), "some lengths should need TP's padding"
    verl = run_distributed(verl_step, 8, samples, cp, budget, 2, timeout_s=TIMEOUT_S)
    (reference,) = run_distributed(reference_step, 1, samples, timeout_s=TIMEOUT_S)
    assert_covers(verl, Layout(tp=2, dp=4 // cp, cp=cp))  # verl's plan mixes CP sizes
    for result in verl:
        assert_padding_contract(result)
        assert sum(result.losses) == pytest.approx(masked_loss(samples, reference.log_probs))
        assert_close_results(
            result.log_probs, result.grads, reference.log_probs, reference.grads, result.num_tokens
        )


def verl_rejects_too_long(rank: int, world_size: int) -> str:
    init_verl_megatron(cp=2)
    from megatron.core import parallel_state as mpu

    batch = verl_batch(make_samples([20, 200]))
    scheduler = DynamicCPScheduler(max_seqlen_per_dp_cp_rank=48, dp_size=2, cp_size=2)
    with pytest.raises(ValueError) as error:
        scheduler.schedule(
            batch, mpu.get_data_parallel_group(with_context_parallel=True), tp_size=1
        )
    return str(error.value)


def test_a_sequence_longer_than_the_domain_is_refused_before_any_collective():
    messages = run_distributed(verl_rejects_too_long, 4, timeout_s=TIMEOUT_S)
    assert all("max_seqlen_per_dp_cp_rank" in message for message in messages)


def verl_mtp_step(rank: int, world_size: int, samples: Sequence[dict], budget: int) -> dict:
    """verl's path with one MTP layer (verl PR #5895: the MTP loss takes its CP group from
    ``packed_seq_params.cp_group``): the CP sizes with which this rank entered the MTP loss,
    the micro-batches' CP sizes and the merged main-head log-probs."""
    from megatron.core.models.gpt import gpt_model

    init_verl_megatron(cp=2)
    (model,) = build_tiny_gpt(cp=2, mtp_layers=1, options=OPTIONS)
    entered, original = [], gpt_model.process_mtp_loss

    def counting(*args, **kwargs):
        entered.append(kwargs["cp_group"].size())
        return original(*args, **kwargs)

    gpt_model.process_mtp_loss = counting  # a forked worker: the parent is untouched
    micro_batches, merged = verl_forward_backward(model, samples, budget)
    return {
        "entered": entered,
        "cp sizes": list(local_cp_sizes(micro_batches)),
        "ran": RanPlan(local_cp_sizes(micro_batches), len(micro_batches), parallel_layout()),
        "log_probs": list(merged["model_output"]["log_probs"].unbind()),
    }


def test_mtp_runs_on_each_micro_batch_cp_group():
    samples = make_samples([90, 7, 30], OPTIONS.vocab_size, seed=5)
    results = run_distributed(verl_mtp_step, 4, samples, 32, timeout_s=TIMEOUT_S)
    (reference,) = run_distributed(reference_step, 1, samples, timeout_s=TIMEOUT_S)
    # 90 tokens need the whole domain at budget 32: every micro-batch on CP 4
    assert_covers([result["ran"] for result in results], Layout(dp=2, cp=2), cp_sizes={4})
    for result in results:
        assert result["entered"] == result["cp sizes"] and max(result["cp sizes"]) > 1
        for got, want in zip(result["log_probs"], reference.log_probs):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
