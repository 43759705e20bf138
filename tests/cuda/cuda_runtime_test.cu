// The CUDA backend's runtime error handling (cuda/runtime.cuh), with the linear tests: what a
// failed runtime call leaves for the code that runs after xent throws for it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <xent/cuda/runtime.cuh>

#include "cuda/device_util.cuh"

namespace {

// A refused call (no such device) leaves a non-sticky error as the runtime's last error; xent's
// exception reports it, and the caller's next check (torch's, on its next op) must not report it
// again as its own.
TEST(CudaRuntime, AFailedCallLeavesNoErrorForTheNextCheck) {
  REQUIRE_GPU();
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const cudaError_t e = cudaSetDevice(-1);
  ASSERT_NE(e, cudaSuccess);
  EXPECT_THROW(xent::cuda_detail::check_cuda("xent::test", e), xent::cuda_error);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
