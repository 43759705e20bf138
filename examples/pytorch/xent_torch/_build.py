"""Builds and loads the C++ ops with torch.utils.cpp_extension.

csrc/xent_ops.cpp (schemas + CPU kernels) and csrc/xent_autograd.cpp (the autograd formulas) are
always built; csrc/xent_ops_cuda.cu (CUDA kernels) is added when torch was built with CUDA and
nvcc is found (no GPU is needed to build it). The first import compiles the library into
examples/pytorch/build/ (or $XENT_TORCH_BUILD_DIR), one folder per variant; later imports reuse
it while the sources are unchanged. The ops are registered with TORCH_LIBRARY, so the library is
loaded with torch.ops.load_library (no Python module, no pybind11).

Environment:
  XENT_TORCH_BUILD_DIR   where the build goes (default: examples/pytorch/build)
  XENT_TORCH_CUDA        auto (default): CUDA kernels when torch has CUDA and nvcc is found;
                         1: require them (an error otherwise); 0: CPU only
  TORCH_CUDA_ARCH_LIST   GPU architectures (torch's variable); when unset and no GPU is visible,
                         or every visible GPU is a Hopper (9.0), 9.0a (the kernels use sm_90
                         thread-block clusters, the fused linear paths sm_90a's wgmma; older GPUs
                         need their own entry, e.g. "8.0;9.0"); otherwise torch's choice
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
with_cuda = False  # whether the loaded library has the CUDA kernels


def _cuda_wanted():
    """Whether to build the CUDA kernels; raises when XENT_TORCH_CUDA=1 cannot be honoured."""
    import torch
    from torch.utils import cpp_extension

    mode = os.environ.get("XENT_TORCH_CUDA", "auto")
    if mode == "0":
        return False
    missing = None
    if torch.version.cuda is None:
        missing = f"torch {torch.__version__} was built without CUDA"
    elif cpp_extension.CUDA_HOME is None:
        missing = "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    if missing and mode == "1":
        raise RuntimeError(f"XENT_TORCH_CUDA=1 but {missing}")
    return missing is None


def load(verbose=None):
    """Compiles the extension if needed and registers the xent:: ops with the dispatcher."""
    global _loaded, with_cuda
    if _loaded:
        return
    import torch
    from torch.utils import cpp_extension

    if verbose is None:
        verbose = os.environ.get("XENT_TORCH_VERBOSE", "0") == "1"
    cuda = _cuda_wanted()
    build_dir = Path(os.environ.get("XENT_TORCH_BUILD_DIR", _PACKAGE_ROOT / "build"))
    build_dir = build_dir / ("cuda" if cuda else "cpu")
    build_dir.mkdir(parents=True, exist_ok=True)
    eigen = os.environ.get("XENT_TORCH_EIGEN", "/usr/include/eigen3")
    # -ffp-contract=off: as xent's CMake build (cmake/XentHelpers.cmake), so entry points that
    # share a computation give the same bits whatever GCC's inlining made of each.
    cflags = ["-O3", "-DNDEBUG", "-ffp-contract=off", "-isystem", eigen]
    native = os.environ.get("XENT_TORCH_NATIVE", "1") != "0"
    if native:
        cflags.append("-march=native")
    csrc = _PACKAGE_ROOT / "csrc"
    sources = [str(csrc / "xent_ops.cpp"), str(csrc / "xent_autograd.cpp")]
    cuda_flags = []
    if cuda:
        sources.append(str(csrc / "xent_ops_cuda.cu"))
        if "TORCH_CUDA_ARCH_LIST" not in os.environ:
            # Hopper (compute capability 9.0) gets sm_90a, as bench/gpu/run.sh builds xent:
            # the wgmma GEMMs of the fused linear paths (cuda/stats_gemm.cuh: the forward without
            # logits, training without the cross-entropy pass) exist only there; an sm_90 build
            # takes cuBLAS and the cross-entropy pass instead. torch would ask for plain 9.0.
            caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
            if not caps or caps == {(9, 0)}:
                os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
        # Eigen is a system include, as in xent's CMake build, and its two nvcc diagnostics
        # (20012: annotations on defaulted functions, 20015: constexpr host calls) are off.
        cuda_flags = ["-O3", "-DNDEBUG", "-isystem", eigen, "-diag-suppress=20012,20015",
                      "-Xcompiler=-fvisibility=hidden", "-Xcompiler=-ffp-contract=off"]
        # The .cu file's host code sees the same headers (Eigen, torch, xent) as the .cpp file:
        # compiled for another instruction set, their shared inline functions and Eigen's
        # alignment (64 bytes with AVX-512, 16 without) would differ between the two objects,
        # and the linker keeps one copy of each for both.
        if native:
            cuda_flags.append("-Xcompiler=-march=native")
        # torch adds its -gencode flags only when no CUDA flag mentions "arch" (it takes any such
        # flag for the user's own choice of GPU), and -march=native does: without them nvcc
        # would target its default (sm_75), where the kernels' cp.async and mbarrier do not
        # exist. So they are asked for here, from TORCH_CUDA_ARCH_LIST or the visible GPUs, as
        # torch would have chosen them.
        cuda_flags += cpp_extension._get_cuda_arch_flags()
    # A compiler that links its own libstdc++ statically (the device machine's /opt/gcc g++ does:
    # the library had no NEEDED libstdc++.so.6) puts a second, newer copy of the C++ runtime in
    # the library beside the one torch uses. Its locale facets' ids are STB_GNU_UNIQUE symbols,
    # which the dynamic linker binds to the first copy loaded: the two copies then disagree on
    # facet indices, and formatting a number (every TORCH_CHECK message with a size in it)
    # crashed in std::ostream::_M_insert<long>. Symbols that come from static archives are kept
    # local to the library; with a shared libstdc++ (the usual case) there are none.
    ldflags = ["-Wl,--exclude-libs,ALL"]
    cpp_extension.load(
        name="xent_torch_ops_cuda" if cuda else "xent_torch_ops",
        sources=sources,
        extra_include_paths=[str(_REPO / "include")],
        extra_cflags=cflags,
        extra_cuda_cflags=cuda_flags,
        extra_ldflags=ldflags,
        build_directory=str(build_dir),
        is_python_module=False,
        with_cuda=cuda,
        verbose=verbose,
    )
    with_cuda = cuda
    _loaded = True
