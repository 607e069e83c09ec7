"""Capture and restore of the global random number generators, for exact continuation.

The captured dict only holds values that ``torch.load(..., weights_only=True)`` accepts and that
compare with ``==`` (so two manager state_dicts can be compared, as ppe's tests do): bytes, ints,
floats, str, None, tuples, lists and dicts. Generator states are ``bytes``; NumPy's key array is a
tuple of ints; Python's state stays a tuple of ints.

Layout (keys present only when the generator exists)::

    {'python': (version, (int, ...), gauss_next),
     'numpy': ('MT19937', (int, ...) of 624, pos, has_gauss, cached_gaussian),
     'torch': bytes (CPU generator),
     'cuda': [bytes, ...] (one per visible device, if CUDA was initialized)}
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import random
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

__all__ = ["RngStream", "capture_rng_state", "restore_rng_state"]

logger = logging.getLogger(__name__)


def _numpy() -> ModuleType | None:
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


def capture_rng_state() -> dict[str, Any]:
    """Returns the state of Python's, NumPy's (if importable), torch's CPU and CUDA generators.

    CUDA states are taken only when CUDA is available and already initialized in this process:
    before initialization no CUDA number was drawn, and capturing would initialize CUDA as a side
    effect.
    """
    return _serializable(_capture_raw())


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restores generators captured by :func:`capture_rng_state`.

    Generators missing from ``state`` are left untouched. If NumPy is not importable its saved
    state is skipped; if the number of CUDA devices differs, the common prefix is restored. Both
    cases are logged as warnings.

    Raises:
        ValueError: A saved state has the wrong shape for its generator.
    """
    if "python" in state:
        version, internal, gauss_next = state["python"]
        random.setstate((int(version), tuple(int(v) for v in internal), gauss_next))
    if "torch" in state:
        torch.set_rng_state(to_tensor(state["torch"]))
    if "numpy" in state:
        np = _numpy()
        if np is None:
            logger.warning("snapshot holds a NumPy RNG state but NumPy is not importable; skipped")
        else:
            kind, keys, pos, has_gauss, cached = state["numpy"]
            keys_array = np.asarray(
                keys.tolist() if isinstance(keys, torch.Tensor) else list(keys), dtype=np.uint32)
            np.random.set_state((kind, keys_array, int(pos), int(has_gauss), float(cached)))
    if "cuda" in state:
        _restore_cuda(list(state["cuda"]))


def _restore_cuda(saved: list[Any]) -> None:
    if not torch.cuda.is_available():
        logger.warning(
            "snapshot holds CUDA RNG states for %d device(s) but CUDA is not available; skipped",
            len(saved),
        )
        return
    count = torch.cuda.device_count()
    if count != len(saved):
        logger.warning(
            "snapshot holds CUDA RNG states for %d device(s), %d visible; restoring the first %d",
            len(saved), count, min(count, len(saved)),
        )
    for index in range(min(count, len(saved))):
        torch.cuda.set_rng_state(to_tensor(saved[index]), index)


def to_bytes(state: torch.Tensor) -> bytes:
    return bytes(state.cpu().contiguous().numpy().tobytes()) if _numpy() is not None \
        else bytes(state.cpu().tolist())


def to_tensor(state: Any) -> torch.Tensor:
    """A saved generator state (bytes, or a uint8 tensor from older snapshots) as a tensor."""
    if isinstance(state, (bytes, bytearray)):
        return torch.tensor(list(state), dtype=torch.uint8)
    return torch.as_tensor(state, dtype=torch.uint8)


