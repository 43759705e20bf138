// Compiled twice into one executable (tests/cuda/CMakeLists.txt): every public CUDA header must
// link however many translation units include it. A kernel that is not a template is defined in
// each of them, and the link fails (the Python package's op files each include the backend).
#include <xent/cuda/backend.cuh>
#include <xent/cuda/linear.cuh>
#include <xent/cuda/vocab_parallel.cuh>
#include <xent/cuda/vocab_parallel_linear.cuh>

#ifdef XENT_LINK_CHECK_MAIN
int main() { return 0; }
#endif
