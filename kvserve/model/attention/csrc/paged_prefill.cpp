// Paged prefill attention for the CPU on AMX bf16 tiles, or on AVX512-BF16 vectors where there is no
// AMX (the same tiles, multiplied a row at a time): each prefill sequence's new queries attend
// causally over its cached keys (the prefix and the chunk itself, written to the cache before this
// runs), read from the paged blocks.
//
// SDPA per sequence needs a gathered copy of the keys and an explicit mask when a prefix is cached,
// and converts bf16 to float32 as it goes. Here, per task
// (sequence, kv head, up to 64 query tokens):
//   1. the keys the task can see are packed once as VNNI B tiles: K^T (16 keys x 32 dims a tile,
//      via a 16 x 16 transpose of 32-bit pairs) and V (32 keys x 16 dims a tile, rows interleaved);
//   2. for each query head of the group and 16 query tokens: S = Q K^T on tiles, in float32; a
//      softmax per row over the keys it may see (in base 2); P rounded to bf16 (as SDPA does for
//      bf16) and O = P V on tiles; O / row sum stored as bf16.
// Two passes over a row's scores instead of an online softmax: a row of the longest chunk (2048
// keys) is 8 KB, and the O tiles never need rescaling.
// With a sliding window (window > 0) query position p sees keys (p - window, p]: a task packs only
// the keys from its first query's window start, and each row's softmax starts at its own.
#include "kernels.h"
#include "simd.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

#if defined(KVSERVE_BF16)
// A task packs the keys its queries see, so a whole sequence per kv head is the cheapest task (with a
// task per 64 queries a 512-token prompt packed its keys 4.5 times over). Sequences are cut into
// pieces (multiples of kPieceTokens queries) only where one would hold more than 1 / kTasksPerThread
// of a thread's share of the work, and pieces run largest first, so the threads finish together. Scratch
// is kept per thread between calls, so a step does not allocate it again.
constexpr int64_t kPieceTokens = 64;
constexpr int64_t kTasksPerThread = 4;  // 2 and 8 no better

struct Task {
  int64_t seq, kv_head, first, last;  // query tokens first..last-1 of sequence seq (its chunk's index)
  int64_t work;                       // keys its queries see, summed: tasks run largest first
};

struct Scratch {
  simd::aligned_vector<uint32_t> kt, vt;  // K^T and V as B tiles (16 x 16 32-bit pairs each)
  simd::aligned_vector<float> s;          // [16, keys] scores
  simd::aligned_vector<uint16_t> p;       // [16, keys rounded up to 32] bf16 weights
  alignas(64) uint16_t q[16 * 128];
  alignas(64) float o[16 * 64];
  float row_sum[16];
};

// The cache's rows as bf16, whatever it stores: kind 0 bf16 values; 1 int8 and 2 fp8 e4m3 values,
// each row followed by its float16 scale (kv_quant.py), dequantized and rounded to bf16 as the
// reference path does. Offsets count elements: bf16 values, or bytes for the quantized kinds.
struct CacheRows {
  const uint8_t* base;
  int64_t kind, D;
  int64_t elem_bytes() const { return kind == 0 ? 2 : 1; }
  int64_t row_elems() const { return kind == 0 ? D : D + 2; }
  float scale(int64_t row) const {  // quantized kinds: the row's scale (fp8: times 256, see simd.h)
    uint16_t bits;
    std::memcpy(&bits, base + row + D, 2);
    const float s = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
    return kind == 2 ? s * 256.f : s;
  }
  __m512 deq16(int64_t row, int64_t d, float s) const {
    const __m512 v = kind == 1 ? simd::int8x16_to_ps(base + row + d) : simd::fp8x16_to_ps_div256(base + row + d);
    return _mm512_mul_ps(v, _mm512_set1_ps(s));
  }
  __m512i bf16x32(int64_t row, int64_t d) const {  // values d .. d + 31
    if (kind == 0) return _mm512_loadu_si512(base + (row + d) * 2);
    const float s = scale(row);
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(deq16(row, d + 16, s), deq16(row, d, s)));
  }
  __m512i bf16x16_as_u32(int64_t row, int64_t d) const {  // values d .. d + 15, zero-extended to 32 bits
    const __m256i v = kind == 0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + (row + d) * 2))
                                : reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(deq16(row, d, scale(row))));
    return _mm512_cvtepu16_epi32(v);
  }
};