class RngState:
    """The global RNG states (Python, NumPy, torch CPU and CUDA) as a state object.

    For ppe's own snapshot extension, which saves no RNG state: register it with ppe's manager,
    ``ExtensionsManager(..., state_objects={'rng': RngState()})``, and the manager's
    ``state_dict()`` carries the states and ``load_state_dict()`` restores them. snapkeep's
    snapshot extension does this by itself.
    """

    def state_dict(self) -> dict[str, Any]:
        """The states (see :func:`capture_rng_state`)."""
        return capture_rng_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore states from :meth:`state_dict`."""
        restore_rng_state(state)


class RngStream:
    """The global generators' stream as a framework's training steps see it, kept across the
    work the framework does between two steps.

    Between the end of one training step and the start of the next, a framework draws from the
    global generators for its own machinery: Lightning builds data loader iterators (each draws a
    base seed, ``torch.utils.data.DataLoader.__iter__``; a ``RandomSampler`` without
    ``generator=`` draws its seed), runs validation (its loader's iterator draws too) and
    constructs loaders after a resume. Which of these run differs between an uninterrupted run
    and one resumed from a snapshot (a resumed run builds its iterator once more; it skips the
    validation that followed the snapshot), so restoring the generators at load time leaves the
    resumed steps some draws off. This stream makes each step start from the state the previous
    step ended with, whatever ran between:

    * :meth:`step_end` (at the end of each training step, before a snapshot of it is taken)
      records the states (Python, NumPy, torch CPU, CUDA where initialized) and reseeds the
      generators for the framework's work in between from a digest of that state (so the
      machinery never draws the numbers the next step will);
    * :meth:`step_start` (at the start of each training step) sets them back to what
      :meth:`step_end` recorded;
    * :meth:`epoch_start` (just before the framework builds the next epoch's loader iterator,
      or a resumed run rebuilds it) reseeds them from the recorded state with another salt, so
      the draws that order an epoch (base seeds, a sampler's seed) do not depend on what ran
      before them (validation);
    * :meth:`state_dict` is the recorded state (in :func:`capture_rng_state`'s layout, so
      older snapshots load); :meth:`load_state_dict` restores it, as if :meth:`step_end` had
      just recorded it.

    The uninterrupted run and a resumed run then draw the same numbers in every step, dropout
    included. The draws made between steps come from streams seeded from the recorded state:
    the same in both runs, different from a run without snapkeep. Cost per step: one capture
    and one restore of the states (about 5 KB each) and three reseeds.

    Not thread-safe: the training thread calls it. Before the first :meth:`step_end` (a fresh
    run) :meth:`step_start` records the state it finds and :meth:`epoch_start` does nothing.
    """

    def __init__(self) -> None:
        self._recorded: dict[str, Any] | None = None  # raw states, as the generators give them

    def step_end(self) -> None:
        """Record the states at the end of a training step, then reseed for the work between
        steps."""
        self._recorded = _capture_raw()
        self._reseed(b"between")

    def step_start(self) -> None:
        """Set the states the last :meth:`step_end` (or :meth:`load_state_dict`) recorded; in
        a fresh run, record the states found."""
        if self._recorded is None:
            self._recorded = _capture_raw()
        else:
            _restore_raw(self._recorded)

    def epoch_start(self) -> None:
        """Reseed for the draws that build the next epoch's iterator (no-op in a fresh run's
        first epoch)."""
        if self._recorded is not None:
            self._reseed(b"epoch")

    @property
    def recorded(self) -> bool:
        """Whether a state was recorded (a step ended, or a snapshot was loaded)."""
        return self._recorded is not None

    def state_dict(self) -> dict[str, Any]:
        """The recorded states in :func:`capture_rng_state`'s layout (the states now, when
        nothing was recorded yet)."""
        if self._recorded is None:
            return capture_rng_state()
        return _serializable(self._recorded)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state`` (:meth:`state_dict`'s or :func:`capture_rng_state`'s), record it
        as the state the next step starts from, and reseed for the work before that step.

        Raises:
            ValueError: a saved state has the wrong shape for its generator.
        """
        restore_rng_state(state)
        self._recorded = _capture_raw()
        self._reseed(b"between")

    def _reseed(self, salt: bytes) -> None:
        recorded = self._recorded
        assert recorded is not None  # noqa: S101 - callers check
        digest = hashlib.blake2b(recorded["torch"].numpy().tobytes() if _numpy() is not None
                                 else bytes(recorded["torch"].tolist()), digest_size=8,
                                 person=b"snapkeep-rng", salt=salt[:16]).digest()
        seed = int.from_bytes(digest, "little")
        random.seed(seed)
        torch.default_generator.manual_seed(seed)
        np = _numpy()
        if np is not None:
            np.random.seed(seed % 2**32)
        if "cuda" in recorded:
            for index in range(torch.cuda.device_count()):
                torch.cuda.default_generators[index].manual_seed(seed)


def _capture_raw() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        state["numpy"] = np.random.get_state(legacy=True)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_raw(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np = _numpy()
        if np is not None:
            np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _serializable(raw: Mapping[str, Any]) -> dict[str, Any]:
    version, internal, gauss_next = raw["python"]
    state: dict[str, Any] = {"python": (int(version), tuple(int(v) for v in internal),
                                        gauss_next),
                             "torch": to_bytes(raw["torch"])}
    if "numpy" in raw:
        kind, keys, pos, has_gauss, cached = raw["numpy"]
        state["numpy"] = (str(kind), tuple(int(k) for k in keys), int(pos), int(has_gauss),
                          float(cached))
    if "cuda" in raw:
        state["cuda"] = [to_bytes(t) for t in raw["cuda"]]
    return state
