// The routed experts of a mixture-of-experts layer on the CPU, one call per layer (layers/moe.py):
// from the router's choices to the layer's output.
//
// Run expert by expert, every projection was a parallel region of its own, split over one expert's
// rows of W: with a few tokens per expert the threads spent the step waking up and waiting at
// barriers, and Python dispatched three calls per expert plus ~10 small tensor ops per layer to sort,
// gather, weight and scatter the (token, expert) pairs. Here:
//   1. the pairs are sorted by expert (a stable counting sort: argsort(stable=True)'s order) and
//      each pair's row of x gathered;
//   2. each projection (gate_up, then down) of all active experts is one parallel region whose items
//      are (expert, strip of W's output channels), a few per thread: every expert's W is still read
//      once per step, and no thread waits on one expert. An item calls the expert's own few-row
//      kernel (ExpertStrips), so each result is bitwise what the expert's LinearSpec computes. An
//      expert with more rows than those kernels serve, or a weight kind without one (a float32 W:
//      at::linear), runs alone through its LinearSpec;
//   3. each token's output is the sum of its pairs' results times their weights, rounded as
//      torch's (y * w).to(dtype) and index_add_ into zeros round them.
#include "kernels.h"
#include "simd.h"

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t kItemsPerThread = 4;
// An item reads at least this much of W: a few microseconds of work, against the cost of taking it.
constexpr int64_t kMinItemBytes = int64_t{1} << 16;

using Grouped = std::vector<std::pair<int64_t, std::unique_ptr<ExpertStrips>>>;  // (expert, its strips)

// A quantized W repacked as strips (qweight [S, C, bytes]) holds 16 output channels a strip.
int64_t out_features(const LinearSpec& s) {
  if (s.kind == LinearSpec::kPacked) return s.out_features;
  return s.kind == LinearSpec::kQuant && s.weight.dim() == 3 ? 16 * s.weight.size(0) : s.weight.size(0);
}

int64_t optional_bytes(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined() ? t->nbytes() : 0; }

int64_t weight_bytes(const LinearSpec& s) {
  return s.weight.nbytes() + optional_bytes(s.scales) + optional_bytes(s.zeros) + optional_bytes(s.factors);
}

// The expert's projection of x into y as strips, or nullptr: it then runs alone.
std::unique_ptr<ExpertStrips> strips_for(const LinearSpec& s, const at::Tensor& x, const at::Tensor& y, bool silu) {
  if (s.bias.has_value()) return nullptr;
  switch (s.kind) {
    case LinearSpec::kPacked: return packed_strips(x, s.weight, s.out_features, s.gated, silu, y);
    case LinearSpec::kQuant:
      return quant_strips(x, s.weight, *s.scales, s.zeros, s.factors, s.group, s.bits, s.max_fused_rows,
                          s.quantize_x, y);
    case LinearSpec::kDense: return dense_strips(x, s.weight, s.max_fused_rows, y);
    default: return nullptr;
  }
}

// Every expert's units in one parallel region: each expert cut into items of about 1 / (4 threads)
// of all the experts' W, handed out one at a time, the longest first (W's bytes, and more for more
// rows): in expert order a thread often took a short item last while the other still read a long
// one, and waited for it. bytes_read: expert e's count at [2 e].
void run_grouped(const Grouped& work, const std::vector<int64_t>& rows, int64_t* bytes_read) {
  if (work.empty()) return;
  int64_t total = 0;
  for (const auto& [e, strips] : work) total += strips->weight_bytes;
  const int64_t target = std::max(kMinItemBytes, total / (kItemsPerThread * at::get_num_threads()));
  struct Item {
    const ExpertStrips* strips;
    int64_t expert, u0, u1;
  };
  std::vector<Item> items;
  for (const auto& [e, strips] : work) {
    const int64_t pieces = std::clamp<int64_t>((strips->weight_bytes + target - 1) / target, 1, strips->units);
    const int64_t per = (strips->units + pieces - 1) / pieces;
    for (int64_t u = 0; u < strips->units; u += per) items.push_back({strips.get(), e, u, std::min(strips->units, u + per)});
  }
  // An item's time: reading its W, plus ~5% of that per row of x (measured: 8 rows ~40%).
  const auto cost = [&](const Item& it) { return it.strips->bytes(it.u0, it.u1) * (20 + rows[it.expert]); };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  parallel_for_dynamic(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Item& item = items[i];
      item.strips->run(item.u0, item.u1);
      if (bytes_read != nullptr)
        __atomic_fetch_add(bytes_read + 2 * item.expert, item.strips->bytes(item.u0, item.u1), __ATOMIC_RELAXED);
    }
  });
  for (const auto& [e, strips] : work) strips->finish();
}

