"""The online cost-model refinement, studied away from training: ``convergence_bench`` (how fast
it finds a known machine, in the simulator) and ``replay`` (a recorded ``bench-train`` run's
refinement replayed offline under its variants, ``megatron-dcp replay-refinement``). See
docs/cost_model.md."""
