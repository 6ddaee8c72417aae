"""The multi-node launch of docs/scaling.md, proved on this machine: two torchrun agents
(``--nnodes 2``, one per "node") meet at a c10d rendezvous on loopback and train the tiny GPT
under DCP with the losses of one agent running the same world size; when one node dies (its
agent and its ranks), the other agent exits with an error within seconds. Both jobs trained
the model their flags ask for (megatron's parameter count against ``testing.model_size``)."""

import time

import pytest

from megatron_dcp.testing.forked_launch import free_port
from megatron_dcp.testing.functional import load_case
from megatron_dcp.testing.model_size import check_model_size, flags_of
from megatron_dcp.tools.launching.training_runs import (
    flag_list,
    kill_tree,
    run_agents,
    run_pretrain,
    start_agents,
)

NNODES, NPROC_PER_NODE = 2, 2
TRAIN_ITERS = 3
# How soon a surviving agent must give up after its peer node died, from the timeouts that
# death runs into (torch's defaults, and the collective timeout this test sets):
# - the c10d rendezvous heartbeat notices the dead agent: keep-alive every 5 s, 3 misses;
# - a surviving rank blocked in a collective with a dead peer usually fails at once (the peer's
#   gloo sockets close), else at the collective timeout, --distributed-timeout-minutes, which
#   megatron gives its groups and megatron_dcp its DCP groups (2 minutes here);
# - the agent stops its own ranks: SIGTERM, then SIGKILL after its 30 s shutdown grace;
# - when the dead node hosted the rendezvous store, the agent's last store reads wait out the
#   c10d backend's 60 s read timeout before it exits;
# with half as much again for a loaded machine (CI runs this beside other work on 2 cores).
RENDEZVOUS_HEARTBEAT_S = 5 * 3
COLLECTIVE_TIMEOUT_MIN = 2
SHUTDOWN_GRACE_S = 30
STORE_READ_TIMEOUT_S = 60
LOADED_MACHINE_MARGIN = 1.5
DEAD_NODE_EXIT_S = LOADED_MACHINE_MARGIN * (
    RENDEZVOUS_HEARTBEAT_S + 60 * COLLECTIVE_TIMEOUT_MIN + SHUTDOWN_GRACE_S + STORE_READ_TIMEOUT_S
)


def job_flags(train_iters: int = TRAIN_ITERS) -> list:
    """The tiny GPT of the TP2·CP4 functional case on 4 ranks: DP2 × CP2, DCP."""
    options = dict(load_case("gpt3_tp2_pp1_cp4_dcp").model_args)
    options.update(
        {
            "--tensor-model-parallel-size": 1,
            "--context-parallel-size": 2,
            "--global-batch-size": 8,
            "--train-iters": train_iters,
            "--distributed-timeout-minutes": COLLECTIVE_TIMEOUT_MIN,
        }
    )
    return flag_list(options)


def test_two_agents_train_like_one(tmp_path):
    two = run_agents(job_flags(), NNODES, NPROC_PER_NODE, free_port(), tmp_path)
    one = run_pretrain(job_flags(), NNODES * NPROC_PER_NODE, tmp_path / "one.log")
    assert sorted(two.losses) == list(range(1, TRAIN_ITERS + 1))
    assert two.losses == pytest.approx(one.losses, rel=1e-6)
    assert len(two.dcp) == TRAIN_ITERS
    for run in (two, one):
        check_model_size(flags_of(job_flags()), run.parameters)


def test_a_dead_node_stops_the_other_within_its_timeouts(tmp_path):
    agents = start_agents(
        job_flags(train_iters=1000), NNODES, NPROC_PER_NODE, free_port(), tmp_path
    )
    try:
        logs = [tmp_path / f"agent{node}.log" for node in range(NNODES)]
        deadline = time.monotonic() + 600
        while not any("[DCP] iteration" in log.read_text() for log in logs):
            assert all(a.poll() is None for a in agents), "an agent exited before training"
            assert time.monotonic() < deadline, "training did not start in 600 s"
            time.sleep(0.5)
        kill_tree(agents[1].pid)
        killed = time.monotonic()
        code = agents[0].wait(timeout=DEAD_NODE_EXIT_S + 30)
        elapsed = time.monotonic() - killed
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    assert code != 0, "the surviving agent must report the failure"
    assert elapsed < DEAD_NODE_EXIT_S, f"the surviving agent took {elapsed:.0f} s to exit"
