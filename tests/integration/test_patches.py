"""The patch table: idempotence, restore, version gate, the listing; switch and restore of the CP
group (also on exceptions), and the TE attention correction on a recording stand-in for TE's
``set_context_parallel_group``."""

import sys
from types import SimpleNamespace

import psutil
import pytest
import torch

from megatron_dcp.integration import patches
from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.integration.patches import table

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

STATIC = SimpleNamespace(name="static-cp", size=lambda: 2, rank=lambda: 0)
DYNAMIC = SimpleNamespace(name="dcp-4", size=lambda: 4, rank=lambda: 1)


def dcp_params(group, size):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", local_cp_size=size, cp_group=group)


def current_targets(entry):
    return [getattr(*table.resolve(target)) for target in entry.targets]


def test_apply_is_idempotent_and_restore_puts_the_originals_back():
    patches.apply_patches()
    applied = [e for e in patches.entries("dcp", "pipeline") if patches.is_applied(e)]
    assert {"attention_rope", "mtp_roll_tensor", "pipeline_p2p_tags"} <= {e.name for e in applied}
    wrapped = {e.name: current_targets(e) for e in applied}
    assert patches.apply_patches() == []
    assert {e.name: current_targets(e) for e in applied} == wrapped
    originals = {e.name: [table.original_of(e, t) for t in e.targets] for e in applied}
    try:
        assert set(patches.restore_groups(("dcp", "pipeline"))) == set(wrapped)
        assert {e.name: current_targets(e) for e in applied} == originals
    finally:
        patches.apply_patches()
    assert all(patches.is_applied(e) for e in applied)


def test_every_entry_is_listed_with_its_reason_gate_and_targets():
    names = [entry.name for entry in patches.PATCHES]
    assert len(names) == len(set(names))
    for entry in patches.PATCHES:
        assert entry.group in patches.GROUPS and entry.targets and len(entry.corrects) > 30
        assert entry.versions == ((0, 19),) and entry.when.name
    listing = patches.describe()
    assert all(f"{name} [" in listing for name in names)


def test_version_gate_rejects_other_megatron_versions(monkeypatch):
    monkeypatch.setattr(table, "megatron_version", lambda: (0, 20, 0))
    entry = patches.entries("dcp")[0]
    with pytest.raises(RuntimeError, match="0.19"):
        patches.check_version(entry)
    if not patches.is_applied(entry):
        with pytest.raises(RuntimeError, match=entry.name):
            table.apply(entry)


def test_micro_batch_cp_group_rules():
    assert patches.micro_batch_cp_group(None) is None
    assert patches.micro_batch_cp_group(dcp_params(None, None)) is None  # static CP: unchanged
    assert patches.micro_batch_cp_group(dcp_params(None, 1)) is patches.SOLO_GROUP
    assert patches.micro_batch_cp_group(dcp_params(DYNAMIC, 4)) is DYNAMIC
    with pytest.raises(ValueError, match="local_cp_size=4"):
        patches.micro_batch_cp_group(dcp_params(None, 4))


class Recorder:
    """A module whose forward records the CP group it sees (stands in for megatron's)."""

    def __init__(self):
        self.pg_collection = SimpleNamespace(cp=STATIC, tp="tp")
        self.cp_group = STATIC
        self.seen = []

    def forward(self, hidden, packed_seq_params=None, fail=False):
        self.seen.append((self.pg_collection.cp, self.cp_group))
        if fail:
            raise RuntimeError("boom")
        return hidden


@pytest.mark.parametrize(
    "swap,attr",
    [(patches.swap_pg_collection_cp, "pg_collection"), (patches.swap_cp_group, "cp_group")],
)
def test_switching_switches_restores_and_restores_on_exception(swap, attr):
    module = Recorder()
    forward = patches.switching(Recorder.forward, swap)
    shared = module.pg_collection
    index = 0 if attr == "pg_collection" else 1

    forward(module, "h", packed_seq_params=dcp_params(DYNAMIC, 4))
    forward(module, "h", dcp_params(None, 1))  # positional packed_seq_params is found too
    forward(module, "h", packed_seq_params=None)
    assert [seen[index] for seen in module.seen] == [DYNAMIC, patches.SOLO_GROUP, STATIC]
    with pytest.raises(RuntimeError, match="boom"):
        forward(module, "h", packed_seq_params=dcp_params(DYNAMIC, 4), fail=True)
    assert module.seen[-1][index] is DYNAMIC
    assert module.pg_collection is shared and shared.cp is STATIC and module.cp_group is STATIC


