"""The save path: staging into reused buffers, the validated overlap, the saver (one in flight,
back-pressure, error once), where a save runs, the commit, the exit drain."""
