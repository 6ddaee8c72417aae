"""The mutants of ``scripts/mutation_check.py`` in the RL adapter's value, reward and
distillation models and in verl's critic and distillation entries: one realistic one-line mistake
each, in the form of ``mutation_list.py``, which gathers them into ``MUTANTS``."""

from __future__ import annotations

from mutation_types import Mutant


RL_MODELS = "tests/integration/test_rl_models.py::"
VALUE_TESTS = (RL_MODELS + "test_value_model_equals_single_process",)
REWARD_TESTS = (RL_MODELS + "test_reward_model_pointwise_and_pairwise_equal_single_process",)
DISTILL_TESTS = (RL_MODELS + "test_distillation_equals_single_process",)
ADAPTERS = "megatron_dcp/adapters/"
VERL_CRITIC = "tests/integration/test_verl_critic.py::"
VERL_DISTILL = "tests/integration/test_verl_distill.py::"
VALUE_CLIP_TESTS = ("tests/integration/test_value_clip.py",)
DEV_CONTRACT_TESTS = ("tests/integration/test_dev_api_contract.py",)

RL_MODEL_MUTANTS = (
    Mutant(
        "value-targets-not-shifted",
        ADAPTERS + "value.py",
        "out[:-1] = value[1:]",
        "out[:] = value",
        VALUE_TESTS,
        "missing shift: each critic output meets its own token's target, not the next token's",
    ),
    Mutant(
        "value-merged-not-shifted",
        ADAPTERS + "value.py",
        "out[1:] = flat[:-1]",
        "out[:] = flat",
        VALUE_TESTS,
        "missing right-shift: merged values are returned at their output positions",
    ),
    Mutant(
        "value-clip-upper-side-doubled",
        ADAPTERS + "value.py",
        "(values - old_values).clamp(-clip_range, clip_range)",
        "(values - old_values).clamp(-clip_range, 2 * clip_range)",
        VALUE_CLIP_TESTS,
        "asymmetric clip: v − v_old clipped to [−ε, 2ε]; values between ε and 2ε pass unclipped",
    ),
    Mutant(
        "dev-scheduler-swallows-arguments",
        "megatron_dcp/integration/megatron_dev_api.py",
        "        pad_sequences: bool = False,\n    ) -> None:",
        "        pad_sequences: bool = False,\n        **_: Any,\n    ) -> None:",
        DEV_CONTRACT_TESTS,
        "dev's scheduler stand-in swallows unknown constructor arguments: a misspelt one is lost",
    ),
    Mutant(
        "scalar-head-no-sequence-gather",
        ADAPTERS + "heads.py",
        "        if self.sequence_parallel:",
        "        if False:",
        VALUE_TESTS,
        "the head reads only this TP rank's sequence-parallel slice",
    ),
    Mutant(
        "score-at-first-token",
        ADAPTERS + "scores.py",
        "mark[-1] = sample_id + 1",
        "mark[0] = sample_id + 1",
        REWARD_TESTS,
        "wrong index: the score is read at the sample's first token, not its last",
    ),
    Mutant(
        "scores-not-gathered",
        ADAPTERS + "scores.py",
        "    if groups.domain_size > 1:\n        device",
        "    if groups.domain_size > 99:\n        device",
        REWARD_TESTS,
        "skipped collective: each rank sees only the scores it owns; pairs across groups break",
    ),
    Mutant(
        "reverse-kl-teacher-weights",
        ADAPTERS + "distill.py",
        "        terms = student.exp() * (student - teacher)",
        "        terms = teacher.exp() * (student - teacher)",
        DISTILL_TESTS,
        "wrong weight: reverse KL weighted by the teacher's probabilities",
    ),
    Mutant(
        "distill-vocab-shard-only",
        ADAPTERS + "distill.py",
        "    if _tp_size() == 1:\n        return logits",
        "    if True:\n        return logits",
        DISTILL_TESTS,
        "no TP gather: the KL is taken over this TP rank's vocabulary shard",
    ),
    Mutant(
        "distill-normaliser-gradient-partial",
        ADAPTERS + "distill.py",
        "    return shard - copy_to_tensor_model_parallel_region(normaliser)",
        "    return shard - normaliser",
        DISTILL_TESTS,
        "the vocabulary-parallel normaliser's gradient not summed over TP: each shard sees its "
        "own share of it",
    ),
    Mutant(
        "distill-ids-not-summed",
        ADAPTERS + "distill.py",
        "    return _tp_sum(picked * inside)",
        "    return picked * inside",
        DISTILL_TESTS,
        "the student's log-probabilities at the teacher's ids only on the shard holding them",
    ),
    Mutant(
        "verl-value-forward-unfixed",
        "megatron_dcp/integration/patches/verl_critic.py",
        "        if not self.engine_config.dynamic_context_parallel:",
        "        if True:",
        (VERL_CRITIC + "test_critic_under_dcp_equals_single_process",),
        "verl's own value forward under DCP: values sharded on the static CP group",
    ),
    Mutant(
        "verl-value-refusal-kept",
        "megatron_dcp/integration/patches/verl_refusals.py",
        "            model_config = LanguageModelView(model_config)",
        "            pass",
        (VERL_CRITIC + "test_critic_under_dcp_equals_single_process",),
        "the value model's refusal not lifted: verl's critic cannot run under DCP",
    ),
    Mutant(
        "verl-value-lift-without-fix",
        "megatron_dcp/integration/patches/verl_refusals.py",
        "    return bool(getattr(forward, PASSES_LOCAL_CP_SIZE, False))",
        "    return True",
        (VERL_CRITIC + "test_only_the_value_model_refusal_is_lifted",),
        "the refusal lifted even where verl's unfixed value forward would run",
    ),
    Mutant(
        "verl-distill-teacher-on-static-group",
        "megatron_dcp/integration/patches/verl_distill.py",
        "    rows, *_ = preprocess_thd_engine(tensor, pre_process=True, local_cp_size=local_cp_size)",
        "    rows, *_ = preprocess_thd_engine(tensor, pre_process=True)",
        (VERL_DISTILL + "test_topk_distillation_under_dcp_equals_single_process",),
        "the teacher's top-k rows cut on the static CP group, the student's on the dynamic one",
    ),
    Mutant(
        "verl-distill-lift-without-fix",
        "megatron_dcp/integration/patches/verl_refusals.py",
        "    return bool(getattr(losses.compute_topk_loss, SHARDS_ON_GROUP, False))",
        "    return True",
        (VERL_DISTILL + "test_only_the_distillation_refusal_is_lifted_with_the_fix",),
        "the distillation refusal lifted even where verl's unfixed top-k loss would run",
    ),
)
