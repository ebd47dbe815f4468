// SPDX-License-Identifier: Apache-2.0
// Instantiations of kv_copy_kernel for gather (paged KV -> staging); see kv_copy.cuh.
#include "kv_copy.cuh"

namespace lmcache {

void launch_kv_gather(const KVCopyParams& p, int vector_bytes, bool checksum, int grid,
                      cudaStream_t stream) {
  launch_kv_copy<true>(p, vector_bytes, checksum, grid, stream);
}

}  // namespace lmcache
