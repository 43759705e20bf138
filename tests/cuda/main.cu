// The main of the CUDA test executables: GoogleTest's, except that a run on a machine with no GPU,
// where the device tests skipped and nothing failed, exits 77, which CTest reports as skipped
// (SKIP_RETURN_CODE in CMakeLists.txt) rather than passed. A failure still exits 1; on a machine
// with a GPU a test that skips (one that needs two GPUs, say) leaves the run passed.
#include <gtest/gtest.h>

#include "cuda/device_util.cuh"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int failed = RUN_ALL_TESTS();
  if (failed != 0) return failed;
  const bool skipped = ::testing::UnitTest::GetInstance()->skipped_test_count() > 0;
  return skipped && !xent_test::no_gpu_reason().empty() ? 77 : 0;
}
