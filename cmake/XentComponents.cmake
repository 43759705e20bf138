# What xent's own CUDA targets (tests, benchmarks, examples) may build: the CUDA language, cuBLAS
# and NCCL, each detected, never required. Sets XENT_HAS_CUDA, XENT_HAS_CUBLAS and XENT_HAS_NCCL
# (cache, read by tests/ and bench/) and the option XENT_ENABLE_CUDA, and prints one status line
# per component. The top-level CMakeLists.txt includes this only when xent builds targets of its
# own or the parent project sets XENT_ENABLE_CUDA, so a CPU-only consumer probes nothing.
include_guard(GLOBAL)

include(CheckLanguage)
check_language(CUDA)
# Only xent's own tests, benchmarks and examples have CUDA sources, so as a subproject xent does
# not enable the CUDA language in its parent's build unless asked to.
if(CMAKE_CUDA_COMPILER AND PROJECT_IS_TOP_LEVEL)
  set(_xent_enable_cuda_default ON)
else()
  set(_xent_enable_cuda_default OFF)
endif()
option(XENT_ENABLE_CUDA "Enable the CUDA language for xent's own CUDA targets"
       ${_xent_enable_cuda_default})

set(XENT_HAS_CUDA OFF CACHE BOOL "CUDA is enabled for xent's own targets (detected)" FORCE)
set(XENT_HAS_CUBLAS OFF CACHE BOOL "cuBLAS was found (detected)" FORCE)
set(XENT_HAS_NCCL OFF CACHE BOOL "NCCL was found (detected)" FORCE)

if(NOT XENT_ENABLE_CUDA)
  if(CMAKE_CUDA_COMPILER)
    message(STATUS "xent: CUDA OFF (XENT_ENABLE_CUDA=OFF): no CUDA, cuBLAS or NCCL targets")
  else()
    message(STATUS "xent: CUDA OFF (no CUDA compiler found): no CUDA, cuBLAS or NCCL targets")
  endif()
  return()
endif()
if(NOT CMAKE_CUDA_COMPILER)
  message(WARNING "xent: XENT_ENABLE_CUDA is ON but no CUDA compiler was found; building "
                  "without CUDA (set CMAKE_CUDA_COMPILER or put nvcc on PATH)")
  return()
endif()

# Architectures, where the configure names none (a given CMAKE_CUDA_ARCHITECTURES, as the cuda
# preset's native or bench/gpu/run.sh's, is kept):
#  - a GPU visible (nvidia-smi lists one): machine code for Hopper and PTX for Ampere, which the
#    driver compiles at load, so that the build runs on either;
#  - none (a machine that only compiles, as the CI): each kernel for one architecture, sm_90, whose
#    code takes the Hopper paths (clusters, bulk copies; tuning/policy.cuh's XENT_CUDA_SM90_PTX).
#    The portable paths below sm_90 are compiled once, as compute_80 PTX of xent::cuda_kernels'
#    float objects (XENT_CUDA_PORTABLE_CHECK), where every kernel that has one is instantiated.
#    Such a build runs on Hopper GPUs alone.
set(XENT_CUDA_PORTABLE_CHECK OFF)
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  find_program(XENT_NVIDIA_SMI nvidia-smi)
  mark_as_advanced(XENT_NVIDIA_SMI)
  set(_xent_gpus "")
  if(XENT_NVIDIA_SMI)
    execute_process(COMMAND "${XENT_NVIDIA_SMI}" -L OUTPUT_VARIABLE _xent_gpus ERROR_QUIET)
  endif()
  if(_xent_gpus MATCHES "GPU [0-9]")
    set(CMAKE_CUDA_ARCHITECTURES "80-virtual;90-real")
  else()
    set(CMAKE_CUDA_ARCHITECTURES "90-real")
    set(XENT_CUDA_PORTABLE_CHECK ON)
  endif()
endif()
enable_language(CUDA)
set(XENT_HAS_CUDA ON CACHE BOOL "CUDA is enabled for xent's own targets (detected)" FORCE)

# cuBLAS and NCCL are looked for beside the CUDA compiler that was enabled.
find_package(CUDAToolkit QUIET)
if(CUDAToolkit_FOUND AND TARGET CUDA::cublas)
  set(XENT_HAS_CUBLAS ON CACHE BOOL "cuBLAS was found (detected)" FORCE)
endif()

set(_xent_nccl_hints /usr/local/cuda)
if(CUDAToolkit_FOUND)
  get_filename_component(_xent_cudatk_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  list(APPEND _xent_nccl_hints ${CUDAToolkit_LIBRARY_ROOT} ${_xent_cudatk_root})
endif()
find_path(XENT_NCCL_INCLUDE_DIR nccl.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} ${_xent_nccl_hints}
  PATH_SUFFIXES include)
find_library(XENT_NCCL_LIBRARY nccl
  HINTS ${CUDAToolkit_LIBRARY_DIR} ${_xent_nccl_hints}
  PATH_SUFFIXES lib64 lib lib/x64)
mark_as_advanced(XENT_NCCL_INCLUDE_DIR XENT_NCCL_LIBRARY)
if(XENT_NCCL_INCLUDE_DIR AND XENT_NCCL_LIBRARY)
  set(XENT_HAS_NCCL ON CACHE BOOL "NCCL was found (detected)" FORCE)
  # For xent's own NCCL tests and benchmarks; not part of the installed package.
  if(NOT TARGET NCCL::nccl)
    add_library(NCCL::nccl UNKNOWN IMPORTED)
    set_target_properties(NCCL::nccl PROPERTIES
      IMPORTED_LOCATION "${XENT_NCCL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${XENT_NCCL_INCLUDE_DIR}"
      # What links NCCL::nccl may include parallel/nccl_group.cuh (xent.hpp does, given this).
      INTERFACE_COMPILE_DEFINITIONS XENT_HAS_NCCL)
  endif()
endif()

if(XENT_CUDA_PORTABLE_CHECK)
  message(STATUS "xent: CUDA   ON  (${CMAKE_CUDA_COMPILER}, no GPU visible: architectures "
                 "${CMAKE_CUDA_ARCHITECTURES}, compute_80 PTX of the float kernels; set "
                 "CMAKE_CUDA_ARCHITECTURES for a build to run elsewhere)")
else()
  message(STATUS "xent: CUDA   ON  (${CMAKE_CUDA_COMPILER}, architectures ${CMAKE_CUDA_ARCHITECTURES})")
endif()
if(XENT_HAS_CUBLAS)
  message(STATUS "xent: cuBLAS ON  (CUDAToolkit ${CUDAToolkit_VERSION})")
else()
  message(STATUS "xent: cuBLAS OFF (CUDAToolkit not found beside ${CMAKE_CUDA_COMPILER})")
endif()
if(XENT_HAS_NCCL)
  message(STATUS "xent: NCCL   ON  (${XENT_NCCL_LIBRARY})")
else()
  message(STATUS "xent: NCCL   OFF (nccl.h / libnccl not found)")
endif()
