"""Extensions: callables the manager runs after iterations (as ppe's ``training/extension.py``).

An extension is any callable taking the manager. Subclassing :class:`Extension` or decorating a
function with :func:`make_extension` gives it defaults (trigger, priority, name) and hooks
(``initialize``, ``on_error``, ``finalize``, ``state_dict``). :class:`ExtensionEntry` binds an
extension to the name, trigger and priority it is registered with.

Priorities (same values as ppe): extensions with a higher priority run first in an iteration.
Extensions at :data:`PRIORITY_SNAPSHOT` run after all others of the same iteration, so a snapshot
records the state every other extension and trigger left for that iteration.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import snapkeep.training._trigger_util as _trigger_util
from snapkeep.training._manager_protocol import ExtensionsManagerProtocol
from snapkeep.training._trigger_util import TriggerLike

__all__ = [
    "PRIORITY_EDITOR",
    "PRIORITY_READER",
    "PRIORITY_SNAPSHOT",
    "PRIORITY_WRITER",
    "Extension",
    "ExtensionEntry",
    "ExtensionLike",
    "make_extension",
]

PRIORITY_WRITER = 300
"""For extensions that write values into the observation."""
PRIORITY_EDITOR = 200
"""For extensions that edit values already in the observation."""
PRIORITY_READER = 100
"""For extensions that only read the observation (the default)."""
PRIORITY_SNAPSHOT = -100
"""For snapshot extensions; deferred until every other extension of the iteration has run."""

ExtensionLike = Callable[[ExtensionsManagerProtocol], Any]
_OnError = Callable[[ExtensionsManagerProtocol, Exception, types.TracebackType], None]


class Extension:
    """Base class of extensions (as ppe's ``Extension``).

    Class attributes give the defaults used when the extension is registered without explicit
    options.

    Attributes:
        trigger: Default trigger, ``(1, 'iteration')``.
        priority: Default priority, :data:`PRIORITY_READER`.
        name: Registered name; set by the manager on registration.
        needs_model_state: ``True`` if the extension reads ``manager.models`` (the manager only
            allows model access in iterations where such an extension may fire).
        is_async: Kept for ppe compatibility; unused by snapkeep's manager.
    """

    trigger: TriggerLike = (1, "iteration")
    priority: int = PRIORITY_READER
    name: str | None = None
    needs_model_state: bool = False
    is_async: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Inside ppe's manager an extension that is not an instance of ppe's `Extension` is
        # wrapped, and the wrapper drops `needs_model_state`, `state_dict` and the rest; so when
        # ppe is loaded, instances are made of a subclass that also derives from ppe's class.
        return object.__new__(_with_ppe_base(cls))

    @property
    def default_name(self) -> str:
        """Name used when none is given: the class name unless overridden."""
        return type(self).__name__

    def __call__(self, manager: ExtensionsManagerProtocol) -> Any:
        """Runs the extension at an iteration its trigger accepted.

        Raises:
            NotImplementedError: The subclass did not override it.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")

    def __getattr__(self, name: str) -> Any:
        if name == "invoke_before_training":
            raise AttributeError(
                "invoke_before_training was removed (as in ppe); use Extension.initialize or "
                "register with call_before_training=True"
            )
        raise AttributeError(f"{type(self).__name__} object has no attribute {name}")

    def initialize(self, manager: ExtensionsManagerProtocol) -> None:
        """Called once when the manager starts its extensions, before the first iteration.

        Skipped when the extension's trigger reports ``finished``. An extension that restores the
        manager (snapshot autoload) does it here.
        """

    def on_error(
        self,
        manager: ExtensionsManagerProtocol,
        exc: Exception,
        tb: types.TracebackType,
    ) -> None:
        """Called (once per manager) when an iteration body or an extension raises."""

    def finalize(self, manager: ExtensionsManagerProtocol) -> None:
        """Called once by ``manager.finalize()`` at the end of training."""

    def state_dict(self) -> dict[str, Any]:
        """State saved in the manager's ``state_dict`` (nothing by default)."""
        return {}

    def load_state_dict(self, to_load: dict[str, Any]) -> None:
        """Restores state produced by :meth:`state_dict`."""


_PPE_EXTENSION_MODULE = "pytorch_pfn_extras.training.extension"
_ppe_variants: dict[type, type] = {}


def _with_ppe_base(cls: type) -> type:
    """``cls``, or (when ppe's extension module is already imported) a subclass of ``cls`` and of
    ppe's ``Extension``, so that ppe's manager runs the extension itself (ppe's ``_as_extension``
    checks ``isinstance(ext, Extension)``). snapkeep never imports ppe: a process that uses ppe's
    manager has imported it before creating extensions. Attributes and methods come from ``cls``
    (first in the MRO); ``type(ext).__name__`` is unchanged."""
    module = sys.modules.get(_PPE_EXTENSION_MODULE)
    ppe_base = getattr(module, "Extension", None)
    if not isinstance(ppe_base, type) or issubclass(cls, ppe_base):
        return cls
    variant = _ppe_variants.get(cls)
    if variant is None:
        variant = type(cls.__name__, (cls, ppe_base), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        })
        _ppe_variants[cls] = variant
    return variant


