"""Peer schedulers run by the simulator for comparison (the real upstream code, scored under our cost model)."""