// Pack keys [0, key_end) of one kv head: token t's rows start at element rows[t] of k and v.
void pack_kv(const CacheRows& k, const CacheRows& v, const std::vector<int64_t>& rows, int64_t key_end, int64_t D,
             Scratch& sc) {
  const int64_t kchunks = D / 32, vchunks = D / 16;
  const int64_t kblocks = (key_end + 15) / 16, vblocks = (key_end + 31) / 32;
  sc.kt.resize(kblocks * kchunks * 256);
  sc.vt.resize(vblocks * vchunks * 256);
  for (int64_t b = 0; b < kblocks; ++b)
    for (int64_t c = 0; c < kchunks; ++c) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t t = b * 16 + i;
        r[i] = t < key_end ? k.bf16x32(rows[t], c * 32) : _mm512_setzero_si512();
      }
      simd::transpose16(r);  // row j: dims 2j, 2j + 1 of chunk c for each of the 16 keys
      uint32_t* dst = sc.kt.data() + (b * kchunks + c) * 256;
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + j * 16, r[j]);
    }
  for (int64_t b = 0; b < vblocks; ++b)
    for (int64_t c = 0; c < vchunks; ++c) {
      uint32_t* dst = sc.vt.data() + (b * vchunks + c) * 256;
      for (int64_t j = 0; j < 16; ++j) {  // row j: keys 2j, 2j + 1 (low, high half) for 16 dims
        const int64_t t0 = b * 32 + 2 * j, t1 = t0 + 1;
        const __m512i lo = t0 < key_end ? v.bf16x16_as_u32(rows[t0], c * 16) : _mm512_setzero_si512();
        const __m512i hi = t1 < key_end ? _mm512_slli_epi32(v.bf16x16_as_u32(rows[t1], c * 16), 16)
                                        : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + j * 16, _mm512_or_si512(lo, hi));
      }
    }
}

// Lanes of keys t .. t + 15 that lie in [lo, hi).
inline __mmask16 key_range(int64_t t, int64_t lo, int64_t hi) {
  const int64_t a = std::max<int64_t>(lo - t, 0), b = std::min<int64_t>(hi - t, 16);
  return b <= a ? 0 : static_cast<__mmask16>(((1u << b) - 1) & ~((1u << a) - 1));
}

// Row r of the score tile sees keys [lo, visible): weights 2^(s * scale2 - max) as bf16 into p (zero
// outside them up to `width`); returns their float32 sum.
float softmax_row(const float* s, int64_t lo, int64_t visible, int64_t width, float scale2, uint16_t* p) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  int64_t t = lo;
  for (; t + 16 <= visible; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
  const __mmask16 tail = static_cast<__mmask16>((1u << (visible - t)) - 1);
  if (tail) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, s + t));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale2), k = _mm512_set1_ps(scale2);
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t < width; t += 16) {
    const __mmask16 live = key_range(t, lo, visible);
    const __m512 e = _mm512_maskz_mov_ps(live, simd::exp2_ps(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, s + t), k, m)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  return _mm512_reduce_add_ps(sum);
}

