"""Every codec round-trips what it accepts: dtypes, conjugate/negative views, strided views; what
it cannot read back is refused with the key named (issue 17 item 5)."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from snapkeep import writing
from snapkeep.codecs import load_safetensors, save_safetensors, torch_save

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64]
TORCH_ONLY = [torch.complex128, torch.complex32, torch.float8_e8m0fnu]
VIEWS = ["plain", "conj", "neg", "conj-imag", "transposed", "sliced", "expanded", "scalar",
         "empty"]


def _base(dtype: torch.dtype, seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.complex64).to(dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def _view(base: torch.Tensor, view: str) -> torch.Tensor:
    if view == "conj":
        return base.conj()  # conjugate bit set on complex, no-op otherwise
    if view == "neg":
        negatable = base.dtype.is_complex or (base.dtype.is_floating_point
                                              and base.element_size() > 1)  # no float8 neg
        return torch._neg_view(base) if negatable else base
    if view == "conj-imag":  # imag of a conjugate view: a negative view
        return base.conj().imag if base.dtype.is_complex else base
    if view == "transposed":
        return base.t()
    if view == "sliced":
        return base[1:, ::2]
    if view == "expanded":
        return base[:1].expand(3, -1)
    if view == "scalar":
        return base[0, 0]
    return base[:0] if view == "empty" else base


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The values as bytes (NaN payloads and -0.0 included), conj/neg bits resolved."""
    return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def _torch_round_trip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch_save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def _safetensors_round_trip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    save_safetensors(state, buffer)
    return load_safetensors(buffer.getvalue())


CODECS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "torch_save": _torch_round_trip, "safetensors": _safetensors_round_trip}


def _assert_same(back: torch.Tensor, t: torch.Tensor) -> None:
    assert (back.dtype, back.shape) == (t.dtype, t.shape)
    assert torch.equal(_bits(back), _bits(t))


def test_the_measured_bug_a_conjugate_view_is_written_conjugated() -> None:
    x = torch.tensor([1 + 2j, 3 - 4j])
    back = _safetensors_round_trip({"x": x.conj()})["x"]
    assert torch.equal(back, torch.tensor([1 - 2j, 3 + 4j]))  # was [1+2j, 3-4j]
    assert torch.equal(_safetensors_round_trip({"n": torch._neg_view(x.real)})["n"],
                       torch.tensor([-1.0, -3.0]))


@pytest.mark.parametrize("codec", sorted(CODECS))
@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), view=st.sampled_from(VIEWS),
       seed=st.integers(0, 2**16))
def test_every_codec_round_trips_dtypes_and_views(codec: str, dtype: torch.dtype, view: str,
                                                  seed: int) -> None:
    t = _view(_base(dtype, seed, (4, 3)), view)
    assert t.is_conj() == (view == "conj" and dtype.is_complex)  # the view is what it says
    back = CODECS[codec]({"model": {"t": t}})["model"]["t"]
    _assert_same(back, t)


@pytest.mark.parametrize("dtype", TORCH_ONLY, ids=str)
def test_safetensors_refuses_what_it_cannot_read_back_naming_the_key(dtype: torch.dtype) -> None:
    state = {"model": {"fine": torch.ones(2), "odd": torch.zeros(2, dtype=dtype)}}
    with pytest.raises(TypeError, match=f"tensor 'model/odd' has dtype {dtype}, which "
                                        "safetensors cannot store and read back"):
        save_safetensors(state, io.BytesIO())
    _assert_same(_torch_round_trip(state)["model"]["odd"], state["model"]["odd"])


def test_torch_save_names_the_keys_of_one_memory_seen_as_two_dtypes() -> None:
    x = torch.randn(3, dtype=torch.complex64)
    state = {"model": {"c": x.conj(), "im": [x.conj().imag]}}
    with pytest.raises(RuntimeError, match=r"torch_save: 'model/c' \(torch.complex64\) and "
                                           r"'model/im/0' \(torch.float32\) view the same memory"):
        torch_save(state, io.BytesIO())
    back = _safetensors_round_trip({"c": x.conj(), "im": x.conj().imag})  # resolved: stored
    _assert_same(back["c"], x.conj())
    _assert_same(back["im"], x.conj().imag)


@pytest.mark.parametrize("codec", ["torch", "safetensors"])
@pytest.mark.parametrize("writer_class", ["SimpleWriter", "ThreadWriter"])
def test_views_round_trip_through_a_writer(tmp_path, codec: str, writer_class: str) -> None:
    """The whole save path (staging for ThreadWriter, then the codec) keeps the values."""
    x, y = torch.randn(5, 3, dtype=torch.complex64), torch.randn(5, 3, dtype=torch.complex64)
    state = {"conj": x.conj(), "neg": y.conj().imag, "t": torch.randn(3, 4).t()}
    writer = getattr(writing, writer_class)(out_dir=str(tmp_path))
    savefun = save_safetensors if codec == "safetensors" else torch_save
    writer("snap", str(tmp_path), state, savefun=savefun)
    writer.finalize()
    data = (tmp_path / "snap").read_bytes()
    back = load_safetensors(data) if codec == "safetensors" else \
        torch.load(io.BytesIO(data), weights_only=True)
    for key, value in state.items():
        _assert_same(back[key], value)
