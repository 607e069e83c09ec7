"""How snapshot bytes are produced and read back: ``torch.save`` (the default) or safetensors.

The safetensors codec is for state trees whose leaves are all tensors (a module's
``state_dict``, or a dict of them). Nested dict keys are flattened with a separator
(``{'model': {'fc.weight': t}}`` -> ``'model/fc.weight'``); the separator and the paths of empty
sub-dicts are recorded in the file's ``__metadata__`` so :func:`load_safetensors` rebuilds the
same tree.

Loading detects the format from the file's first bytes, so a copied or manifest-less file still
loads: a safetensors file starts with an 8-byte little-endian header length followed by ``{``;
``torch.save`` files start with ``PK`` (zip) or ``\\x80`` (legacy pickle). safetensors never runs
code on load, so it needs no ``weights_only`` opt-in.
"""

from __future__ import annotations

import inspect
import json
import logging
import pickle
import struct
from typing import Any, BinaryIO

import torch

from snapkeep._core.format.json_records import RecordError, parse_json

logger = logging.getLogger(__name__)

#: Metadata key naming the layout written by :func:`save_safetensors`.
LAYOUT_KEY = "snapkeep.layout"
LAYOUT = "nested/1"
SEPARATOR_KEY = "snapkeep.separator"
EMPTY_KEY = "snapkeep.empty_dicts"
DEFAULT_SEPARATOR = "/"
#: Bytes of a file needed by :func:`is_safetensors_header`.
HEADER_PROBE_BYTES = 9
_MAX_HEADER_BYTES = 100 << 20


def _flatten(
    tree: Any, prefix: str, separator: str, out: dict[str, torch.Tensor], empty: list[str],
) -> None:
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
        return
    if not isinstance(tree, dict):
        where = prefix or "<root>"
        raise TypeError(
            f"save_safetensors: the leaf at {where!r} is a {type(tree).__name__}, not a tensor; "
            "safetensors stores tensors only (save a module's state_dict, or use torch.save for "
            "states with optimizer/manager values)")
    if not tree and prefix:
        empty.append(prefix)
    for key, value in tree.items():
        if not isinstance(key, str):
            raise TypeError(
                f"save_safetensors: key {key!r} under {prefix or '<root>'!r} is a "
                f"{type(key).__name__}; only str keys can be stored")
        if separator in key:
            raise ValueError(
                f"save_safetensors: key {key!r} under {prefix or '<root>'!r} contains the "
                f"separator {separator!r}; pass another separator=")
        _flatten(value, f"{prefix}{separator}{key}" if prefix else key, separator, out, empty)


_ROUND_TRIPS: dict[torch.dtype, bool] = {}


def _dtype_round_trips(dtype: torch.dtype) -> bool:
    """Whether safetensors both writes and reads back ``dtype`` as itself (measured once per
    dtype with a one-element tensor: the installed safetensors writes some dtypes, e.g.
    ``float8_e8m0fnu``, that it cannot read back)."""
    known = _ROUND_TRIPS.get(dtype)
    if known is None:
        from safetensors.torch import load, save

        try:
            back = load(save({"t": torch.zeros(1, dtype=dtype)}))["t"]
            known = back.dtype == dtype
        except Exception:  # any refusal (KeyError, SafetensorError, ...) means: not supported
            known = False
        _ROUND_TRIPS[dtype] = known
    return known


