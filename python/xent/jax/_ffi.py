"""Loads xent's XLA FFI handlers and registers them with XLA; compiles nothing.

libxent_jax.so (csrc/jax/, built by `pip install ./python` when jax is importable) exports each
handler as a plain C symbol made by XLA_FFI_DEFINE_HANDLER_SYMBOL, as XLA's FFI guide does: the
library is loaded with ctypes and each symbol registered with jax.ffi.register_ffi_target (typed
FFI, api_version 1). Nothing in it links jax, and XLA's FFI C API is versioned, so the library
built against one jaxlib serves another.
"""

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

for _name in TARGETS:
    jax.ffi.register_ffi_target(
        _name, jax.ffi.pycapsule(getattr(_lib, _name + "_cpu")), platform="cpu"
    )
    if with_cuda:
        jax.ffi.register_ffi_target(
            _name, jax.ffi.pycapsule(getattr(_lib, _name + "_cuda")), platform="CUDA"
        )
