"""Every tensor form torch can hold is saved value-exact by every writer, or refused with an error
naming the key and what is unsupported: views with lazy conjugate/negative bits, non-contiguous
views, storage offsets, zero-size tensors, every dtype."""

from __future__ import annotations

import io
import os

import pytest
import torch

import snapkeep


def _all_dtypes() -> list[torch.dtype]:
    found = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    return sorted(found, key=str)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty((0,), dtype=torch.uint8).set_(storage)


def _dtype_tensor(dtype: torch.dtype) -> torch.Tensor | None:
    """A 3x4 tensor of ``dtype`` with varied bytes, viewed at an offset and transposed."""
    if dtype.is_complex or dtype.is_floating_point or dtype == torch.bool or \
            str(dtype).split(".")[1].startswith(("int", "uint", "bits", "float8", "float4")):
        try:
            base = torch.empty(20, dtype=dtype)
        except (RuntimeError, TypeError):
            return None
        raw = _bytes_of(base.untyped_storage())
        raw.copy_(torch.arange(raw.numel(), dtype=torch.int64).mul_(37).remainder_(251)
                  .to(torch.uint8))
        if dtype == torch.bool:
            raw.remainder_(2)
        tensor = base[2:14].view(3, 4).t()
        try:  # dtypes torch itself cannot copy or save (sub-byte int1..7) are not snapkeep's
            _value_bytes(tensor)
            torch.save(tensor, io.BytesIO())
        except (RuntimeError, NotImplementedError, TypeError):
            return None
        return tensor
    return None


def _forms() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    z = torch.randn(4, 3, dtype=torch.complex64)
    r = torch.randn(5, 6)
    forms = {
        "conj": z.conj(),
        "conj_of_transpose": z.t().conj(),
        "neg_view": torch._neg_view(r),
        "conj_imag_neg_bit": torch.randn(3, 2, dtype=torch.complex128).conj().imag,
        "conj_physical": z.conj_physical(),
        "non_contiguous": r[:, ::2],
        "offset": r[2:],
        "expanded": torch.randn(3, 1).expand(3, 5),
        "zero_size": torch.empty(0, 3),
        "zero_size_view_of_big": torch.randn(10)[4:4],
        "scalar": torch.tensor(3.5),
        "parameter_conj": torch.nn.Parameter(torch.randn(2, 2, dtype=torch.complex64)).conj(),
    }
    shared = torch.randn(3, 3, dtype=torch.complex64)
    forms["shared_plain"] = shared
    forms["shared_conj"] = shared.conj()
    for dtype in _all_dtypes():
        tensor = _dtype_tensor(dtype)
        if tensor is not None:
            forms[f"dtype_{str(dtype).split('.')[1]}"] = tensor
    return forms


def _resolved(t: torch.Tensor) -> torch.Tensor:
    return t.detach().resolve_conj().resolve_neg()


def _value_bytes(t: torch.Tensor) -> torch.Tensor:
    t = _resolved(t).contiguous().reshape(-1)
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(_value_bytes(a), _value_bytes(b)))


WRITERS = {
    "simple": lambda: snapkeep.writing.SimpleWriter(),
    "thread": lambda: snapkeep.writing.ThreadWriter(),
    "process": lambda: snapkeep.writing.ProcessWriter(),
}


@pytest.mark.filterwarnings("ignore:ComplexHalf:UserWarning")
@pytest.mark.parametrize("writer_kind", sorted(WRITERS))
def test_every_form_is_saved_value_exact(tmp_path, writer_kind):
    state = _forms()
    assert len([k for k in state if k.startswith("dtype_")]) >= 20
    expected = {k: _resolved(v).clone() for k, v in state.items()}
    bits = {k: (v.is_conj(), v.is_neg()) for k, v in state.items()}
    writer = WRITERS[writer_kind]()
    try:
        writer("snap", str(tmp_path), state)
        if writer_kind != "simple":
            # the loop mutates every storage in place right after the call
            storages = {v.untyped_storage().data_ptr(): v.untyped_storage()
                        for v in state.values() if v.untyped_storage().nbytes()}
            for storage in storages.values():
                _bytes_of(storage).bitwise_not_()
            changed = [k for k, v in state.items() if v.numel() and v.dtype != torch.bool]
            assert all(not _same(state[k], expected[k]) for k in changed)  # differs before
    finally:
        writer.finalize()
    loaded = torch.load(os.path.join(tmp_path, "snap"), weights_only=True)
    wrong = sorted(k for k in state if not _same(loaded[k], expected[k]))
    assert wrong == [], {k: (loaded[k], expected[k]) for k in wrong[:3]}
    # the lazy bits travel with the value (as torch.save keeps them for the source)
    assert {k: (v.is_conj(), v.is_neg()) for k, v in loaded.items()} == bits
    assert loaded["shared_conj"].untyped_storage().data_ptr() == \
        loaded["shared_plain"].untyped_storage().data_ptr()


def _refused() -> dict[str, tuple[torch.Tensor, str]]:
    refused = {
        "sparse_coo": (torch.eye(3).to_sparse(), "sparse"),
        "sparse_csr": (torch.eye(3).to_sparse_csr(), "sparse"),
        "meta": (torch.empty(3, device="meta"), "meta"),
        "quantized": (torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
                      "quantized"),
        "nested": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
        "nested_jagged": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)],
                                                     layout=torch.jagged), "nested"),
    }
    return refused


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("writer_kind", ["thread", "process"])
def test_unsupported_forms_are_refused_naming_key_and_kind(tmp_path, writer_kind):
    writer = WRITERS[writer_kind]()
    try:
        for key, (tensor, kind) in _refused().items():
            state = {"model": {"ok": torch.ones(2), key: tensor}}
            with pytest.raises(TypeError, match=f"model/{key}.*{kind}.*SimpleWriter"):
                writer(f"snap_{key}", str(tmp_path), state)
        writer("snap_after", str(tmp_path), {"x": torch.ones(2)})  # the writer still works
    finally:
        writer.finalize()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("snap")) == ["snap_after"]
