"""snapkeep: safe, cheap PyTorch training snapshots with a pytorch-pfn-extras compatible API."""

__version__ = "0.1.0"