class FakeTEBase:
    """Records TE's ``set_context_parallel_group`` calls and holds TE's CP state."""

    def __init__(self):
        self.cp_group, self.cp_global_ranks = STATIC, [0, 1]
        self.cp_stream, self.cp_comm_type = "static-stream", "p2p"
        self.set_calls = []

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type):
        self.set_calls.append(cp_group)
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type


def make_te_stand_in():
    class StandInTEDotProductAttention(FakeTEBase):
        """Reproduces 0.19.2's forward: switches to the micro-batch group, never restores."""

        cp_stream = None

        def forward(self, q, k, v, mask, mask_type, attention_bias=None, packed_seq_params=None):
            if packed_seq_params is not None:
                if packed_seq_params.cp_group is not None:
                    self.cp_group = packed_seq_params.cp_group
                    cls = StandInTEDotProductAttention
                    super().set_context_parallel_group(self.cp_group, [9], cls.cp_stream, "p2p")
                elif packed_seq_params.local_cp_size is not None:
                    super().set_context_parallel_group(None, None, None, self.cp_comm_type)
            self.ran_with = (self.cp_group, self.cp_stream)
            if q == "fail":
                raise RuntimeError("kernel failed")
            return q

    return StandInTEDotProductAttention


def test_te_patch_restores_static_group_and_creates_cp_stream_lazily():
    cls = make_te_stand_in()
    cls.forward = patches.te_attention_forward(cls, cls.forward, make_stream=lambda: "lazy-stream")
    module = cls()

    module.forward("q", "k", "v", None, "causal", packed_seq_params=dcp_params(DYNAMIC, 4))
    assert module.ran_with == (DYNAMIC, "lazy-stream") and cls.cp_stream == "lazy-stream"
    assert (module.cp_group, module.cp_stream, module.cp_global_ranks) == (
        STATIC,
        "static-stream",
        [0, 1],
    )
    module.forward("q", "k", "v", None, "causal", None, dcp_params(None, 1))
    assert module.ran_with[0] is None and module.cp_group is STATIC
    with pytest.raises(RuntimeError, match="kernel failed"):
        module.forward("fail", "k", "v", None, "causal", packed_seq_params=dcp_params(DYNAMIC, 4))
    assert module.cp_group is STATIC and module.set_calls[-1] is STATIC


def test_te_patch_leaves_static_cp_forward_alone():
    cls = make_te_stand_in()
    cls.forward = patches.te_attention_forward(cls, cls.forward, make_stream=lambda: "lazy-stream")
    module = cls()
    module.forward("q", "k", "v", None, "causal", packed_seq_params=None)
    assert module.set_calls == [] and cls.cp_stream is None and module.ran_with[0] is STATIC


def test_mamba_context_parallel_is_rebuilt_for_the_micro_batch_group():
    static = SimpleNamespace(
        **{name: name for name in ("conv1d_weight_cp1", "conv1d_bias_cp1", "dt_bias_cp1")},
        A_log_cp1="A",
        D_cp1="D",
        D_has_hdim=False,
        d_inner_local_tp=16,
        nheads_local_tp=4,
        ngroups_local_tp=4,
        d_state=8,
        conv1d_padding=3,
    )
    mixer = SimpleNamespace(cp=static)
    with patches.swap_mamba_context_parallel(mixer, DYNAMIC):
        rebuilt = mixer.cp
        assert rebuilt.cp_group is DYNAMIC and rebuilt.cp_size == 4
        assert rebuilt.nheads_local_tpcp == 1
    assert mixer.cp is static
    with patches.swap_mamba_context_parallel(mixer, DYNAMIC):
        assert mixer.cp is rebuilt  # cached per group


def gdn_stand_in():
    """What ``swap_gdn_context_parallel`` reads and swaps on megatron's GatedDeltaNet (TP 1, static
    CP 2): 4 key heads and 8 value heads of 8 channels."""
    sections = (32, 32, 64, 64, 8, 8)  # q, k, v, gate, beta, alpha
    return SimpleNamespace(
        pg_collection=SimpleNamespace(cp=STATIC, tp="tp"),
        cp_size=2,
        in_proj_split_sections=sections,
        feat_dim_split=(64, 32, 4, 4),
        num_k_heads_local_tp=4,
        num_v_heads_local_tp=8,
    )


