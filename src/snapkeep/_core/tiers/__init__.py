"""Layers with the session's interface: the memory tier (node RAM + peer copies) and incremental
snapshots (content-addressed blobs)."""
