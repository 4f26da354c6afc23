// A decode step of the Llama-family decoder (models/llama.py) as one C++ call: every sequence in
// the batch brings one new token, attention reads the paged KV cache (the torch backend's layout).
//
// It calls the same kernels, in the same order, as the eager model does through Python, so its
// output is bitwise the same; what it removes is Python itself: about 30 dispatched calls per layer,
// and the idle gaps between kernels in which the OpenMP threads went back to
// sleep (waking them costs tens of microseconds per kernel). At one sequence that is a large share
// of the step.
#include "kernels.h"

#include <ATen/ATen.h>

at::Tensor LinearSpec::apply(const at::Tensor& x) const {
  at::Tensor y;
  if (kind == kPacked) y = packed_linear(x, weight, out_features, gated, false);
  else if (kind == kDense) y = dense_linear(x, weight, max_fused_rows);
  else if (kind == kQuant) y = quant_linear(x, weight, *scales, zeros, factors, group, bits, max_fused_rows,
                                            max_mid_rows, tile_bytes, quantize_x);
  else y = at::linear(x, weight);
  return bias.has_value() ? y + *bias : y;
}

at::Tensor LinearSpec::apply_silu_mul(const at::Tensor& x) const {
  if (kind == kPacked && gated && !bias.has_value()) return packed_linear(x, weight, out_features, true, true);
  return silu_mul(apply(x));
}

at::Tensor MoeSpec::forward(const at::Tensor& x) const {
  const at::Tensor logits = router.apply(x);
  auto [weights, ids] = at::topk(at::softmax(logits, -1, at::kFloat), top_k, -1);
  if (renormalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
  if (!float32_weights) weights = weights.to(logits.scalar_type());
  return experts.forward(x, weights, ids.contiguous(), c10::nullopt);
}

LlamaDecoder::LlamaDecoder(std::vector<LayerSpec> layers, at::Tensor final_norm, at::Tensor cos, at::Tensor sin,
                           std::vector<at::Tensor> kv_caches, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, double eps, double scale, int64_t kv_kind, std::vector<int64_t> windows)
    : layers_(std::move(layers)), final_norm_(std::move(final_norm)), cos_(std::move(cos)), sin_(std::move(sin)),
      kv_caches_(std::move(kv_caches)), num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
      eps_(eps), scale_(scale), kv_kind_(kv_kind), windows_(std::move(windows)) {
  TORCH_CHECK(layers_.size() == kv_caches_.size() && layers_.size() == windows_.size(),
              "one KV cache and one window per layer");
  TORCH_CHECK(kv_kind_ >= 0 && kv_kind_ <= 2, "unknown KV cache kind ", kv_kind_);
  for (const at::Tensor& cache : kv_caches_) {
    TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5 && cache.size(0) == 2 && cache.size(3) == num_kv_heads_ &&
                    cache.size(4) == head_dim_ + (kv_kind_ ? 2 : 0),
                "KV caches must be contiguous [2, blocks, block_size, kv_heads, head_dim (+ 2 for a scale)]");
    halves_.emplace_back(cache[0], cache[1]);  // K and V, selected once, not per step
  }
}

at::Tensor LlamaDecoder::forward(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slot_mapping,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                 int64_t split_batch) const {
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
    write_kv_cache(k, v, kv_caches_[i], slot_mapping, kv_kind_);
    const at::Tensor attn = paged_decode_attention(q.contiguous(), halves_[i].first, halves_[i].second, block_tables,
                                                   seq_lens, scale_, kv_kind_, windows_[i], split_batch);
    normed = rms_norm(layer.o.apply(attn.view({tokens, q_width})), residual, layer.post_norm, eps_);
    h = layer.moe ? layer.moe->forward(normed) : layer.down.apply(layer.gate_up.apply_silu_mul(normed));
  }
  return rms_norm(h, residual, final_norm_, eps_);
}