def test_gdn_layer_switches_group_size_and_split_and_restores_them():
    from megatron_dcp.integration.patches.gdn_switching import (
        GDN_PATCHES,
        swap_gdn_context_parallel,
    )

    module = gdn_stand_in()
    shared = module.pg_collection
    with swap_gdn_context_parallel(module, DYNAMIC):
        assert module.pg_collection.cp is DYNAMIC and module.pg_collection.tp == "tp"
        assert module.cp_size == 4 and module.feat_dim_split == (32, 16, 2, 2)
    with swap_gdn_context_parallel(module, patches.SOLO_GROUP):
        assert module.cp_size == 1 and module.feat_dim_split == (128, 64, 8, 8)
    assert module.pg_collection is shared and shared.cp is STATIC
    assert (module.cp_size, module.feat_dim_split) == (2, (64, 32, 4, 4))
    eight = SimpleNamespace(size=lambda: 8, rank=lambda: 0)
    with pytest.raises(ValueError, match="4 key and 8 value heads per TP rank .* group of 8"):
        with swap_gdn_context_parallel(module, eight):
            pass
    module.feat_dim_split = (64, 64, 4, 4)  # a layout the switch does not know
    with pytest.raises(RuntimeError, match="written for megatron-core 0.19"):
        with swap_gdn_context_parallel(module, DYNAMIC):
            pass
    # The output all-to-all switches on its own too (recomputed in the backward pass).
    (entry,) = GDN_PATCHES
    assert [target.rsplit(".", 1)[-1] for target in entry.targets] == [
        "forward",
        "_gated_norm_and_a2a",
    ]


class FakeRouter:
    """What ``swap_moe_router_group`` touches on megatron's router: its TP×CP group, TP group and
    the method that attaches an aux loss and records it for logging."""

    def __init__(self, tp_size=1):
        self.tp_cp_group = STATIC
        self.tp_group = SimpleNamespace(size=lambda: tp_size)
        self.calls = []

    def attach_and_log_load_balancing_loss(self, activation, coeff, loss, name, reduce_group):
        self.calls.append((self.tp_cp_group, reduce_group))  # (scaled by, logged over)
        return activation


class FakeMoELayer:
    def __init__(self, router=None, recompute=False):
        self.mlp = SimpleNamespace(router=router, moe_layer_recompute=recompute)
        self.training = True

    def _forward_mlp(self, hidden, inference_context=None, packed_seq_params=None, fail=False):
        router = self.mlp.router
        if router is not None:
            router.attach_and_log_load_balancing_loss(hidden, 0.1, 1.0, "aux", router.tp_cp_group)
        if fail:
            raise RuntimeError("boom")
        return hidden


def test_moe_router_reduces_over_the_micro_batch_group_and_logs_over_the_static_one():
    router = FakeRouter()
    layer = FakeMoELayer(router)
    forward = patches.moe_router_switching(FakeMoELayer._forward_mlp)

    forward(layer, "h", packed_seq_params=dcp_params(DYNAMIC, 4))
    forward(layer, "h", None, dcp_params(None, 1))
    forward(layer, "h", packed_seq_params=None)
    with pytest.raises(RuntimeError, match="boom"):
        forward(layer, "h", packed_seq_params=dcp_params(DYNAMIC, 4), fail=True)
    assert router.calls == [
        (DYNAMIC, STATIC),
        (patches.SOLO_GROUP, STATIC),
        (STATIC, STATIC),
        (DYNAMIC, STATIC),
    ]
    assert router.tp_cp_group is STATIC
    assert "attach_and_log_load_balancing_loss" not in vars(router)
    forward(FakeMoELayer(None), "h", packed_seq_params=dcp_params(DYNAMIC, 4))  # dense: no-op


def test_moe_router_with_tp_reduces_over_the_tp_cp_group_the_wrapper_attached():
    """TP 2: the router runs on the TP×CP group named in the micro-batch (the TP group for a
    micro-batch without CP) and still logs over the static group."""
    router = FakeRouter(tp_size=2)
    forward = patches.moe_router_switching(FakeMoELayer._forward_mlp)
    tp_cp = SimpleNamespace(name="tp2-x-dcp-4", size=lambda: 8)
    tp = SimpleNamespace(name="tp2", size=lambda: 2)
    for group, size, attached in [(DYNAMIC, 4, tp_cp), (None, 1, tp)]:
        params = dcp_params(group, size)
        setattr(params, patches.TP_CP_GROUP_ATTRIBUTE, attached)
        forward(FakeMoELayer(router), "h", packed_seq_params=params)
    assert router.calls == [(tp_cp, STATIC), (tp, STATIC)]
    assert router.tp_cp_group is STATIC


def wrong_size_group(size):
    params = dcp_params(DYNAMIC, size)
    setattr(params, patches.TP_CP_GROUP_ATTRIBUTE, DYNAMIC)  # the CP group alone: 4, not 2 x 4
    return params


