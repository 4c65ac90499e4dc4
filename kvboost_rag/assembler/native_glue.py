"""The lean forward's work between its matrix products: through PyTorch ops, or compiled.

Between the products of a layer sit a residual add, two RMSNorms and RoPE: ~25 PyTorch ops a
layer, each a dispatched kernel with its allocation. On a short forward (a decode step of 8 rows)
they cost more than their arithmetic by far: SmolLM2 bf16, ~10 ms of a ~31 ms step on 2 cores.
:class:`NativeGlue` runs them as two C functions (``native_glue.c``), compiled once per machine
with the system's C compiler (``$CC``, else ``cc``) into ``$KVBOOST_RAG_HOME/native`` and loaded
through ctypes; :class:`TorchGlue` is the same work as
PyTorch ops (the models' modules' arithmetic, op for op), used where no compiler is found, where
``KVBOOST_NATIVE_GLUE=0``, and off the CPU.

The two give different bits (the C code sums a row's squares in its own order), so the store
namespace names which one ran (:func:`glue_for`'s ``tag``). Each computes every row alone, in the
same order whatever the row count: the forward stays split-invariant, as the load-time probe checks.

Layouts: hidden states ``[1, rows, hidden]``; the fused q/k/v product ``[1, rows, (heads + 2 *
kv_heads) * head_dim]``; queries ``[1, heads, rows, head_dim]``, keys and values ``[1, kv_heads,
rows, head_dim]``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..models import kvboost_home

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_glue.c")
NATIVE_TAG = "glue1"
"""Names the C arithmetic in the store namespace; bump it whenever ``native_glue.c``'s arithmetic changes."""
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
"""No reassociation (no -ffast-math) and no contraction: IEEE operations in program order, the
same bits whatever the vector width the machine gives -march=native."""
DISABLE_ENV = "KVBOOST_NATIVE_GLUE"


@dataclass(frozen=True)
class RMSNorm:
    weight: torch.Tensor
    eps: float


class Glue(Protocol):
    tag: str
    """"" for the PyTorch ops; otherwise a name the store namespace carries."""

    def norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """RMSNorm of ``x``."""
        ...

    def add_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + delta`` (rounded to their dtype) and its RMSNorm."""
        ...

    def rope_split(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and keys rotated, values, from a fused q/k/v product; ``cos``/``sin`` ``[1, rows,
        head_dim]`` with sin's first half negated."""
        ...


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


class TorchGlue:
    """The glue as the models' modules compute it, op for op."""

    tag = ""

    def norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """RMSNorm as the model's module computes it (in float32, scaled in the input dtype)."""
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + norm.eps)
        return norm.weight * h.to(dtype)

    def add_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = residual + delta
        return total, self.norm(total, norm)

    def rope_split(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, dim = qkv.shape[1], cos.shape[-1]
        # queries and keys rotated in one pass: [1, heads + kv_heads, rows, dim]
        qk = qkv[..., : (heads + kv_heads) * dim].view(1, rows, heads + kv_heads, dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        qk = (qk * cos) + (_swap_halves(qk) * sin)
        v = qkv[..., (heads + kv_heads) * dim :].view(1, rows, kv_heads, dim).transpose(1, 2)
        return qk[:, :heads], qk[:, heads:], v


_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class NativeGlue:
    """The glue in C (``native_glue.c``); CPU tensors of one dtype, float32 or bfloat16."""

    tag = NATIVE_TAG

    def __init__(self, library: ctypes.CDLL) -> None:
        self._add_rms_norm = library.add_rms_norm
        self._add_rms_norm.restype = ctypes.c_int
        self._add_rms_norm.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 5]
        self._add_rms_norm.argtypes += [ctypes.c_float]
        self._rope_split = library.rope_split
        self._rope_split.restype = ctypes.c_int
        self._rope_split.argtypes = [ctypes.c_int, *[ctypes.c_int64] * 4, *[ctypes.c_void_p] * 6]

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device) -> bool:
        return dtype in _DTYPE_CODES and device.type == "cpu"

    def norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return self._add_norm(x, None, norm)[1]

    def add_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._add_norm(residual, delta, norm)

    def _add_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual.contiguous()
        width = residual.shape[-1]
        total = residual if delta is None else torch.empty_like(residual)
        normed = torch.empty_like(residual)
        status = self._add_rms_norm(
            _DTYPE_CODES[residual.dtype],
            residual.numel() // width,
            width,
            residual.data_ptr(),
            None if delta is None else delta.contiguous().data_ptr(),
            None if delta is None else total.data_ptr(),
            normed.data_ptr(),
            norm.weight.data_ptr(),
            norm.eps,
        )
        if status:
            raise MemoryError("the native RMSNorm could not allocate its row buffers")
        return total, normed

    def rope_split(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        rows, dim = qkv.shape[1], cos.shape[-1]
        queries = qkv.new_empty(1, heads, rows, dim)
        keys = qkv.new_empty(1, kv_heads, rows, dim)
        values = qkv.new_empty(1, kv_heads, rows, dim)
        status = self._rope_split(
            _DTYPE_CODES[qkv.dtype],
            rows,
            heads,
            kv_heads,
            dim,
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            queries.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
        )
        if status:
            raise MemoryError(f"the native RoPE failed (head_dim {dim} odd, or out of memory)")
        return queries, keys, values


# -- building the library ------------------------------------------------------------------------


def _machine_identity() -> str:
    """What -march=native compiles for: a library built on one CPU may not run on another sharing
    the cache directory (a home directory on a network share)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            flags = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _build(compiler: str) -> Path:
    """The library for this machine, compiled now unless a previous build is cached."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), _machine_identity().encode()]))
    directory = kvboost_home() / "native"
    path = directory / f"native_glue-{key.hexdigest()[:20]}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / path.name
        result = subprocess.run(
            [compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if result.returncode:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, path)  # atomic: a concurrent build of the same key writes the same bytes
    return path


_LOADED: list[NativeGlue | None] = []
_LOAD_GUARD = threading.Lock()


def native_glue() -> NativeGlue | None:
    """The compiled glue (built at the first call in a process, cached on disk per machine), or None
    where it is switched off or cannot be built (the reason logged once)."""
    with _LOAD_GUARD:
        if not _LOADED:
            _LOADED.append(_load())
        return _LOADED[0]


def _load() -> NativeGlue | None:
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning(
            "no C compiler found: the lean forward's glue runs as PyTorch ops (a decode step ~30 %% "
            "slower); install one (apt install gcc) or set CC, or set %s=0 to silence this",
            DISABLE_ENV,
        )
        return None
    try:
        return NativeGlue(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning(
            "the lean forward's native glue could not be built (%s); it runs as PyTorch ops. Set %s=0 "
            "to silence this",
            error,
            DISABLE_ENV,
        )
        return None


def glue_for(dtype: torch.dtype, device: torch.device) -> Glue:
    """The glue a lean forward of this dtype and device runs: the compiled one where it can."""
    if NativeGlue.supports(dtype, device):
        native = native_glue()
        if native is not None:
            return native
    return TorchGlue()
