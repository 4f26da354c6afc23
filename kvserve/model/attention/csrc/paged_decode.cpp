// Paged decode attention for the CPU: one query token per sequence, keys and values read in place
// from the block pool (no gathered copy of each sequence's history).
//
// Layout (per layer): k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] in the query's
// dtype, or for a quantized cache (kind 1 = int8, 2 = fp8 e4m3) uint8 rows of head_dim + 2 bytes: the
// values, then a float16 scale for that token and head (see kv_quant.py); rows are dequantized on read.
// Work is split over (sequence, kv head) pairs; the query heads of one GQA group share every
// key/value row they read, so each row is loaded once per group.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// Row readers: load the (slot, head) row of K or V as float32.
template <typename T>
struct DenseRows {
  const T* base;
  int64_t num_kv_heads, head_dim;
  void load(int64_t slot, int64_t head, float* row) const {
    const T* p = base + (slot * num_kv_heads + head) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) row[d] = to_float(p[d]);
  }
};

inline float fp16_to_float(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, sizeof(h));
  return static_cast<float>(h);
}

struct Int8Rows {
  const uint8_t* base;
  int64_t num_kv_heads, head_dim;
  void load(int64_t slot, int64_t head, float* row) const {
    const uint8_t* p = base + (slot * num_kv_heads + head) * (head_dim + 2);
    const float s = fp16_to_float(p + head_dim);
    const int8_t* v = reinterpret_cast<const int8_t*>(p);
    for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(v[d]) * s;
  }
};

// float8_e4m3fn -> float for all 256 bit patterns, built once.
const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

struct Fp8Rows {
  const uint8_t* base;
  int64_t num_kv_heads, head_dim;
  const float* table;
  void load(int64_t slot, int64_t head, float* row) const {
    const uint8_t* p = base + (slot * num_kv_heads + head) * (head_dim + 2);
    const float s = fp16_to_float(p + head_dim);
    for (int64_t d = 0; d < head_dim; ++d) row[d] = table[p[d]] * s;
  }
};

// Softmax of each of `rows` rows of `len` scores, in place, in float32.
inline void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * len;
    const float mx = *std::max_element(sg, sg + len);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
  }
}

template <typename T, typename Rows>
void decode_one(const T* q, const Rows& k_rows, const Rows& v_rows, const int64_t* table, int64_t seq_len,
                int64_t block_size, int64_t head, int64_t group, int64_t head_dim, float scale,
                T* out, std::vector<float>& scores, std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& row) {
  scores.assign(group * seq_len, 0.f);
  qf.resize(group * head_dim);
  acc.assign(group * head_dim, 0.f);
  row.resize(head_dim);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(q[g * head_dim + d]) * scale;

  for (int64_t t = 0; t < seq_len; ++t) {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    k_rows.load(slot, head, row.data());
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * head_dim;
      float s = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * row[d];
      scores[g * seq_len + t] = s;
    }
  }
  softmax_rows(scores.data(), group, seq_len);
  for (int64_t t = 0; t < seq_len; ++t) {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    v_rows.load(slot, head, row.data());
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * seq_len + t];
      float* ag = acc.data() + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * row[d];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = static_cast<T>(acc[g * head_dim + d]);
}

#if defined(__AVX512BF16__)
// The common case, vectorised: bf16 cache and query, head_dim a multiple of 32 (at most 256).
// q.k: vdpbf16ps multiplies 32 bf16 pairs exactly and accumulates in float32 (then * scale, which
// equals scaling q first up to float32 rounding); p.v: rows widened to float32, fused multiply-add.
void decode_one_bf16(const c10::BFloat16* q, const c10::BFloat16* k_base, const c10::BFloat16* v_base,
                     int64_t num_kv_heads, const int64_t* table, int64_t seq_len, int64_t block_size, int64_t head,
                     int64_t group, int64_t head_dim, float scale, c10::BFloat16* out, std::vector<float>& scores,
                     std::vector<float>& acc) {
  const int64_t pairs = head_dim / 32, vecs = head_dim / 16;
  scores.resize(group * seq_len);
  acc.assign(group * head_dim, 0.f);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q);
  for (int64_t t = 0; t < seq_len; ++t) {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    const uint16_t* kr = reinterpret_cast<const uint16_t*>(k_base + (slot * num_kv_heads + head) * head_dim);
    for (int64_t g = 0; g < group; ++g) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t j = 0; j < pairs; ++j)
        s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(kr + 32 * j), (__m512bh)_mm512_loadu_si512(qp + g * head_dim + 32 * j));
      scores[g * seq_len + t] = _mm512_reduce_add_ps(s) * scale;
    }
  }
  softmax_rows(scores.data(), group, seq_len);
  __m512 v[16];
  for (int64_t t = 0; t < seq_len; ++t) {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    const uint16_t* vr = reinterpret_cast<const uint16_t*>(v_base + (slot * num_kv_heads + head) * head_dim);
    for (int64_t j = 0; j < vecs; ++j)
      v[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + 16 * j))), 16));
    for (int64_t g = 0; g < group; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * seq_len + t]);
      float* ag = acc.data() + g * head_dim;
      for (int64_t j = 0; j < vecs; ++j) _mm512_storeu_ps(ag + 16 * j, _mm512_fmadd_ps(p, v[j], _mm512_loadu_ps(ag + 16 * j)));
    }
  }
  for (int64_t i = 0; i < group * head_dim; ++i) out[i] = static_cast<c10::BFloat16>(acc[i]);
}
#endif