// Without AMX, the two tile products a row at a time on AVX512-BF16, reading the same packed tiles:
// each vdpbf16ps multiplies one tile row (16 keys x a pair of dims, or 16 dims x a pair of keys) by
// that pair of the query row (or of the weights) broadcast.
//
// S = Q K^T for query rows [0, n) (of sc.q) against key blocks [0, kblocks), into sc.s (row stride width).
void scores_vec(Scratch& sc, int64_t n, int64_t kblocks, int64_t kchunks, int64_t D, int64_t width) {
  constexpr int R = 8;  // query rows per pass: 8 accumulators, each K^T row loaded once per pass
  for (int64_t r0 = 0; r0 < n; r0 += R) {
    for (int64_t b = 0; b < kblocks; ++b) {
      __m512 acc[R];
      for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
      const uint32_t* kt = sc.kt.data() + b * kchunks * 256;
      for (int64_t c = 0; c < kchunks; ++c)
        for (int j = 0; j < 16; ++j) {
          const __m512bh kv = (__m512bh)_mm512_load_si512(kt + c * 256 + j * 16);
          for (int i = 0; i < R; ++i) {
            const int32_t pair = *reinterpret_cast<const int32_t*>(sc.q + (r0 + i) * D + c * 32 + 2 * j);
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(pair), kv);
          }
        }
      for (int i = 0; i < R; ++i) _mm512_storeu_ps(sc.s.data() + (r0 + i) * width + b * 16, acc[i]);
    }
  }
}

// O = P V for rows [0, n) and dims [16 d0, 16 d0 + 64), into sc.o (16 rows x 64 floats), as the AMX
// path leaves it.
void weighted_values_vec(Scratch& sc, int64_t n, int64_t width, int64_t vchunks, int64_t d0) {
  constexpr int R = 4;  // 4 rows x 4 vectors of dims: 16 accumulators
  for (int64_t r0 = 0; r0 < n; r0 += R) {
    __m512 acc[R][4];
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < width / 32; ++b) {
      const uint32_t* vt = sc.vt.data() + (b * vchunks + d0) * 256;
      for (int j = 0; j < 16; ++j) {
        __m512bh v[4];
        for (int c = 0; c < 4; ++c) v[c] = (__m512bh)_mm512_load_si512(vt + c * 256 + j * 16);
        for (int i = 0; i < R; ++i) {
          const int32_t pair = *reinterpret_cast<const int32_t*>(sc.p.data() + (r0 + i) * width + b * 32 + 2 * j);
          const __m512bh p = (__m512bh)_mm512_set1_epi32(pair);
          for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], p, v[c]);
        }
      }
    }
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < 4; ++c) _mm512_store_ps(sc.o + (r0 + i) * 64 + 16 * c, acc[i][c]);
  }
}

