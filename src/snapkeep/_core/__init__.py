"""The snapshot engine. Knows nothing about managers, extensions or ppe writers.

Dependency direction: ``training -> writing -> _core``; ``_core`` imports neither.
"""
