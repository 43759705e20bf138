// One object of the xent::cuda_kernels library: the row dispatch's instances of one pass over
// logits of one dtype (cuda/instances.cuh lists them), named by XENT_CUDA_KERNELS_DTYPE and
// XENT_CUDA_KERNELS_PASS, which CMake sets for each object it builds from this file.
#include <xent/cuda/instances.cuh>

XENT_CUDA_ROWS(XENT_CUDA_ROWS_INSTANCE, XENT_CUDA_KERNELS_DTYPE, XENT_CUDA_KERNELS_PASS)
