"""Loads the compiled ops into torch's dispatcher; compiles nothing.

libxent_torch.so (csrc/, built by `pip install ./python`: CMakeLists.txt) registers the xent::
ops with TORCH_LIBRARY, so it is loaded with torch.ops.load_library (no Python module, no
pybind11). It links the libraries of the torch it was built against, whose C++ ABI changes
between releases: under any other torch version the import stops with an ImportError rather than
failing later on a missing symbol.
"""

from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent

try:
    from . import _build_info
except ImportError:
    raise ImportError(
        f"xent.torch: the compiled ops are missing from {_HERE}: xent is imported from its "
        "source tree instead of an installed package; install it with "
        "`pip install --no-build-isolation ./python` and import it from elsewhere"
    ) from None

if _build_info.torch_version != torch.__version__:
    raise ImportError(
        f"xent.torch was built against torch {_build_info.torch_version} but torch "
        f"{torch.__version__} is imported: reinstall xent under this torch "
        "(pip install --no-build-isolation ./python)"
    )

torch.ops.load_library(str(_HERE / "libxent_torch.so"))

with_cuda: bool = _build_info.cuda
"""Whether the library has the CUDA kernels (CMakeLists.txt: torch with CUDA and nvcc found)."""
