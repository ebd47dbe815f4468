// SPDX-License-Identifier: Apache-2.0
// The only registration file of lmcache's ops: every schema of the `lmcache` namespace is here
// (never `_C`, where vLLM's ops live), with its CUDA implementation. The pure-torch reference of
// each op is lmcache/gpu_ops/_ref.py, with the same arguments; the typed wrappers that choose
// between the implementations are in lmcache/gpu_ops/__init__.py. Keep each m.def schema on one
// line (a CPU test reads them from this file).
//
// Registered on torch's stable ABI (STABLE_TORCH_LIBRARY, torch >= 2.9; this build targets the
// 2.11 ABI through TORCH_TARGET_VERSION): one compiled library loads with every torch of the
// supported range. It is a plain shared library, loaded with torch.ops.load_library; it has no
// Python module init, so the same file serves every Python version.
#include <torch/csrc/stable/library.h>

#include "ops.h"

STABLE_TORCH_LIBRARY(lmcache, m) {
  // Gather: paged KV -> chunk-major staging, all chunks and all given layers in one launch.
  //   k_caches[i] / v_caches[i]: layer i as a [num_pages, page_size, heads, head_size] view (any
  //     strides, last axis contiguous); v_caches empty for MLA (one latent per token).
  //   slots [num_tokens] int64: engine slot (page * page_size + offset) of each staging token;
  //     < 0 (or >= num_pages * page_size) skips the token: its staging rows are not written.
  //   chunk_offsets [num_chunks + 1] int64: staging token offsets of the chunks (0 .. num_tokens).
  //   staging: per chunk [layers, n_c, kv_width], chunks back to back (the host chunk layout);
  //     layers = total_layers if staging_full else len(k_caches).
  //   checksums [num_chunks] int64 or None: each chunk's checksum of the staging bytes of these
  //     layers is ADDED (mod 2^64; zero it first). first_layer: chunk layer of k_caches[0].
  //   max_sms: at most this many SMs (0: all).
  m.def("gather_kv(Tensor[] k_caches, Tensor[] v_caches, Tensor slots, Tensor chunk_offsets, Tensor(a!) staging, Tensor(b!)? checksums, int first_layer, int total_layers, bool staging_full, int max_sms) -> ()");

  // Scatter: chunk-major staging -> paged KV, the reverse of gather_kv with the same arguments;
  // skipped slots leave the cache untouched. Checksums cover every staging row of the given
  // layers, skipped or not (verify the whole chunk). Duplicate slots: which row lands is
  // unspecified.
  m.def("scatter_kv(Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor chunk_offsets, Tensor staging, Tensor(c!)? checksums, int first_layer, int total_layers, bool staging_full, int max_sms) -> ()");

  // Checksums of byte ranges: out[c] = checksum of the bytes
  // [offsets[c] * unit_bytes, offsets[c + 1] * unit_bytes) of contiguous data (overwritten).
  m.def("checksum_chunks(Tensor data, Tensor offsets, int unit_bytes, Tensor(a!) out) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(lmcache, CUDA, m) {
  m.impl("gather_kv", TORCH_BOX(&lmcache::gather_kv));
  m.impl("scatter_kv", TORCH_BOX(&lmcache::scatter_kv));
  m.impl("checksum_chunks", TORCH_BOX(&lmcache::checksum_chunks));
}
