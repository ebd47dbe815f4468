// SPDX-License-Identifier: Apache-2.0
// Chunk checksums over byte regions (checksum.cuh): the checksum_chunks op, and the fallback of
// the copy kernels when their vectors are narrower than a checksum word.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "checksum.cuh"
#include "kv_copy_params.h"

namespace lmcache {

__global__ void __launch_bounds__(kChecksumThreads)
    region_checksum_kernel(const __grid_constant__ RegionChecksumParams p) {
  for (int64_t c = blockIdx.y; c < p.num_chunks; c += gridDim.y) {
    const int64_t a = __ldg(p.offsets + c);
    const int64_t b = __ldg(p.offsets + c + 1);
    if (a < 0 || b <= a || b > p.num_units) continue;  // block-uniform
    const int64_t n = b - a;
    const int64_t len = p.layers * n * p.row_bytes;
    const unsigned char* base = p.data + (a * p.stage_layers + p.stage_layer0 * n) * p.row_bytes;
    const unsigned long long word1 =
        static_cast<unsigned long long>(p.chunk_layer0 * n * p.row_bytes) / 8 + 1;
    const int64_t words = (len + 7) / 8;
    unsigned long long acc = 0;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const unsigned char* q = base + 8 * i;
      unsigned long long w = 0;
      if ((reinterpret_cast<uintptr_t>(q) & 7) == 0 && 8 * i + 8 <= len) {
        w = __ldg(reinterpret_cast<const unsigned long long*>(q));
      } else {
        const int64_t m = len - 8 * i < 8 ? len - 8 * i : 8;
        for (int64_t k = 0; k < m; ++k) {
          w |= static_cast<unsigned long long>(__ldg(q + k)) << (8 * k);
        }
      }
      acc += word_term(w, word1 + i);
    }
    if (p.chunk_layer0 == 0 && blockIdx.x == 0 && threadIdx.x == 0) {
      acc += mix64(static_cast<unsigned long long>(p.total_layers * n * p.row_bytes));
    }
    warp_flush(acc, p.out + c);
  }
}

void launch_region_checksum(const RegionChecksumParams& p, int sms, cudaStream_t stream) {
  const int chunks_y = std::min(p.num_chunks, 65535);
  const int per_chunk = std::max(1, (4 * sms + chunks_y - 1) / chunks_y);
  region_checksum_kernel<<<dim3(per_chunk, chunks_y), kChecksumThreads, 0, stream>>>(p);
}

}  // namespace lmcache
