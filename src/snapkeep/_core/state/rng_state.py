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

import importlib
import logging
import random
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

__all__ = ["capture_rng_state", "restore_rng_state"]

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
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": (int(version), tuple(int(v) for v in internal), gauss_next),
        "torch": to_bytes(torch.get_rng_state()),
    }
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = (
            str(kind),
            tuple(int(k) for k in keys),
            int(pos),
            int(has_gauss),
            float(cached),
        )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [to_bytes(t) for t in torch.cuda.get_rng_state_all()]
    return state


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
