"""Replicas: the router's links to its scheduler+worker pairs (local and remote), the
routing among them, the request manager over them, and a remote replica's own relay."""