def _storable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors with no two sharing memory (safetensors refuses
    shared storages; tied weights are stored twice and load as separate tensors), their
    conjugate and negative bits resolved (safetensors writes the raw memory, so ``x.conj()``
    would otherwise be stored unconjugated)."""
    seen: set[tuple[str, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        t = tensor.detach()
        if t.layout != torch.strided:
            raise TypeError(f"save_safetensors: tensor {name!r} has layout {t.layout}; only "
                            "dense tensors can be stored")
        if not _dtype_round_trips(t.dtype):
            raise TypeError(
                f"save_safetensors: tensor {name!r} has dtype {t.dtype}, which safetensors "
                "cannot store and read back; save this state with torch.save (torch_save)")
        if t.device.type != "cpu":
            t = t.cpu()
        try:
            t = t.resolve_conj().resolve_neg()  # a copy only when a bit is set
        except (RuntimeError, NotImplementedError) as e:  # e.g. no neg kernel for float8
            raise TypeError(f"save_safetensors: tensor {name!r} is a conjugate or negative view "
                            f"of dtype {t.dtype} that torch cannot resolve ({e}); pass "
                            "tensor.clone() values, or save with torch.save") from e
        ident = (str(t.device), t.untyped_storage().data_ptr())
        full = t.is_contiguous() and t.storage_offset() == 0 \
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        if ident in seen or not full:
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add((str(t.device), t.untyped_storage().data_ptr()))
        out[name] = t
    return out


def save_safetensors(obj: Any, f: BinaryIO, *, separator: str = DEFAULT_SEPARATOR) -> None:
    """A ``savefun`` writing ``obj`` in the safetensors format (``savefun(obj, file)`` order).

    Usable wherever ``savefun=`` is accepted, e.g.
    ``snapshot_object(model, 'model_{.iteration}.safetensors', savefun=save_safetensors)``.
    The whole file is built in memory first (safetensors writes bytes), so peak memory is about
    twice the state's size.

    Args:
        obj: a tensor-leaved tree of ``str``-keyed dicts (any device; written as CPU tensors;
            any dtype that safetensors reads back, e.g. not ``complex128``; conjugate and
            negative views are written as the values they show).
        f: a writable binary file object.
        separator: joins nested keys; must not occur in any key.

    Raises:
        TypeError: a leaf is not a tensor (its path is named), a key is not a ``str``, or a
            tensor is sparse or of a dtype safetensors cannot read back (e.g.
            ``complex128``; the key is named).
        ValueError: a key contains ``separator``.
    """
    from safetensors.torch import save

    if not isinstance(separator, str) or not separator:
        raise ValueError(f"separator must be a non-empty str, got {separator!r}")
    flat: dict[str, torch.Tensor] = {}
    empty: list[str] = []
    _flatten(obj, "", separator, flat, empty)
    metadata = {LAYOUT_KEY: LAYOUT, SEPARATOR_KEY: separator, EMPTY_KEY: json.dumps(empty)}
    f.write(save(_storable(flat), metadata=metadata))


def is_safetensors_header(head: bytes, size_bytes: int | None = None) -> bool:
    """Whether a file starting with ``head`` (at least :data:`HEADER_PROBE_BYTES` bytes) is a
    safetensors file."""
    if len(head) < HEADER_PROBE_BYTES or head[8:9] != b"{":
        return False
    (header_bytes,) = struct.unpack("<Q", head[:8])
    if header_bytes > _MAX_HEADER_BYTES:
        return False
    return size_bytes is None or 8 + header_bytes <= size_bytes


def _metadata(data: bytes) -> dict[str, str]:
    (header_bytes,) = struct.unpack("<Q", data[:8])
    header = parse_json(data[8:8 + header_bytes], max_bytes=_MAX_HEADER_BYTES)
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return dict(meta) if isinstance(meta, dict) else {}


def load_safetensors(data: bytes, *, map_location: Any = "cpu") -> Any:
    """Decode a safetensors file's bytes into the tree :func:`save_safetensors` was given.

    Files without snapkeep's layout metadata (written by other tools) load as their flat
    ``{name: tensor}`` dict.

    Args:
        data: the whole file.
        map_location: ``None``/``'cpu'``, or a device (``str`` or :class:`torch.device`) to move
            the tensors to.

    Raises:
        ValueError: not a readable safetensors file, or a layout this version does not know.
        TypeError: ``map_location`` is a dict or callable (only devices are supported here).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        meta = _metadata(data)
        flat = load(data)
    except (SafetensorError, struct.error, UnicodeDecodeError, RecordError) as e:
        raise ValueError(f"not a readable safetensors file: {e}") from e
    return _tree(flat, meta, map_location)


