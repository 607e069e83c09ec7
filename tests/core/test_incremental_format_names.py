"""The module path of the incremental format is on disk: a skeleton's pickle names
``<module>.open_incremental_snapshot`` and ``<module>.tensor_ref``. Skeletons written before the
core moved into sub-packages name ``snapkeep._core.tiers.incremental``; they must still open,
through
the weights-only reader and through ``weights_only=False``."""

from __future__ import annotations

import io
import pickle
import sys
import types

import pytest
import torch

from snapkeep._core.load.loading import SAFE_GLOBALS
from snapkeep._core.tiers import incremental
from snapkeep.errors import IncrementalSnapshotError


def _skeleton_bytes(module: str) -> bytes:
    """A ``torch.save`` stream of a skeleton whose globals name ``module``."""
    fake = types.ModuleType(module)

    def open_incremental_snapshot(*args):  # pragma: no cover - never called here
        raise AssertionError

    def tensor_ref(*args):  # pragma: no cover - never called here
        raise AssertionError

    for fn in (open_incremental_snapshot, tensor_ref):
        fn.__module__ = module
        fn.__qualname__ = fn.__name__
        setattr(fake, fn.__name__, fn)
    if module == incremental.__name__:  # today's path: the real functions
        open_incremental_snapshot, tensor_ref = (incremental.open_incremental_snapshot,
                                                 incremental.tensor_ref)

    class LegacyPickler(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, incremental.Skeleton):
                return open_incremental_snapshot, (incremental.FORMAT, obj.area,
                                                   [list(s) for s in obj.storages], obj.tree)
            if isinstance(obj, incremental.TensorRef):
                return tensor_ref, tuple(obj.__reduce__()[1])
            return NotImplemented

    module_like = types.SimpleNamespace(Pickler=LegacyPickler, __name__="legacy_pickle")

    ref = incremental.TensorRef(storage=0, dtype="float32", shape=(2, 3), stride=(3, 1),
                                offset=0)
    skeleton = incremental.Skeleton(area=".snapkeep/blobs/snap-0123456789ab",
                                    storages=(("ab" * 16, 24),),
                                    tree={"model": {"w": ref}, "step": 7})
    legacy = module != incremental.__name__
    if legacy:
        sys.modules[module] = fake
    try:
        buf = io.BytesIO()
        torch.save(skeleton, buf, pickle_module=module_like)
    finally:
        if legacy:
            del sys.modules[module]
    data = buf.getvalue()
    assert module.encode() in data
    return data


@pytest.mark.parametrize("module", [incremental.LEGACY_MODULE, incremental.__name__])
def test_a_skeleton_naming_either_module_path_opens(module: str) -> None:
    data = _skeleton_bytes(module)
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        opened = torch.load(io.BytesIO(data), weights_only=True)
    assert isinstance(opened, incremental.Skeleton)
    assert opened.area == ".snapkeep/blobs/snap-0123456789ab"
    assert opened.tree["step"] == 7 and opened.tree["model"]["w"].shape == (2, 3)
    unsafe = torch.load(io.BytesIO(data), weights_only=False,
                        pickle_module=incremental.PICKLE_MODULE)
    assert unsafe == opened


def test_the_legacy_name_is_the_pre_recut_path_and_a_bare_load_still_refuses() -> None:
    assert incremental.LEGACY_MODULE == "snapkeep._core" + ".incremental"
    assert incremental.LEGACY_MODULE != incremental.__name__
    with pytest.raises(IncrementalSnapshotError):
        torch.load(io.BytesIO(_skeleton_bytes(incremental.__name__)), weights_only=False)
