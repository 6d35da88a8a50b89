"""The application layer: what assembles a run from a config (the workload, the training loop,
run checkpoints, the benchmarks in bench/) on top of the runtime and the RL core."""
