// Gathers of units along a middle axis, for weight matching's similarity products on the CPU.
//
// torch's index_select along an axis other than the first copies entry by entry through a
// generic strided loop, on one thread: 7x a plain copy for a convolution's (out, in, 3, 3)
// weight taken along `in`, 4x for a linear layer's columns. Here each unit's entries are one
// run of bytes, copied as words, and the rows are split over threads. (A CUDA tensor keeps
// torch's gather, which runs at the device's bandwidth.)
#pragma once
#include <cstdint>

namespace pyperm::cpu {

// out[o, j, :] = src[o, index[j], :] for C-contiguous src (outer, n, unit_bytes) and out
// (outer, k, unit_bytes), on up to `threads` threads (a thread per MiB of output at most).
// Returns false, having written nothing, when an index lies outside [0, n).
bool gather_units(const unsigned char* src, int64_t outer, int64_t n, int64_t unit_bytes, const int64_t* index,
                  int64_t k, unsigned char* out, int threads);

}  // namespace pyperm::cpu
