"""The snapkeep version (its own module so that no subpackage imports the package root)."""

__version__ = "0.1.0"
