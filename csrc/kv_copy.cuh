// SPDX-License-Identifier: Apache-2.0
// The one gather/scatter kernel between a paged KV cache and chunk-major staging.
//
// Work: one warp per staging row (one token of one layer: row_bytes bytes), rows in staging
// order, a grid-stride loop over rows (a persistent grid of at most one 1024-thread block per
// SM: the grid size is the SM cap). A lane moves VW-byte vectors (16 where every address and
// length allows), kUnroll loads in flight before the stores. Slots < 0 or >= capacity are
// skipped: their cache entries are not touched and, on gather, their staging rows are not
// written. With CSUM, each lane folds the bytes it moves (and, on gather, the staging bytes of
// skipped rows) into the chunk checksum (checksum.cuh) in the same pass; a warp adds its sum
// to the chunk's checksum with one atomic when it moves to another chunk.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "checksum.cuh"
#include "kv_copy_params.h"

namespace lmcache {

constexpr int kUnroll = 4;

template <int VW>
struct Vec;
template <>
struct Vec<16> {
  using T = uint4;
  __device__ static unsigned long long terms(const uint4& v, unsigned long long i) {
    const unsigned long long w0 = static_cast<unsigned long long>(v.x) |
                                  (static_cast<unsigned long long>(v.y) << 32);
    const unsigned long long w1 = static_cast<unsigned long long>(v.z) |
                                  (static_cast<unsigned long long>(v.w) << 32);
    return word_term(w0, i) + word_term(w1, i + 1);
  }
};
template <>
struct Vec<8> {
  using T = uint2;
  __device__ static unsigned long long terms(const uint2& v, unsigned long long i) {
    return word_term(
        static_cast<unsigned long long>(v.x) | (static_cast<unsigned long long>(v.y) << 32), i);
  }
};
// Narrower vectors never checksum in the copy pass (the host launches the region kernel).
template <>
struct Vec<4> {
  using T = unsigned int;
  __device__ static unsigned long long terms(const T&, unsigned long long) { return 0; }
};
template <>
struct Vec<2> {
  using T = unsigned short;
  __device__ static unsigned long long terms(const T&, unsigned long long) { return 0; }
};
template <>
struct Vec<1> {
  using T = unsigned char;
  __device__ static unsigned long long terms(const T&, unsigned long long) { return 0; }
};

// Address in the cache of byte b of a row whose K heads start at kb and V heads at vb.
__device__ __forceinline__ char* seg_addr(const KVCopyParams& p, char* kb, char* vb, int k_bytes,
                                          int b) {
  if (b < k_bytes) {
    int h, w;
    if (p.k_seg_shift >= 0) {
      h = b >> p.k_seg_shift;
      w = b & (p.k_seg_bytes - 1);
    } else {
      h = b / p.k_seg_bytes;
      w = b - h * p.k_seg_bytes;
    }
    return kb + h * p.k_head_stride + w;
  }
  b -= k_bytes;
  int h, w;
  if (p.v_seg_shift >= 0) {
    h = b >> p.v_seg_shift;
    w = b & (p.v_seg_bytes - 1);
  } else {
    h = b / p.v_seg_bytes;
    w = b - h * p.v_seg_bytes;
  }
  return vb + h * p.v_head_stride + w;
}

// Last chunk c with offsets[c] * nl <= r (0 when none is: the caller checks).
__device__ __forceinline__ int find_chunk(const int64_t* offsets, int num_chunks, int64_t r,
                                          int64_t nl) {
  int lo = 0, hi = num_chunks - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(offsets + mid) * nl <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <int VW, bool GATHER, bool CSUM>
__global__ void __launch_bounds__(kCopyThreads, 1)
    kv_copy_kernel(const __grid_constant__ KVCopyParams p) {
  using V = typename Vec<VW>::T;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kCopyThreads / 32);
  const int64_t nl = p.launch_layers;
  const int64_t rows = p.num_tokens * nl;
  const int units = p.row_bytes / VW;
  const int k_bytes = p.heads * p.k_seg_bytes;
  int chunk = -1;
  int64_t c_lo = 0, c_hi = 0, tok0 = 0, n = 1;
  unsigned long long acc = 0;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (kCopyThreads / 32) + (threadIdx.x >> 5);
       r < rows; r += warps) {
    if (r < c_lo || r >= c_hi) {  // warp-uniform: r is the warp's
      if (CSUM && chunk >= 0) {
        warp_flush(acc, p.checksums + chunk);
        acc = 0;
      }
      chunk = find_chunk(p.chunk_offsets, p.num_chunks, r, nl);
      const int64_t a = __ldg(p.chunk_offsets + chunk);
      const int64_t b = __ldg(p.chunk_offsets + chunk + 1);
      if (a < 0 || b <= a || b > p.num_tokens || r < a * nl || r >= b * nl) {
        chunk = -1;  // malformed offsets: this row is not part of a chunk; never read past
        c_lo = c_hi = 0;  // the buffers
        continue;
      }
      tok0 = a;
      n = b - a;
      c_lo = a * nl;
      c_hi = b * nl;
    }
    const int64_t within = r - c_lo;
    const int64_t li = within / n;  // layer within the launch
    const int64_t t = within - li * n;
    const int64_t slot = __ldg(p.slots + tok0 + t);
    const bool valid = slot >= 0 && slot < p.capacity;
    if (!CSUM && !valid) continue;
    const int64_t layer = p.layer_base + li;  // layer within the call
    char* stg = p.staging + (tok0 * p.stage_layers + (p.stage_layer0 + layer) * n + t) *
                                static_cast<int64_t>(p.row_bytes);
    char* kb = nullptr;
    char* vb = nullptr;
    if (valid) {
      const int64_t page = slot / p.page_size;
      const int64_t off = slot - page * p.page_size;
      kb = p.k_ptr[li] + page * p.k_page_stride + off * p.k_offset_stride;
      if (p.v_seg_bytes > 0) vb = p.v_ptr[li] + page * p.v_page_stride + off * p.v_offset_stride;
    }
    unsigned long long word1 = 0;  // 1-based index in the full chunk of the row's first word
    if constexpr (CSUM) {
      word1 = static_cast<unsigned long long>((p.chunk_layer0 + layer) * n + t) *
                  static_cast<unsigned long long>(p.row_bytes / 8) +
              1;
    }
    for (int u0 = lane; u0 < units; u0 += 32 * kUnroll) {
      V vals[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int u = u0 + 32 * j;
        if (u < units) {
          const int b = u * VW;
          const char* src;
          if constexpr (GATHER) {
            src = valid ? seg_addr(p, kb, vb, k_bytes, b) : stg + b;
          } else {
            src = stg + b;
          }
          vals[j] = __ldg(reinterpret_cast<const V*>(src));
        }
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int u = u0 + 32 * j;
        if (u < units) {
          const int b = u * VW;
          if (valid) {
            char* dst;
            if constexpr (GATHER) {
              dst = stg + b;
            } else {
              dst = seg_addr(p, kb, vb, k_bytes, b);
            }
            *reinterpret_cast<V*>(dst) = vals[j];
          }
          if constexpr (CSUM) acc += Vec<VW>::terms(vals[j], word1 + b / 8);
        }
      }
    }
    if constexpr (CSUM) {
      if (lane == 0 && t == 0 && p.chunk_layer0 + layer == 0) {
        acc += mix64(static_cast<unsigned long long>(p.total_layers * n) *
                     static_cast<unsigned long long>(p.row_bytes));
      }
    }
  }
  if (CSUM && chunk >= 0) warp_flush(acc, p.checksums + chunk);
}

template <bool GATHER>
void launch_kv_copy(const KVCopyParams& p, int vector_bytes, bool checksum, int grid,
                    cudaStream_t stream) {
  const dim3 g(grid), b(kCopyThreads);
  switch (vector_bytes) {
    case 16:
      if (checksum) {
        kv_copy_kernel<16, GATHER, true><<<g, b, 0, stream>>>(p);
      } else {
        kv_copy_kernel<16, GATHER, false><<<g, b, 0, stream>>>(p);
      }
      break;
    case 8:
      if (checksum) {
        kv_copy_kernel<8, GATHER, true><<<g, b, 0, stream>>>(p);
      } else {
        kv_copy_kernel<8, GATHER, false><<<g, b, 0, stream>>>(p);
      }
      break;
    case 4:
      kv_copy_kernel<4, GATHER, false><<<g, b, 0, stream>>>(p);
      break;
    case 2:
      kv_copy_kernel<2, GATHER, false><<<g, b, 0, stream>>>(p);
      break;
    default:
      kv_copy_kernel<1, GATHER, false><<<g, b, 0, stream>>>(p);
      break;
  }
}

}  // namespace lmcache
