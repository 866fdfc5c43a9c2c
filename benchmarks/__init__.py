"""Benchmarks and dev tools; none of it runs inside a server process.

- `serving` (+ `workloads`, `transports`, `report`, `summary`, `plots`, `records`): the
  serving benchmark, radix-mlx against mlx_lm.server (`python -m benchmarks.serving`).
- `one_batch`: one static batch through the worker's ModelRunner, no server around it.
- `scheduler_micro`: the scheduler's own overhead per decode step, and the radix trie.
- `hop`: what one scheduler <-> worker process hop costs per step.
- `trace_report`: where each request's time to first token went, from a `--trace-dir`.
"""
