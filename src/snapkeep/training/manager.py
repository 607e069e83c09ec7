"""The training-loop manager (as ppe's ``training/manager.py`` ``ExtensionsManager``).

The user owns the loop; the manager counts iterations, opens a reporting scope per iteration,
runs extensions whose triggers fire, and saves/restores the whole training state::

    manager = ExtensionsManager(model, optimizer, max_epochs=10, iters_per_epoch=len(loader))
    manager.extend(extensions.snapshot(), trigger=(1, "epoch"))
    while not manager.stop_trigger:
        for batch in loader:
            with manager.run_iteration(step_optimizers=["main"]):
                loss = model(batch)
                snapkeep.report({"loss": loss})
                loss.backward()

Extensions (as ppe's): registered (``extend``, ``get_extension``), started once (each
``initialize``, then those with ``call_before_training``), run after each iteration when their
triggers fire, in priority order (``PRIORITY_SNAPSHOT`` last), and ``on_error`` once when an
iteration raises. The state dict's layout is :mod:`._manager_state`.
"""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import logging
import numbers
import time
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch

import snapkeep.reporting as reporting
from snapkeep.distributed import end_if_orphaned
from snapkeep.training._manager_protocol import (
    ExtensionsManagerProtocol,
    StateObjectProtocol,
    WriterLike,
)
from snapkeep.training._manager_state import (
    PPE_VERSION_KEY,
    RNG_STATE_KEY,
    VERSION_KEY,
    load_manager_state,
    manager_state,
)
from snapkeep.training._trigger_util import Trigger, TriggerLike, get_trigger
from snapkeep.training.extension import (
    PRIORITY_SNAPSHOT,
    Extension,
    ExtensionEntry,
    ExtensionLike,
)

__all__ = ["ExtensionsManager", "PPE_VERSION_KEY", "VERSION_KEY", "RNG_STATE_KEY"]

logger = logging.getLogger(__name__)

_get_time = time.perf_counter
TransformModel = Callable[[str, torch.nn.Module], torch.nn.Module]


class _StopAtOnce(Trigger):
    """Stop trigger of ``max_epochs=0``: training is over before it starts."""

    def __call__(self, manager: Any) -> bool:
        return True

    def get_training_length(self) -> tuple[float, str]:
        return (0, "epoch")


def _identity_transform(name: str, model: torch.nn.Module) -> torch.nn.Module:
    return model


