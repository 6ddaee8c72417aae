"""Peer schedulers run by the simulator for comparison (the real upstream code where it imports,
scored under our cost model)."""
