"""Training-loop API with ppe's names: ``ExtensionsManager``, extensions and triggers.

Mirrors the manager/extension/trigger part of ``pytorch_pfn_extras.training``; ppe's
``Trainer``, ``Evaluator``, Ignite manager and metrics are not provided (asking for them raises
an ``AttributeError`` that points to the plug-in path).
``snapkeep.training.extensions`` is imported on first access.
"""

from typing import TYPE_CHECKING, Any

from snapkeep._not_shipped import not_shipped_error
from snapkeep.layout import RngState
from snapkeep.training import triggers
from snapkeep.training._manager_protocol import (
    ExtensionsManagerProtocol,
    StateObjectProtocol,
    WriterLike,
)
from snapkeep.training.extension import (
    PRIORITY_EDITOR,
    PRIORITY_READER,
    PRIORITY_SNAPSHOT,
    PRIORITY_WRITER,
    Extension,
    ExtensionEntry,
    make_extension,
)
from snapkeep.training.manager import ExtensionsManager

if TYPE_CHECKING:
    from snapkeep.training import extensions

__all__ = [
    "PRIORITY_EDITOR",
    "PRIORITY_READER",
    "PRIORITY_SNAPSHOT",
    "PRIORITY_WRITER",
    "RngState",
    "Extension",
    "ExtensionEntry",
    "ExtensionsManager",
    "ExtensionsManagerProtocol",
    "StateObjectProtocol",
    "WriterLike",
    "extensions",
    "make_extension",
    "triggers",
]


def __getattr__(name: str) -> Any:
    # `extensions` pulls in the snapshot extension and the writers; importing it lazily keeps
    # `snapkeep.training` importable on its own and free of import cycles.
    if name == "extensions":
        import importlib

        return importlib.import_module("snapkeep.training.extensions")
    raise not_shipped_error(__name__, name)
