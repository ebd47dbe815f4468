// SPDX-License-Identifier: Apache-2.0
// Launch parameters of the lmcache CUDA kernels (plain data: included by host and device code).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace lmcache {

// Layers one launch of kv_copy_kernel handles: their base pointers travel in the kernel's
// parameter block (2 x 128 x 8 bytes, under the 4 KiB limit); a call with more layers launches
// once per group of this many.
constexpr int kMaxLayersPerLaunch = 128;

// Gather (paged KV -> chunk-major staging) or scatter (the reverse) of one launch.
//
// Staging holds, per chunk c of n_c tokens starting at staging token tok0_c, the rows
// [stage_layers, n_c, row_bytes] (the host chunk layout [num_layers, num_tokens, kv_width]);
// call layer i lives at staging layer stage_layer0 + i. A row is all K heads, then all V heads,
// each head_size elements (MLA: one latent, no V).
struct KVCopyParams {
  char* k_ptr[kMaxLayersPerLaunch];  // per launch layer: K view base ([pages, page_size, heads, hk])
  char* v_ptr[kMaxLayersPerLaunch];  // per launch layer: V view base, unused when v_seg_bytes == 0
  const int64_t* slots;              // [num_tokens] engine slot per staging token, < 0: skipped
  const int64_t* chunk_offsets;      // [num_chunks + 1] staging token offsets of the chunks
  char* staging;                     // chunk-major staging, contiguous
  unsigned long long* checksums;     // [num_chunks] or nullptr: the chunk checksums, added to
  int64_t num_tokens;
  int64_t capacity;  // num_pages * page_size: slots >= capacity are skipped like slots < 0
  int64_t page_size;
  int64_t k_page_stride, k_offset_stride, k_head_stride;  // bytes
  int64_t v_page_stride, v_offset_stride, v_head_stride;  // bytes
  int64_t stage_layers;  // layers per chunk in staging
  int64_t stage_layer0;  // staging layer of call layer 0
  int64_t chunk_layer0;  // layer of the full chunk that call layer 0 is (checksum word index)
  int64_t total_layers;  // layers of a full chunk (checksum length term)
  int num_chunks;
  int heads;
  int k_seg_bytes;  // bytes of one K head
  int v_seg_bytes;  // bytes of one V head (0: MLA)
  int k_seg_shift;  // log2(k_seg_bytes) when a power of two, else -1
  int v_seg_shift;
  int row_bytes;      // heads * (k_seg_bytes + v_seg_bytes)
  int launch_layers;  // layers in this launch
  int layer_base;     // call layer of this launch's layer 0
};

// Chunk checksums over byte regions of a buffer (the fallback of the copy kernels, and the
// checksum_chunks op). Chunk c (tokens [a, b) of offsets, n = b - a) covers the bytes
// [(a * stage_layers + stage_layer0 * n) * row_bytes, + layers * n * row_bytes), whose first
// word is word chunk_layer0 * n * row_bytes / 8 of the full chunk.
struct RegionChecksumParams {
  const unsigned char* data;
  const int64_t* offsets;  // [num_chunks + 1]
  unsigned long long* out;  // [num_chunks], added to
  int64_t num_units;        // offsets must not exceed this
  int64_t row_bytes;
  int64_t stage_layers;
  int64_t stage_layer0;
  int64_t layers;
  int64_t chunk_layer0;
  int64_t total_layers;
  int num_chunks;
};

constexpr int kCopyThreads = 1024;     // one block per SM at most: the grid size caps the SMs
constexpr int kChecksumThreads = 256;

void launch_kv_gather(const KVCopyParams& p, int vector_bytes, bool checksum, int grid,
                      cudaStream_t stream);
void launch_kv_scatter(const KVCopyParams& p, int vector_bytes, bool checksum, int grid,
                       cudaStream_t stream);
void launch_region_checksum(const RegionChecksumParams& p, int sms, cudaStream_t stream);

}  // namespace lmcache