def load_safetensors_file(path: str, *, map_location: Any = "cpu") -> Any:
    """:func:`load_safetensors` for a local file, through safetensors' own memory map: the
    tensors are views of the mapped file (copy-on-write), so nothing is read until used.

    Raises:
        ValueError, TypeError: as :func:`load_safetensors`.
        OSError: the file cannot be opened.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = dict(f.metadata() or {})
            flat = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a readable safetensors file: {e}") from e
    return _tree(flat, meta, map_location)


def _tree(flat: dict[str, torch.Tensor], meta: dict[str, str], map_location: Any) -> Any:
    """The tree :func:`save_safetensors` flattened into ``flat`` (with its ``meta``)."""
    if map_location not in (None, "cpu"):
        if not isinstance(map_location, (str, torch.device)):
            raise TypeError("safetensors snapshots support map_location as a device only, got "
                            f"{type(map_location).__name__}")
        flat = {k: v.to(map_location) for k, v in flat.items()}
    layout = meta.get(LAYOUT_KEY)
    if layout is None:
        return flat
    if layout != LAYOUT:
        raise ValueError(f"safetensors layout {layout!r} is not supported by this snapkeep "
                         f"(knows {LAYOUT!r})")
    separator = meta.get(SEPARATOR_KEY, DEFAULT_SEPARATOR)
    tree: dict[str, Any] = {}
    paths: list[tuple[str, Any]] = list(flat.items())
    try:
        empty = parse_json(meta.get(EMPTY_KEY, "[]"), max_bytes=_MAX_HEADER_BYTES)
    except RecordError as e:
        raise ValueError(f"safetensors metadata {EMPTY_KEY!r}: {e}") from None
    if not isinstance(empty, list) or not all(isinstance(n, str) for n in empty):
        raise ValueError(f"safetensors metadata {EMPTY_KEY!r} is not a list of names")
    paths += [(name, {}) for name in empty]
    for name, value in paths:
        *parents, leaf = name.split(separator)
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"safetensors layout: {name!r} lies under the tensor "
                                 f"{part!r}")
        if isinstance(node.get(leaf), dict) and not isinstance(value, dict):
            raise ValueError(f"safetensors layout: {name!r} is both a tensor and a sub-tree")
        node[leaf] = value
    return tree


# -- torch.save without the zip CRC-32 ------------------------------------------------------------
_SAVE_PARAMS = ("obj", "zip_file", "pickle_module", "pickle_protocol",
                "_disable_byteorder_record")


def _fast_save_supported() -> bool:
    """Whether this torch's internals are those :func:`torch_save` uses (checked at import; they
    are in torch 2.13). Otherwise it is plain ``torch.save``."""
    ser = torch.serialization
    try:
        params = tuple(inspect.signature(ser._save).parameters)  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return False
    return params == _SAVE_PARAMS and hasattr(ser, "_get_storage_alignment") \
        and hasattr(ser, "get_crc32_options")


_FAST_SAVE = _fast_save_supported()

#: Alignment of tensor records in the files of large states: one page, so the local commit can
#: hand the staging buffers (page-aligned) to an ``O_DIRECT`` write without a copy.
PAGE_ALIGNMENT = 4096
#: Largest share of a file the page alignment's padding (up to 4 KiB per record) may take.
_MAX_PADDING_SHARE = 1 / 64
#: Records of a ``torch.save`` file besides the tensors' (pickle, version, byte order, ...).
_OTHER_RECORDS = 8


def record_alignment(obj: Any, base: int) -> int:
    """Alignment in bytes for the tensor records of ``obj``'s file: :data:`PAGE_ALIGNMENT` when
    its padding costs at most 1/64 of the tensor bytes (states with large tensors, where a copy
    per byte matters), else ``base`` (torch's, 64 unless the user changed
    ``torch.serialization.config.save.storage_alignment``; a value that is not a divisor of a
    page is kept as is)."""
    from snapkeep._core.save.staging import iter_tensors

    if base >= PAGE_ALIGNMENT or PAGE_ALIGNMENT % base:
        return base
    sizes: dict[tuple[str, int], int] = {}
    for t in iter_tensors(obj):
        if t.device.type == "meta" or t.layout != torch.strided:
            continue  # sparse and other layouts have no one storage to count (torch saves parts)
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            continue
        sizes[(str(t.device), storage.data_ptr())] = storage.nbytes()
    padding = (len(sizes) + _OTHER_RECORDS) * PAGE_ALIGNMENT
    return PAGE_ALIGNMENT if padding <= sum(sizes.values()) * _MAX_PADDING_SHARE else base


def torch_save(obj: Any, f: BinaryIO, **kwargs: Any) -> None:
    """``torch.save(obj, f)`` without computing the zip records' CRC-32 (snapkeep's default save).

    The bytes are exactly those of ``torch.save`` with
    ``torch.serialization.set_crc32_options(False)`` (a process-wide switch this function does not
    touch): a zip whose records carry a CRC of 0; for states whose tensors are large, with the
    records aligned to 4 KiB instead of 64 bytes (as ``torch.serialization.config.save.
    storage_alignment = 4096`` does; see :func:`record_alignment`), which ``torch.load`` reads as
    any other file. ``torch.load`` never checks that CRC (a flipped
    byte in a tensor record loads silently), so it protects nothing there, and costs about 0.25
    CPU-s per GiB on one core here -- the largest CPU cost of a snapshot after the kernel's page
    cache copy. snapkeep's own XXH3-128 checksum of the whole file, recorded in the manifest and
    verified on resume, is what detects corruption. ``unzip -t`` reports CRC errors on such files;
    writers take ``zip_crc32=True`` to keep computing them (see :class:`snapkeep.writing.Writer`).

    Any keyword argument (``pickle_module``, ``pickle_protocol``, ...), a torch without the
    internals used here, or a non-file target falls back to ``torch.save(obj, f, **kwargs)``.

    Args:
        obj: what ``torch.save`` accepts.
        f: a writable binary file object (``write``/``flush``); not seeked.

    Raises:
        RuntimeError: as ``torch.save``; when two tensors share memory as different dtypes
            (``x.conj()`` and ``x.conj().imag``), the message names both paths.
    """
    try:
        _torch_save(obj, f, **kwargs)
    except RuntimeError as e:
        clash = _dtype_clash(obj)
        if clash is None:
            raise
        raise RuntimeError(f"torch_save: {clash}; torch.save cannot store two views of one "
                           "memory as different dtypes: save a .clone() of one of them") from e


def _dtype_clash(obj: Any) -> str | None:
    """The first two tensor paths of ``obj`` (dicts, lists, tuples) whose memory is shared but
    whose dtypes differ (``x.conj()`` beside ``x.conj().imag``), as a sentence; None if none."""
    seen: dict[tuple[str, int], tuple[str, torch.dtype]] = {}
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, torch.Tensor):
            try:
                key = (str(node.device), node.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # no single storage (sparse, subclass)
                continue
            first = seen.setdefault(key, (where, node.dtype))
            if first[1] != node.dtype:
                return (f"{first[0] or '<root>'!r} ({first[1]}) and {where or '<root>'!r} "
                        f"({node.dtype}) view the same memory")
        elif isinstance(node, dict):
            stack.extend(reversed([(f"{where}/{k}" if where else str(k), v)
                                   for k, v in node.items()]))  # walked in order
        elif isinstance(node, (list, tuple)):
            stack.extend(reversed([(f"{where}/{i}" if where else str(i), v)
                                   for i, v in enumerate(node)]))
    return None


def _torch_save(obj: Any, f: BinaryIO, **kwargs: Any) -> None:
    if kwargs or not _FAST_SAVE or not callable(getattr(f, "write", None)):
        torch.save(obj, f, **kwargs)
        return
    ser: Any = torch.serialization
    writer = torch._C.PyTorchFileWriter(
        f, False, record_alignment(obj, ser._get_storage_alignment()))
    try:
        ser._save(obj, writer, pickle, ser.DEFAULT_PROTOCOL, False)
    except BaseException:
        # as torch.save's context manager does: an unfinished writer would otherwise try to
        # finish the file from its destructor, on a file that may be closed by then, and abort
        # the process
        try:
            writer.write_end_of_file()
        except Exception:  # the save's own error is what the caller must see
            pass
        raise
    writer.write_end_of_file()
    f.flush()
