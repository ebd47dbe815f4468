// SPDX-License-Identifier: Apache-2.0
// Instantiations of kv_copy_kernel for scatter (staging -> paged KV); see kv_copy.cuh.
#include "kv_copy.cuh"

namespace lmcache {

void launch_kv_scatter(const KVCopyParams& p, int vector_bytes, bool checksum, int grid,
                       cudaStream_t stream) {
  launch_kv_copy<false>(p, vector_bytes, checksum, grid, stream);
}

}  // namespace lmcache
