"""The engine session every door drives (open, resume, retention, close) and its run control
(preemption, run status)."""
