"""S3 path benchmark: a 256 MiB snapshot through snapkeep versus a plain s3fs upload.

Starts moto's S3 server on 127.0.0.1 (a local, single-process, slow server: absolute numbers say
little, the ratio between rows of the same run is what counts) and, for each of ``--repeats``
rounds, times:

- ``s3fs pipe_file``: the already-encoded snapshot bytes uploaded with one s3fs call (the
  baseline; s3fs uploads large payloads as a multipart upload with concurrent parts);
- ``torch.save + s3fs pipe_file``: the same, including the encoding, for context;
- ``snapkeep SimpleWriter``: ``writer(name, out_dir, state)`` to ``s3://``: encode, hash, stream
  the multipart upload, complete it, write the checksum manifest;
- ``snapkeep ThreadWriter``: the same through a background thread, timed until the call returns
  (the training stall: staging copy) and until the snapshot is committed.

Usage: ``python benchmarks/bench_s3.py [--size-mib 256] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import io
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import torch

from snapkeep import writing

BUCKET = "snapkeep-bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1):
                return process, endpoint
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit("moto's S3 server did not start (pip install 'moto[server]')")


def make_state(size_mib: int) -> dict[str, torch.Tensor]:
    """``size_mib`` MiB of float32 tensors, 16 MiB each (like a model's parameters)."""
    generator = torch.Generator().manual_seed(0)
    n, last = divmod(size_mib, 16)
    sizes = [16] * n + ([last] if last else [])
    return {f"layer{i}.weight": torch.randn(mib << 18, generator=generator)
            for i, mib in enumerate(sizes)}


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be >= 3 (medians)")

    import s3fs

    process, endpoint = start_moto()
    try:
        options = {"key": "bench", "secret": "bench", "endpoint_url": endpoint}
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        fs.mkdir(BUCKET)
        state = make_state(args.size_mib)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        size_mib = len(data) / 2**20

        rows: dict[str, list[float]] = {}

        def record(name: str, seconds: float) -> None:
            rows.setdefault(name, []).append(seconds)

        def encode_and_pipe(path: str) -> None:
            b = io.BytesIO()
            torch.save(state, b)
            fs.pipe_file(path, b.getvalue())

        def one_round(run: str) -> None:
            record("s3fs pipe_file (encoded bytes)", timed(lambda: fs.pipe_file(f"{run}/plain",
                                                                              data)))
            record("torch.save + s3fs pipe_file", timed(lambda: encode_and_pipe(f"{run}/enc")))

            simple = writing.SimpleWriter(out_dir=run, storage_options=options)
            simple.initialize("")
            record("snapkeep SimpleWriter", timed(lambda: simple("snap_simple", "", state)))
            simple.finalize()

            threaded = writing.ThreadWriter(out_dir=run, storage_options=options)
            threaded.initialize("")
            start = time.perf_counter()
            threaded("snap_thread", "", state)
            record("snapkeep ThreadWriter: call returns", time.perf_counter() - start)
            threaded.wait()
            record("snapkeep ThreadWriter: committed", time.perf_counter() - start)
            threaded.finalize()

            got = fs.info(f"{run}/snap_simple", refresh=True)["size"]
            if got != len(data):
                raise SystemExit(f"snapkeep wrote {got} bytes, torch.save gives {len(data)}")
            fs.rm(run, recursive=True)

        for r in range(args.repeats):
            one_round(f"s3://{BUCKET}/r{r}-{uuid.uuid4().hex[:6]}")

        baseline = statistics.median(rows["s3fs pipe_file (encoded bytes)"])
        print(f"S3 benchmark: {size_mib:.0f} MiB snapshot, moto server at 127.0.0.1, "
              f"{args.repeats} repeats, medians (torch {torch.__version__}, "
              f"s3fs {s3fs.__version__})")
        header = f"{'path':<40}{'median s':>10}{'MiB/s':>9}{'x pipe':>9}   all runs (s)"
        print(header)
        print("-" * len(header))
        for name, values in rows.items():
            median = statistics.median(values)
            runs = ", ".join(f"{v:.2f}" for v in values)
            print(f"{name:<40}{median:>10.2f}{size_mib / median:>9.0f}"
                  f"{median / baseline:>9.2f}   {runs}")
    finally:
        process.terminate()
        process.wait(timeout=10)


if __name__ == "__main__":
    main()
