// SPDX-License-Identifier: Apache-2.0
// C++ entry points of the torch.ops.lmcache ops; their schemas are in torch_bindings.cpp.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <optional>

namespace lmcache {

void gather_kv(at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots,
               const at::Tensor& chunk_offsets, at::Tensor& staging,
               const std::optional<at::Tensor>& checksums, int64_t first_layer,
               int64_t total_layers, bool staging_full, int64_t max_sms);

void scatter_kv(at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots,
                const at::Tensor& chunk_offsets, const at::Tensor& staging,
                const std::optional<at::Tensor>& checksums, int64_t first_layer,
                int64_t total_layers, bool staging_full, int64_t max_sms);

void checksum_chunks(const at::Tensor& data, const at::Tensor& offsets, int64_t unit_bytes,
                     at::Tensor& out);

}  // namespace lmcache
