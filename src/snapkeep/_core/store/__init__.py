"""The store contract and its kinds (single files, marked checkpoint-N directories), the directory
lock, retention policies, lineage: which files are whose."""
