"""The extensions half of :class:`~snapkeep.training.manager.ExtensionsManager` (as ppe's):
registering them (``extend``, ``get_extension``), starting them once (each ``initialize``, then
those with ``call_before_training``), running those whose triggers fire after each iteration in
priority order (``PRIORITY_SNAPSHOT`` last), and ``on_error`` once when an iteration raises.

:class:`ExtensionsRunner` is a base of the manager; the manager's ``__init__`` sets the attributes
it declares.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import torch

from snapkeep import reporting
from snapkeep.training._trigger_util import TriggerLike
from snapkeep.training.extension import (
    PRIORITY_SNAPSHOT,
    Extension,
    ExtensionEntry,
    ExtensionLike,
)

if TYPE_CHECKING:
    from snapkeep.training._manager_protocol import ExtensionsManagerProtocol

logger = logging.getLogger(__name__)


class ExtensionsRunner:
    """Registers, starts and runs the manager's extensions (see the module docstring).

    Attributes (set by the manager's ``__init__``):
        extensions: ``(name, entry)`` pairs in run order, once started.
        observation: the current iteration's reported values.
        reporter: the manager's reporter.
        execution: iterations run by this manager.
    """

    extensions: list[tuple[str, ExtensionEntry]]
    observation: reporting.Observation
    reporter: reporting.Reporter
    execution: int
    _extensions: dict[str, ExtensionEntry]
    _start_extensions_called: bool
    _run_on_error_called: bool
    _model_available: bool
    _enable_profile: bool
    _iteration: int
    _iters_per_epoch_value: int

    @property
    def iteration(self) -> int:
        """Completed iterations (the manager's)."""
        raise NotImplementedError

    @property
    def _as_manager(self) -> ExtensionsManagerProtocol:
        """This object, as extensions and triggers receive it (the manager itself)."""
        return cast("ExtensionsManagerProtocol", self)

    def extend(
        self,
        extension: ExtensionLike | ExtensionEntry,
        name: str | None = None,
        trigger: TriggerLike = None,
        priority: int | None = None,
        *,
        call_before_training: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """Registers an extension (as ppe's ``extend``).

        Args:
            extension: An extension (callable taking the manager) or an :class:`ExtensionEntry`.
            name: Name; default ``extension.name`` or ``extension.default_name``. A taken name
                gets the suffix ``_1``, ``_2``, ...
            trigger: When to run; default the extension's ``trigger`` (every iteration).
            priority: Higher runs earlier; default the extension's ``priority``.
            call_before_training: Also run once before the first iteration.
            **kwargs: Accepted and ignored, for signature compatibility with ppe.

        Raises:
            RuntimeError: The extensions were already started.
            ValueError: The name is ``'training'`` or the trigger is invalid.
        """
        if self._start_extensions_called:
            raise RuntimeError("extend() called after the extensions were started")
        entry = extension if isinstance(extension, ExtensionEntry) else ExtensionEntry(extension)
        if trigger is not None:
            entry._update_trigger(trigger)
        if priority is not None:
            entry.priority = priority
        if call_before_training is not None:
            entry.call_before_training = call_before_training
        base = name or entry.name
        unique, ordinal = base, 0
        while unique in self._extensions:
            ordinal += 1
            unique = f"{base}_{ordinal}"
        entry._update_name(unique)
        self._extensions[unique] = entry

    def get_extension(self, name: str) -> Extension:
        """Returns the extension registered as ``name``.

        Raises:
            ValueError: No extension has that name (as ppe).
        """
        try:
            return self._extensions[name].extension
        except KeyError:
            raise ValueError(
                f"extension {name!r} not found; registered: {sorted(self._extensions)}"
            ) from None

    def start_extensions(self) -> None:
        """Initializes the extensions and runs those with ``call_before_training``; once."""
        if self._start_extensions_called:
            return
        self._start_extensions_called = True  # set first: initialize() reads the status
        self.extensions = sorted(
            self._extensions.items(), key=lambda item: item[1].priority, reverse=True
        )
        for _, entry in self.extensions:
            if not getattr(entry.trigger, "finished", False):
                entry.extension.initialize(self._as_manager)
        self.observation = {}
        with self.reporter.scope(self.observation):
            for name, entry in self.extensions:
                if entry.call_before_training:
                    self._call_extension(name, entry.extension)

    def needs_model_state(self, iteration: int | None = None) -> bool:
        """Whether an extension declaring ``needs_model_state`` may fire at ``iteration``.

        Args:
            iteration: Iteration count to ask about; default the next one.
        """
        if iteration is None:
            iteration = self.iteration + 1
        return any(
            getattr(entry.extension, "needs_model_state", False)
            and entry.trigger.may_fire(iteration, self._iters_per_epoch_value)
            for entry in self._extensions.values()
        )

    def needs_state_this_iteration(self) -> bool:
        """ppe compatibility: ``needs_model_state`` for the next execution."""
        return self.needs_model_state(self.execution + 1)

    def _call_extension(self, name: str, extension: ExtensionLike) -> None:
        if self._enable_profile:
            label = f"snapkeep.training.ExtensionsManager.run_extensions:{name}"
            with torch.profiler.record_function(label):
                extension(self._as_manager)
        else:
            extension(self._as_manager)

    def run_extensions(self) -> None:
        """Runs the extensions whose triggers fire at the current iteration.

        Every trigger is evaluated in priority order and non-snapshot extensions run as soon as
        their trigger fires (their reports can feed later triggers). Extensions at
        ``PRIORITY_SNAPSHOT`` run last, once every trigger of the iteration has been evaluated,
        so a snapshot never records a trigger state that is about to change (as ppe).
        """
        self._model_available = self.needs_model_state(self.iteration)
        try:
            deferred: list[tuple[str, Extension]] = []
            for name, entry in self.extensions:
                if not entry.trigger(self._as_manager):
                    continue
                if entry.priority == PRIORITY_SNAPSHOT:
                    deferred.append((name, entry.extension))
                else:
                    self._call_extension(name, entry.extension)
            for name, extension in deferred:
                self._call_extension(name, extension)
        finally:
            self._model_available = True

    def _settle_staging(self) -> None:
        """The end of ``run_iteration``: a safe point for overlapped staging. Extensions with a
        ``settle_staging()`` (snapkeep's snapshot) validate a background copy that is done, so
        its snapshot is published now (see :mod:`snapkeep._core.overlap`)."""
        for _, entry in self.extensions:
            settle = getattr(entry.extension, "settle_staging", None)
            if callable(settle):
                settle()

    def _run_on_error(self, exc: Exception) -> None:
        if self._run_on_error_called:
            return
        self._run_on_error_called = True
        tb = exc.__traceback__
        if tb is None:  # only for exceptions created but never raised
            return
        for name, entry in self.extensions:
            try:
                entry.extension.on_error(self._as_manager, exc, tb)
            except Exception:
                logger.exception(
                    "on_error of extension %r failed at iteration %d", name, self._iteration
                )