class ExtensionsManager:
    """Keeps the training status, runs extensions and saves/restores training state.

    Behaviour follows ppe 0.9.0's ``ExtensionsManager``:

    * Extensions run after each iteration in descending priority (ties: registration order);
      those at ``PRIORITY_SNAPSHOT`` run after every other extension of the iteration.
    * Extensions are started lazily, on the first ``run_iteration`` or the first read of a
      status property (``iteration``, ``models``, ``stop_trigger`` ...): each extension's
      ``initialize`` runs, then those registered with ``call_before_training``.
    * ``on_error`` of every extension runs (once per manager) when an iteration raises.
    * When the stop trigger fires at the end of ``run_iteration`` the manager finalizes itself.

    Writer use: the constructor calls ``writer.initialize(manager.out)``; ``manager.out`` is
    ``writer.out_dir``; ``finalize()`` calls ``writer.finalize()`` after the extensions'
    ``finalize``. Extensions (snapshots) call the writer; the manager never does.

    Args:
        models: A module (registered as ``'main'``) or a mapping of names to modules.
        optimizers: An optimizer (registered as ``'main'``) or a mapping of names to optimizers.
        max_epochs: Training length in epochs, >= 0; ignored when ``stop_trigger`` is given.
            0 makes a manager that only loads (``stop_trigger`` is ``True`` at once), as ppe
            allows.
        iters_per_epoch: Iterations per epoch, >= 1.
        extensions: Extensions to register with their default options.
        out_dir: Output directory of the default writer (ignored when ``writer`` is given).
        stop_trigger: When training ends; default ``(max_epochs, 'epoch')``.
        writer: Writer for extensions; default ``snapkeep.writing.SimpleWriter(out_dir=out_dir)``.
        transform_model: ``fn(name, model) -> model`` applied when extensions read ``models``
            (for example to unwrap ``DistributedDataParallel``).
        enable_profile: Wrap each extension call in ``torch.profiler.record_function``.
        enable_trace: Accepted for ppe compatibility; ppe's timeline tracing is not implemented
            and a ``True`` value only emits a warning.
        state_objects: Names to objects with ``state_dict``/``load_state_dict`` whose state is
            saved and restored with the manager's.
        save_rng_state: Let snapkeep's snapshot extension save Python's, NumPy's, torch's CPU
            and CUDA RNG states in its part of the state dict and restore them when it loads,
            so a resumed run draws the same numbers as an uninterrupted one (also restores the
            top-level ``_rng_state`` of snapkeep 0.1.0 snapshots). snapkeep addition.

    Raises:
        ValueError: ``iters_per_epoch < 1``, ``models`` is neither a module nor a mapping, or a
            trigger is invalid.
        TypeError: ``iters_per_epoch`` is not an integer.
    """

    def __init__(
        self,
        models: torch.nn.Module | Mapping[str, torch.nn.Module],
        optimizers: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer],
        max_epochs: int,
        *,
        iters_per_epoch: int,
        extensions: Sequence[ExtensionLike] | None = None,
        out_dir: str = "result",
        stop_trigger: TriggerLike = None,
        writer: WriterLike | None = None,
        transform_model: TransformModel = _identity_transform,
        enable_profile: bool = False,
        enable_trace: bool = False,
        state_objects: Mapping[str, StateObjectProtocol] | None = None,
        save_rng_state: bool = True,
    ) -> None:
        if isinstance(iters_per_epoch, bool) or not isinstance(iters_per_epoch, numbers.Integral):
            raise TypeError(f"iters_per_epoch must be an int >= 1, got {iters_per_epoch!r}")
        if iters_per_epoch < 1:
            raise ValueError(f"iters_per_epoch must be >= 1, got {iters_per_epoch!r}")
        if stop_trigger is None and (isinstance(max_epochs, bool)
                                     or not isinstance(max_epochs, numbers.Real)):
            raise TypeError(f"max_epochs must be a number of epochs (an int >= 0), got "
                            f"{max_epochs!r} ({type(max_epochs).__name__})")
        if stop_trigger is None and not max_epochs >= 0:
            raise ValueError(f"max_epochs must be >= 0 (0: a manager that only loads), got "
                             f"{max_epochs!r}")
        if isinstance(models, collections.abc.Mapping):
            self._models: Mapping[str, torch.nn.Module] = models
        elif isinstance(models, torch.nn.Module):
            self._models = {"main": models}
        else:
            raise ValueError(
                f"models must be a torch.nn.Module or a mapping of names to modules, "
                f"got {type(models).__name__}"
            )
        # Not type-checked (as ppe): tests and users pass optimizer-like objects.
        self._optimizers: Mapping[str, Any] = (
            optimizers if isinstance(optimizers, collections.abc.Mapping) else {"main": optimizers}
        )
        self.max_epochs: int = max_epochs
        if stop_trigger is None and max_epochs == 0:
            stop_trigger = _StopAtOnce()
        self._stop_trigger: Trigger = get_trigger(
            (max_epochs, "epoch") if stop_trigger is None else stop_trigger
        )
        # Stateful triggers: the copy consulted by run_iteration must not advance the one the
        # user polls through `stop_trigger`.
        self._internal_stop_trigger: Trigger = copy.deepcopy(self._stop_trigger)
        self._iters_per_epoch_value: int = int(iters_per_epoch)
        self._transform_model: TransformModel = transform_model
        self._state_objects: Mapping[str, StateObjectProtocol] = dict(state_objects or {})
        self._save_rng_state: bool = save_rng_state
        self._enable_profile: bool = enable_profile
        if enable_trace:
            warnings.warn(
                "enable_trace is accepted for ppe compatibility but snapkeep does not trace; "
                "use enable_profile with torch.profiler instead",
                UserWarning,
                stacklevel=2,
            )

        self._out: str = out_dir
        if writer is None:
            from snapkeep.writing import SimpleWriter

            writer = SimpleWriter(out_dir=out_dir)
        self.writer: WriterLike = writer
        self.observation: reporting.Observation = {}
        self.reporter: reporting.Reporter = reporting.Reporter()
        for name, model in self._models.items():
            observed = self._transform_model(name, model)
            self.reporter.add_observer(name, observed)
            if isinstance(observed, torch.nn.Module):
                self.reporter.add_observers(name, observed.named_modules())

        self._iteration: int = 0
        self.execution: int = 0
        self._start_iteration: int = 0
        self._start_execution: int = 0
        self._start_time: float | None = None
        self._start_extensions_called: bool = False
        self._run_on_error_called: bool = False
        self._finalized: bool = False
        # bodies tolerated after the stop trigger finalized a run resumed mid-epoch
        self._overrun_left: int = 0
        # Extensions may read `models` only in iterations where one that declares
        # `needs_model_state` may fire (ppe's rule); outside run_extensions always.
        self._model_available: bool = True
        self._extensions: dict[str, ExtensionEntry] = {}
        self.extensions: list[tuple[str, ExtensionEntry]] = []
        for ext in extensions or []:
            self.extend(ext)
        self.writer.initialize(self.out)

    # -- extensions -------------------------------------------------------------------------
    @property
    def _as_manager(self) -> ExtensionsManagerProtocol:
        """This object, as extensions and triggers receive it (the manager itself)."""
        return cast(ExtensionsManagerProtocol, self)

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
        its snapshot is published now (see :mod:`snapkeep._core.save.overlap`)."""
        for _, entry in self.extensions:
            settle = getattr(entry.extension, "settle_staging", None)
            if callable(settle):
                settle()

    def _run_on_error(self, exc: Exception) -> None:
        if self._run_on_error_called:
            return
        # a torchrun worker whose agent was killed: the error is most likely a collective with
        # a peer worker that already ended for that reason; end the same way, no traceback
        end_if_orphaned()
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

    # -- status -----------------------------------------------------------------------------
    # Reading the status starts the extensions first: a snapshot extension may restore the
    # state in its `initialize`.

    @property
    def iteration(self) -> int:
        """Completed iterations (incremented before the extensions of an iteration run)."""
        self.start_extensions()
        return self._iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self._iteration = value

    @property
    def _iters_per_epoch(self) -> int:
        return self._iters_per_epoch_value

    @property
    def epoch(self) -> int:
        """Completed epochs: ``iteration // iters_per_epoch``."""
        return self.iteration // self._iters_per_epoch_value

    @property
    def epoch_detail(self) -> float:
        """Fractional epochs: ``iteration / iters_per_epoch``."""
        return self.iteration / self._iters_per_epoch_value

    @property
    def is_before_training(self) -> bool:
        """``True`` while no iteration has completed."""
        return self.iteration == 0

    @property
    def elapsed_time(self) -> float:
        """Seconds since the first ``run_iteration`` of this manager (not of the resumed run).

        Raises:
            RuntimeError: Before the first ``run_iteration``.
        """
        if self._start_time is None:
            raise RuntimeError("elapsed_time is unavailable before the first run_iteration")
        return _get_time() - self._start_time

    @property
    def stop_trigger(self) -> bool:
        """Evaluates the stop trigger; ``True`` when training should end."""
        self.start_extensions()
        return self._stop_trigger(self)

    @property
    def out(self) -> str:
        """Output directory: the writer's ``out_dir``, or the manager's ``out_dir`` when the writer
        has none (ppe returned ``''`` there, so queued snapshots landed in the working directory).
        """
        return str(getattr(self.writer, "out_dir", "") or self._out)

    @property
    def models(self) -> Mapping[str, torch.nn.Module]:
        """Models after ``transform_model``.

        Raises:
            RuntimeError: Read by an extension in an iteration where no extension declaring
                ``needs_model_state = True`` may fire (as ppe).
        """
        self.start_extensions()
        self._check_model_available()
        return {name: self._transform_model(name, m) for name, m in self._models.items()}

    @property
    def raw_models(self) -> Mapping[str, torch.nn.Module]:
        """Models as given to the constructor (same access rule as :attr:`models`)."""
        self.start_extensions()
        self._check_model_available()
        return self._models

    @property
    def optimizers(self) -> Mapping[str, torch.optim.Optimizer]:
        """Optimizers by name."""
        self.start_extensions()
        return self._optimizers

    @property
    def updater(self) -> ExtensionsManager:
        """Deprecated alias of the manager itself (ppe deprecated it in v0.3.0)."""
        warnings.warn(
            "`updater` is deprecated; use the manager's iteration, epoch and epoch_detail "
            "(e.g. 'snapshot_iter_{.iteration}' instead of 'snapshot_iter_{.updater.iteration}')",
            DeprecationWarning,
            stacklevel=2,
        )
        return self

    def _check_model_available(self) -> None:
        if not self._model_available:
            raise RuntimeError(
                "models cannot be accessed by extensions in this iteration; an extension that "
                "reads models must declare `needs_model_state = True`"
            )

    @contextlib.contextmanager
    def run_iteration(self, *, step_optimizers: Sequence[str] | None = None) -> Iterator[None]:
        """Context manager wrapping the body of one training iteration.

        On entry: starts the extensions (first call), opens a fresh ``observation`` and makes
        the manager's reporter current, calls ``zero_grad()`` on ``step_optimizers``. On normal
        exit: ``step()`` on them, ``iteration += 1``, runs the extensions, then finalizes the
        manager if the stop trigger fires. If the body or an extension raises, every
        extension's ``on_error`` runs (once per manager) and the exception propagates.

        After a resume ``r`` iterations into an epoch, a ``for batch in loader`` loop whose
        loader position was not saved (``snapshot(loaders=...)``) runs ``r`` iterations past
        the end: those ``r`` calls after the stop trigger finalized the manager run the body
        uncounted (no zero_grad/step, no extension) with one warning, instead of raising
        (snapkeep addition; ppe raises).

        Args:
            step_optimizers: Names of optimizers to zero and step around the body.

        Raises:
            RuntimeError: The manager was already finalized (beyond the tolerance above).
            KeyError: A name in ``step_optimizers`` is not a registered optimizer.
        """
        if self._finalized:
            if self._overrun_left > 0:  # a loader epoch that outlasts a resumed run's end
                self._overrun_left -= 1
                self._warn_overrun()
                with self.reporter.scope({}):
                    yield
                return
            raise RuntimeError(
                "Attempted to run a finalized manager (a closed manager: finalize() already ran)")
        names = list(step_optimizers or [])
        unknown = [n for n in names if n not in self._optimizers]
        if unknown:
            raise KeyError(
                f"step_optimizers names unknown optimizers {unknown}; "
                f"registered: {sorted(self._optimizers)}"
            )
        if self._start_time is None:
            self._start_time = _get_time()
            self.start_extensions()
        self.observation = {}
        with self.reporter.scope(self.observation):
            try:
                for n in names:
                    self._optimizers[n].zero_grad()
                yield
                for n in names:
                    self._optimizers[n].step()
                self._settle_staging()  # a safe point for a snapshot's background copy
                self.iteration += 1
                self.execution += 1
                self.run_extensions()
            except Exception as exc:
                self._run_on_error(exc)
                raise
        if self._internal_stop_trigger(self):
            self._overrun_left = self._start_iteration % self._iters_per_epoch_value
            self.finalize()

    def _warn_overrun(self) -> None:
        if getattr(self, "_overrun_warned", False):
            return
        self._overrun_warned = True
        logger.warning(
            "training ended at iteration %d, but the loop's data loader epoch goes on because "
            "the run resumed %d iterations into an epoch without the loader's position: its "
            "remaining run_iteration bodies run uncounted (no zero_grad/step, no extensions); "
            "pass extensions.snapshot(..., loaders={'train': loader}) to resume exactly",
            self._iteration, self._start_iteration % self._iters_per_epoch_value)

    def finalize(self) -> None:
        """Finalizes the started extensions, then the writer; idempotent.

        The writer is finalized even if an extension's ``finalize`` raises.
        """
        if self._finalized:
            return
        self._finalized = True
        logger.debug("finalizing manager at iteration %d (out=%s)", self._iteration, self.out)
        try:
            if self._start_extensions_called:
                for _, entry in self.extensions:
                    hook = getattr(entry.extension, "finalize", None)
                    if callable(hook):
                        hook(self)
        finally:
            self.writer.finalize()

    def __enter__(self) -> ExtensionsManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.finalize()

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Returns the training state, in ppe 0.9.0's layout.

        Keys: ``_start_iteration``, ``_start_execution``, ``models``, ``optimizers``,
        ``state_objects``, ``extensions`` (each ``{'extension': ..., 'trigger': ...}``) and
        ``ppe_version`` (snapkeep's version). RNG and stop trigger states are in the snapshot
        extension's ``'extension'`` part. The dict loads with ``torch.load(weights_only=True)``
        when the models, optimizers, extensions and state objects return such values.
        """
        return manager_state(self)

    def load_state_dict(self, to_load: Mapping[str, Any]) -> None:
        """Restores a state produced by :meth:`state_dict` or by ppe's manager.

        Warns (``UserWarning``) when the dict was saved by another snapkeep version or records
        no version at all; a ppe dict (``'ppe_version'``) loads without warning. Extensions
        registered now but missing from the dict keep their state (logged). RNG states are
        restored only with ``save_rng_state``.

        Raises:
            KeyError: A model, optimizer or state object has no entry in the dict.
        """
        load_manager_state(self, to_load, restore_rng=self._save_rng_state)
