"""The load path: the one verified reader, one-pass loading, the preflight checks, the structure
check before a load, what a resume tells the user."""
