// SPDX-License-Identifier: Apache-2.0
// Host side of the lmcache ops: every input checked (what was expected, what was found), launch
// parameters built, kernels launched on torch's current stream. Written against torch's stable
// ABI only (torch/csrc/stable, torch/headeronly), so one binary loads with every torch >= 2.11.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kv_copy_params.h"
#include "ops.h"

namespace lmcache {
namespace {

// Error messages are built here as one std::string, without iostreams: streaming numbers through
// a std::ostringstream compiled into this library crashed (SIGSEGV in
// std::ostream::_M_insert<long>) in a build on torch 2.11 + GCC 13. The exception type is
// std::runtime_error, which torch raises in Python as RuntimeError.
using torch::headeronly::ScalarType;

std::string piece(const char* s) { return s; }
std::string piece(const std::string& s) { return s; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
std::string piece(T v) {
  return std::to_string(v);
}
std::string piece(ScalarType t) { return torch::headeronly::toString(t); }
std::string piece(const torch::stable::Device& d) {
  return std::string(d.is_cuda() ? "cuda:" : d.is_cpu() ? "cpu:" : "device:") +
         std::to_string(d.index());
}
std::string piece(torch::headeronly::IntHeaderOnlyArrayRef a) {
  std::string out = "[";
  for (size_t i = 0; i < a.size(); ++i) out += (i ? ", " : "") + std::to_string(a[i]);
  return out + "]";
}

template <typename... Args>
std::string msg(const Args&... args) {
  std::string out;
  ((out += piece(args)), ...);
  return out;
}

#define LMC_CHECK(cond, ...)                                                    \
  do {                                                                         \
    if (!(cond)) throw std::runtime_error(::lmcache::msg(__VA_ARGS__));        \
  } while (0)

#define LMC_CUDA_CHECK(expr)                                                               \
  do {                                                                                      \
    const cudaError_t err_ = (expr);                                                        \
    LMC_CHECK(err_ == cudaSuccess, "lmcache: CUDA error ", cudaGetErrorName(err_), " (",    \
              cudaGetErrorString(err_), ") at ", __FILE__, ":", __LINE__, " in ", #expr); \
  } while (0)

std::string describe(const Tensor& t) {
  return msg("shape ", t.sizes(), " strides ", t.strides(), " ", t.scalar_type(), " on ",
             t.device());
}

int log2_or_minus1(int64_t x) {
  if (x <= 0 || (x & (x - 1)) != 0) return -1;
  int s = 0;
  while ((int64_t{1} << s) < x) ++s;
  return s;
}

void check_index_tensor(const char* op, const char* name, const Tensor& t,
                        const torch::stable::Device& device) {
  LMC_CHECK(t.scalar_type() == ScalarType::Long && t.dim() == 1 && t.is_contiguous(), op,
              ": expected ", name, " as a contiguous 1-D int64 tensor, found ", describe(t));
  LMC_CHECK(t.device() == device, op, ": expected ", name, " on ", device, " (the staging's ",
              "device), found ", t.device());
}

// Checks the layer views of one list; returns false when the list is empty.
void check_layers(const char* op, const char* name, const std::vector<Tensor>& layers,
                  const torch::stable::Device& device) {
  for (size_t i = 0; i < layers.size(); ++i) {
    const Tensor& t = layers[i];
    LMC_CHECK(t.is_cuda(), op, ": expected ", name, "[", i, "] in CUDA device memory, found ",
                describe(t), " (host memory moves by DMA: copy it to the device first)");
    LMC_CHECK(t.device() == device, op, ": expected ", name, "[", i, "] on ", device,
                " (the staging's device), found ", t.device());
    LMC_CHECK(t.dim() == 4, op, ": expected ", name, "[", i,
                "] as a [num_pages, page_size, heads, head_size] view, found ", describe(t));
    LMC_CHECK(t.stride(3) == 1 || t.size(3) == 1, op, ": expected ", name, "[", i,
                "] to have a contiguous last axis (stride 1), found ", describe(t));
    for (int d = 0; d < 3; ++d) {
      LMC_CHECK(t.size(d) == 1 || t.stride(d) > 0, op, ": expected positive strides in ", name,
                  "[", i, "], found ", describe(t));
    }
    if (i > 0) {
      const Tensor& f = layers[0];
      LMC_CHECK(t.sizes().equals(f.sizes()) && t.strides().equals(f.strides()) &&
                      t.scalar_type() == f.scalar_type(),
                  op, ": expected every layer of ", name, " like ", name, "[0] (", describe(f),
                  "), found ", name, "[", i, "] ", describe(t));
    }
  }
}

int64_t fold_align(int64_t g, int64_t x) { return std::gcd(g, x); }

int device_sms(const torch::stable::Device& device) {
  int sms = 0;
  LMC_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device.index()));
  return sms;
}

// torch's current CUDA stream of a device. The stable ABI of torch 2.11 has no device-generic way
// to read a stream's native handle (Stream::nativeHandle came in 2.13), so the CUDA shim
// function is looked up in the libtorch_cuda.so torch has loaded. Looking it up at run time
// rather than linking it keeps this library loadable by CPU-only torch builds.
using CurrentCudaStreamFn = int32_t (*)(int32_t, void**);

CurrentCudaStreamFn current_stream_fn() {
  static const CurrentCudaStreamFn fn = []() -> CurrentCudaStreamFn {
    void* sym = dlsym(RTLD_DEFAULT, "aoti_torch_get_current_cuda_stream");
    if (sym == nullptr) {
      void* lib = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
      if (lib != nullptr) sym = dlsym(lib, "aoti_torch_get_current_cuda_stream");
    }
    return reinterpret_cast<CurrentCudaStreamFn>(sym);
  }();
  return fn;
}

cudaStream_t current_stream(int32_t device_index) {
  const CurrentCudaStreamFn fn = current_stream_fn();
  LMC_CHECK(fn != nullptr,
            "lmcache: torch's CUDA library (libtorch_cuda.so, aoti_torch_get_current_cuda_stream) "
            "is not loaded in this process: expected a CUDA build of torch with a CUDA tensor "
            "argument");
  void* stream = nullptr;
  LMC_CHECK(fn(device_index, &stream) == 0,
            "lmcache: could not read torch's current CUDA stream of device ", device_index);
  return static_cast<cudaStream_t>(stream);
}

struct Plan {
  KVCopyParams params{};
  int32_t device_index = 0;
  int vector_bytes = 1;
  bool in_pass_checksum = false;
  bool region_checksum = false;
  int sms = 1;
  int64_t nl = 0;
};

Plan plan_copy(const char* op, const std::vector<Tensor>& k, const std::vector<Tensor>& v, const Tensor& slots,
               const Tensor& chunk_offsets, const Tensor& staging,
               const std::optional<Tensor>& checksums, int64_t first_layer,
               int64_t total_layers, bool staging_full, int64_t max_sms) {
  LMC_CHECK(staging.is_cuda(), op, ": expected staging in CUDA device memory, found ",
              describe(staging), " (host memory moves by DMA: stage on the device)");
  const torch::stable::Device device = staging.device();
  LMC_CHECK(!k.empty(), op, ": expected at least one layer in k_caches, found none");
  LMC_CHECK(v.empty() || v.size() == k.size(), op,
              ": expected v_caches to hold 0 layers (MLA: one latent per token) or ", k.size(),
              " like k_caches, found ", v.size());
  check_layers(op, "k_caches", k, device);
  check_layers(op, "v_caches", v, device);
  const Tensor& k0 = k[0];
  if (!v.empty()) {
    const Tensor& v0 = v[0];
    LMC_CHECK(v0.size(0) == k0.size(0) && v0.size(1) == k0.size(1) &&
                    v0.size(2) == k0.size(2) && v0.scalar_type() == k0.scalar_type(),
                op, ": expected v_caches with the pages, page size, heads and dtype of k_caches (",
                describe(k0), "), found ", describe(v0));
  }
  check_index_tensor(op, "slots", slots, device);
  check_index_tensor(op, "chunk_offsets", chunk_offsets, device);
  LMC_CHECK(chunk_offsets.numel() >= 1, op,
              ": expected chunk_offsets [num_chunks + 1] with at least one entry, found none");
  const int64_t nl = static_cast<int64_t>(k.size());
  LMC_CHECK(first_layer >= 0 && total_layers >= first_layer + nl, op,
              ": expected 0 <= first_layer and first_layer + len(k_caches) <= total_layers, "
              "found first_layer=",
              first_layer, ", ", nl, " layers, total_layers=", total_layers);
  LMC_CHECK(max_sms >= 0, op, ": expected max_sms >= 0 (0: all SMs), found ", max_sms);

  const int64_t elt = static_cast<int64_t>(k0.element_size());
  const int64_t heads = k0.size(2);
  const int64_t k_seg = k0.size(3) * elt;
  const int64_t v_seg = v.empty() ? 0 : v[0].size(3) * elt;
  const int64_t row_bytes = heads * (k_seg + v_seg);
  const int64_t width = row_bytes / elt;
  const int64_t num_tokens = slots.numel();
  const int64_t stage_layers = staging_full ? total_layers : nl;
  LMC_CHECK(row_bytes > 0 && row_bytes < (int64_t{1} << 30), op,
              ": expected 0 < heads * (head_size_k + head_size_v) * element size < 2^30, found ",
              row_bytes, " bytes");
  LMC_CHECK(staging.scalar_type() == k0.scalar_type(), op, ": expected staging of dtype ",
              k0.scalar_type(), " (the KV dtype), found ", staging.scalar_type());
  LMC_CHECK(staging.is_contiguous(), op, ": expected a contiguous staging tensor, found ",
              describe(staging));
  LMC_CHECK(staging.numel() == num_tokens * stage_layers * width, op,
              ": expected staging of num_tokens * layers * kv_width = ", num_tokens, " * ",
              stage_layers, " * ", width, " = ", num_tokens * stage_layers * width,
              " elements (layout [chunk][layer][token][kv_width]), found ", staging.numel());
  const int64_t num_chunks = chunk_offsets.numel() - 1;
  if (checksums.has_value()) {
    const Tensor& c = *checksums;
    LMC_CHECK(c.scalar_type() == ScalarType::Long && c.is_contiguous() && c.numel() == num_chunks, op,
                ": expected checksums as a contiguous int64 tensor of num_chunks = ", num_chunks,
                " entries, found ", describe(c));
    LMC_CHECK(c.device() == device, op, ": expected checksums on ", device, ", found ",
                c.device());
  }

  Plan plan;
  KVCopyParams& p = plan.params;
  plan.nl = nl;
  plan.device_index = staging.get_device_index();
  int64_t g = 16;
  g = fold_align(g, k_seg);
  if (v_seg > 0) g = fold_align(g, v_seg);
  const Tensor* views[2] = {&k0, v.empty() ? nullptr : &v[0]};
  for (const Tensor* t : views) {
    if (t == nullptr) continue;
    for (int d = 0; d < 3; ++d) {
      if (t->size(d) > 1) g = fold_align(g, t->stride(d) * elt);
    }
  }
  for (const Tensor& t : k) g = fold_align(g, reinterpret_cast<uintptr_t>(t.data_ptr()) % 16);
  for (const Tensor& t : v) g = fold_align(g, reinterpret_cast<uintptr_t>(t.data_ptr()) % 16);
  g = fold_align(g, reinterpret_cast<uintptr_t>(staging.data_ptr()) % 16);
  plan.vector_bytes = static_cast<int>(g);
  if (checksums.has_value() && num_chunks > 0) {
    plan.in_pass_checksum = plan.vector_bytes >= 8;
    plan.region_checksum = !plan.in_pass_checksum;
    LMC_CHECK(row_bytes % 8 == 0 || (first_layer == 0 && nl == total_layers), op,
                ": checksums of a layer range need rows of a multiple of 8 bytes; found rows of ",
                row_bytes, " bytes and layers [", first_layer, ", ", first_layer + nl, ") of ",
                total_layers, ": move all layers in one call, or pass checksums=None");
  }

  p.slots = static_cast<const int64_t*>(slots.data_ptr());
  p.chunk_offsets = static_cast<const int64_t*>(chunk_offsets.data_ptr());
  p.staging = static_cast<char*>(staging.data_ptr());
  p.checksums = checksums.has_value()
                    ? static_cast<unsigned long long*>(checksums->data_ptr())
                    : nullptr;
  p.num_tokens = num_tokens;
  p.capacity = k0.size(0) * k0.size(1);
  p.page_size = k0.size(1);
  p.k_page_stride = k0.stride(0) * elt;
  p.k_offset_stride = k0.stride(1) * elt;
  p.k_head_stride = k0.stride(2) * elt;
  if (!v.empty()) {
    p.v_page_stride = v[0].stride(0) * elt;
    p.v_offset_stride = v[0].stride(1) * elt;
    p.v_head_stride = v[0].stride(2) * elt;
  }
  p.stage_layers = stage_layers;
  p.stage_layer0 = staging_full ? first_layer : 0;
  p.chunk_layer0 = first_layer;
  p.total_layers = total_layers;
  LMC_CHECK(num_chunks < (int64_t{1} << 31), op, ": expected fewer than 2^31 chunks, found ",
              num_chunks);
  p.num_chunks = static_cast<int>(num_chunks);
  p.heads = static_cast<int>(heads);
  p.k_seg_bytes = static_cast<int>(k_seg);
  p.v_seg_bytes = static_cast<int>(v_seg);
  p.k_seg_shift = log2_or_minus1(k_seg);
  p.v_seg_shift = log2_or_minus1(v_seg);
  p.row_bytes = static_cast<int>(row_bytes);

  const int sms = device_sms(device);
  plan.sms = max_sms > 0 ? static_cast<int>(std::min<int64_t>(max_sms, sms)) : sms;
  return plan;
}

void run_copy(bool gather, Plan& plan, const std::vector<Tensor>& k, const std::vector<Tensor>& v) {
  KVCopyParams& p = plan.params;
  if (p.num_tokens == 0 || p.num_chunks == 0) return;
  const cudaStream_t stream = current_stream(plan.device_index);
  for (int64_t g0 = 0; g0 < plan.nl; g0 += kMaxLayersPerLaunch) {
    const int64_t count = std::min<int64_t>(kMaxLayersPerLaunch, plan.nl - g0);
    for (int64_t i = 0; i < count; ++i) {
      p.k_ptr[i] = static_cast<char*>(k[g0 + i].data_ptr());
      p.v_ptr[i] = v.empty() ? nullptr : static_cast<char*>(v[g0 + i].data_ptr());
    }
    p.launch_layers = static_cast<int>(count);
    p.layer_base = static_cast<int>(g0);
    const int64_t warps_needed = p.num_tokens * count;
    const int64_t blocks = (warps_needed + kCopyThreads / 32 - 1) / (kCopyThreads / 32);
    const int grid = static_cast<int>(std::min<int64_t>(blocks, plan.sms));
    if (gather) {
      launch_kv_gather(p, plan.vector_bytes, plan.in_pass_checksum, grid, stream);
    } else {
      launch_kv_scatter(p, plan.vector_bytes, plan.in_pass_checksum, grid, stream);
    }
    LMC_CUDA_CHECK(cudaGetLastError());
  }
  if (plan.region_checksum) {
    RegionChecksumParams r{};
    r.data = reinterpret_cast<const unsigned char*>(p.staging);
    r.offsets = p.chunk_offsets;
    r.out = p.checksums;
    r.num_units = p.num_tokens;
    r.row_bytes = p.row_bytes;
    r.stage_layers = p.stage_layers;
    r.stage_layer0 = p.stage_layer0;
    r.layers = plan.nl;
    r.chunk_layer0 = p.chunk_layer0;
    r.total_layers = p.total_layers;
    r.num_chunks = p.num_chunks;
    launch_region_checksum(r, plan.sms, stream);
    LMC_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

void gather_kv(const std::vector<Tensor>& k_caches, const std::vector<Tensor>& v_caches, const Tensor& slots,
               const Tensor& chunk_offsets, Tensor& staging,
               const std::optional<Tensor>& checksums, int64_t first_layer,
               int64_t total_layers, bool staging_full, int64_t max_sms) {
  Plan plan = plan_copy("lmcache::gather_kv", k_caches, v_caches, slots, chunk_offsets, staging,
                        checksums, first_layer, total_layers, staging_full, max_sms);
  const torch::stable::accelerator::DeviceGuard guard(staging.get_device_index());  // a CUDA one
  run_copy(true, plan, k_caches, v_caches);
}

void scatter_kv(const std::vector<Tensor>& k_caches, const std::vector<Tensor>& v_caches, const Tensor& slots,
                const Tensor& chunk_offsets, const Tensor& staging,
                const std::optional<Tensor>& checksums, int64_t first_layer,
                int64_t total_layers, bool staging_full, int64_t max_sms) {
  Plan plan = plan_copy("lmcache::scatter_kv", k_caches, v_caches, slots, chunk_offsets, staging,
                        checksums, first_layer, total_layers, staging_full, max_sms);
  const torch::stable::accelerator::DeviceGuard guard(staging.get_device_index());  // a CUDA one
  run_copy(false, plan, k_caches, v_caches);
}

void checksum_chunks(const Tensor& data, const Tensor& offsets, int64_t unit_bytes,
                     Tensor& out) {
  const char* op = "lmcache::checksum_chunks";
  LMC_CHECK(data.is_cuda(), op, ": expected data in CUDA device memory, found ",
              describe(data));
  LMC_CHECK(data.is_contiguous(), op, ": expected contiguous data, found ", describe(data));
  const torch::stable::Device device = data.device();
  const torch::stable::accelerator::DeviceGuard guard(data.get_device_index());
  check_index_tensor(op, "offsets", offsets, device);
  LMC_CHECK(offsets.numel() >= 1, op,
              ": expected offsets [num_chunks + 1] with at least one entry, found none");
  LMC_CHECK(unit_bytes > 0, op, ": expected unit_bytes > 0, found ", unit_bytes);
  const int64_t nbytes = data.numel() * static_cast<int64_t>(data.element_size());
  const int64_t num_chunks = offsets.numel() - 1;
  LMC_CHECK(out.scalar_type() == ScalarType::Long && out.is_contiguous() && out.numel() == num_chunks &&
                  out.device() == device,
              op, ": expected out as a contiguous int64 tensor of num_chunks = ", num_chunks,
              " entries on ", device, ", found ", describe(out));
  LMC_CHECK(num_chunks < (int64_t{1} << 31), op, ": expected fewer than 2^31 chunks, found ",
              num_chunks);
  torch::stable::zero_(out);
  if (num_chunks == 0 || nbytes == 0) return;
  RegionChecksumParams r{};
  r.data = static_cast<const unsigned char*>(data.data_ptr());
  r.offsets = static_cast<const int64_t*>(offsets.data_ptr());
  r.out = static_cast<unsigned long long*>(out.data_ptr());
  r.num_units = nbytes / unit_bytes;
  r.row_bytes = unit_bytes;
  r.stage_layers = 1;
  r.stage_layer0 = 0;
  r.layers = 1;
  r.chunk_layer0 = 0;
  r.total_layers = 1;
  r.num_chunks = static_cast<int>(num_chunks);
  launch_region_checksum(r, device_sms(device), current_stream(data.get_device_index()));
  LMC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace lmcache
