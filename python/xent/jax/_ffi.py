"""Loads xent's XLA FFI handlers and registers them with XLA; compiles nothing.

libxent_jax.so (csrc/jax/, built by `pip install ./python` when jax is importable) exports each
handler as a plain C symbol made by XLA_FFI_DEFINE_HANDLER_SYMBOL, as XLA's FFI guide does: the
library is loaded with ctypes and each symbol registered with jax.ffi.register_ffi_target (typed
FFI, api_version 1). Nothing in it links jax, and XLA's FFI C API is versioned, so the library
built against one jaxlib serves another.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import jax

_LIBRARY = Path(__file__).resolve().parent / "libxent_jax.so"
if not _LIBRARY.exists():
    raise ImportError(
        f"xent.jax: {_LIBRARY.name} is missing from {_LIBRARY.parent}: xent is imported from its "
        "source tree, or was built where jax was not importable; install it with "
        "`pip install ./python` (jax installed) and import it from elsewhere"
    )

from . import _build_info  # noqa: E402  (written beside the library by the build)

_lib = ctypes.cdll.LoadLibrary(str(_LIBRARY))

# The handlers, each exported as <name>_cpu and (CUDA builds) <name>_cuda.
TARGETS = (
    "xent_cross_entropy_fwd",
    "xent_cross_entropy_bwd",
    "xent_cross_entropy_fwd_bwd",
    "xent_scale_grad",
    "xent_linear_cross_entropy_fwd",
    "xent_linear_cross_entropy_bwd",
    "xent_linear_cross_entropy_fwd_bwd",
    "xent_vocab_parallel_records",
    "xent_vocab_parallel_merge",
    "xent_vocab_parallel_backward",
)

with_cuda: bool = _build_info.cuda
"""Whether the library has the CUDA handlers (built where nvcc was found)."""

# The CUDA handlers' workspace query (ffi_cuda.cu): the bytes of the uint8 result a call takes.
WORKSPACE_KINDS = {
    "cross_entropy": 0,
    "vocab_parallel_merge": 1,
    "linear_forward": 2,
    "linear_training": 3,
}
_WORKSPACE_DTYPES = {"float32": 0, "bfloat16": 1, "float16": 2}
if with_cuda:
    _query = _lib.xent_jax_cuda_workspace_bytes
    _query.restype = ctypes.c_int64
    _query.argtypes = (
        (ctypes.c_int, ctypes.c_int)
        + (ctypes.c_int64,) * 3
        + (ctypes.c_int, ctypes.c_int, ctypes.c_float)
    )


def workspace_bytes(
    kind: str,
    dtype,
    rows: int,
    dim: int = 0,
    vocab: int = 0,
    *,
    reduced: bool = True,
    choices: tuple = (0, 0, 0.0),
) -> int | None:
    """The bytes of device workspace a CUDA call of `kind` takes as one more result (0 for a
    cross-entropy call whose loss is not reduced), None where the library has no CUDA handlers.
    choices: a fused linear call's (order, accumulate, sparse_threshold) codes (_core's). 0 for
    what no CUDA call runs (float64, a shape or choice the call refuses): the handler refuses the
    call itself, float64 by name before it looks at the workspace."""
    if not with_cuda:
        return None
    if not reduced:
        return 0
    code = _WORKSPACE_DTYPES.get(str(dtype), -1)
    return max(0, int(_query(WORKSPACE_KINDS[kind], code, rows, dim, vocab, *choices)))


_records_bytes = _lib.xent_jax_records_bytes
_records_bytes.restype = ctypes.c_int64
_records_bytes.argtypes = (ctypes.c_int64, ctypes.c_float)


def records_bytes(rows: int, label_smoothing: float) -> int:
    """Bytes of one device's vocab-parallel records block for `rows` rows of class ids (the
    library's parallel/records.hpp layout)."""
    got = int(_records_bytes(rows, label_smoothing))
    if got < 0:
        raise ValueError(f"xent.jax: {rows} rows is more than one exchange holds")
    return got


for _name in TARGETS:
    jax.ffi.register_ffi_target(
        _name, jax.ffi.pycapsule(getattr(_lib, _name + "_cpu")), platform="cpu"
    )
    if with_cuda:
        jax.ffi.register_ffi_target(
            _name, jax.ffi.pycapsule(getattr(_lib, _name + "_cuda")), platform="CUDA"
        )
