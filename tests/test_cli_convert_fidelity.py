"""`snapkeep convert` checks the round trip before it publishes and leaves nothing on failure
(issue 17 item 5): conjugate views convert right, codec refusals name the key, a DST that would
read back different is never written."""

from __future__ import annotations

import io
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from snapkeep import writing
from snapkeep._cli_maintain import check_round_trip, remove_published
from snapkeep.cli import cli
from snapkeep.codecs import load_safetensors, torch_save
from snapkeep.store import resolve_storage


def files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def test_a_conjugate_view_converts_to_safetensors_conjugated(tmp_path: Path) -> None:
    x = torch.tensor([1 + 2j, 3 - 4j])
    torch.save({"x": x.conj(), "n": torch._neg_view(torch.tensor([1.0, -2.0]))},
               tmp_path / "src.pt")
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "src.pt"),
                                      str(tmp_path / "dst.safetensors")])
    assert result.exit_code == 0, result.output  # was: exit 1 and a wrong DST left behind
    back = load_safetensors((tmp_path / "dst.safetensors").read_bytes())
    assert torch.equal(back["x"], torch.tensor([1 - 2j, 3 + 4j]))
    assert torch.equal(back["n"], torch.tensor([-1.0, 2.0]))


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ({"m": {1: torch.ones(2)}}, "key 1 under 'm' is a int"),
        ({"a/b": torch.ones(2)}, "key 'a/b' under '<root>' contains the separator '/'"),
        ({"m": {"w": torch.zeros(2, dtype=torch.complex128)}},
         "tensor 'm/w' has dtype torch.complex128, which safetensors cannot store and read back"),
        ({"m": {"w": torch.zeros(2, dtype=torch.float8_e8m0fnu)}},
         "tensor 'm/w' has dtype torch.float8_e8m0fnu"),
    ],
    ids=["int-key", "separator-in-key", "complex128", "float8_e8m0fnu"],
)
def test_a_codec_refusal_names_the_key_and_leaves_nothing(tmp_path: Path, state, expected) -> None:
    src, out = tmp_path / "src.pt", tmp_path / "out"
    torch.save(state, src)
    out.mkdir()
    result = CliRunner().invoke(cli, ["convert", str(src), str(out / "dst.safetensors")])
    assert result.exit_code == 1, result.output
    assert expected in result.output and "nothing was written" in result.output
    assert "check the path and its permissions" not in result.output  # not a storage error
    assert files(out) == []


def test_a_dst_that_would_read_back_different_is_not_written(tmp_path: Path) -> None:
    """The check itself, given the bytes of another state (what a lossy codec would make)."""
    state = {"w": torch.tensor([1.0, 2.0])}
    lossy = io.BytesIO()
    torch_save({"w": torch.tensor([1.0, 2.5])}, lossy)
    with pytest.raises(click.ClickException, match="would read back different from SRC, so it "
                                                    "was not written") as info:
        check_round_trip(state, lossy.getvalue(), "SRC", str(tmp_path / "dst.pt"),
                          unsafe=False)
    assert info.value.exit_code == 1
    assert files(tmp_path) == []
    exact = io.BytesIO()
    torch_save(state, exact)
    check_round_trip(state, exact.getvalue(), "SRC", str(tmp_path / "dst.pt"), unsafe=False)


def test_a_published_dst_that_fails_its_check_is_removed_with_its_manifest(tmp_path: Path) -> None:
    """What convert does when the published DST does not verify: the store's delete, so
    nothing is left (the name may hold template braces)."""
    writer = writing.SimpleWriter(out_dir=str(tmp_path))
    writer("out{x}.safetensors", str(tmp_path), {"a": torch.ones(1)})
    writer.finalize()
    assert files(tmp_path) == [".snapkeep/out{x}.safetensors.json", "out{x}.safetensors"]
    storage, path = resolve_storage(str(tmp_path / "out{x}.safetensors"))
    assert remove_published(storage, path) == [
        path, str(tmp_path / ".snapkeep" / "out{x}.safetensors.json")]
    assert files(tmp_path) == []
