"""The quick-start's table speaks the benchmark's language: per iteration the busiest position's
measured and predicted forward-backward time and each plan's critical path over the lower bound
(re-made from the same batches under the prior cost model, marked where a run ran another plan);
no load-imbalance column; a note that its times are no benchmark, pointing to bench-train; and
the batches it re-plans are the ones training hands out."""

from megatron_dcp.integration.data.datasets import build_varlen_datasets
from megatron_dcp.scheduling import build_cost_model
from megatron_dcp.tools import quickstart
from megatron_dcp.tools.launching.training_runs import DCPFigures, RunLog

COST = build_cost_model("model")
LENGTHS = [[900, 40, 60, 30, 200, 100, 20, 16], [300, 300, 200, 100, 50, 50, 30, 16]]


def figures_of(plan, measured, predicted):
    sizes = plan.cp_size_histogram()
    return DCPFigures(plan.num_microbatches, sizes, 1.0, 1.1, 1.2, 500, predicted, measured)


def runs(plans):
    static, dcp = RunLog(), RunLog()
    for it, made in enumerate(plans, start=1):
        static.losses[it], dcp.losses[it] = 4.0, 4.0
        static.dcp[it] = figures_of(made["dp_balanced"], 885.0 + it, 59.6)
        dcp.dcp[it] = figures_of(made["default_dynamic_cp"], 814.6 + it, 1810.7)
    return static, dcp


def test_the_table_shows_measured_and_predicted_time_and_cp_over_lb():
    plans = [quickstart.plans_of(quickstart.MODEL, COST, lengths) for lengths in LENGTHS]
    header, *rows = quickstart.comparison(*runs(plans), plans, COST)
    assert "imbalance" not in header
    for column in ("fwd-bwd ms s/d", "pred. ms s/d", "CP/LB prior s/d", "mb s/d", "tok/s s/d"):
        assert column in header
    for it, row in enumerate(rows, start=1):
        ratios = [quickstart.ratio_to_bound(plans[it - 1][n], COST) for n in quickstart.SCHEDULERS]
        assert f"{885.0 + it:.1f}/{814.6 + it:.1f}" in row.replace(" ", "")
        assert "59.6/1810.7" in row.replace(" ", "")
        assert f"{ratios[0]:.3f}/{ratios[1]:.3f}" in row.replace(" ", "")
        assert quickstart.REPLANNED_MARK not in row
        assert len(row) == len(header)
    assert ratios[0] > ratios[1] >= 1.0  # static CP is further from the bound than DCP here


def test_a_row_whose_run_ran_another_plan_is_marked():
    plans = [quickstart.plans_of(quickstart.MODEL, COST, lengths) for lengths in LENGTHS]
    static, dcp = runs(plans)
    ran = dcp.dcp[2]
    dcp.dcp[2] = DCPFigures(ran.microbatches + 1, ran.cp_sizes, 1.0, 1.1, 1.2, 500)
    _, first, second = quickstart.comparison(static, dcp, plans, COST)
    assert quickstart.REPLANNED_MARK not in first and quickstart.REPLANNED_MARK in second


def test_the_notes_say_the_times_are_no_benchmark_and_point_to_bench_train():
    notes = quickstart.table_notes(cores=2)
    assert "8 ranks share 2 cores here" in notes[-1]
    assert "megatron-dcp bench-train" in notes[-1] and "docs/performance.md" in notes[-1]
    assert "prior cost model" in notes[1] and quickstart.REPLANNED_MARK in notes[1]
    assert "share" not in quickstart.table_notes(cores=16)[-1].split(",")[0]


def test_each_iteration_replans_the_batch_training_hands_out():
    """Iteration i gets samples (i − 1)·G .. i·G − 1 of the dataset of iters·G samples."""
    model, size = quickstart.MODEL, int(quickstart.MODEL["--global-batch-size"])
    batches = quickstart.batch_lengths(model, 3)
    train_ds, _, _ = build_varlen_datasets(
        seq_length=int(model["--seq-length"]),
        vocab_size=int(model["--vocab-size"]),
        seed=int(model["--seed"]),
        num_samples=[3 * size, 0, 0],
        distribution=model["--varlen-distribution"],
    )
    assert [len(batch) for batch in batches] == [size] * 3
    for it, batch in enumerate(batches, start=1):
        assert batch == [train_ds.sequence_length(i) for i in range((it - 1) * size, it * size)]
    assert batches[0] != batches[1]


def test_the_quickstart_prints_the_table_and_its_notes(monkeypatch, capsys, tmp_path):
    plans = [quickstart.plans_of(quickstart.MODEL, COST, lengths) for lengths in LENGTHS]
    static, dcp = runs(plans)
    drawn = []
    monkeypatch.setattr(quickstart, "require_matplotlib", lambda what: None)
    by_name = {"dp_balanced": static, "default_dynamic_cp": dcp}
    monkeypatch.setattr(quickstart, "train", lambda model, name, iters, out: by_name[name])
    monkeypatch.setattr(quickstart, "replan", lambda model, iters: (COST, plans[:iters]))
    monkeypatch.setattr(quickstart, "available_cores", lambda: 2)
    monkeypatch.setattr(quickstart, "plot_first_plans", lambda *args: drawn.append(args))
    assert quickstart.main(["--iters", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "CP/LB prior s/d" in out and "imbalance" not in out
    assert "8 ranks share 2 cores here" in out and "megatron-dcp bench-train" in out
    assert drawn == [(plans[0], COST, tmp_path / "plan_iteration1.png")]


def test_each_run_reports_its_iterations_off_a_terminal(monkeypatch, capsys, tmp_path):
    """The quick-start's two runs report their iterations as the training log shows them (the
    ``[DCP]`` line rank 0 prints after each step), as plain lines when stdout is no terminal."""

    def fake_run(flags, nproc, log, on_line=None):
        for iteration in (1, 2, 3):
            on_line("a megatron line\n")
            on_line(f" [DCP] iteration {iteration:8d} | micro-batches: 2 | ...\n")
        return "the run's log"

    monkeypatch.setattr(quickstart, "run_pretrain", fake_run)
    assert quickstart.train(quickstart.MODEL, "default_dynamic_cp", 3, tmp_path) == "the run's log"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("quickstart: training with default_dynamic_cp on 8 CPU ranks")
    assert lines[1].startswith("quickstart: default_dynamic_cp: 1/3 iterations, ")
    assert lines[-1].startswith("quickstart: default_dynamic_cp: 3/3 iterations, ")
    assert len(lines) == 3  # off a terminal: at most one line per 30 s, and the last


def test_the_quickstart_trains_the_model_of_the_tp2_functional_case():
    """The quick-start's runs are recorded above (no model is built here); the model its flags
    ask for is the dense GPT of ``gpt3_tp2_pp1_cp4_dcp``, whose runs check megatron's parameter
    count (functional_tests)."""
    from megatron_dcp.testing.functional import load_case
    from megatron_dcp.testing.model_size import expected_parameters

    case = load_case("gpt3_tp2_pp1_cp4_dcp")
    assert expected_parameters(quickstart.MODEL) == expected_parameters(case.model_args)
