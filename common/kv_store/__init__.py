"""The persistent KV tier's storage (docs/architecture.md, "The disk tier"): block keys
(`block_keys`), the storage interface (`BlockStore`) and its file backend
(`FileBlockStore`). MLX-free: the scheduler computes keys, the worker stores blocks."""
