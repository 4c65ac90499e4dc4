"""One OpenMP worker pool at a time: a thread that stops computing gives its pool back.

PyTorch's CPU kernels run on OpenMP. With GNU libgomp (PyTorch's Linux wheels) every thread that
runs a parallel kernel gets a pool of worker threads of its own, kept until that thread exits.
Once the pools' workers (plus the first thread) outnumber the cores, libgomp stops letting idle
workers spin and parks them in the kernel instead, so every parallel kernel of every thread waits
for its workers to wake up, whether or not the other pools are busy. A decode step runs ~450
small kernels; measured on 2 cores (SmolLM2 bfloat16, 1K tokens of context), a step takes 31-36 ms
from the only thread with a pool, and 47-58 ms once another thread has run a parallel kernel
(the caller's thread loaded the model or ran a peer, the engine's worker decodes).

So the engine's threads give their pool back when they stop computing (:func:`release_pool`):
a caller's thread when it hands a request to the engine's worker, the worker when its queue runs
dry, background writers likewise. The next parallel kernel on that thread starts a new pool
(~0.1 ms). With other OpenMP runtimes (LLVM's libomp keeps one pool per process) and on other
platforms this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from pathlib import Path

OMP_PAUSE_SOFT = 1
"""``omp_pause_soft`` (OpenMP 5.0): free the pool; the runtime starts a new one when needed."""


@functools.cache
def _pause_functions() -> tuple[Callable[[int], int], ...]:
    """``omp_pause_resource_all`` of every GNU libgomp loaded in this process (PyTorch's, and any
    other library's own copy)."""
    if not sys.platform.startswith("linux"):
        return ()
    import torch  # noqa: F401  (loads PyTorch's libgomp before the process's libraries are read)

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ()
    paths = sorted(
        {
            fields[5]
            for fields in (line.split(maxsplit=5) for line in maps.splitlines())
            if len(fields) == 6 and Path(fields[5]).name.startswith("libgomp")
        }
    )
    functions = []
    for path in paths:
        try:
            library = ctypes.CDLL(path)  # the loaded copy: dlopen of a loaded path returns it
            pause = library.omp_pause_resource_all
        except (OSError, AttributeError):  # an old libgomp without OpenMP 5.0
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        functions.append(pause)
    return tuple(functions)


def release_pool() -> bool:
    """End the calling thread's OpenMP worker threads (GNU libgomp); True when a runtime took the
    call. Cheap when the thread has no pool; call it where a thread stops running kernels."""
    functions = _pause_functions()
    for pause in functions:
        pause(OMP_PAUSE_SOFT)
    return bool(functions)
