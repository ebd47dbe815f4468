// SPDX-License-Identifier: Apache-2.0
// The only registration file of lmcache's ops: every schema of the `lmcache` namespace is here
// (never `_C`, where vLLM's ops live), with its CUDA implementation. The pure-torch reference of
// each op is lmcache/gpu_ops/_ref.py, with the same arguments; the typed wrappers that choose
// between the two are in lmcache/gpu_ops/__init__.py. Keep each m.def schema on one line (a CPU
// test reads them from this file).
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

#define LMCACHE_STR_(x) #x
#define LMCACHE_STR(x) LMCACHE_STR_(x)
#ifndef LMCACHE_SOURCES_HASH
#define LMCACHE_SOURCES_HASH unknown
#endif

TORCH_LIBRARY(lmcache, m) {
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
  m.impl("gather_kv", c10::kCUDA, &lmcache::gather_kv);

  // Scatter: chunk-major staging -> paged KV, the reverse of gather_kv with the same arguments;
  // skipped slots leave the cache untouched. Checksums cover every staging row of the given
  // layers, skipped or not (verify the whole chunk). Duplicate slots: which row lands is
  // unspecified.
  m.def("scatter_kv(Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor chunk_offsets, Tensor staging, Tensor(c!)? checksums, int first_layer, int total_layers, bool staging_full, int max_sms) -> ()");
  m.impl("scatter_kv", c10::kCUDA, &lmcache::scatter_kv);

  // Checksums of byte ranges: out[c] = checksum of the bytes
  // [offsets[c] * unit_bytes, offsets[c + 1] * unit_bytes) of contiguous data (overwritten).
  m.def("checksum_chunks(Tensor data, Tensor offsets, int unit_bytes, Tensor(a!) out) -> ()");
  m.impl("checksum_chunks", c10::kCUDA, &lmcache::checksum_chunks);
}

// `import lmcache._C` (a build at install) gives a module whose `sources_hash` names the sources
// it was built from; a JIT build is loaded as a plain library and registers the same ops.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr};
  PyObject* mod = PyModule_Create(&module);
  if (mod != nullptr &&
      PyModule_AddStringConstant(mod, "sources_hash", LMCACHE_STR(LMCACHE_SOURCES_HASH)) != 0) {
    Py_DECREF(mod);
    return nullptr;
  }
  return mod;
}
