# Helpers for xent's own targets (tests, benchmarks, examples). Nothing here touches the xent
# INTERFACE target, so a consumer never inherits our warnings, sanitizers or -march=native.
include_guard(GLOBAL)

set(XENT_CUDA_TUNING "" CACHE STRING
  "Tuning overrides of xent's own CUDA targets: a ;-list of NAME=VALUE (XENT_CUDA_<NAME>)")
set(XENT_CUDA_TUNED_MAJOR "" CACHE STRING
  "Compute capability major whose tuning row xent's own CUDA targets take (empty: the header's, 9)")
set(_xent_tuning_override "${CMAKE_CURRENT_LIST_DIR}/../bench/tuning/override.cuh")

# xent_target_options(<target>)
#
# Applies the project-internal build flags to <target>, for C++ and (when enabled) CUDA sources:
#   - warnings: -Wall -Wextra, plus -Werror when XENT_WERROR is ON;
#   - XENT_SANITIZE: -fsanitize=address,undefined -fno-omit-frame-pointer
#     -fno-sanitize-recover=all on compile and link;
#   - -ffp-contract=off (host code), so the tests' bitwise comparisons see the code as written;
#   - XENT_NATIVE: -march=native, so Eigen's packet math uses the host's AVX2 / AVX-512;
#   - CXX_EXTENSIONS / CUDA_EXTENSIONS OFF;
#   - XENT_CUDA_TUNING (a ;-list of NAME=VALUE, empty by default): CUDA sources get
#     XENT_CUDA_TUNING_OVERRIDE, naming bench/tuning/override.cuh, and -DXENT_CUDA_<NAME>=<VALUE>
#     for each item, which replace those numbers of the tuning row they are built with
#     (include/xent/cuda/tuning/policy.cuh), e.g. -DXENT_CUDA_TUNING="SPLIT_BARRIERS=0;SMALL_REGS=0";
#   - XENT_CUDA_TUNED_MAJOR (empty by default): -DXENT_CUDA_TUNED_MAJOR=<major> on CUDA sources,
#     the tuning row their kernels take.
# CUDA sources get the host-compiler flags through -Xcompiler.
function(xent_target_options target)
  if(NOT TARGET ${target})
    message(FATAL_ERROR "xent_target_options: '${target}' is not a target")
  endif()

  get_target_property(_type ${target} TYPE)
  if(_type STREQUAL "INTERFACE_LIBRARY")
    set(_scope INTERFACE)
  else()
    set(_scope PRIVATE)
  endif()

  # Standard C++ / CUDA C++ (-std=c++17, not gnu++17), so GNU extensions do not creep in.
  # (With cmake_minimum_required 3.21, CMP0128 is OLD: *_EXTENSIONS only takes effect together
  # with *_STANDARD, so set the standard too unless the target already chose one.)
  if(NOT _type STREQUAL "INTERFACE_LIBRARY")
    foreach(_lang CXX CUDA)
      get_target_property(_std ${target} ${_lang}_STANDARD)
      if(NOT _std)
        set_target_properties(${target} PROPERTIES ${_lang}_STANDARD 17)
      endif()
      set_target_properties(${target} PROPERTIES ${_lang}_STANDARD_REQUIRED ON ${_lang}_EXTENSIONS OFF)
    endforeach()
  endif()

  set(_cxx "$<COMPILE_LANGUAGE:CXX>")
  set(_cu "$<COMPILE_LANGUAGE:CUDA>")

  # Warnings. GCC 12 reports -W(maybe-)uninitialized inside its own AVX-512 intrinsics
  # (_mm512_undefined_ps, GCC bug 105593) once Eigen's packet math is inlined into our code with
  # -march=native: a false positive in a system header we cannot annotate, so those two warnings
  # are off for GCC before 13.
  # nvcc: Eigen's headers draw warnings 20012 / 20015 (annotations on defaulted functions,
  # constexpr host calls); they are Eigen's, not ours.
  target_compile_options(${target} ${_scope}
    "$<${_cxx}:-Wall;-Wextra>"
    "$<$<AND:${_cxx},$<CXX_COMPILER_ID:GNU>,$<VERSION_LESS:$<CXX_COMPILER_VERSION>,13>>:-Wno-maybe-uninitialized;-Wno-uninitialized>"
    "$<${_cu}:-Xcompiler=-Wall;-Xcompiler=-Wextra;-diag-suppress=20012,20015>")
  if(XENT_WERROR)
    target_compile_options(${target} ${_scope}
      $<${_cxx}:-Werror>
      $<${_cu}:-Xcompiler=-Werror>)
  endif()

  # Sanitizers: compile and link.
  if(XENT_SANITIZE)
    set(_san -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
    # nvcc splits -Xcompiler arguments at commas, so each host flag gets its own -Xcompiler.
    set(_san_cu -Xcompiler=-fsanitize=address -Xcompiler=-fsanitize=undefined
                -Xcompiler=-fno-omit-frame-pointer -Xcompiler=-fno-sanitize-recover=all)
    target_compile_options(${target} ${_scope}
      "$<${_cxx}:${_san}>"
      "$<${_cu}:${_san_cu}>")
    # CMake links CUDA executables with the host compiler (CMAKE_CUDA_HOST_LINK_LAUNCHER), so
    # the link takes the plain flags whichever the link language.
    target_link_options(${target} ${_scope} ${_san})
  endif()

  # No contraction of a * b + c into one FMA behind the code's back. GCC contracts by default in
  # C++ (-ffp-contract=fast), and whether it does at a given sum depends on how that template
  # instantiation was inlined: forward with every output and forward with the loss alone, which
  # share their arithmetic but not their inlining, then differed in the last bit on a Zen 3
  # (AVX2) host and agreed on a Zen 4 (AVX-512) one. Explicit FMAs (Eigen's pmadd) stay FMAs.
  target_compile_options(${target} ${_scope}
    $<${_cxx}:-ffp-contract=off>
    $<${_cu}:-Xcompiler=-ffp-contract=off>)

  # The tuning row, then overrides: one include hook and the numbers it replaces (CUDA sources).
  if(XENT_CUDA_TUNED_MAJOR)
    target_compile_definitions(${target} ${_scope}
      "$<${_cu}:XENT_CUDA_TUNED_MAJOR=${XENT_CUDA_TUNED_MAJOR}>")
  endif()
  if(XENT_CUDA_TUNING)
    get_filename_component(_override "${_xent_tuning_override}" ABSOLUTE)
    set(_defs "XENT_CUDA_TUNING_OVERRIDE=\"${_override}\"")
    foreach(_item IN LISTS XENT_CUDA_TUNING)
      if(NOT _item MATCHES "^[A-Z0-9_]+=.+$")
        message(FATAL_ERROR "XENT_CUDA_TUNING: '${_item}' is not NAME=VALUE")
      endif()
      list(APPEND _defs "XENT_CUDA_${_item}")
    endforeach()
    foreach(_def IN LISTS _defs)
      target_compile_definitions(${target} ${_scope} "$<${_cu}:${_def}>")
    endforeach()
  endif()

  # Host-specific code generation.
  if(XENT_NATIVE)
    target_compile_options(${target} ${_scope}
      $<${_cxx}:-march=native>
      $<${_cu}:-Xcompiler=-march=native>)
  endif()
endfunction()
