// A decode step of the Llama-family decoder (models/llama.py) as one C++ call: every sequence in
// the batch brings one new token, attention reads the paged KV cache (the torch backend's layout).
//
// It calls the same kernels, in the same order, as the eager model does through Python, so its
// output is bitwise the same; what it removes is Python itself: about 30 dispatched calls per layer,
// ~0.2 ms per layer here, and the idle gaps between kernels in which the OpenMP threads went back to
// sleep (waking them costs tens of microseconds per kernel). At one sequence that was a third of
// the step.
#include "kernels.h"

#include <ATen/ATen.h>

#include <cstring>

at::Tensor LinearSpec::apply(const at::Tensor& x) const {
  at::Tensor y;
  if (kind == kDense && x.size(0) <= max_kernel_rows) y = dense_linear(x, weight, max_fused_rows, max_amx_rows);
  else if (kind == kQuant) y = quant_linear(x, weight, *scales, zeros, factors, group, bits, max_fused_rows,
                                            max_amx_rows, tile_bytes);
  else y = at::linear(x, weight);
  return bias.has_value() ? y + *bias : y;
}

LlamaDecoder::LlamaDecoder(std::vector<LayerSpec> layers, at::Tensor final_norm, at::Tensor cos, at::Tensor sin,
                           std::vector<at::Tensor> kv_caches, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, double eps, double scale, int64_t kv_kind)
    : layers_(std::move(layers)), final_norm_(std::move(final_norm)), cos_(std::move(cos)), sin_(std::move(sin)),
      kv_caches_(std::move(kv_caches)), num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
      eps_(eps), scale_(scale), kv_kind_(kv_kind) {
  TORCH_CHECK(layers_.size() == kv_caches_.size(), "one KV cache per layer");
  TORCH_CHECK(kv_kind_ >= 0 && kv_kind_ <= 2, "unknown KV cache kind ", kv_kind_);
  for (const at::Tensor& cache : kv_caches_) {
    TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5 && cache.size(0) == 2 && cache.size(3) == num_kv_heads_ &&
                    cache.size(4) == head_dim_ + (kv_kind_ ? 2 : 0),
                "KV caches must be contiguous [2, blocks, block_size, kv_heads, head_dim (+ 2 for a scale)]");
    halves_.emplace_back(cache[0], cache[1]);  // K and V, selected once, not per step
  }
}

// Stores k, v [T, Hkv, D] at their slots of the flat cache, as TorchAttentionBackend._write does.
void LlamaDecoder::write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache,
                            const at::Tensor& slots) const {
  const int64_t tokens = k.size(0), num_slots = cache.size(1) * cache.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " is outside the KV cache (", num_slots, ")");
  if (kv_kind_ == 0) {  // a row copy per token: k and v are views into the qkv output, rows of Hkv * D
    TORCH_CHECK(k.scalar_type() == cache.scalar_type(), "the KV cache must be in the model dtype");
    const int64_t row_bytes = num_kv_heads_ * head_dim_ * k.element_size();
    TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == head_dim_ && v.stride(2) == 1 && v.stride(1) == head_dim_,
                "each token's k and v heads must be contiguous");
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
  const double max = kv_kind_ == 1 ? 127.0 : 448.0;
  const at::Tensor flat = cache.view({2, num_slots, num_kv_heads_, head_dim_ + 2});
  for (int64_t half = 0; half < 2; ++half) {
    const at::Tensor x32 = (half ? v : k).to(at::kFloat);
    const at::Tensor scale = (x32.abs().amax({-1}, true) / max).clamp_min(std::ldexp(1.0, -24)).to(at::kHalf);
    const at::Tensor scaled = x32 / scale.to(at::kFloat);
    const at::Tensor values = kv_kind_ == 1 ? scaled.round().clamp(-127, 127).to(at::kChar).view(at::kByte)
                                            : scaled.clamp(-448, 448).to(at::kFloat8_e4m3fn).view(at::kByte);
    flat[half].index_copy_(0, slots, at::cat({values, scale.view(at::kByte)}, -1));
  }
}

at::Tensor LlamaDecoder::forward(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slot_mapping,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens) const {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be the [tokens, hidden] embeddings");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == x.size(0) && positions.numel() == x.size(0) &&
                  block_tables.size(0) == x.size(0) && seq_lens.numel() == x.size(0),
              "one position, slot, block table and length per token: every sequence decodes one token");
  const int64_t tokens = x.size(0), q_width = num_heads_ * head_dim_, kv_width = num_kv_heads_ * head_dim_;
  // As in LlamaForCausalLM.forward: `h` is a layer's output not yet added into `residual`, the
  // running sum, which is updated in place (the first layer's residual is the embeddings tensor).
  at::Tensor h = x, residual;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerSpec& layer = layers_[i];
    at::Tensor normed;
    if (residual.defined()) {
      normed = rms_norm(h, residual, layer.input_norm, eps_);
    } else {
      residual = h;
      normed = rms_norm(h, c10::nullopt, layer.input_norm, eps_);
    }
    const at::Tensor qkv = layer.qkv.apply(normed);
    at::Tensor q = qkv.narrow(1, 0, q_width).view({tokens, num_heads_, head_dim_});
    at::Tensor k = qkv.narrow(1, q_width, kv_width).view({tokens, num_kv_heads_, head_dim_});
    const at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({tokens, num_kv_heads_, head_dim_});
    if (layer.q_norm.has_value()) {
      q = rms_norm(q, c10::nullopt, *layer.q_norm, eps_);
      k = rms_norm(k, c10::nullopt, *layer.k_norm, eps_);
    }
    rotary_(q, k, positions, cos_, sin_);
    write_kv(k, v, kv_caches_[i], slot_mapping);
    const at::Tensor attn = paged_decode_attention(q.contiguous(), halves_[i].first, halves_[i].second, block_tables,
                                                   seq_lens, scale_, kv_kind_);
    normed = rms_norm(layer.o.apply(attn.view({tokens, q_width})), residual, layer.post_norm, eps_);
    h = layer.down.apply(silu_mul(layer.gate_up.apply(normed)));
  }
  return rms_norm(h, residual, final_norm_, eps_);
}
