"""``python -m snapkeep``: the ``snapkeep`` command (same options, output and exit status)."""

from snapkeep.cli import main

if __name__ == "__main__":
    main()
