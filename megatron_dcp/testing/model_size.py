"""The parameter count a training run's flags ask for, computed from the flags alone, to check the
model a run trained against what its name and flags claim.

megatron logs ``number of parameters on (tensor, ..., pipeline) model parallel rank (t, g, p): N``
(``RunLog.parameters``); :func:`expected_parameters` computes the same figure per (tensor rank,
pipeline rank) from the architecture: embeddings, norms, attention, MLP, experts, MTP layers,
Mamba and Gated DeltaNet layers, each sharded as megatron's tensor, pipeline, virtual-pipeline
and expert parallelism shard it. A flag it does not know is a ``ValueError`` (every flag that may change the
model must be modelled or declared neutral here), so a case cannot add a model flag unchecked.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

# Flags that do not change the parameters (parallel layout of tokens, data, optimizer, logging).
NEUTRAL = frozenset(
    """--dynamic-context-parallel --max-seqlen-per-dp-cp-rank --min-dynamic-context-parallel-size
    --sequence-packing-scheduler --context-parallel-size --sequence-parallel --seq-length
    --micro-batch-size --global-batch-size --train-iters --hidden-dropout --attention-dropout
    --lr --min-lr --lr-decay-style --clip-grad --seed --eval-iters --eval-interval --log-interval
    --tokenizer-type --tokenizer-model --data-path --split --save --save-interval --load
    --ckpt-step --use-distributed-optimizer --distributed-timeout-minutes --recompute-granularity
    --recompute-method --recompute-num-layers --recompute-modules --moe-router-topk
    --moe-token-dispatcher-type --moe-router-load-balancing-type --moe-aux-loss-coeff
    --expert-model-parallel-size --calculate-per-token-loss --use-rope-scaling
    --rope-scaling-factor --use-rotary-position-embeddings --no-bias-gelu-fusion --rope-type
    --rotary-scaling-factor --mscale --mscale-all-dim --num-workers""".split()
)
NEUTRAL_PREFIXES = ("--dcp-", "--sft-", "--varlen-")
MODELLED = frozenset(
    """--num-layers --hidden-size --num-attention-heads --group-query-attention --num-query-groups
    --ffn-hidden-size --vocab-size --make-vocab-size-divisible-by --max-position-embeddings
    --position-embedding-type --untie-embeddings-and-output-weights --disable-bias-linear
    --add-qkv-bias --normalization --swiglu --qk-layernorm --qk-l2-norm
    --tensor-model-parallel-size --pipeline-model-parallel-size
    --num-layers-per-virtual-pipeline-stage --num-experts --moe-layer-freq --moe-ffn-hidden-size
    --moe-shared-expert-intermediate-size --expert-tensor-parallel-size --mtp-num-layers
    --hybrid-layer-pattern --mamba-head-dim --mamba-num-groups --mamba-state-dim
    --mamba-num-heads --multi-latent-attention --q-lora-rank --kv-lora-rank --qk-head-dim
    --qk-pos-emb-head-dim --v-head-dim --experimental-attention-variant --linear-attention-freq
    --linear-conv-kernel-dim --linear-key-head-dim --linear-value-head-dim
    --linear-num-key-heads --linear-num-value-heads""".split()
)
MAMBA_EXPAND, MAMBA_CONV_WIDTH = 2, 4  # megatron's d_inner = 2·hidden, convolution width 4
# megatron's Gated DeltaNet defaults (TransformerConfig): convolution width, head dims, heads.
GDN_DEFAULTS = {
    "--linear-conv-kernel-dim": 4,
    "--linear-key-head-dim": 128,
    "--linear-value-head-dim": 128,
    "--linear-num-key-heads": 16,
    "--linear-num-value-heads": 32,
}


@dataclass(frozen=True)
class Shape:
    """The architecture and layout of a run, from its flags."""

    flags: Mapping[str, object]

    def get(self, flag: str, default: object = None) -> object:
        return self.flags.get(flag, default)

    def on(self, flag: str) -> bool:
        return bool(self.flags.get(flag, False))

    def int(self, flag: str, default: int) -> int:
        value = self.flags.get(flag)
        return default if value is None else int(value)

    @property
    def hidden(self) -> int:
        return self.int("--hidden-size", 0)

    @property
    def tp(self) -> int:
        return self.int("--tensor-model-parallel-size", 1)

    @property
    def bias(self) -> bool:
        return not self.on("--disable-bias-linear")

    def norm(self, size: int) -> int:
        """A LayerNorm has a weight and a bias, an RMSNorm a weight."""
        return size if self.get("--normalization", "LayerNorm") == "RMSNorm" else 2 * size


def flags_of(argv: Sequence[str]) -> Dict[str, object]:
    """A command line's flags as ``{flag: value}`` (a flag without a value: True), the form the
    functions here take (the inverse of ``training_runs.flag_list``)."""
    flags: Dict[str, object] = {}
    for index, word in enumerate(argv):
        if word.startswith("--"):
            following = argv[index + 1] if index + 1 < len(argv) else "--"
            flags[word] = True if following.startswith("--") else following
    return flags


def check_flags(flags: Mapping[str, object]) -> None:
    """A ValueError naming a flag the formula neither models nor knows to be neutral."""
    for flag, value in flags.items():
        if value is False or value is None or flag in MODELLED or flag in NEUTRAL:
            continue
        if not flag.startswith(NEUTRAL_PREFIXES):
            raise ValueError(
                f"{flag}: testing.model_size does not know whether it changes the parameters; "
                "model it (MODELLED) or declare it neutral (NEUTRAL)"
            )


def padded_vocab(shape: Shape, vocab_size: Optional[int]) -> int:
    """megatron pads the vocabulary to a multiple of ``--make-vocab-size-divisible-by`` × TP."""
    vocab = vocab_size if vocab_size is not None else shape.int("--vocab-size", 0)
    multiple = shape.int("--make-vocab-size-divisible-by", 128) * shape.tp
    return -(-vocab // multiple) * multiple


def attention(shape: Shape) -> int:
    """One TP shard of self-attention: QKV (GQA), projection, optional q/k norms."""
    if shape.on("--multi-latent-attention"):
        return mla_attention(shape)
    h, tp, heads = shape.hidden, shape.tp, shape.int("--num-attention-heads", 1)
    head_dim = h // heads
    groups = heads
    if shape.on("--group-query-attention"):
        groups = shape.int("--num-query-groups", heads)
    qkv_out = (heads + 2 * groups) * head_dim
    total = qkv_out * h // tp + h * h // tp
    if shape.bias or shape.on("--add-qkv-bias"):
        total += qkv_out // tp
    if shape.bias:
        total += h  # the row-parallel projection's bias is whole on every TP rank
    if shape.on("--qk-layernorm") and not shape.on("--qk-l2-norm"):
        total += 2 * shape.norm(head_dim)  # over the head dimension, on every TP rank
    return total


def mla_attention(shape: Shape) -> int:
    """One TP shard of multi-latent attention (megatron's local spec): the query projection
    (direct, or down to ``--q-lora-rank`` and up), the key/value down projection to the latent
    and the shared RoPE key, its up projection to per-head keys and values, the output
    projection; with ``--qk-layernorm`` norms of the compressed query and of the latent. Only
    the output projection has a bias. megatron's argument defaults where a flag is absent."""
    h, tp, heads = shape.hidden, shape.tp, shape.int("--num-attention-heads", 1)
    kv_rank, q_rank = shape.int("--kv-lora-rank", 32), shape.int("--q-lora-rank", 0)
    nope, rope = shape.int("--qk-head-dim", 128), shape.int("--qk-pos-emb-head-dim", 64)
    value = shape.int("--v-head-dim", 128)
    query_out = heads * (nope + rope)
    query = q_rank * (h + query_out) // tp if q_rank else h * query_out // tp
    key_value = h * (kv_rank + rope) // tp + kv_rank * heads * (nope + value) // tp
    total = query + key_value + heads * value * h // tp + (h if shape.bias else 0)
    if shape.on("--qk-layernorm"):
        total += shape.norm(kv_rank) + (shape.norm(q_rank) if q_rank else 0)
    return total


def mlp(shape: Shape, ffn: int, tp: int, bias: bool) -> int:
    """One shard (``tp`` ways) of an MLP hidden -> ``ffn`` (×2 with SwiGLU) -> hidden."""
    h, gate = shape.hidden, 2 if shape.on("--swiglu") else 1
    total = h * ffn * gate // tp + ffn * h // tp
    return total + (ffn * gate // tp + h if bias else 0)


def ffn_size(shape: Shape) -> int:
    return shape.int("--ffn-hidden-size", 4 * shape.hidden)


def moe(shape: Shape) -> int:
    """An MoE block on one rank: router, this rank's experts, shared experts."""
    experts = shape.int("--num-experts", 0)
    local = experts // shape.int("--expert-model-parallel-size", 1)
    etp = shape.int("--expert-tensor-parallel-size", shape.tp)
    expert_ffn = shape.int("--moe-ffn-hidden-size", ffn_size(shape))
    total = experts * shape.hidden + local * mlp(shape, expert_ffn, etp, shape.bias)
    shared = shape.int("--moe-shared-expert-intermediate-size", 0)
    return total + (mlp(shape, shared, shape.tp, shape.bias) if shared else 0)


def moe_layers(shape: Shape, num_layers: int) -> List[bool]:
    """Which decoder layers are MoE layers (``--moe-layer-freq``: every N-th, or a 0/1 list)."""
    if not shape.get("--num-experts"):
        return [False] * num_layers
    frequency = shape.get("--moe-layer-freq", 1)
    if isinstance(frequency, str) and frequency.strip().startswith("["):
        pattern = [bool(x) for x in ast.literal_eval(frequency)]
    else:
        pattern = [i % int(frequency) == 0 for i in range(num_layers)]
    return pattern


def transformer_layer(shape: Shape, is_moe: bool, is_gdn: bool = False) -> int:
    h = shape.hidden
    feed_forward = moe(shape) if is_moe else mlp(shape, ffn_size(shape), shape.tp, shape.bias)
    mixer = gated_delta_net(shape) if is_gdn else attention(shape)
    return shape.norm(h) + mixer + shape.norm(h) + feed_forward


def gated_delta_net(shape: Shape) -> int:
    """A Gated DeltaNet's TP shard: the projection to q, k, v, gate, beta and alpha, the
    convolution over q, k and v, dt bias and A, the output norm (over a value head, whole on
    every TP rank) and the output projection; no biases."""
    h, tp = shape.hidden, shape.tp
    size = {flag: shape.int(flag, default) for flag, default in GDN_DEFAULTS.items()}
    qk = size["--linear-key-head-dim"] * size["--linear-num-key-heads"]
    value_heads = size["--linear-num-value-heads"]
    v = size["--linear-value-head-dim"] * value_heads
    in_proj = h * (2 * qk + 2 * v + 2 * value_heads) // tp
    conv = (2 * qk + v) * size["--linear-conv-kernel-dim"] // tp
    out_norm = shape.norm(size["--linear-value-head-dim"])
    return in_proj + conv + 2 * value_heads // tp + out_norm + v * h // tp


def gdn_layers(shape: Shape, num_layers: int) -> List[bool]:
    """Which decoder layers are Gated DeltaNet layers: all but every N-th
    (``--linear-attention-freq N``), or a 0/1 list; none without the variant."""
    variant = shape.get("--experimental-attention-variant")
    if variant is None:
        return [False] * num_layers
    if variant != "gated_delta_net":
        raise ValueError(f"--experimental-attention-variant {variant}: not modelled here")
    frequency = shape.get("--linear-attention-freq")
    if isinstance(frequency, str) and frequency.strip().startswith("["):
        return [bool(x) for x in ast.literal_eval(frequency)]
    return [(i + 1) % int(frequency) != 0 for i in range(num_layers)]


def mamba_layer(shape: Shape) -> int:
    """A Mamba-2 layer's TP shard: norm, in/out projections, convolution, A, D, dt bias, norm."""
    h, tp = shape.hidden, shape.tp
    inner = MAMBA_EXPAND * h
    heads = shape.int("--mamba-num-heads", 0) or inner // shape.int("--mamba-head-dim", 64)
    states = 2 * shape.int("--mamba-num-groups", 8) * shape.int("--mamba-state-dim", 128)
    in_proj = h * (2 * inner + states + heads) // tp
    conv = (inner + states) * (MAMBA_CONV_WIDTH + 1) // tp
    return shape.norm(h) + in_proj + conv + 3 * heads // tp + inner // tp + inner * h // tp


def hybrid_layer(shape: Shape, symbol: str) -> int:
    h = shape.hidden
    sizes = {
        "M": lambda: mamba_layer(shape),
        "*": lambda: shape.norm(h) + attention(shape),
        "-": lambda: shape.norm(h) + mlp(shape, ffn_size(shape), shape.tp, shape.bias),
        "E": lambda: shape.norm(h) + moe(shape),
    }
    if symbol not in sizes:
        raise ValueError(f"--hybrid-layer-pattern: testing.model_size has no '{symbol}' layers")
    return sizes[symbol]()


def decoder_layers(shape: Shape) -> List[int]:
    """The parameters of every decoder layer (one TP shard each), in order."""
    pattern = shape.get("--hybrid-layer-pattern")
    if pattern:
        return [hybrid_layer(shape, symbol) for symbol in str(pattern)]
    num_layers = shape.int("--num-layers", 0)
    kinds = zip(moe_layers(shape, num_layers), gdn_layers(shape, num_layers))
    return [transformer_layer(shape, is_moe, is_gdn) for is_moe, is_gdn in kinds]


def stage_layers(shape: Shape, pp_rank: int, num_layers: int) -> List[int]:
    """The decoder layers pipeline rank ``pp_rank`` holds (every virtual stage's)."""
    pp = shape.int("--pipeline-model-parallel-size", 1)
    per_virtual = shape.int("--num-layers-per-virtual-pipeline-stage", num_layers // pp)
    chunks = num_layers // (pp * per_virtual)
    layers = []
    for chunk in range(chunks):
        start = (chunk * pp + pp_rank) * per_virtual
        layers += range(start, start + per_virtual)
    return layers


def mtp_layers(shape: Shape, last_layer: int) -> int:
    """MTP layers: two norms, the 2h -> h projection, a decoder layer, a final norm each."""
    h, count = shape.hidden, shape.int("--mtp-num-layers", 0)
    return count * (3 * shape.norm(h) + 2 * h * h // shape.tp + last_layer)


def expected_parameters(
    flags: Mapping[str, object], vocab_size: Optional[int] = None
) -> Dict[Tuple[int, int], int]:
    """(tensor rank, pipeline rank) -> the parameters megatron should log for a run of ``flags``
    (``vocab_size``: the tokenizer's, when it is not ``--vocab-size``)."""
    check_flags(flags)
    shape = Shape(flags)
    layers = decoder_layers(shape)
    pp = shape.int("--pipeline-model-parallel-size", 1)
    h, vocab = shape.hidden, padded_vocab(shape, vocab_size) // shape.tp
    untied = shape.on("--untie-embeddings-and-output-weights")
    embedding = vocab * h
    if shape.get("--position-embedding-type", "learned_absolute") == "learned_absolute":
        embedding += shape.int("--max-position-embeddings", 0) * h
    counts = {}
    for pp_rank in range(pp):
        first, last = pp_rank == 0, pp_rank == pp - 1
        mtp = last and shape.int("--mtp-num-layers", 0) > 0
        total = sum(layers[i] for i in stage_layers(shape, pp_rank, len(layers)))
        # The MTP layers embed the shifted tokens themselves: the last stage has an embedding too.
        total += embedding if (first or mtp) else 0
        if last:
            total += shape.norm(h) + mtp_layers(shape, layers[-1])
            # The output layer's weight is the embedding's only where both are on one stage.
            total += vocab * h if (untied or not first) else 0
        for tp_rank in range(shape.tp):
            counts[tp_rank, pp_rank] = total
    return counts


def check_model_size(
    flags: Mapping[str, object],
    logged: Mapping[Tuple[int, int], int],
    vocab_size: Optional[int] = None,
) -> None:
    """An AssertionError unless megatron logged, for every (tensor, pipeline) rank, the count
    the flags ask for (``logged``: ``RunLog.parameters``)."""
    expected = expected_parameters(flags, vocab_size)
    assert logged, "the run logged no parameter count (megatron's 'number of parameters on ...')"
    assert dict(logged) == expected, (
        f"the trained model is not the one the flags ask for: megatron logged {dict(logged)} "
        f"parameters per (tensor, pipeline) rank, the flags make {expected}"
    )