void run_task(const Task& task, const uint16_t* q, int64_t q_row, const CacheRows& k, const CacheRows& v,
              uint16_t* out, const int64_t* table, int64_t seq_len, int64_t q_first, int64_t num_queries,
              int64_t num_heads, int64_t num_kv_heads, int64_t D, int64_t block_size, float scale, int64_t window,
              bool amx, Scratch& sc, std::vector<int64_t>& rows) {
  const int64_t group = num_heads / num_kv_heads, context = seq_len - num_queries;
  // Keys are packed from position key_begin (the task's first query's window start) to key_end (what its
  // last query sees); below, key indices count from key_begin.
  const int64_t key_begin = window > 0 ? std::max<int64_t>(0, context + task.first - window + 1) : 0;
  const int64_t key_end = context + task.last - key_begin;
  rows.resize(key_end);
  for (int64_t t = 0; t < key_end; ++t) {
    const int64_t pos = key_begin + t;
    rows[t] = ((table[pos / block_size] * block_size + pos % block_size) * num_kv_heads + task.kv_head) * k.row_elems();
  }
  pack_kv(k, v, rows, key_end, D, sc);
  const int64_t width_max = (key_end + 31) / 32 * 32, kchunks = D / 32, vchunks = D / 16;
  sc.s.resize(16 * width_max);
  sc.p.resize(16 * width_max);
  const float scale2 = scale * 1.4426950408889634f;  // base 2

  for (int64_t h = task.kv_head * group; h < (task.kv_head + 1) * group; ++h) {
    for (int64_t j0 = task.first; j0 < task.last; j0 += 16) {
      const int64_t n = std::min<int64_t>(16, task.last - j0);
      for (int64_t r = 0; r < 16; ++r) {
        uint16_t* dst = sc.q + r * D;
        if (r < n) std::memcpy(dst, q + (q_first + j0 + r) * q_row + h * D, D * 2);
        else std::memset(dst, 0, D * 2);
      }
      const int64_t keys = context + j0 + n - key_begin, width = (keys + 31) / 32 * 32;
      if (amx) {
#if defined(KVSERVE_AMX)
        for (int64_t b = 0; b < (keys + 15) / 16; ++b) {
          _tile_zero(0);
          for (int64_t c = 0; c < kchunks; ++c) {
            _tile_loadd(1, sc.q + c * 32, D * 2);
            _tile_loadd(2, sc.kt.data() + (b * kchunks + c) * 256, 64);
            _tile_dpbf16ps(0, 1, 2);
          }
          _tile_stored(0, sc.s.data() + b * 16, width * 4);
        }
#endif
      } else {
        scores_vec(sc, n, (keys + 15) / 16, kchunks, D, width);
      }
      for (int64_t r = 0; r < 16; ++r) {
        uint16_t* pr = sc.p.data() + r * width;
        const int64_t visible = context + j0 + r + 1 - key_begin;  // relative to key_begin, like `keys`
        const int64_t lo = window > 0 ? std::max<int64_t>(0, visible - window) : 0;
        if (r < n) sc.row_sum[r] = softmax_row(sc.s.data() + r * width, lo, visible, width, scale2, pr);
        else std::memset(pr, 0, width * 2);
      }
      for (int64_t d0 = 0; d0 < vchunks; d0 += 4) {  // 64 output dims (4 C tiles) at a time
        if (amx) {
#if defined(KVSERVE_AMX)
          _tile_zero(3); _tile_zero(4); _tile_zero(5); _tile_zero(6);
          for (int64_t b = 0; b < width / 32; ++b) {
            _tile_loadd(7, sc.p.data() + b * 32, width * 2);
            const uint32_t* vt = sc.vt.data() + (b * vchunks + d0) * 256;
            _tile_loadd(2, vt, 64); _tile_dpbf16ps(3, 7, 2);
            _tile_loadd(2, vt + 256, 64); _tile_dpbf16ps(4, 7, 2);
            _tile_loadd(2, vt + 512, 64); _tile_dpbf16ps(5, 7, 2);
            _tile_loadd(2, vt + 768, 64); _tile_dpbf16ps(6, 7, 2);
          }
          _tile_stored(3, sc.o, 256); _tile_stored(4, sc.o + 16, 256);
          _tile_stored(5, sc.o + 32, 256); _tile_stored(6, sc.o + 48, 256);
#endif
        } else {
          weighted_values_vec(sc, n, width, vchunks, d0);
        }
        for (int64_t r = 0; r < n; ++r) {
          const __m512 inv = _mm512_set1_ps(1.f / sc.row_sum[r]);
          uint16_t* dst = out + ((q_first + j0 + r) * num_heads + h) * D + d0 * 16;
          for (int c = 0; c < 4; ++c)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c), reinterpret_cast<__m256i>(
                                    _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(sc.o + r * 64 + 16 * c), inv))));
        }
      }
    }
  }
}
#endif

}  // namespace

bool paged_prefill_supported(int64_t head_dim) {
#if defined(KVSERVE_BF16)
  return head_dim % 64 == 0 && head_dim <= 128;
#else
  (void)head_dim;
  return false;
#endif
}

