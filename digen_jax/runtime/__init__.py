"""The disaggregated runtime: the planner, the executor and what it dispatches with (device
meshes, transfers, weight sync, the trace), and the simulator that runs the same plans against a
cost model (docs/design.md)."""
