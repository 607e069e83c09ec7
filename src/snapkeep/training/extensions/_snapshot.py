"""Snapshot extensions (placeholder; written by the snapshot extension owner)."""