// q, out: [T, Hq, D] bf16: the step's flat queries (q may be a view into the qkv output, its rows
// strided) and their outputs (rows of sequences not in `seqs` are left alone);
// k_cache, v_cache: [num_blocks, block_size, Hkv, D] bf16 (kv_kind 0), or uint8 [.., D + 2] rows for
// int8 (1) / fp8 (2); block_tables [S, W] (int64), seq_lens [S] and query_start [S + 1] describe
// every sequence of the step; `seqs` lists the ones to compute.
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const std::vector<int64_t>& seq_lens,
                             const std::vector<int64_t>& query_start, const std::vector<int64_t>& seqs, double scale,
                             int64_t kv_kind, int64_t window, at::Tensor& out) {
  const int64_t num_heads = q.size(1), D = q.size(2), num_kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(paged_prefill_supported(D), "paged_prefill_attention needs AVX512-BF16 and head_dim 64 or 128");
  TORCH_CHECK(kv_kind >= 0 && kv_kind <= 2, "unknown KV cache kind ", kv_kind);
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "queries must be bf16");
  TORCH_CHECK(k_cache.scalar_type() == (kv_kind == 0 ? at::kBFloat16 : at::kByte) && v_cache.scalar_type() == k_cache.scalar_type(),
              "cache dtype does not match its kind (bf16, or uint8 rows for int8 / fp8)");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "each query row's heads must be contiguous");
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(3) == (kv_kind == 0 ? D : D + 2), "head shapes do not match");
#if defined(KVSERVE_BF16)
  const auto tables = block_tables.contiguous();
  const int64_t* bt = tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data();
  const int64_t* qs = query_start.data();
  const int64_t num_seqs = static_cast<int64_t>(seq_lens.size());
  TORCH_CHECK(tables.size(0) == num_seqs && static_cast<int64_t>(query_start.size()) == num_seqs + 1 &&
                  query_start.back() <= q.size(0), "block_tables, seq_lens and query_start disagree");
  // Work of queries [first, last) of a sequence with `context` cached keys: the keys they see.
  const auto work = [&](int64_t s, int64_t first, int64_t last) {
    return (last - first) * (sl[s] - (qs[s + 1] - qs[s]) + (first + last + 1) / 2);
  };
  int64_t total = 0;
  for (const int64_t s : seqs) {
    TORCH_CHECK(s >= 0 && s < num_seqs, "sequence index ", s, " out of range");
    const int64_t n = qs[s + 1] - qs[s];
    TORCH_CHECK(n <= sl[s] && sl[s] <= tables.size(1) * block_size, "sequence ", s, " does not fit its block table");
    total += work(s, 0, n) * num_kv_heads;
  }
  const int64_t limit = std::max<int64_t>(1, total / (kTasksPerThread * at::get_num_threads()));
  std::vector<Task> tasks;
  for (const int64_t s : seqs) {
    const int64_t n = qs[s + 1] - qs[s];
    for (int64_t first = 0; first < n;) {
      int64_t last = std::min(n, first + kPieceTokens);
      while (last < n && work(s, first, std::min(n, last + kPieceTokens)) <= limit) last = std::min(n, last + kPieceTokens);
      for (int64_t h = 0; h < num_kv_heads; ++h) tasks.push_back({s, h, first, last, work(s, first, last)});
      first = last;
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.work > b.work; });
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  const CacheRows kp{static_cast<const uint8_t*>(k_cache.data_ptr()), kv_kind, D};
  const CacheRows vp{static_cast<const uint8_t*>(v_cache.data_ptr()), kv_kind, D};
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
#if defined(KVSERVE_AMX)
  const bool amx = simd::amx_ready();
#else
  const bool amx = false;
#endif
  parallel_for_dynamic(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
#if defined(KVSERVE_AMX)
    if (amx) simd::configure_tiles();
#endif
    // Per thread and kept between calls: fresh buffers cost page faults in every layer.
    static thread_local Scratch sc;
    static thread_local std::vector<int64_t> rows;
    for (int64_t i = begin; i < end; ++i) {
      const Task& t = tasks[i];
      run_task(t, qp, q.stride(0), kp, vp, op, bt + t.seq * tables.size(1), sl[t.seq], qs[t.seq],
               qs[t.seq + 1] - qs[t.seq], num_heads, num_kv_heads, D, block_size, static_cast<float>(scale), window,
               amx, sc, rows);
    }
#if defined(KVSERVE_AMX)
    if (amx) _tile_release();
#endif
  });
#else
  (void)block_tables, (void)seq_lens, (void)query_start, (void)seqs, (void)scale, (void)kv_kind, (void)window;
#endif
}
