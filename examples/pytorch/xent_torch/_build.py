"""Builds and loads the C++ ops (csrc/xent_ops.cpp) with torch.utils.cpp_extension.

The first import compiles the library into examples/pytorch/build/ (or $XENT_TORCH_BUILD_DIR);
later imports reuse it while the source is unchanged. The ops are registered with TORCH_LIBRARY,
so the library is loaded with torch.ops.load_library (no Python module, no pybind11).

Environment:
  XENT_TORCH_BUILD_DIR   where the build goes (default: examples/pytorch/build)
  XENT_TORCH_EIGEN       Eigen's include directory (default: /usr/include/eigen3)
  XENT_TORCH_NATIVE=0    build without -march=native (portable, slower Eigen packet math)
  XENT_TORCH_VERBOSE=1   print the compiler commands
"""

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_PACKAGE_ROOT = _HERE.parent  # examples/pytorch
_REPO = _PACKAGE_ROOT.parents[1]
_loaded = False


def load(verbose=None):
    """Compiles the extension if needed and registers the xent:: ops with the dispatcher."""
    global _loaded
    if _loaded:
        return
    from torch.utils.cpp_extension import load as cpp_load

    if verbose is None:
        verbose = os.environ.get("XENT_TORCH_VERBOSE", "0") == "1"
    build_dir = Path(os.environ.get("XENT_TORCH_BUILD_DIR", _PACKAGE_ROOT / "build"))
    build_dir.mkdir(parents=True, exist_ok=True)
    eigen = os.environ.get("XENT_TORCH_EIGEN", "/usr/include/eigen3")
    cflags = ["-O3", "-DNDEBUG", "-isystem", eigen]
    if os.environ.get("XENT_TORCH_NATIVE", "1") != "0":
        cflags.append("-march=native")
    cpp_load(
        name="xent_torch_ops",
        sources=[str(_PACKAGE_ROOT / "csrc" / "xent_ops.cpp")],
        extra_include_paths=[str(_REPO / "include")],
        extra_cflags=cflags,
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=verbose,
    )
    _loaded = True
