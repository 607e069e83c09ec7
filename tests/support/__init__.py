"""Helpers shared by the tests (imported as ``support.<module>``; ``tests/`` is on ``sys.path``
through ``tests/conftest.py``, pytest's default ``prepend`` import mode).

Scripts that tests start as subprocesses by path (``*_worker.py``, ``loader_loop.py``,
``ppe_example.py``, ``ppe_mnist_example.py``) stay beside their tests."""
