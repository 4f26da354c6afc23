// Paged decode attention for the CPU: one query token per sequence, keys and values read in place
// from the block pool (no gathered copy of each sequence's history).
//
// Layout (per layer): k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
// Work is split over (sequence, kv head) pairs; the query heads of one GQA group share every
// key/value row they read, so each row is loaded once per group.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
void decode_one(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t seq_len,
                int64_t block_size, int64_t num_kv_heads, int64_t head, int64_t group, int64_t head_dim, float scale,
                T* out, std::vector<float>& scores, std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& row) {
  const int64_t row_stride = num_kv_heads * head_dim;  // between consecutive tokens
  scores.assign(group * seq_len, 0.f);
  qf.resize(group * head_dim);
  acc.assign(group * head_dim, 0.f);
  row.resize(head_dim);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(q[g * head_dim + d]) * scale;

  for (int64_t t = 0; t < seq_len; ++t) {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    const T* k = k_cache + slot * row_stride + head * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) row[d] = to_float(k[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * head_dim;
      float s = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * row[d];
      scores[g * seq_len + t] = s;
    }
  }
  for (int64_t g = 0; g < group; ++g) {  // softmax per query head, in float32
    float* sg = scores.data() + g * seq_len;
    const float mx = *std::max_element(sg, sg + seq_len);
    float sum = 0.f;
    for (int64_t t = 0; t < seq_len; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < seq_len; ++t) sg[t] *= inv;
  }
  for (int64_t t = 0; t < seq_len; ++t) {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    const T* v = v_cache + slot * row_stride + head * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) row[d] = to_float(v[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * seq_len + t];
      float* ag = acc.data() + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * row[d];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = static_cast<T>(acc[g * head_dim + d]);
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
         const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, width = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf, acc, row;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / num_kv_heads, h = i % num_kv_heads;
      const int64_t offset = (b * num_heads + h * group) * head_dim;
      decode_one<T>(qp + offset, kp, vp, bt + b * width, sl[b], block_size, num_kv_heads, h, group, head_dim,
                    static_cast<float>(scale), op + offset, scores, qf, acc, row);
    }
  });
}

}  // namespace

// q: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_tables: [B, W] int64;
// seq_lens: [B] int64. Returns [B, Hq, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) run<float>(q, k_cache, v_cache, tables, lens, scale, out);
  else if (q.scalar_type() == at::kBFloat16) run<c10::BFloat16>(q, k_cache, v_cache, tables, lens, scale, out);
  else if (q.scalar_type() == at::kHalf) run<c10::Half>(q, k_cache, v_cache, tables, lens, scale, out);
  else TORCH_CHECK(false, "unsupported dtype");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
