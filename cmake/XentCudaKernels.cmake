# xent::cuda_kernels: a static library of the CUDA row dispatch's common instances
# (include/xent/cuda/instances.cuh lists them), compiled once. A target that links it gets
# XENT_CUDA_PRECOMPILED, whose explicit instantiation declarations keep its own translation units
# from compiling those kernels again: a .cu with one entry-point call then compiles no kernel.
# Code that does not link it includes the same headers and compiles every kernel it calls.
#
# One object per logits dtype and pass (nine), so that a build spreads them over its cores. The
# library takes the project's CUDA architectures; targets that link it must run on them.
# Included by the top-level CMakeLists.txt when CUDA is enabled, after XentHelpers.cmake.
include_guard(GLOBAL)

# Only xent's own targets need it built with `all`; a parent project that links it builds it then.
if(PROJECT_IS_TOP_LEVEL)
  set(_xent_kernels_all "")
else()
  set(_xent_kernels_all EXCLUDE_FROM_ALL)
endif()

set(_xent_kernel_objects "")
foreach(_dtype IN ITEMS f32 bf16 f16)
  foreach(_pass IN ITEMS forward fused backward)
    set(_object xent_cuda_rows_${_dtype}_${_pass})
    add_library(${_object} OBJECT ${_xent_kernels_all} ${PROJECT_SOURCE_DIR}/src/cuda/rows.cu)
    target_compile_definitions(${_object} PRIVATE XENT_CUDA_PRECOMPILED
                               XENT_CUDA_KERNELS_DTYPE=${_dtype} XENT_CUDA_KERNELS_PASS=${_pass})
    target_link_libraries(${_object} PRIVATE xent::xent)
    xent_target_options(${_object})
    # A build for sm_90 alone (no GPU visible, cmake/XentComponents.cmake) compiles the kernels'
    # portable paths here: the float instances as compute_80 PTX too.
    if(XENT_CUDA_PORTABLE_CHECK AND _dtype STREQUAL "f32")
      set_property(TARGET ${_object} PROPERTY CUDA_ARCHITECTURES 80-virtual
                                                                 ${CMAKE_CUDA_ARCHITECTURES})
    endif()
    list(APPEND _xent_kernel_objects $<TARGET_OBJECTS:${_object}>)
  endforeach()
endforeach()

add_library(xent_cuda_kernels STATIC ${_xent_kernels_all} ${_xent_kernel_objects})
add_library(xent::cuda_kernels ALIAS xent_cuda_kernels)
set_target_properties(xent_cuda_kernels PROPERTIES LINKER_LANGUAGE CUDA)
target_link_libraries(xent_cuda_kernels PUBLIC xent::xent)
target_compile_definitions(xent_cuda_kernels PUBLIC XENT_CUDA_PRECOMPILED)
