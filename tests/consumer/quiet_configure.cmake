# cmake -DXENT_SOURCE_DIR=... -DCONSUMER_DIR=... -DBINARY_DIR=... [-DGENERATOR=...] -P this
# Configures the add_subdirectory consumer afresh and fails if xent printed anything of its own:
# a CPU-only parent that asks for no CUDA component gets no "xent: ..." line (and, as that
# project's CMakeLists checks, no probe).
file(REMOVE_RECURSE "${BINARY_DIR}")
set(_generator)
if(GENERATOR)
  set(_generator -G "${GENERATOR}")
endif()
execute_process(
  COMMAND "${CMAKE_COMMAND}" -S "${CONSUMER_DIR}" -B "${BINARY_DIR}" ${_generator}
          "-DXENT_SOURCE_DIR=${XENT_SOURCE_DIR}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
          "-DEigen3_DIR=${Eigen3_DIR}"
  OUTPUT_VARIABLE _out
  ERROR_VARIABLE _out
  RESULT_VARIABLE _result)
if(NOT _result EQUAL 0)
  message(FATAL_ERROR "configuring ${CONSUMER_DIR} failed:\n${_out}")
endif()
# Every message of xent's CMake code begins "xent:".
string(REGEX MATCHALL "[^\n]*xent:[^\n]*" _lines "${_out}")
if(_lines)
  list(JOIN _lines "\n" _lines)
  message(FATAL_ERROR "xent printed while configured as a CPU-only subproject:\n${_lines}")
endif()
message(STATUS "quiet: nothing of xent's among the configure's output")
