// SPDX-License-Identifier: Apache-2.0
// C++ entry points of the torch.ops.lmcache ops; their schemas are in torch_bindings.cpp.
// Only torch's stable ABI appears here (torch::stable::Tensor), never ATen or c10.
#pragma once

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace lmcache {

using torch::stable::Tensor;

void gather_kv(const std::vector<Tensor>& k_caches, const std::vector<Tensor>& v_caches,
               const Tensor& slots, const Tensor& chunk_offsets, Tensor& staging,
               const std::optional<Tensor>& checksums, int64_t first_layer, int64_t total_layers,
               bool staging_full, int64_t max_sms);

void scatter_kv(const std::vector<Tensor>& k_caches, const std::vector<Tensor>& v_caches,
                const Tensor& slots, const Tensor& chunk_offsets, const Tensor& staging,
                const std::optional<Tensor>& checksums, int64_t first_layer,
                int64_t total_layers, bool staging_full, int64_t max_sms);

void checksum_chunks(const Tensor& data, const Tensor& offsets, int64_t unit_bytes, Tensor& out);

}  // namespace lmcache