// One projection of every active expert: rows [offset_e, offset_e + counts[e]) of x through expert
// e's spec, SiLU(gate) * up of it if `silu`.
at::Tensor project(const at::Tensor& x, const std::vector<int64_t>& counts, const std::vector<LinearSpec>& specs,
                   bool silu, int64_t* bytes_read) {
  int64_t n = -1;
  for (size_t e = 0; e < specs.size(); ++e) {
    if (counts[e] == 0) continue;
    TORCH_CHECK(n < 0 || out_features(specs[e]) == n, "every expert's projection must have the same outputs");
    n = out_features(specs[e]);
  }
  at::Tensor out = at::empty({x.size(0), silu ? n / 2 : n}, x.options());
  at::Tensor full;  // [P, n]: gate_up outputs of experts whose kernel cannot write SiLU(gate) * up itself
  Grouped grouped;
  std::vector<int64_t> alone, unfused, offset(specs.size() + 1, 0);
  for (size_t e = 0; e < specs.size(); ++e) {
    offset[e + 1] = offset[e] + counts[e];
    if (counts[e] == 0) continue;
    const LinearSpec& spec = specs[e];
    const at::Tensor xe = x.narrow(0, offset[e], counts[e]);
    std::unique_ptr<ExpertStrips> strips;
    if (!silu || (spec.kind == LinearSpec::kPacked && spec.gated)) {
      strips = strips_for(spec, xe, out.narrow(0, offset[e], counts[e]), silu);
    } else {
      if (!full.defined()) full = at::empty({x.size(0), n}, x.options());
      strips = strips_for(spec, xe, full.narrow(0, offset[e], counts[e]), false);
      if (strips) unfused.push_back(static_cast<int64_t>(e));
    }
    if (strips) grouped.emplace_back(static_cast<int64_t>(e), std::move(strips));
    else alone.push_back(static_cast<int64_t>(e));
  }
  run_grouped(grouped, counts, bytes_read);
  for (int64_t e : unfused)
    out.narrow(0, offset[e], counts[e]).copy_(silu_mul(full.narrow(0, offset[e], counts[e])));
  for (int64_t e : alone) {
    const at::Tensor xe = x.narrow(0, offset[e], counts[e]);
    out.narrow(0, offset[e], counts[e]).copy_(silu ? specs[e].apply_silu_mul(xe) : specs[e].apply(xe));
    if (bytes_read != nullptr) bytes_read[2 * e] += weight_bytes(specs[e]);
  }
  return out;
}

// Keeps v as computed: -ffast-math would otherwise contract a product and the sum it is added to into
// one FMA (or reorder a sum), which torch's separate ops round differently.
template <typename V>
inline void opaque(V& v) {
  asm("" : "+x"(v));
}

// The pairs of a step sorted by expert: ids [T, k] -> rows of each expert, in order.
struct Pairs {
  std::vector<int64_t> counts;  // [E]
  std::vector<int64_t> token;   // [P] the token of each sorted pair
  std::vector<float> weight;    // [P] its router weight
  std::vector<int64_t> rows;    // [T, k] each token's sorted positions, ascending
};