@pytest.mark.parametrize(
    "layer,params,match",
    [
        (FakeMoELayer(FakeRouter(tp_size=2)), dcp_params(DYNAMIC, 4), "tensor parallelism 2"),
        (FakeMoELayer(FakeRouter(tp_size=2)), wrong_size_group(4), "tensor parallelism 2"),
        (FakeMoELayer(FakeRouter(), True), dcp_params(DYNAMIC, 4), "moe"),
    ],
    ids=["tp2-no-group", "tp2-cp-group-only", "moe-recompute"],
)
def test_moe_router_switch_refuses_a_missing_tp_cp_group_and_moe_recompute(layer, params, match):
    forward = patches.moe_router_switching(FakeMoELayer._forward_mlp)
    with pytest.raises(ValueError, match=match):
        forward(layer, "h", packed_seq_params=params)
    assert layer.mlp.router.tp_cp_group is STATIC
    forward(layer, "h", packed_seq_params=None)  # static CP: megatron's own path, no refusal


def test_the_checkpoint_queue_server_is_forked_not_spawned(tmp_path, monkeypatch):
    """megatron's first checkpoint save starts a manager for its write results; with the
    cpu_training entry its server process is forked from the rank (no fresh interpreter that
    re-runs the training entry module and imports torch), and without it, it is spawned and
    re-runs the entry module."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    entry = next(p for p in patches.entries("cpu_training") if "checkpoint_queue" in p.name)
    marker = tmp_path / "entry_ran"
    script = tmp_path / "entry.py"
    script.write_text(f"open({str(marker)!r}, 'a').write('ran\\n')\n")
    main = type(sys)("__main__")
    main.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", main)

    def new_server(get_queue) -> psutil.Process:
        """The server process of a new queue, which it checks with a tensor."""
        monkeypatch.setattr(filesystem_async, "_results_queue", None)
        queue = get_queue()
        queue.put(torch.ones(2))
        assert torch.equal(queue.get(), torch.ones(2))
        return psutil.Process(queue._manager._process.pid)  # the proxy's manager

    plain = getattr(filesystem_async.get_write_results_queue, "__wrapped__", None)
    plain = plain if table.is_applied(entry) else filesystem_async.get_write_results_queue
    forked = new_server(entry.replace(filesystem_async, plain))
    assert not marker.exists() and "spawn_main" not in " ".join(forked.cmdline())
    spawned = new_server(plain)
    assert marker.read_text() == "ran\n" and "spawn_main" in " ".join(spawned.cmdline())
    assert sys.modules["__main__"] is main  # put back


class MLARecorder:
    """Stands in for ``MLASelfAttention``: records the CP group, the config's CP size and the
    ``local_cp_size`` its ``get_query_key_value_tensors`` sees."""

    def __init__(self):
        self.pg_collection = SimpleNamespace(cp=STATIC, tp="tp")
        self.config = SimpleNamespace(context_parallel_size=2, kv_lora_rank=32)
        self.seen = []

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, position_ids=None, packed_seq_params=None
    ):
        local = getattr(packed_seq_params, "local_cp_size", None)
        self.seen.append((self.pg_collection.cp, self.config.context_parallel_size, local))
        if hidden_states == "fail":
            raise RuntimeError("boom")
        return "qkv"


def test_mla_rope_runs_on_the_micro_batch_group_and_restores_the_static_one():
    """The MLA entry: for a DCP micro-batch the RoPE group is the micro-batch's, the CP size
    the config reports is its size, and the assertion sees no local_cp_size (the caller's
    params keep theirs); static CP unchanged; the static state back after each call, errors too."""
    from megatron_dcp.integration.patches.mla_attention import mla_qkv_switching

    module = MLARecorder()
    qkv = mla_qkv_switching(MLARecorder.get_query_key_value_tensors)
    config, collection = module.config, module.pg_collection
    params = dcp_params(DYNAMIC, 4)
    assert qkv(module, "h", None, None, params) == "qkv"  # positional packed_seq_params
    qkv(module, "h", packed_seq_params=dcp_params(None, 1))
    qkv(module, "h", packed_seq_params=dcp_params(None, None))
    assert module.seen == [(DYNAMIC, 4, None), (patches.SOLO_GROUP, 1, None), (STATIC, 2, None)]
    assert params.local_cp_size == 4 and params.cp_group is DYNAMIC
    with pytest.raises(RuntimeError, match="boom"):
        qkv(module, "fail", packed_seq_params=params)
    assert module.seen[-1] == (DYNAMIC, 4, None)
    assert module.config is config and config.context_parallel_size == 2
    assert module.pg_collection is collection and collection.cp is STATIC
