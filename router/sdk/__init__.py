"""The server side of the ZMQ SDK: the front door that SDK clients (`radix_mlx`,
`router.client`) talk to."""
