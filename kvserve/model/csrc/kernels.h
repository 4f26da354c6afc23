// kvserve's C++ CPU kernels: what each source file provides to the others and to Python (module.cpp
// binds them). All of them are built as one extension (kvserve/model/cpu_kernels.py), so the fused
// decoder (models/csrc/llama_decode.cpp) calls the same kernels as the eager model, without Python.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <tuple>
#include <utility>
#include <vector>

// at::parallel_for's contract (f(begin, end) over consecutive pieces of at least `grain` items), but
// the pieces, about four per thread, are handed out one at a time instead of one fixed share per
// thread. On a shared machine another process often holds one of our cores for a while: with
// fixed shares the other threads waited at the end of every kernel for the delayed one (a busy
// neighbour, or the server's own load generator, cost decode steps 30-50%); now they take its work.
template <typename F>
void parallel_for_dynamic(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin, threads = at::get_num_threads();
  if (n <= 0) return;
  if (threads == 1 || n <= grain || omp_in_parallel()) {
    f(begin, end);
    return;
  }
  const int64_t piece = std::max<int64_t>(std::max<int64_t>(grain, 1), (n + 4 * threads - 1) / (4 * threads));
  const int64_t pieces = (n + piece - 1) / piece;
  std::exception_ptr error;
  std::once_flag first_error;
#pragma omp parallel for schedule(dynamic, 1) num_threads(static_cast<int>(std::min(threads, pieces)))
  for (int64_t i = 0; i < pieces; ++i) {
    try {
      f(begin + i * piece, std::min(end, begin + (i + 1) * piece));
    } catch (...) {  // an exception must not cross the OpenMP region: rethrown below
      std::call_once(first_error, [&] { error = std::current_exception(); });
    }
  }
  if (error) std::rethrow_exception(error);
}

// f(begin, end) over [0, n) in pieces of `piece`: each thread streams its own contiguous share of W,
// piece after piece, then takes what is left of the others' (a thread that another process delays
// leaves its rest to the others). Handing out small pieces to whichever thread asked
// (parallel_for_dynamic) cut each thread's stream at every piece, and with the software prefetch
// running past each piece's end the default model's step was ~10% slower; one share per thread was
// as fast as this but waits for a delayed thread.
template <typename F>
void parallel_for_streams(int64_t n, int64_t piece, const F& f) {
  const int64_t threads = at::get_num_threads();
  if (threads == 1 || n <= piece || omp_in_parallel()) {
    f(0, n);
    return;
  }
  const int64_t shares = std::min(threads, (n + piece - 1) / piece);
  piece = std::max(piece, n / (8 * shares));  // a big W: fewer, larger pieces
  struct alignas(64) Share {  // a line each: the threads' counters must not share one
    std::atomic<int64_t> next;
    int64_t end;
  };
  std::unique_ptr<Share[]> share(new Share[shares]);
  for (int64_t t = 0; t < shares; ++t) {
    share[t].next = n * t / shares;
    share[t].end = n * (t + 1) / shares;
  }
#pragma omp parallel num_threads(static_cast<int>(shares))
  {
    const int64_t me = omp_get_thread_num();
    for (int64_t i = 0; i < shares; ++i) {
      Share& sh = share[(me + i) % shares];
      for (int64_t a = sh.next.fetch_add(piece); a < sh.end; a = sh.next.fetch_add(piece)) f(a, std::min(sh.end, a + piece));
    }
  }
}

// Calls f(std::integral_constant<int, R>{}) with R = rows clamped to 1..Max (4; 6 for the packed
// kernel's many-row blocks; 8 for its few-row one), for kernels that take a few rows of x as a template
// parameter (their accumulators live in registers).
template <int Max = 4, typename F>
void with_few_rows(int64_t rows, const F& f) {
  static_assert(Max == 4 || Max == 6 || Max == 8, "instantiated for at most 4, 6 or 8 rows");
  if constexpr (Max == 8) {
    if (rows >= 8) return f(std::integral_constant<int, 8>{});
    if (rows == 7) return f(std::integral_constant<int, 7>{});
  }
  if constexpr (Max >= 6) {
    if (rows >= 6) return f(std::integral_constant<int, 6>{});
    if (rows == 5) return f(std::integral_constant<int, 5>{});
  }
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// layers/csrc/elementwise.cpp
at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                    double eps);
void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& x);
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& temperatures, const at::Tensor& uniforms,
                       const c10::optional<at::Tensor>& filters);
at::Tensor filtered_probs(const at::Tensor& x, const at::Tensor& temperatures,
                          const c10::optional<at::Tensor>& filters);
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_logprobs(const at::Tensor& x, const at::Tensor& rows,
                                                            const at::Tensor& targets, int64_t num_top);

