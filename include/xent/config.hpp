// Portability macros shared by every xent header.
#pragma once

#if defined(__CUDACC__)
#define XENT_HOST_DEVICE __host__ __device__
#else
#define XENT_HOST_DEVICE
#endif

#if defined(__GNUC__) || defined(__clang__)
#define XENT_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define XENT_ALWAYS_INLINE inline
#endif

#define XENT_VERSION_MAJOR 0
#define XENT_VERSION_MINOR 1
#define XENT_VERSION_PATCH 0
