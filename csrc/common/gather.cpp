#include "common/gather.h"

#include <algorithm>
#include <cstring>

#include "common/thread_pool.h"

namespace pyperm::cpu {
namespace {

// One unit of `bytes` bytes, in 16-byte moves (the last one overlapping the one before, so any
// size takes ceil(bytes / 16) moves, never a byte loop).
inline void copy_unit(unsigned char* d, const unsigned char* s, int64_t bytes) {
  if (bytes >= 16) {
    for (int64_t off = 0; off + 16 < bytes; off += 16) std::memcpy(d + off, s + off, 16);
    std::memcpy(d + bytes - 16, s + bytes - 16, 16);
  } else if (bytes >= 8) {
    std::memcpy(d, s, 8);
    std::memcpy(d + bytes - 8, s + bytes - 8, 8);
  } else if (bytes >= 4) {
    std::memcpy(d, s, 4);
    std::memcpy(d + bytes - 4, s + bytes - 4, 4);
  } else {
    for (int64_t b = 0; b < bytes; ++b) d[b] = s[b];
  }
}

// Units of one word (a linear layer's columns). The bytes may hold any dtype and need not be
// aligned to the word, so they are moved with memcpy, which is defined for any bytes (a load
// through a cast pointer is not); the compiler turns a fixed-size memcpy into one plain move.
template <int64_t Bytes>
void gather_words(const unsigned char* src_row, const int64_t* index, int64_t k, unsigned char* out_row) {
  for (int64_t j = 0; j < k; ++j) std::memcpy(out_row + j * Bytes, src_row + index[j] * Bytes, Bytes);
}

// One row, out_row[j] = src_row[index[j]]. The units are read in the index's order, which
// defeats the hardware's prefetching: the next row (`next`, src_bytes long) is prefetched
// along the way, so that its cache lines arrive before they are read.
void gather_row(const unsigned char* src_row, const unsigned char* next, int64_t src_bytes, const int64_t* index,
                int64_t k, int64_t unit, unsigned char* out_row) {
  constexpr int64_t kLine = 64;
  int64_t ahead = 0;  // bytes of the next row prefetched so far
  const int64_t per_unit = next ? (src_bytes + k - 1) / k : 0;
  for (int64_t j0 = 0; j0 < k; j0 += 64) {
    const int64_t j1 = j0 + 64 < k ? j0 + 64 : k;
    if (unit == 2) gather_words<2>(src_row, index + j0, j1 - j0, out_row + j0 * 2);
    else if (unit == 4) gather_words<4>(src_row, index + j0, j1 - j0, out_row + j0 * 4);
    else if (unit == 8) gather_words<8>(src_row, index + j0, j1 - j0, out_row + j0 * 8);
    else
      for (int64_t j = j0; j < j1; ++j) copy_unit(out_row + j * unit, src_row + index[j] * unit, unit);
    const int64_t target = std::min(src_bytes, j1 * per_unit);
    for (; ahead < target; ahead += kLine) __builtin_prefetch(next + ahead);
  }
}

}  // namespace

bool gather_units(const unsigned char* src, int64_t outer, int64_t n, int64_t unit_bytes, const int64_t* index,
                  int64_t k, unsigned char* out, int threads) {
  for (int64_t j = 0; j < k; ++j)
    if (index[j] < 0 || index[j] >= n) return false;
  if (outer <= 0 || k <= 0 || unit_bytes <= 0) return true;
  const int64_t src_row = n * unit_bytes, out_row = k * unit_bytes;
  // Tasks of about 256 KiB of output; threads only for outputs of a MiB each (the copy is bound by memory
  // bandwidth, and waking a worker costs more than a smaller copy).
  const int64_t rows_per_task = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(out_row, 1));
  const int64_t tasks = (outer + rows_per_task - 1) / rows_per_task;
  const int64_t most = std::max<int64_t>(1, outer * out_row >> 20);
  parallel_for(tasks, static_cast<int>(std::min<int64_t>(std::max(threads, 1), most)), [&](int64_t t) {
    const int64_t end = std::min(outer, (t + 1) * rows_per_task);
    for (int64_t o = t * rows_per_task; o < end; ++o) {
      const unsigned char* next = o + 1 < end ? src + (o + 1) * src_row : nullptr;
      gather_row(src + o * src_row, next, src_row, index, k, unit_bytes, out + o * out_row);
    }
  });
  return true;
}

}  // namespace pyperm::cpu