// One expert's projection y = x W^T, cut into units of W's output channels that threads compute
// apart: the MoE kernel (layers/csrc/moe.cpp) spreads (expert, units) items of every active expert
// over the threads in one parallel region. x is prepared (converted, quantized) once, when the
// object is made; every channel comes out bitwise as the whole-layer kernel computes it.
class ExpertStrips {
 public:
  virtual ~ExpertStrips() = default;
  virtual void run(int64_t u0, int64_t u1) const = 0;  // units [u0, u1) for every row of x
  virtual void finish() {}                             // once, after every unit has run
  int64_t units = 0;
  int64_t unit_bytes = 0;    // bytes of W one unit reads (the last unit may read less)
  int64_t weight_bytes = 0;  // bytes of W in all
  int64_t bytes(int64_t u0, int64_t u1) const { return std::min(u1 * unit_bytes, weight_bytes) - u0 * unit_bytes; }
};

// quant/csrc/quant_linear.cpp. quantize_x: calls of up to max_fused_rows rows may quantize x to int8
// per 32 inputs and multiply in integers where this CPU has such a kernel (AVX512-VNNI, AVX2).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& factors,
                        int64_t group, int64_t bits, int64_t max_fused_rows, int64_t max_mid_rows,
                        int64_t tile_bytes, bool quantize_x);
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, int64_t max_fused_rows);
at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                      const c10::optional<at::Tensor>& factors, int64_t group, int64_t bits, at::ScalarType dtype);
bool has_amx();
bool has_int8_activations();  // few-row int4/int8 kernels can quantize x to int8 (AVX512-VNNI or AVX2)
// Whether few rows of x against an int4/int8 W of k inputs in groups of `group` (coded: 8-bit codes
// of the scales) meet an integer kernel when quantize_x asks for one; else the float loop runs.
bool int8_x_serves(int64_t bits, int64_t group, int64_t k, bool coded);
int64_t vector_bits();        // the kernels' vector width: 512 (AVX-512), 256 (AVX2 + FMA + F16C) or 0 (scalar)
// quant_linear's and dense_linear's few-row paths as ExpertStrips writing y (x's dtype, [M, N]
// contiguous), or nullptr where x has more rows than max_fused_rows (the whole-layer call then).
std::unique_ptr<ExpertStrips> quant_strips(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                           const c10::optional<at::Tensor>& zeros,
                                           const c10::optional<at::Tensor>& factors, int64_t group, int64_t bits,
                                           int64_t max_fused_rows, bool quantize_x, const at::Tensor& y);
std::unique_ptr<ExpertStrips> dense_strips(const at::Tensor& x, const at::Tensor& weight, int64_t max_fused_rows,
                                           const at::Tensor& y);

// quant/csrc/quant_embed.cpp: rows `ids` of an int8 / int4 W (row-major or strips), dequantized into
// `dtype` [ids, K], bitwise packing.py's dequantize.
at::Tensor quant_embed(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                       const c10::optional<at::Tensor>& factors, int64_t bits, const at::Tensor& ids,
                       at::ScalarType dtype);

// quant/csrc/quant_linear_avx2.cpp: quant_linear's integer kernels on AVX2 (no AVX-512), on W as
// quant_linear.cpp describes it (n rows of k inputs, a scale and zero point per group of inputs).
struct QuantWeightRef {
  const uint8_t* data;
  const void* scales;   // c10::Half, or uint8 codes when `factors` is set
  const void* zeros;    // c10::Half, or int8 codes when `factors` is set; nullptr: no zero points
  const float* factors;  // [n, 2] per-row steps of the codes; nullptr: float16 scales and zeros
  int64_t n, k, group;
};
bool int_linear_avx2_supported(const QuantWeightRef& w, int64_t bits);  // an AVX2 build, groups of 16s
at::Tensor int_linear_avx2(const QuantWeightRef& w, int64_t bits, const at::Tensor& x);
// W repacked as strips (quant/packing.py to_strips; n, k as the row-major W's), x quantized to int8.
bool strip_linear_avx2_supported(int64_t bits);  // an AVX2 build, int4
at::Tensor strip_linear_avx2(const QuantWeightRef& w, int64_t bits, const at::Tensor& x);

// layers/csrc/packed_linear.cpp: dense bf16 W in the AMX tile layout [N / 16, K / 32, 16, 32];
// gated: W = [W_gate; W_up], packed so that the kernel can also write SiLU(gate) * up [M, N / 2].
bool packed_linear_supported();  // AVX512-BF16 (or AMX), or AVX2 + FMA with float32 products
bool native_bf16();              // bf16 products in hardware (AVX512-BF16 / AMX): what dtype "auto" asks
at::Tensor pack_bf16_weight(const at::Tensor& weight, bool gated);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool gated, bool silu_mul);
// packed_linear as ExpertStrips writing y ([M, N] or [M, N / 2] for silu_mul, contiguous), or
// nullptr for more rows than one pass over W serves (AMX tiles past 8 rows; blocks of rows past 128).
std::unique_ptr<ExpertStrips> packed_strips(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool gated,
                                            bool silu_mul, const at::Tensor& y);