class _WrappedExtension(Extension):
    """Gives a plain callable the :class:`Extension` interface, reading its attributes."""

    def __init__(self, ext: ExtensionLike) -> None:
        self._ext = ext
        self.trigger = getattr(ext, "trigger", Extension.trigger)
        self.priority = getattr(ext, "priority", Extension.priority)
        self.needs_model_state = bool(getattr(ext, "needs_model_state", False))

    @property
    def default_name(self) -> str:
        name = getattr(self._ext, "default_name", None)
        return name if isinstance(name, str) and name else super().default_name

    def __call__(self, manager: ExtensionsManagerProtocol) -> Any:
        return self._ext(manager)

    def initialize(self, manager: ExtensionsManagerProtocol) -> None:
        hook = getattr(self._ext, "initialize", None)
        if hook is not None:
            hook(manager)

    def on_error(
        self,
        manager: ExtensionsManagerProtocol,
        exc: Exception,
        tb: types.TracebackType,
    ) -> None:
        hook = getattr(self._ext, "on_error", None)
        if hook is not None:
            hook(manager, exc, tb)

    def finalize(self, manager: ExtensionsManagerProtocol) -> None:
        hook = getattr(self._ext, "finalize", None)
        if hook is not None:
            hook(manager)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped extension's state, when it has one (a ppe extension such as ppe's
        ``LogReport`` under snapkeep's manager), so it travels in the snapshot."""
        hook = getattr(self._ext, "state_dict", None)
        return hook() if callable(hook) else {}

    def load_state_dict(self, to_load: dict[str, Any]) -> None:
        hook = getattr(self._ext, "load_state_dict", None)
        if callable(hook):
            hook(to_load)


def _noop_hook(manager: ExtensionsManagerProtocol) -> None:
    return None


def _noop_on_error(
    manager: ExtensionsManagerProtocol, exc: Exception, tb: types.TracebackType
) -> None:
    return None


def make_extension(
    trigger: TriggerLike = Extension.trigger,
    default_name: str | None = None,
    priority: int = Extension.priority,
    finalizer: ExtensionLike = _noop_hook,
    initializer: ExtensionLike = _noop_hook,
    on_error: _OnError = _noop_on_error,
) -> Callable[[ExtensionLike], ExtensionLike]:
    """Decorator turning a function ``f(manager)`` into an extension (as ppe's).

    It only sets attributes on the function: ``trigger``, ``default_name`` (the function name if
    not given), ``priority``, ``finalize``, ``initialize`` and ``on_error``.

    Args:
        trigger: Default trigger.
        default_name: Default name.
        priority: Default priority.
        finalizer: Called as ``finalizer(manager)`` by ``manager.finalize()``.
        initializer: Called as ``initializer(manager)`` before the first iteration.
        on_error: Called as ``on_error(manager, exc, tb)`` when training raises.
    """

    def decorator(ext: ExtensionLike) -> ExtensionLike:
        target: Any = ext
        target.trigger = trigger
        target.default_name = default_name or ext.__name__  # type: ignore[attr-defined]
        target.priority = priority
        target.finalize = finalizer
        target.initialize = initializer
        target.on_error = on_error
        return ext

    return decorator


def _as_extension(ext: ExtensionLike) -> Extension:
    return ext if isinstance(ext, Extension) else _WrappedExtension(ext)


class ExtensionEntry:
    """An extension with the name, trigger and priority it runs under (as ppe's).

    Options left ``None`` are taken from the extension's attributes.

    Args:
        extension: The extension (any callable taking the manager).
        name: Registration name; ``'training'`` is reserved.
        priority: Invocation priority; higher runs earlier.
        trigger: Anything :func:`~snapkeep.training.triggers.get_trigger` accepts.
        call_before_training: Also run the extension once before the first iteration.

    Raises:
        ValueError: ``name`` is ``'training'``, or the trigger is invalid.
    """

    def __init__(
        self,
        extension: ExtensionLike,
        *,
        name: str | None = None,
        priority: int | None = None,
        trigger: TriggerLike = None,
        call_before_training: bool = False,
    ) -> None:
        self.extension = _as_extension(extension)
        self.priority = priority if priority is not None else self.extension.priority
        self.call_before_training = call_before_training
        self._update_trigger(trigger if trigger is not None else self.extension.trigger)
        self._update_name(name or self.extension.name or self.extension.default_name)

    def _update_trigger(self, trigger: TriggerLike) -> None:
        self.trigger = _trigger_util.get_trigger(trigger)

    def _update_name(self, name: str) -> None:
        if name == "training":
            raise ValueError("name 'training' is reserved and cannot name an extension")
        self.name = name
        self.extension.name = name

    def state_dict(self) -> dict[str, Any]:
        """Returns ``{'extension': ..., 'trigger': ...}`` (ppe's layout)."""
        return {
            "extension": self.extension.state_dict(),
            "trigger": self.trigger.state_dict(),
        }

    def load_state_dict(self, to_load: dict[str, Any]) -> None:
        """Restores the extension and trigger state; missing parts are left as they are."""
        if "extension" in to_load:
            self.extension.load_state_dict(to_load["extension"])
        if "trigger" in to_load:
            self.trigger.load_state_dict(to_load["trigger"])