// A stable counting sort: experts in order, each expert's pairs in the order of ids.flatten(), which
// is torch.argsort(ids.flatten(), stable=True).
Pairs sort_pairs(const at::Tensor& ids, const at::Tensor& weights, int64_t experts) {
  const int64_t tokens = ids.size(0), k = ids.size(1), pairs = tokens * k;
  const int64_t* id = ids.data_ptr<int64_t>();
  const at::Tensor w32 = weights.to(at::kFloat).contiguous();
  const float* w = w32.data_ptr<float>();
  Pairs out{std::vector<int64_t>(experts, 0), std::vector<int64_t>(pairs), std::vector<float>(pairs),
            std::vector<int64_t>(pairs)};
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < experts, "expert id ", id[i], " out of range [0, ", experts, ")");
    ++out.counts[id[i]];
  }
  std::vector<int64_t> next(experts, 0), filled(tokens, 0);
  for (int64_t e = 1; e < experts; ++e) next[e] = next[e - 1] + out.counts[e - 1];
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t pos = next[id[i]]++;
    out.token[pos] = i / k;
    out.weight[pos] = w[i];
  }
  for (int64_t pos = 0; pos < pairs; ++pos) {
    const int64_t t = out.token[pos];
    out.rows[t * k + filled[t]++] = pos;
  }
  return out;
}

// x's row of each sorted pair.
at::Tensor gather_rows(const at::Tensor& x, const std::vector<int64_t>& token) {
  at::Tensor out = at::empty({static_cast<int64_t>(token.size()), x.size(1)}, x.options());
  const int64_t row_bytes = x.size(1) * x.element_size();
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  parallel_for_dynamic(0, out.size(0), std::max<int64_t>(1, (int64_t{1} << 16) / row_bytes), [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) std::memcpy(dst + i * row_bytes, src + token[i] * row_bytes, row_bytes);
  });
  return out;
}