// attention/csrc/paged_decode.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t kind, int64_t window, int64_t split_batch = 0);

// attention/csrc/kv_write.cpp: k, v [T, Hkv, D] (heads contiguous, any token stride) into their slots.
void write_kv_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache, const at::Tensor& slots,
                    int64_t kv_kind);

// attention/csrc/paged_prefill.cpp
bool paged_prefill_supported(int64_t head_dim);
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const std::vector<int64_t>& seq_lens,
                             const std::vector<int64_t>& query_start, const std::vector<int64_t>& seqs, double scale,
                             int64_t kv_kind, int64_t window, at::Tensor& out);
// models/csrc/llama_decode.cpp: a whole decode step of the Llama-family decoder in one call.

// One Linear as the eager model applies it (quant/methods.py), y = x W^T (+ bias).
struct LinearSpec {
  enum Kind : int64_t { kDense = 0, kQuant = 1, kTorch = 2, kPacked = 3 };
  int64_t kind = kTorch;
  at::Tensor weight;  // kDense / kTorch: the float weight [N, K]; kQuant: qweight; kPacked: the AMX tile layout
  c10::optional<at::Tensor> scales, zeros, factors, bias;
  int64_t group = 0, bits = 0;
  int64_t max_fused_rows = 0, max_mid_rows = 0;  // the kernels' dispatch thresholds (methods.py)
  int64_t tile_bytes = 0;                        // kQuant: the prefill tile size
  bool quantize_x = false;                       // kQuant: few rows of x may be quantized to int8
  int64_t out_features = 0;                      // kPacked: N (the layout pads it to whole strips)
  bool gated = false;                            // kPacked: packed as gated (can write SiLU(gate) * up)
  at::Tensor apply(const at::Tensor& x) const;
  at::Tensor apply_silu_mul(const at::Tensor& x) const;  // SiLU(gate) * up of apply(x), a gated layer's use
};

// layers/csrc/moe.cpp: the routed experts of a mixture-of-experts layer, down_e(SiLU(gate_e) * up_e).
class MoeExperts {
 public:
  MoeExperts(std::vector<LinearSpec> gate_up, std::vector<LinearSpec> down);
  // x [T, H]; ids, weights [T, k]: each token's experts and their router weights. Returns
  // sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) [T, H], bitwise the per-expert torch path of
  // layers/moe.py: each expert's rows as its own LinearSpec calls compute them, weighted and summed
  // with torch's roundings. bytes_read ([E, 2] int64, optional): each expert's gate_up and down
  // bytes of W read are added.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                     const c10::optional<at::Tensor>& bytes_read) const;

 private:
  std::vector<LinearSpec> gate_up_, down_;
};

// A mixture-of-experts MLP as layers/moe.py's SparseMoeBlock runs it with softmax routing: the
// router's logits, a float32 softmax, the top k (renormalized to sum to 1 if asked, rounded to the
// logits' dtype unless kept in float32), then the experts' call. Same ATen ops, same results.
struct MoeSpec {
  LinearSpec router;
  MoeExperts experts;
  int64_t top_k;
  bool renormalize, float32_weights;
  at::Tensor forward(const at::Tensor& x) const;
};

struct LayerSpec {
  LinearSpec qkv, o, gate_up, down;  // gate_up and down unused where `moe` is set
  at::Tensor input_norm, post_norm;
  c10::optional<at::Tensor> q_norm, k_norm;  // Qwen3's per-head norms
  std::optional<MoeSpec> moe;                // the layer's MLP is a mixture of experts
};

// The decoder stack for steps in which every row is one new token attending to its sequence's cache up
// to itself (a decode step, or a verify step's tokens as rows of their own); see llama_decode.cpp.
class LlamaDecoder {
 public:
  LlamaDecoder(std::vector<LayerSpec> layers, at::Tensor final_norm, at::Tensor cos, at::Tensor sin,
               std::vector<at::Tensor> kv_caches, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               double eps, double scale, int64_t kv_kind, std::vector<int64_t> windows);
  // split_batch: the sequences the rows belong to (0: one per row), see paged_decode_attention.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t split_batch = 0) const;

 private:
  std::vector<LayerSpec> layers_;
  at::Tensor final_norm_, cos_, sin_;
  std::vector<at::Tensor> kv_caches_;
  std::vector<std::pair<at::Tensor, at::Tensor>> halves_;  // each cache's K and V views
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t kv_kind_;  // paged_decode_attention's cache kind: 0 the model dtype, 1 int8, 2 fp8
  std::vector<int64_t> windows_;  // each layer's sliding window, 0 for full attention
};