template <typename T, typename Rows>
void run(const at::Tensor& q, const Rows& k_rows, const Rows& v_rows, int64_t block_size, int64_t num_kv_heads,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t group = num_heads / num_kv_heads, width = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
#if defined(__AVX512BF16__)
  constexpr bool bf16_rows = std::is_same_v<Rows, DenseRows<c10::BFloat16>>;
  const bool vectorised = bf16_rows && head_dim % 32 == 0 && head_dim <= 256;
#else
  const bool vectorised = false;
#endif
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf, acc, row;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / num_kv_heads, h = i % num_kv_heads;
      const int64_t offset = (b * num_heads + h * group) * head_dim;
#if defined(__AVX512BF16__)
      if constexpr (bf16_rows) {
        if (vectorised) {
          decode_one_bf16(qp + offset, k_rows.base, v_rows.base, num_kv_heads, bt + b * width, sl[b], block_size, h,
                          group, head_dim, static_cast<float>(scale), op + offset, scores, acc);
          continue;
        }
      }
#endif
      decode_one<T, Rows>(qp + offset, k_rows, v_rows, bt + b * width, sl[b], block_size, h, group, head_dim,
                          static_cast<float>(scale), op + offset, scores, qf, acc, row);
    }
  });
}

template <typename T>
void run_kind(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
              const at::Tensor& lens, double scale, int64_t kind, at::Tensor& out) {
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), head_dim = q.size(2);
  if (kind == 0) {
    TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "cache and query dtypes differ");
    run<T>(q, DenseRows<T>{k_cache.data_ptr<T>(), num_kv_heads, head_dim},
           DenseRows<T>{v_cache.data_ptr<T>(), num_kv_heads, head_dim}, block_size, num_kv_heads, tables, lens, scale, out);
    return;
  }
  TORCH_CHECK(k_cache.scalar_type() == at::kByte && k_cache.size(3) == head_dim + 2, "quantized cache rows must be uint8 [head_dim + 2]");
  const uint8_t* kp = k_cache.data_ptr<uint8_t>();
  const uint8_t* vp = v_cache.data_ptr<uint8_t>();
  if (kind == 1) run<T>(q, Int8Rows{kp, num_kv_heads, head_dim}, Int8Rows{vp, num_kv_heads, head_dim}, block_size,
                        num_kv_heads, tables, lens, scale, out);
  else if (kind == 2) run<T>(q, Fp8Rows{kp, num_kv_heads, head_dim, fp8_table()}, Fp8Rows{vp, num_kv_heads, head_dim, fp8_table()},
                             block_size, num_kv_heads, tables, lens, scale, out);
  else TORCH_CHECK(false, "unknown cache kind ", kind);
}

}  // namespace

// q: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (kind 0) or uint8
// [num_blocks, block_size, Hkv, D + 2] (kind 1 int8, 2 fp8); block_tables: [B, W] int64;
// seq_lens: [B] int64. Returns [B, Hq, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t kind) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) run_kind<float>(q, k_cache, v_cache, tables, lens, scale, kind, out);
  else if (q.scalar_type() == at::kBFloat16) run_kind<c10::BFloat16>(q, k_cache, v_cache, tables, lens, scale, kind, out);
  else if (q.scalar_type() == at::kHalf) run_kind<c10::Half>(q, k_cache, v_cache, tables, lens, scale, kind, out);
  else TORCH_CHECK(false, "unsupported dtype");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
