"""The processes: `radix-mlx serve` and `radix-mlx replica` start, supervise and stop
the replicas' workers and schedulers."""
