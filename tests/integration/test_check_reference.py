"""``megatron-dcp check``'s reference arm on its own: it refuses to run inside the DCP patch table,
its names for a pipeline stage's parameters are the single-process model's, and its float64 pass
on a tiny GPT agrees with the oracle the integration tests use (``testing.gpt``: another attention,
megatron's ``DotProductAttention`` here against the CPU backend's reference attention there)."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from megatron_dcp.testing.gpt import TinyGPTOptions, build_tiny_gpt, make_samples
from megatron_dcp.testing.gpt import single_process_reference
from megatron_dcp.tools.check import global_names, reference_arm
from megatron_dcp.tools.launching.local_ranks import run_distributed


REFUSAL = """
from megatron_dcp.integration.patches import entries
from megatron_dcp.integration.patches.table import apply
from megatron_dcp.tools.check.reference_arm import outside_runtime

outside_runtime()  # a fresh interpreter: only the CPU stand-ins could be applied
(entry,) = [e for e in entries("dcp") if e.name == "attention_rope"]
assert apply(entry)
outside_runtime()
"""


def test_the_reference_refuses_to_run_inside_the_patch_table():
    # A fresh interpreter: this one has applied entries for the tests before this one.
    done = subprocess.run([sys.executable, "-c", REFUSAL], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RuntimeError: the reference arm runs inside the patch table: ['attention_rope']" in (
        done.stderr
    )


class Layer(torch.nn.Module):
    def __init__(self, number):
        super().__init__()
        self.layer_number = number


class Stage(torch.nn.Module):
    """The last of two pipeline stages of a tied-embedding GPT: layers 3 and 4 of 4."""

    share_embeddings_and_output_weights = True

    def __init__(self):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([Layer(3), Layer(4)])


@pytest.mark.parametrize(
    "local, single",
    [
        ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.2.mlp.linear_fc1.weight"),
        ("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
         "decoder.layers.3.input_layernorm.weight"),
        ("decoder.layers.1.mlp.linear_fc1.layer_norm_bias",
         "decoder.layers.3.pre_mlp_layernorm.bias"),
        ("output_layer.weight", "embedding.word_embeddings.weight"),
        ("decoder.final_layernorm.weight", "decoder.final_layernorm.weight"),
    ],
)  # fmt: skip
def test_a_stage_names_its_parameters_as_the_single_process_model(local, single):
    assert global_names.global_name(Stage(), local) == single


OPTIONS = TinyGPTOptions(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)


def reference_of(rank, world_size, samples):
    from megatron_dcp.integration.model_parallel import init_megatron

    init_megatron(seed=OPTIONS.seed)
    (model,) = build_tiny_gpt(options=OPTIONS)
    config = dataclasses.replace(model.config, tensor_model_parallel_size=1)
    gpt = {
        "vocab_size": OPTIONS.vocab_size,
        "max_sequence_length": OPTIONS.max_sequence_length,
        "position_embedding_type": "rope",
        "share_embeddings_and_output_weights": False,
    }
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    description = {"transformer": config, "gpt": gpt}
    return reference_arm.reference_pass(description, weights, samples, torch.float64)


def test_the_float64_pass_agrees_with_the_oracle_of_the_integration_tests():
    samples = make_samples([40, 7, 90], OPTIONS.vocab_size, seed=3)
    ((loss, tokens, grads),) = run_distributed(reference_of, 1, samples)
    oracle = single_process_reference(samples, OPTIONS).exact
    assert tokens == sum(int((s["loss_mask"] != 0).sum()) for s in samples)
    assert loss == pytest.approx(oracle.loss_sum, rel=1e-6)  # megatron takes the loss in float32
    assert grads.keys() == oracle.tensors.keys()
    for name, exact in oracle.tensors.items():
        torch.testing.assert_close(grads[name], exact, rtol=1e-10, atol=1e-12, msg=name)


def test_ranks_that_miss_a_reference_tensor_are_refused():
    from megatron_dcp.tools.check.rounding import exact_run

    tensors = {"a": torch.ones(2), "b": torch.ones(3)}
    reference = exact_run(5.0, tensors, [(5.0, tensors)])
    by_rank = {0: {"dcp": ((5.0, 4), {"a": torch.ones(2)})}, 1: {"dcp": ((5.0, 4), {})}}
    with pytest.raises(ValueError, match=r"dcp's ranks hold other gradients .* missing \['b'\]"):
        reference_arm.compare_batch(0, reference, 4, by_rank, 2.0**-23)
    by_rank[1]["dcp"][1]["b"] = torch.ones(3)
    found = reference_arm.compare_batch(0, reference, 4, by_rank, 2.0**-23)
    assert {(f["rank"], f["name"]) for f in found} == {(0, "loss"), (0, "a"), (1, "b")}