// Values as float32, and rounded to T, n at a time.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec load_vec(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load_vec(const c10::BFloat16* p) { return simd::load16(p); }
inline Vec load_vec(const c10::Half* p) { return simd::load16(p); }
inline Vec zero_vec() { return _mm512_setzero_ps(); }
inline Vec mul_vec(Vec a, float b) { return _mm512_mul_ps(a, _mm512_set1_ps(b)); }
inline Vec add_vec(Vec a, Vec b) { return _mm512_add_ps(a, b); }
template <typename T>
inline Vec round_vec(Vec v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    return _mm512_castsi512_ps(_mm512_and_si512(simd::bf16_bits(v), _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
  else if constexpr (std::is_same_v<T, c10::Half>)
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  else
    return v;
}
inline void store_vec(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void store_vec(c10::BFloat16* p, Vec v) {  // v already rounded: keep the high halves
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
inline void store_vec(c10::Half* p, Vec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
#elif defined(KVSERVE_AVX2)
constexpr int64_t kLanes = 8;
using Vec = __m256;
template <typename T>
inline Vec load_vec(const T* p) { return simd::load8(p); }
inline Vec zero_vec() { return _mm256_setzero_ps(); }
inline Vec mul_vec(Vec a, float b) { return _mm256_mul_ps(a, _mm256_set1_ps(b)); }
inline Vec add_vec(Vec a, Vec b) { return _mm256_add_ps(a, b); }
template <typename T>
inline Vec round_vec(Vec v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return simd::round8_bf16(v);
  else if constexpr (std::is_same_v<T, c10::Half>) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  else return v;
}
template <typename T>
inline void store_vec(T* p, Vec v) { simd::store8(p, v); }
#endif

// out[t] = sum over t's pairs, in sorted order, of T(y[pair] * weight[pair]), summed in float32 and
// rounded once: bitwise torch's zeros.index_add_(0, token, (y * weight).to(T)).
template <typename T>
void combine(const at::Tensor& y, const Pairs& pairs, at::Tensor& out) {
  const int64_t tokens = out.size(0), h = out.size(1), k = tokens ? static_cast<int64_t>(pairs.rows.size()) / tokens : 0;
  const T* yp = y.data_ptr<T>();
  T* op = out.data_ptr<T>();
  parallel_for_dynamic(0, tokens, std::max<int64_t>(1, (int64_t{1} << 14) / (h * k)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t* rows = pairs.rows.data() + t * k;
      int64_t c = 0;
#if defined(__AVX512F__) || defined(KVSERVE_AVX2)
      for (; c + kLanes <= h; c += kLanes) {
        Vec acc = zero_vec();  // index_add_'s zeros: -0 terms sum to +0 (opaque: fast-math drops 0 + v)
        opaque(acc);
        for (int64_t j = 0; j < k; ++j) {
          Vec v = round_vec<T>(mul_vec(load_vec(yp + rows[j] * h + c), pairs.weight[rows[j]]));
          opaque(v);
          acc = add_vec(acc, v);
          opaque(acc);
        }
        store_vec(op + t * h + c, round_vec<T>(acc));
      }
#endif
      for (; c < h; ++c) {
        float acc = 0.f;
        opaque(acc);
        for (int64_t j = 0; j < k; ++j) {
          float v = static_cast<float>(static_cast<T>(static_cast<float>(yp[rows[j] * h + c]) * pairs.weight[rows[j]]));
          opaque(v);
          acc = acc + v;
          opaque(acc);
        }
        op[t * h + c] = static_cast<T>(acc);
      }
    }
  });
}

}  // namespace

MoeExperts::MoeExperts(std::vector<LinearSpec> gate_up, std::vector<LinearSpec> down)
    : gate_up_(std::move(gate_up)), down_(std::move(down)) {
  TORCH_CHECK(!gate_up_.empty() && gate_up_.size() == down_.size(), "one gate_up and one down projection per expert");
}

at::Tensor MoeExperts::forward(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                               const c10::optional<at::Tensor>& bytes_read) const {
  const int64_t experts = static_cast<int64_t>(gate_up_.size());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [tokens, hidden] matrix");
  TORCH_CHECK(ids.dim() == 2 && ids.is_contiguous() && ids.scalar_type() == at::kLong && ids.size(0) == x.size(0),
              "ids must be a contiguous int64 [tokens, k] matrix");
  TORCH_CHECK(weights.sizes() == ids.sizes() && at::isFloatingType(weights.scalar_type()),
              "weights must be a floating [tokens, k] matrix, like ids");
  int64_t* bytes = nullptr;
  if (bytes_read.has_value()) {
    TORCH_CHECK(bytes_read->is_contiguous() && bytes_read->scalar_type() == at::kLong && bytes_read->dim() == 2 &&
                    bytes_read->size(0) == experts && bytes_read->size(1) == 2,
                "bytes_read must be a contiguous int64 [experts, 2] tensor");
    bytes = bytes_read->data_ptr<int64_t>();
  }
  at::Tensor out = at::empty_like(x);
  if (x.size(0) == 0) return out;
  const Pairs pairs = sort_pairs(ids, weights, experts);
  const at::Tensor act = project(gather_rows(x, pairs.token), pairs.counts, gate_up_, true, bytes);
  const at::Tensor y = project(act, pairs.counts, down_, false, bytes == nullptr ? nullptr : bytes + 1);
  TORCH_CHECK(y.size(1) == x.size(1), "the experts' down projections have ", y.size(1), " outputs, x ", x.size(1));
  switch (x.scalar_type()) {
    case at::kFloat: combine<float>(y, pairs, out); break;
    case at::kBFloat16: combine<c10::BFloat16>(y, pairs, out); break;
    case at::kHalf: combine<c10::Half>(y, pairs, out); break;
    default: TORCH_CHECK(false, "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
  return out;
}
