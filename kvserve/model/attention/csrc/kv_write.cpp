// Writing a step's new keys and values into the paged KV cache, for the eager backend and the fused
// decoder alike: the cache is [2 (K, V), num_blocks, block_size, Hkv, D] in the model dtype (kind 0),
// or uint8 rows of D values and a float16 scale for int8 (1) / fp8 e4m3 (2).
#include "kernels.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache, const at::Tensor& slots,
                    int64_t kv_kind) {
  TORCH_CHECK(kv_kind >= 0 && kv_kind <= 2, "unknown KV cache kind ", kv_kind);
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && cache.dim() == 5 && cache.size(0) == 2 &&
                  cache.size(3) == k.size(1) && cache.size(4) == k.size(2) + (kv_kind == 0 ? 0 : 2),
              "k, v [T, Hkv, D] do not match the cache [2, blocks, block_size, Hkv, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "one int64 slot per token");
  TORCH_CHECK(cache.is_contiguous(), "the KV cache must be contiguous");
  const int64_t tokens = k.size(0), num_kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t num_slots = cache.size(1) * cache.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " is outside the KV cache (", num_slots, ")");
  if (kv_kind == 0) {  // a row copy per token: k and v may be views into the qkv output, rows of Hkv * D
    TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(),
                "the KV cache must be in the dtype of k and v");
    TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == head_dim && v.stride(2) == 1 && v.stride(1) == head_dim,
                "each token's k and v heads must be contiguous");
    const int64_t row_bytes = num_kv_heads * head_dim * k.element_size();
    auto* base = static_cast<char*>(cache.data_ptr());
    const auto* k_base = static_cast<const char*>(k.data_ptr());
    const auto* v_base = static_cast<const char*>(v.data_ptr());
    const int64_t half_bytes = num_slots * row_bytes, k_step = k.stride(0) * k.element_size(),
                  v_step = v.stride(0) * v.element_size();
    for (int64_t t = 0; t < tokens; ++t) {
      std::memcpy(base + slot[t] * row_bytes, k_base + t * k_step, row_bytes);
      std::memcpy(base + half_bytes + slot[t] * row_bytes, v_base + t * v_step, row_bytes);
    }
    return;
  }
  // int8 / fp8 rows with a float16 scale each: the same tensor ops as KVQuantFormat.quantize.
  TORCH_CHECK(cache.scalar_type() == at::kByte, "an int8 / fp8 KV cache holds uint8 rows");
  const double max = kv_kind == 1 ? 127.0 : 448.0;
  const at::Tensor flat = cache.view({2, num_slots, num_kv_heads, head_dim + 2});
  for (int64_t half = 0; half < 2; ++half) {
    const at::Tensor x32 = (half ? v : k).to(at::kFloat);
    const at::Tensor scale = (x32.abs().amax({-1}, true) / max).clamp_min(std::ldexp(1.0, -24)).to(at::kHalf);
    const at::Tensor scaled = x32 / scale.to(at::kFloat);
    const at::Tensor values = kv_kind == 1 ? scaled.round().clamp(-127, 127).to(at::kChar).view(at::kByte)
                                           : scaled.clamp(-448, 448).to(at::kFloat8_e4m3fn).view(at::kByte);
    flat[half].index_copy_(0, slots, at::cat({values, scale.view(at::kByte)}, -1));
  }
}
