// CUDA error checks for the .cu files. Only CUDA sources include this header.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define PYPERM_CUDA_CHECK(expr)                                                              \
  do {                                                                                       \
    cudaError_t pyperm_err_ = (expr);                                                        \
    if (pyperm_err_ != cudaSuccess)                                                          \
      throw std::runtime_error(std::string("CUDA error in " #expr ": ") +                   \
                               cudaGetErrorString(pyperm_err_));                             \
  } while (0)

// After a <<<...>>> launch: catches bad configurations (too much shared memory, too many
// threads) at once instead of at the next synchronising call, where the cause is lost.
#define PYPERM_CUDA_CHECK_LAUNCH(what)                                                       \
  do {                                                                                       \
    cudaError_t pyperm_err_ = cudaGetLastError();                                            \
    if (pyperm_err_ != cudaSuccess)                                                          \
      throw std::runtime_error(std::string("CUDA error launching ") + (what) + ": " +       \
                               cudaGetErrorString(pyperm_err_));                             \
  } while (0)
