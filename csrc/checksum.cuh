// SPDX-License-Identifier: Apache-2.0
// The lmcache chunk checksum on the device ("lmcache-mix64-sum", version 1).
//
// A chunk's bytes are read as little-endian 64-bit words w_1 .. w_m (the last one zero-padded);
// its checksum is
//     (mix64(nbytes) + sum_i mix64(w_i XOR (i * 0x9E3779B97F4A7C15))) mod 2^64
// where mix64 is splitmix64's finalizer (a bijection). Terms add, so any split of the words
// over threads, blocks or launches reduces to the same value; lmcache/gpu_ops/_ref.py computes
// it with torch ops and is the oracle.
#pragma once

#include <cstdint>

namespace lmcache {

constexpr unsigned long long kChecksumGolden = 0x9E3779B97F4A7C15ull;

__device__ __forceinline__ unsigned long long mix64(unsigned long long x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

// Term of word w at 1-based index i.
__device__ __forceinline__ unsigned long long word_term(unsigned long long w, unsigned long long i) {
  return mix64(w ^ (i * kChecksumGolden));
}

// Sum acc over the warp; lane 0 adds it to *dst. Every lane of the warp must call it.
__device__ __forceinline__ void warp_flush(unsigned long long acc, unsigned long long* dst) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(dst, acc);
}

}  // namespace lmcache
