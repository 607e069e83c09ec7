"""Snapshot formats beyond the default ``torch.save``.

``save_safetensors`` is a ``savefun`` for state trees whose leaves are all tensors::

    snapshot_object(model, "model_iter_{.iteration}", savefun=codecs.save_safetensors)

``autoload`` (and :func:`load_safetensors`) recognise such files by their first bytes, so no
extra argument is needed to resume from them. See :mod:`snapkeep._core.codec` for the layout.
"""

from snapkeep._core.codec import load_safetensors, save_safetensors

__all__ = ["load_safetensors", "save_safetensors"]
