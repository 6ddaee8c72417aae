"""The compute terms of the GPU cost model against the clock, on one CUDA GPU.

    python scripts/gpu_cost_probe.py [--out probe.json] [--layers-dtype bf16]

Times forward + backward of one GPT layer of the cost model's default shape (Llama-3-8B-like:
hidden 4096, FFN 14336 gated, 32 heads, 8 K/V groups, bf16) on micro-batches of B sequences of
length L, with PyTorch's flash attention (causal). Pure PyTorch: no Transformer Engine, no
megatron, one GPU, so only the terms one rank pays alone are probed: GEMMs per token (``linear``),
causal attention per token pair (``quadratic``) and the fixed cost of a layer pass
(``microbatch``). The CP terms (K/V exchange, ring steps) need two GPUs and are not probed.

For every probe it prints the measured time, the ``h100-nvlink`` profile's prediction for one
layer (the per-layer share of ``CostModel.from_model_shape``) and the prediction of the three
coefficients fitted to all probes (least squares on relative error), then the fitted coefficients
beside the profile's and the efficiencies they imply (H100 and H200 share the 989 TFLOP/s dense
bf16 peak). Last, the fixed cost per sequence of megatron's unfused THD RoPE (the cost model's
``sequence`` term where it runs; :func:`sequence_probe`). docs/performance.md ("On a GPU") holds
a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.hardware import HardwareProfile
from megatron_dcp.scheduling.model_shape import ModelShape

SHAPE = ModelShape()
# (sequences, length): tiny, linear-dominated, quadratic-dominated, mixed at 32 K tokens, tiny
# again (the fixed cost, before and after the GPU's clocks have risen).
PROBES = (
    [(1, 16), (1, 64)]
    + [(n // 128, 128) for n in (2048, 8192, 32768)]
    + [(1, n) for n in (1024, 4096, 8192, 16384, 32768, 65536)]
    + [(32768 // n, n) for n in (512, 2048, 8192)]
    + [(1, 16), (1, 64), (4, 64), (1, 256)]
)


class Layer(torch.nn.Module):
    """One GPT layer: RMSNorm, QKV, causal flash attention (GQA), output, RMSNorm, gated MLP."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.heads, self.groups, self.dim = shape.num_attention_heads, shape.num_query_groups, d
        self.qkv = torch.nn.Linear(h, shape.query_dim + 2 * shape.kv_dim, bias=False)
        self.proj = torch.nn.Linear(shape.query_dim, h, bias=False)
        self.up = torch.nn.Linear(h, 2 * shape.ffn_hidden_size, bias=False)
        self.down = torch.nn.Linear(shape.ffn_hidden_size, h, bias=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(F.rms_norm(x, x.shape[-1:])).split(
            [self.heads * self.dim, self.groups * self.dim, self.groups * self.dim], dim=-1
        )
        q = q.view(b, n, self.heads, self.dim).transpose(1, 2)
        k, v = (t.view(b, n, self.groups, self.dim).transpose(1, 2) for t in (k, v))
        repeat = self.heads // self.groups
        k, v = (t.repeat_interleave(repeat, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        gate, up = self.up(F.rms_norm(x, x.shape[-1:])).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def seconds(layer: Layer, sequences: int, length: int, repeats: int = 10) -> float:
    """Median seconds of one forward + backward of ``layer`` on ``sequences`` × ``length``."""
    x = torch.randn(sequences, length, SHAPE.hidden_size, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(True)
    grad = torch.randn_like(x)
    times = []
    for i in range(repeats + 3):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        layer(x).backward(grad)
        stop.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def per_layer_model(hardware: Optional[HardwareProfile] = None) -> CostModel:
    """A profile's cost of one GPT layer (default ``h100-nvlink``): the difference of 2-layer
    and 1-layer models (the output head cancels)."""
    one, two = (
        CostModel.from_model_shape(ModelShape(num_layers=n), hardware) for n in (1, 2)
    )
    return CostModel(
        linear=two.linear - one.linear,
        quadratic=two.quadratic - one.quadratic,
        microbatch=two.microbatch - one.microbatch,
        name=f"{hardware.name if hardware else 'h100-nvlink'}, one layer",
    )


def fit(rows: list[dict]) -> np.ndarray:
    """(microbatch, linear, quadratic) by least squares on relative error, each ≥ 0."""
    features = np.array([[1.0, r["tokens"], r["pairs"]] for r in rows])
    measured = np.array([r["measured"] for r in rows])
    weighted = features / measured[:, None]
    theta, *_ = np.linalg.lstsq(weighted, np.ones(len(rows)), rcond=None)
    return np.maximum(theta, 0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the probes and the fit as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_cost_probe needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    layer = Layer(SHAPE).to("cuda", torch.bfloat16)
    model = per_layer_model()
    rows = []
    seconds(layer, 1, 16)  # clocks up before the first probe
    for sequences, length in PROBES:
        tokens, pairs = sequences * length, sequences * length * length
        rows.append(
            dict(
                sequences=sequences,
                length=length,
                tokens=tokens,
                pairs=pairs,
                measured=seconds(layer, sequences, length),
                model=model.microbatch + model.linear * tokens + model.quadratic * pairs,
            )
        )
    theta = fit(rows)
    report(rows, theta, model)
    chunks = ring_chunks()
    per_sequence = sequence_probe()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(device=torch.cuda.get_device_name(), rows=rows, fit=theta.tolist(),
                     ring_chunks=chunks, sequence=per_sequence),
                f,
            )
    return 0


class OneRank:
    """A CP group of one rank, for megatron's THD RoPE (it asks the group's size and rank)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def sequence_probe(tokens: int = 8192, repeats: int = 10) -> Optional[dict]:
    """The cost model's ``sequence`` term on this GPU where megatron's unfused THD RoPE runs
    (no Transformer Engine, or ``--no-rope-fusion``): forward + backward of RoPE on the query and
    key of one layer (32 and 8 heads × 128 dims) for packs of ``tokens`` tokens in n sequences;
    the slope over n is the fixed cost each sequence adds to one attention layer pass pair.
    With Transformer Engine's fused RoPE (megatron's default) the pack takes one kernel: the
    GPU profiles carry no such term. None (and a line saying why) where megatron is missing."""
    try:
        from megatron_dcp.integration.megatron_import import import_megatron_core

        import_megatron_core()
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
    except ImportError as error:
        print(f"\nsequence probe skipped: megatron-core is not importable ({error})")
        return None
    dim = SHAPE.head_dim
    freqs = torch.randn(tokens, 1, 1, dim, device="cuda", dtype=torch.float32)
    rows = []
    for count in (1, 4, 16, 64, 256):
        bounds = torch.linspace(0, tokens, count + 1, device="cuda").round().int()
        q = torch.randn(tokens, 32, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(tokens, 8, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        times = []
        for i in range(repeats + 3):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = [_apply_rotary_pos_emb_thd(t, bounds, freqs, cp_group=OneRank()) for t in (q, k)]
            (out[0].float().sum() + out[1].float().sum()).backward()
            stop.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(stop) / 1e3)
        rows.append(dict(sequences=count, seconds=statistics.median(times)))
    slope = np.polyfit([r["sequences"] for r in rows], [r["seconds"] for r in rows], 1)[0]
    print(f"\nunfused THD RoPE, {tokens} tokens, q and k, fwd+bwd:   sequences   ms")
    for r in rows:
        print(f"{'':52}{r['sequences']:>9} {1e3 * r['seconds']:>6.3f}")
    print(f"per sequence and attention layer (forward + backward): {1e3 * slope:.4f} ms")
    return dict(rows=rows, seconds_per_sequence_per_layer=float(slope))


def attention_seconds(queries: int, keys: int, causal: bool, repeats: int = 10) -> float:
    """Median seconds of forward + backward of causal or full flash attention (32 heads)."""
    heads, dim = SHAPE.num_attention_heads, SHAPE.head_dim
    q = torch.randn(1, heads, queries, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(1, heads, keys, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    grad = torch.randn_like(q)
    times = []
    for i in range(repeats + 3):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad)
        stop.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def ring_chunks() -> list[dict]:
    """The cost model's ``cp_efficiency``: one rank's share of a zigzag ring over ``c`` ranks
    (a causal block of L/c, then c - 1 full blocks of L/c queries × L/2c keys: L²/2c pairs)
    against a whole causal sequence's attention divided by ``c``. Attention kernels only: the
    K/V transfers and the softmax-correction kernels are not timed."""
    print("\nring chunks (attention fwd+bwd only)   L    c   whole/c ms   chunks ms   efficiency")
    out = []
    for length in (8192, 32768, 131072):
        whole = attention_seconds(length, length, True)
        for c in (2, 4, 8):
            diagonal = attention_seconds(length // c, length // c, True)
            off = attention_seconds(length // c, length // (2 * c), False) if c > 1 else 0.0
            chunked = diagonal + (c - 1) * off
            out.append(dict(length=length, cp=c, whole=whole, chunked=chunked))
            print(f"{'':38}{length:>6} {c:>4} {1e3 * whole / c:>12.3f} {1e3 * chunked:>11.3f} "
                  f"{whole / c / chunked:>12.2f}")
    return out


def report(rows: list[dict], theta: np.ndarray, model: CostModel) -> None:
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'B':>5} {'L':>6} {'tokens':>7} {'measured ms':>12} {'profile ms':>11} "
          f"{'profile/clock':>13} {'fit ms':>8} {'fit/clock':>9}")
    for r in rows:
        fitted = theta @ np.array([1.0, r["tokens"], r["pairs"]])
        print(f"{r['sequences']:>5} {r['length']:>6} {r['tokens']:>7} {1e3 * r['measured']:>12.3f} "
              f"{1e3 * r['model']:>11.3f} {r['model'] / r['measured']:>13.2f} "
              f"{1e3 * fitted:>8.3f} {fitted / r['measured']:>9.2f}")
    peak = 989e12
    per_layer_lin = model.linear * peak * 0.5
    per_layer_quad = model.quadratic * peak * 0.4
    print("\ncoefficient        profile      fitted    fitted/profile  implied efficiency")
    names = (("microbatch s", model.microbatch, None), ("linear s/token", model.linear, per_layer_lin),
             ("quadratic s/pair", model.quadratic, per_layer_quad))
    for (name, prior, flops), value in zip(names, theta):
        eff = f"{flops / (value * peak):.0%} of peak" if flops and value > 0 else ""
        print(f"{name:<17} {prior:>10.3e} {value:>10.3e} {value / prior:>10.2f}        {eff}")


if __name__ == "__main__":
    raise SystemExit(main())
