"""Snapshot formats beyond the default ``torch.save``.

``save_safetensors`` is a ``savefun`` for state trees whose leaves are all tensors::

    snapshot_object(model, "model_iter_{.iteration}", savefun=codecs.save_safetensors)

``torch_save`` is what writers use when ``savefun`` is ``torch.save`` (the default): the same
bytes, without the zip CRC-32 that ``torch.load`` never checks.

``autoload`` (and :func:`load_safetensors`) recognise such files by their first bytes, so no
extra argument is needed to resume from them. See :mod:`snapkeep._core.format.codec` for the layout.
"""

from snapkeep._core.format.codec import (
    HEADER_PROBE_BYTES,
    is_safetensors_header,
    load_safetensors,
    save_safetensors,
    torch_save,
)

__all__ = [
    "HEADER_PROBE_BYTES", "is_safetensors_header", "load_safetensors", "save_safetensors",
    "torch_save",
]
