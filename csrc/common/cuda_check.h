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
