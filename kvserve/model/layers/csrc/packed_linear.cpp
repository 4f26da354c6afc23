// y = x W^T for a dense bf16 weight stored in the AMX tile layout ("packed"), on CPUs with AMX.
//
// The packed layout cuts W [N, K] into strips of 16 output channels and chunks of 32 inputs; tile
// (strip s, chunk c) is 1 KB, stored strip by strip, chunk by chunk:
//     packed[s][c][r][2 j + e] = W[16 s + j][32 c + 2 r + e]      (r, j < 16; e < 2; N padded with zeros)
// which is the B operand of an AMX bf16 multiply as it is: 16 rows of input pairs x 16 channels. So
//   - x is the A operand straight from memory (its rows, 32 inputs per tile) and each C tile holds
//     16 rows of y for 16 channels: no transpose of x or of the result, unlike multiplying W from its
//     row-major form (W as A, x^T as B, y^T in C);
//   - a thread's share of W is one sequential stream of 1 KB tiles instead of 32 rows read side by
//     side, which the hardware prefetchers follow better.
// AVX512-BF16 reads the same layout: a tile row is 16 channels x one input pair, multiplied by that
// pair of x broadcast, so each accumulator lane is one output channel and nothing is reduced across
// lanes. It serves 1-4 rows of x (single-stream decode) everywhere, and every number of rows on
// CPUs without AMX (AMD Zen 4, say): decode batches pass over W four strips at a time with the next
// four prefetched, prefill blocks x by rows and W by L2-sized groups of strips.
//
// "Gated": the fused gate/up projection of an MLP, W = [W_gate; W_up] (N/2 rows each). Its strips
// are stored alternately, gate strip i then up strip i, so the two accumulators of a strip pair hold
// matching gate and up channels and the kernel can write SiLU(gate) * up [M, N/2] directly (rounded
// as silu_mul rounds: bitwise the same result) instead of [M, N] that silu_mul then reads back from
// memory. It can also write the plain [M, N] projection, each strip to its own channels.
//
// The packed copy is the only copy of W kept at load (except for token embeddings, looked up by
// row): this kernel serves every number of rows.
#include "kernels.h"
#include "simd.h"

#include <ATen/ATen.h>

#include <algorithm>

#if defined(KVSERVE_BF16) || defined(KVSERVE_AVX2)
#include <immintrin.h>
#endif

namespace {
// The first of W's rows (output channels) that strip s holds: strips of 16 in order, or for a gated
// W = [W_gate; W_up] gate and up strips alternating (gate strip i is 2i, up strip i is 2i + 1). The
// packs and the kernels' stores of both layouts place channels by it.
[[maybe_unused]] inline int64_t strip_channel(int64_t s, int64_t n, bool gated) {
  return gated ? (s % 2) * (n / 2) + (s / 2) * 16 : s * 16;
}
}  // namespace

#if defined(KVSERVE_BF16)
namespace {

constexpr int64_t kTile = 512;         // bf16 values per 16 x 32 tile
constexpr int64_t kMaxVectorRows = 4;  // up to here AVX512-BF16 everywhere (vector_linear)
// With AMX, also 5-8 rows (a speculative verify step of one request, small decode batches): W is still
// read once, and each row's sums are bitwise those of a 1-row call, since the accumulation order per
// channel does not depend on the rows (AMX tiles add in another order). Beyond, AMX tiles.
constexpr int kMaxVectorRowsBeforeAmx = 8;
// How 1-2 rows of x stream W: how many strips side by side, and how far ahead (bf16 values) each
// strip's stream is prefetched by software, with which hint. Each is the fastest of those tried on
// its CPU: Intel, 4 strips with a 4 KB prefetch into L1; AMD before Zen 5, 8 strips with a 1 KB
// prefetch into L2 (into L1 was slower than none); Zen 5, 8 strips and no software prefetch, which
// its hardware prefetcher does better without.
// cpu_kernels.py defines KVSERVE_AMD and KVSERVE_AMD_ZEN5 from /proc/cpuinfo.
#if defined(KVSERVE_AMD)
constexpr bool kAmd = true;
constexpr int kFewRowStrips = 8;
#if defined(KVSERVE_AMD_ZEN5)
constexpr int64_t kPrefetchValues = 0;
#else
constexpr int64_t kPrefetchValues = 512;
#endif
constexpr _mm_hint kPrefetchHint = _MM_HINT_T2;
#else
constexpr bool kAmd = false;
constexpr int kFewRowStrips = 4;
constexpr int64_t kPrefetchValues = 2048;
constexpr _mm_hint kPrefetchHint = _MM_HINT_T0;
#endif
// Many rows without AMX: work items of kVectorBlockRows rows of x against a group of strip pairs
// holding about kVectorGroupBytes of W (it stays in L2 while the item's rows pass over it, kVectorRows
// at a time: 6 rows x 4 strips, 24 accumulators in registers). This runs close to the vdpbf16ps peak,
// ahead of oneDNN; 4 rows at a time, and other group or block sizes, were no better.
constexpr int64_t kVectorGroupBytes = int64_t{1} << 18;
constexpr int kVectorRows = 6;
constexpr int64_t kVectorBlockRows = 8 * kVectorRows;
// Up to kPassRows rows without AMX (decode batches) every row passes over four strips of W before the
// next four, which are prefetched meanwhile (vector_linear_passes), so W streams in under the
// arithmetic; past kPassRows the blocks above are as fast.
constexpr int64_t kPassRows = 128;
// Many rows of x (prefill, large decode batches): W is cut into groups of strip pairs holding
// ~kGroupBytes, and a work item is one group against one block of 32 rows of x: the block's A tiles
// stay in L1 while the group's strips stream from L2, and the group stays in L2 for the next block.
// Up to kFewRowBlocks blocks (128 rows) the work is bound by reading W instead: the groups are then
// small (about four per thread) and a thread takes all of a group's blocks, so W is read once.
// 1 MB was the best group of 128 KB-1.5 MB (1,024 rows, one thread, K = 576 and 1,536).
constexpr int64_t kGroupBytes = int64_t{1} << 20;
constexpr int64_t kFewRowBlocks = 4;

// Whether m rows of x take one pass over W's strips side by side (vector_linear): up to four rows,
// and with AMX up to eight.
bool vector_rows_serve(int64_t m) {
#if defined(KVSERVE_AMX)
  if (simd::amx_ready()) return m <= kMaxVectorRowsBeforeAmx;
#endif
  return m <= kMaxVectorRows;
}

// Tile (s, c) of W from 16 rows x 32 inputs: 16 x 16 transpose of input pairs (32-bit elements).
void pack_tile(const uint16_t* w, int64_t k, int64_t rows, uint16_t* out) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_loadu_si512(w + i * k) : _mm512_setzero_si512();
  simd::transpose16(r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + i * 32, r[i]);
}

// Where a kernel's accumulators go: y [M, n] in bf16, or for a gated weight with silu_mul set
// SiLU(gate) * up [M, n / 2].
struct Output {
  c10::BFloat16* y;
  int64_t n;      // W's rows
  bool gated;     // W packed with gate and up strips alternating (pack_bf16_weight's `gated`)
  bool silu_mul;  // gated only: write SiLU(gate) * up instead of y
  // Row `row`'s 16 channels of strip s (channels past n dropped), from float32 sums.
  void store(int64_t row, int64_t s, __m512 v) const {
    const int64_t col = strip_channel(s, n, gated);
    const int64_t cols = std::min<int64_t>(16, n - col);
    const __mmask16 mask = cols == 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
    _mm256_mask_storeu_epi16(y + row * n + col, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
  // Not gated: row `row`'s 32 channels of strip pair p, all below n.
  void store_pair(int64_t row, int64_t p, __m512 v0, __m512 v1) const {
    _mm512_storeu_si512(y + row * n + p * 32, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
  }
  // silu_mul: row `row`'s channels of strip pair p, from the gate and up sums (rounded to bf16 first,
  // as the unfused projection's output would be).
  void store_silu_mul(int64_t row, int64_t p, __m512 gate, __m512 up) const {
    const __m512 g = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(gate)), u = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(up));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + row * (n / 2) + p * 16), simd::silu_mul16_bf16(g, u));
  }
};

// Cache lines of W to bring in while a kernel computes: per_step lines per input pair until the range
// is done. Hint T2 (on CPUs before Zen 5, T0 evicted the lines in use from L1); on Zen 5 T0 reads W
// faster than T2.
#if defined(KVSERVE_AMD_ZEN5)
constexpr _mm_hint kPassPrefetchHint = _MM_HINT_T0;
#else
constexpr _mm_hint kPassPrefetchHint = _MM_HINT_T2;
#endif
struct Prefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int per_step = 0;  // lines per step, in 16ths
  int credit = 0;
  void step() {
    credit += per_step;
    for (; credit >= 16 && next < end; credit -= 16, next += 64) _mm_prefetch(next, kPassPrefetchHint);
  }
};

// MB rows of x (rows row0.. of y) against G strips at a time: each broadcast pair of x serves G
// strips, and the G strips are G streams through memory, which keeps more cache-line fills in flight
// than one.
template <int MB, int G>
void vector_strips(const uint16_t* w, const uint16_t* x, int64_t k, const Output& out, int64_t row0, int64_t s,
                   Prefetch* pf = nullptr) {
  const int64_t chunks = k / 32, strip_values = chunks * kTile;
  __m512 acc[G][MB];
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < MB; ++m) acc[g][m] = _mm512_setzero_ps();
  const uint16_t* ws = w + s * strip_values;
  for (int64_t c = 0; c < chunks; ++c) {
    for (int r = 0; r < 16; ++r) {
      if (pf != nullptr) pf->step();
      __m512bh xv[MB];
      for (int m = 0; m < MB; ++m)
        xv[m] = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + m * k + c * 32 + 2 * r));
      for (int g = 0; g < G; ++g) {
        const uint16_t* t = ws + g * strip_values + c * kTile + r * 32;
        if constexpr (kPrefetchValues > 0 && (!kAmd || MB <= 2))
          _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetchValues), kPrefetchHint);
        const __m512bh wv = (__m512bh)_mm512_load_si512(t);
        for (int m = 0; m < MB; ++m) acc[g][m] = _mm512_dpbf16_ps(acc[g][m], wv, xv[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    if (out.silu_mul) {
      if constexpr (G % 2 == 0)
        for (int g = 0; g < G; g += 2) out.store_silu_mul(row0 + m, (s + g) / 2, acc[g][m], acc[g + 1][m]);
    } else {
      for (int g = 0; g < G; ++g) out.store(row0 + m, s + g, acc[g][m]);
    }
  }
}

// Strips [s0, s1), s0 even: kFewRowStrips at a time for 1-2 rows (registers allow), four at a time
// (up to 6 rows), then a pair, then one (never left for a gated weight, whose strips come in pairs).
template <int MB>
void vector_rows(const uint16_t* w, const uint16_t* x, int64_t k, const Output& out, int64_t row0, int64_t s0,
                 int64_t s1, Prefetch* pf = nullptr) {
  int64_t s = s0;
  if constexpr (MB <= 2 && kFewRowStrips > 4)
    for (; s + kFewRowStrips <= s1; s += kFewRowStrips) vector_strips<MB, kFewRowStrips>(w, x, k, out, row0, s);
  if constexpr (MB <= 6)  // 7-8 rows: a pair at a time (the accumulators fill the registers)
    for (; s + 4 <= s1; s += 4) vector_strips<MB, 4>(w, x, k, out, row0, s, pf);
  for (; s + 2 <= s1; s += 2) vector_strips<MB, 2>(w, x, k, out, row0, s, pf);
  for (; s < s1; ++s) vector_strips<MB, 1>(w, x, k, out, row0, s, pf);
}

void vector_linear(const at::Tensor& x, const uint16_t* w, const Output& out) {
  const int64_t m = x.size(0), k = x.size(1), strips = (out.n + 15) / 16, pairs = (strips + 1) / 2;
  const uint16_t* xp = static_cast<const uint16_t*>(x.data_ptr());
  // A second thread costs a wake-up that a small matrix never earns back: >= 256 KB of W per task,
  // and a whole number of tasks per thread (the 576 x 576 projection made 3 tasks for 2 threads,
  // one thread reading 7 of its 18 pairs while the other waited).
  const int64_t threads = at::get_num_threads();
  int64_t tasks = std::max<int64_t>(1, pairs * k * 64 / (int64_t{1} << 18));
  if (tasks > 1) tasks = (tasks + threads - 1) / threads * threads;
  parallel_for_dynamic(0, pairs, (pairs + tasks - 1) / tasks, [&](int64_t p0, int64_t p1) {
    with_few_rows<kMaxVectorRowsBeforeAmx>(m, [&](auto mb) {
      vector_rows<decltype(mb)::value>(w, xp, k, out, 0, 2 * p0, std::min(2 * p1, strips));
    });
  });
}

// Strips [s0, s1) for m rows of x, four strips at a time, prefetching the next four (up to s1).
void passes_over_strips(const uint16_t* w, const uint16_t* x, int64_t m, int64_t k, const Output& out, int64_t s0,
                        int64_t s1) {
  const int64_t strip_values = k / 32 * kTile;
  const int64_t passes = (m + kVectorRows - 1) / kVectorRows;
  // The next four strips' lines spread evenly over all passes' input pairs: fetched sooner, they
  // were slower (their fills compete with the lines the passes wait for)
  const int64_t lines = 4 * strip_values * 2 / 64, steps = passes * k / 2;
  const int per_step = static_cast<int>((16 * lines + steps - 1) / steps);
  for (int64_t s = s0; s < s1; s += 4) {
    const int64_t e = std::min(s1, s + 4);
    Prefetch pf{reinterpret_cast<const char*>(w + e * strip_values),
                reinterpret_cast<const char*>(w + std::min(s1, e + 4) * strip_values), per_step};
    for (int64_t i = 0, r = 0; i < passes; ++i) {
      // passes of even size: a pass of one or two rows waits on its few accumulators' latency
      const int64_t rows = (m - r) / (passes - i);
      with_few_rows<kVectorRows>(rows, [&](auto mb) {
        vector_rows<decltype(mb)::value>(w, x + r * k, k, out, r, s, e, &pf);
      });
      r += rows;
    }
  }
}

// 5 to kPassRows rows without AMX: each thread takes a run of consecutive strips and goes through it
// four strips at a time; all rows pass over those four (kVectorRows at a time) while they sit in L2,
// and meanwhile the run's next four are prefetched, so W streams in under the arithmetic instead of
// stalling the first pass over each group of W.
void vector_linear_passes(const at::Tensor& x, const uint16_t* w, const Output& out) {
  const int64_t m = x.size(0), k = x.size(1), strips = (out.n + 15) / 16, pairs = (strips + 1) / 2;
  const uint16_t* xp = static_cast<const uint16_t*>(x.data_ptr());
  parallel_for_dynamic(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    passes_over_strips(w, xp, m, k, out, 2 * p0, std::min(strips, 2 * p1));
  });
}

// Many rows without AMX. Items run group by group (a thread's consecutive items share W's group).
void vector_linear_blocked(const at::Tensor& x, const uint16_t* w, const Output& out) {
  const int64_t m = x.size(0), k = x.size(1), strips = (out.n + 15) / 16, pairs = (strips + 1) / 2;
  const uint16_t* xp = static_cast<const uint16_t*>(x.data_ptr());
  // An even number of pairs where possible: strips go through the kernel four at a time.
  const int64_t blocks = (m + kVectorBlockRows - 1) / kVectorBlockRows;
  const int64_t group = std::clamp<int64_t>(kVectorGroupBytes / (k * 64) / 2 * 2, 1, pairs);
  const int64_t groups = (pairs + group - 1) / group;
  parallel_for_dynamic(0, groups * blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t g = item / blocks, r0 = item % blocks * kVectorBlockRows, r1 = std::min(m, r0 + kVectorBlockRows);
      const int64_t s0 = 2 * g * group, s1 = std::min(strips, 2 * (g + 1) * group);
      for (int64_t r = r0; r < r1; r += kVectorRows) {
        with_few_rows<kVectorRows>(r1 - r, [&](auto mb) {
          vector_rows<decltype(mb)::value>(w, xp + r * k, k, out, r, s0, s1);
        });
      }
    }
  });
}

#if defined(KVSERVE_AMX)
using simd::aligned_vector;

// One 32-row block's result for one strip pair, in a C buffer (amx_2x2's layout: C[2 * block +
// strip]), to be converted and stored while the next block's multiplies run: done after the
// multiplies, the conversion left the tile unit idle for a quarter of the time at 1,024 rows.
struct PendingBlock {
  const float* c = nullptr;
  int64_t row0 = 0, pair = 0;
  int rows[2] = {0, 0};  // rows of y in each 16-row block (0: no such block)
  int strips = 0;

  void store(const Output& out, int q0, int q1) const {  // rows [q0, q1) of the 32
    for (int q = q0; q < q1; ++q) {
      const int i = q / 16, r = q % 16;
      if (r >= rows[i]) continue;
      const float* ci = c + 2 * i * 256 + r * 16;
      if (out.silu_mul) {
        out.store_silu_mul(row0 + q, pair, _mm512_load_ps(ci), _mm512_load_ps(ci + 256));
      } else if (strips == 2 && !out.gated && (pair + 1) * 32 <= out.n) {  // one 64-byte store
        out.store_pair(row0 + q, pair, _mm512_load_ps(ci), _mm512_load_ps(ci + 256));
      } else {
        for (int s = 0; s < strips; ++s) out.store(row0 + q, 2 * pair + s, _mm512_load_ps(ci + s * 256));
      }
    }
  }
};

void amx_linear(const at::Tensor& x, const uint16_t* w, const Output& out) {
  const int64_t m = x.size(0), k = x.size(1), chunks = k / 32, strips = (out.n + 15) / 16, pairs = (strips + 1) / 2;
  const int64_t full = m / 16 * 16, blocks = (m + 31) / 32;
  const uint16_t* xp = static_cast<const uint16_t*>(x.data_ptr());
  // The last block of rows if m is not a multiple of 16: copied into 16 zero-padded rows, since a tile
  // load reads all 16 (past the end of x otherwise). The calling thread's buffer; workers get a pointer.
  thread_local aligned_vector<uint16_t> tail;
  if (full < m) {
    tail.assign(16 * k, 0);
    std::copy(xp + full * k, xp + m * k, tail.data());
  }
  const uint16_t* tailp = tail.data();
  const bool few_rows = blocks <= kFewRowBlocks;
  const int64_t group = few_rows ? std::max<int64_t>(1, pairs / (4 * at::get_num_threads()))
                                 : std::clamp<int64_t>(kGroupBytes / (k * 64), 1, pairs);
  const int64_t groups = (pairs + group - 1) / group;
  const int per_chunk = static_cast<int>((32 + chunks - 1) / chunks);  // pending rows converted per chunk
  parallel_for_dynamic(0, groups * blocks, few_rows ? blocks : 1, [&](int64_t i0, int64_t i1) {
    simd::configure_tiles();
    alignas(64) float cbuf[2][4 * 256];
    PendingBlock pending;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t g = item / blocks, row0 = item % blocks * 32;
      const uint16_t* a[2] = {nullptr, nullptr};
      int rows[2] = {0, 0}, na = 0;
      for (; na < 2 && row0 + 16 * na < m; ++na) {
        const int64_t r = row0 + 16 * na;
        a[na] = r == full ? tailp : xp + r * k;
        rows[na] = static_cast<int>(std::min<int64_t>(16, m - r));
      }
      for (int64_t pair = g * group; pair < std::min(pairs, (g + 1) * group); ++pair) {
        const int64_t s0 = pair * 2;
        const int strips_here = static_cast<int>(std::min<int64_t>(2, strips - s0));
        const uint16_t* b[2] = {w + s0 * chunks * kTile, w + (s0 + 1) * chunks * kTile};
        float* c = cbuf[pending.c == cbuf[0] ? 1 : 0];
        simd::amx_2x2(a, 32, 2 * k, na, b, strips_here, chunks, c, [&](int64_t chunk) {
          const int q0 = static_cast<int>(chunk) * per_chunk;
          if (pending.c != nullptr && q0 < 32) pending.store(out, q0, std::min(32, q0 + per_chunk));
        });
        pending = PendingBlock{c, row0, pair, {rows[0], rows[1]}, strips_here};
      }
    }
    if (pending.c != nullptr) pending.store(out, 0, 32);
    _tile_release();
  });
}
#endif  // KVSERVE_AMX

}  // namespace
#elif defined(KVSERVE_AVX2)
namespace {

// ---- AVX2 + FMA (no bf16 arithmetic: AMD Zen 1-3, say) ---------------------------------------------
// The same tensor [N / 16, K / 32, 16, 32] holds another layout here: strip s is K rows of its 16
// channels, packed[s][k][p] = W[16 s + channel(p)][k], the products are float32 FMAs, and x is
// converted to float32 once per call. A row of 16 bf16 channels becomes two float32 vectors by one
// unpack each (zero in the low halves): unpacklo takes positions 0-3 and 8-11, unpackhi 4-7 and 12-15,
// so positions 4-7 and 8-11 hold channels 8-11 and 4-7, and the vectors hold channels 0-7 and 8-15.
// Every path sums a row's products in the same order (k ascending, one chain per channel), so a
// row's result does not depend on the other rows of the batch.
constexpr int kPosChannel[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
// Many rows: a work item is a block of kBlockRows rows of x against a group of strips holding about
// kGroupBytes of W (it stays in L2 while the block passes over it, a strip at a time, which stays in L1
// while the block's rows go through it kMicroRows at a time: 6 rows x 16 channels, 12 accumulators).
constexpr int kMicroRows = 6;
constexpr int64_t kBlockRows = 8 * kMicroRows;
constexpr int64_t kGroupBytes = int64_t{1} << 18;
constexpr int64_t kFewRows = 4;  // up to here each thread streams its share of W once for all rows

struct Output {
  c10::BFloat16* y;
  int64_t n;      // W's rows
  bool gated;     // gate and up strips alternating (pack_bf16_weight's `gated`)
  bool silu_mul;  // gated only: write SiLU(gate) * up instead of y
  // Row `row`'s 16 channels of strip s (channels past n dropped).
  void store(int64_t row, int64_t s, __m256 lo, __m256 hi) const {
    const int64_t col = strip_channel(s, n, gated);
    c10::BFloat16* dst = y + row * n + col;
    if (col + 16 <= n) {
      simd::store8(dst, lo), simd::store8(dst + 8, hi);
    } else {
      c10::BFloat16 tmp[16];
      simd::store8(tmp, lo), simd::store8(tmp + 8, hi);
      std::copy(tmp, tmp + (n - col), dst);
    }
  }
  // SiLU(gate) * up for row `row`'s 16 channels of strip pair p, rounded as silu_mul rounds.
  void store_silu_mul(int64_t row, int64_t p, __m256 g_lo, __m256 g_hi, __m256 u_lo, __m256 u_hi) const {
    c10::BFloat16* dst = y + row * (n / 2) + p * 16;
    simd::store8(dst, simd::silu_mul8_bf16(simd::round8_bf16(g_lo), simd::round8_bf16(u_lo)));
    simd::store8(dst + 8, simd::silu_mul8_bf16(simd::round8_bf16(g_hi), simd::round8_bf16(u_hi)));
  }
};

// res[m][j][16] = rows m < MR of x (float32) times strips s .. s + NS - 1 of W, as float32 sums. The
// accumulators are one flat array in fully unrolled loops, and reach the caller through `res`:
// written as acc[MR][NS][2] handed to the stores, GCC kept them in memory and stored all of them on
// every step of the k loop (12 stores per 12 FMAs, half speed).
template <int MR, int NS>
void micro(const float* x, int64_t k, const uint16_t* w, int64_t s, float* res) {
  constexpr int kAcc = MR * NS * 2;
  const int64_t strip_values = k * 16;
  const uint16_t* ws = w + s * strip_values;
  const __m256i zero = _mm256_setzero_si256();
  __m256 acc[kAcc];
#pragma GCC unroll 32
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
#pragma GCC unroll 8
    for (int j = 0; j < NS; ++j) {
      const __m256i raw = _mm256_load_si256(reinterpret_cast<const __m256i*>(ws + j * strip_values + kk * 16));
      const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
      const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * k + kk);
        acc[(m * NS + j) * 2] = _mm256_fmadd_ps(xv, lo, acc[(m * NS + j) * 2]);
        acc[(m * NS + j) * 2 + 1] = _mm256_fmadd_ps(xv, hi, acc[(m * NS + j) * 2 + 1]);
      }
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < kAcc; ++i) _mm256_store_ps(res + 8 * i, acc[i]);
}

// micro<MR, NS> for `rows` <= MR rows (a runtime count), then y's rows row0.. written from the sums.
template <int NS>
void micro_rows(const float* x, int64_t k, const uint16_t* w, const Output& out, int64_t row0, int64_t rows,
                int64_t s) {
  // The blocks that fit the 16 registers: up to 6 rows of one strip, 3 of a pair, 1 of four strips.
  TORCH_INTERNAL_ASSERT(rows >= 1 && rows <= (NS == 1 ? kMicroRows : NS == 2 ? 3 : 1), "micro_rows: ", rows,
                        " rows of ", NS, " strips");
  alignas(32) float res[kMicroRows * NS * 16];
  switch (rows) {
    case 6: if constexpr (NS == 1) micro<6, 1>(x, k, w, s, res); break;
    case 5: if constexpr (NS == 1) micro<5, 1>(x, k, w, s, res); break;
    case 4: if constexpr (NS == 1) micro<4, 1>(x, k, w, s, res); break;
    case 3: micro<3, NS>(x, k, w, s, res); break;
    case 2: micro<2, NS>(x, k, w, s, res); break;
    default: micro<1, NS>(x, k, w, s, res); break;
  }
  for (int64_t m = 0; m < rows; ++m)
    for (int j = 0; j < NS; ++j) {
      const float* r = res + (m * NS + j) * 16;
      out.store(row0 + m, s + j, _mm256_load_ps(r), _mm256_load_ps(r + 8));
    }
}

// Rows [r0, r1) against strips [s0, s1) (s0 even; a silu_mul range holds whole pairs).
void rows_by_strips(const float* x, int64_t k, const uint16_t* w, const Output& out, int64_t r0, int64_t r1,
                    int64_t s0, int64_t s1) {
  if (out.silu_mul && r1 - r0 <= 3) {
    // Few rows: strip pairs side by side (gate, up, gate, up: 8 chains for one row, 8 or 12 for
    // two or three), SiLU(gate) * up from the sums. One strip at a time was latency-bound (two
    // chains per row): 30% of a single-stream step.
    const int64_t rows = r1 - r0;
    alignas(32) float res[3 * 4 * 16];
    for (int64_t s = s0; s < s1;) {
      const int ns = rows == 1 && s + 4 <= s1 ? 4 : 2;
      if (ns == 4) micro<1, 4>(x + r0 * k, k, w, s, res);
      else if (rows == 1) micro<1, 2>(x + r0 * k, k, w, s, res);
      else if (rows == 2) micro<2, 2>(x + r0 * k, k, w, s, res);
      else micro<3, 2>(x + r0 * k, k, w, s, res);
      for (int64_t m = 0; m < rows; ++m)
        for (int j = 0; j < ns; j += 2) {
          const float* g = res + (m * ns + j) * 16;
          out.store_silu_mul(r0 + m, (s + j) / 2, _mm256_load_ps(g), _mm256_load_ps(g + 8), _mm256_load_ps(g + 16),
                             _mm256_load_ps(g + 24));
        }
      s += ns;
    }
    return;
  }
  if (out.silu_mul) {  // gate strip, then its up strip, kMicroRows rows at a time, then SiLU(gate) * up
    alignas(32) float gate[kMicroRows * 16], up[kMicroRows * 16];
    for (int64_t s = s0; s < s1; s += 2)
      for (int64_t r = r0; r < r1; r += kMicroRows) {
        const int64_t mr = std::min<int64_t>(kMicroRows, r1 - r);
        const float* xr = x + r * k;
        with_few_rows<kMicroRows>(mr, [&](auto rows) {
          micro<decltype(rows)::value, 1>(xr, k, w, s, gate);
          micro<decltype(rows)::value, 1>(xr, k, w, s + 1, up);
        });
        for (int64_t m = 0; m < mr; ++m)
          out.store_silu_mul(r + m, s / 2, _mm256_load_ps(gate + 16 * m), _mm256_load_ps(gate + 16 * m + 8),
                             _mm256_load_ps(up + 16 * m), _mm256_load_ps(up + 16 * m + 8));
      }
    return;
  }
  const int64_t rows = r1 - r0;
  if (rows == 1) {  // four strips side by side: 8 chains, and four streams of W
    int64_t s = s0;
    for (; s + 4 <= s1; s += 4) micro_rows<4>(x + r0 * k, k, w, out, r0, 1, s);
    for (; s < s1; ++s) micro_rows<1>(x + r0 * k, k, w, out, r0, 1, s);
    return;
  }
  if (rows <= 3) {  // strip pairs: 8 or 12 chains
    int64_t s = s0;
    for (; s + 2 <= s1; s += 2) micro_rows<2>(x + r0 * k, k, w, out, r0, rows, s);
    for (; s < s1; ++s) micro_rows<1>(x + r0 * k, k, w, out, r0, rows, s);
    return;
  }
  for (int64_t s = s0; s < s1; ++s)  // the strip stays in L1 while the rows pass over it
    for (int64_t r = r0; r < r1; r += kMicroRows)
      micro_rows<1>(x + r * k, k, w, out, r, std::min<int64_t>(kMicroRows, r1 - r), s);
}

void avx2_linear(const at::Tensor& x, const uint16_t* w, const Output& out) {
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const float* xp = x32.data_ptr<float>();
  const int64_t m = x.size(0), k = x.size(1), strips = (out.n + 15) / 16, pairs = (strips + 1) / 2;
  if (m <= kFewRows) {
    // Bound by reading W: strip pairs split over the threads, >= 256 KB of W per task (a second
    // thread's wake-up costs more than a small matrix), all rows against each strip.
    const int64_t threads = at::get_num_threads();
    int64_t tasks = std::max<int64_t>(1, pairs * k * 64 / (int64_t{1} << 18));
    if (tasks > 1) tasks = (tasks + threads - 1) / threads * threads;
    parallel_for_dynamic(0, pairs, (pairs + tasks - 1) / tasks, [&](int64_t p0, int64_t p1) {
      const int64_t s0 = 2 * p0, s1 = std::min(2 * p1, strips);
      rows_by_strips(xp, k, w, out, 0, m, s0, s1);  // W read once for all rows
    });
    return;
  }
  const int64_t blocks = (m + kBlockRows - 1) / kBlockRows;
  const int64_t group = std::clamp<int64_t>(kGroupBytes / (k * 64), 1, pairs);  // strip pairs per group
  const int64_t groups = (pairs + group - 1) / group;
  parallel_for_dynamic(0, groups * blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t g = item / blocks, r0 = item % blocks * kBlockRows;
      rows_by_strips(xp, k, w, out, r0, std::min(m, r0 + kBlockRows), 2 * g * group,
                     std::min(strips, 2 * (g + 1) * group));
    }
  });
}

}  // namespace
#endif  // KVSERVE_BF16 / KVSERVE_AVX2

// ---- one expert's projection in units of strip pairs (ExpertStrips, for layers/csrc/moe.cpp) --------
// packed_linear's row loops over a range of W's strips. Every channel's sum runs in the same order
// whatever rows and strips share a call, so each unit's channels are bitwise packed_linear's.
#if defined(KVSERVE_BF16)
namespace {

class PackedStrips final : public ExpertStrips {
 public:
  PackedStrips(const at::Tensor& x, const uint16_t* w, const Output& out)
      : x_(static_cast<const uint16_t*>(x.data_ptr())), w_(w), out_(out), m_(x.size(0)), k_(x.size(1)),
        strips_((out.n + 15) / 16) {}
  void run(int64_t p0, int64_t p1) const override {
    const int64_t s0 = 2 * p0, s1 = std::min(2 * p1, strips_);
    if (vector_rows_serve(m_)) {  // W streams once, all rows against each strip (vector_linear)
      with_few_rows<kMaxVectorRowsBeforeAmx>(m_, [&](auto mb) {
        vector_rows<decltype(mb)::value>(w_, x_, k_, out_, 0, s0, s1);
      });
      return;
    }
    passes_over_strips(w_, x_, m_, k_, out_, s0, s1);  // as vector_linear_passes
  }

 private:
  const uint16_t* x_;
  const uint16_t* w_;
  Output out_;
  int64_t m_, k_, strips_;
};

// Rows that packed_linear sums in another order (AMX tiles), or that its blocks of rows serve better
// than one pass over W's strips: the expert then runs alone, through packed_linear.
bool packed_rows_elsewhere(int64_t m) {
#if defined(KVSERVE_AMX)
  if (simd::amx_ready() && m > kMaxVectorRowsBeforeAmx) return true;
#endif
  return m > kPassRows;
}

}  // namespace
#elif defined(KVSERVE_AVX2)
namespace {

class PackedStrips final : public ExpertStrips {
 public:
  PackedStrips(const at::Tensor& x, const uint16_t* w, const Output& out)
      : x32_(x.to(at::kFloat).contiguous()), w_(w), out_(out), strips_((out.n + 15) / 16) {}
  void run(int64_t p0, int64_t p1) const override {
    const int64_t m = x32_.size(0), k = x32_.size(1), s0 = 2 * p0, s1 = std::min(2 * p1, strips_);
    for (int64_t r0 = 0; r0 < m; r0 += kBlockRows)  // avx2_linear's blocks of rows
      rows_by_strips(x32_.data_ptr<float>(), k, w_, out_, r0, std::min(m, r0 + kBlockRows), s0, s1);
  }

 private:
  at::Tensor x32_;
  const uint16_t* w_;
  Output out_;
  int64_t strips_;
};

// Past two of avx2_linear's blocks of rows, its items of (rows, strips) serve better.
bool packed_rows_elsewhere(int64_t m) { return m > 2 * kBlockRows; }

}  // namespace
#endif

bool packed_linear_supported() {
#if defined(KVSERVE_BF16) || defined(KVSERVE_AVX2)
  return true;
#else
  return false;
#endif
}

bool native_bf16() {
#if defined(KVSERVE_BF16)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_bf16_weight(const at::Tensor& weight, bool gated) {
  TORCH_CHECK(packed_linear_supported(), "the packed bf16 layout needs AVX512-BF16 or AVX2");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16 &&
                  weight.size(1) % 32 == 0,
              "weight must be a contiguous bfloat16 [N, K] matrix with K a multiple of 32");
  const int64_t n = weight.size(0), k = weight.size(1), strips = (n + 15) / 16, chunks = k / 32;
  TORCH_CHECK(!gated || n % 32 == 0, "a gated weight's halves must be whole strips of 16 rows (N a multiple of 32)");
  at::Tensor out = at::empty({strips, chunks, 16, 32}, weight.options());
#if defined(KVSERVE_BF16) || defined(KVSERVE_AVX2)
  const uint16_t* src = static_cast<const uint16_t*>(weight.data_ptr());
  uint16_t* dst = static_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t row = strip_channel(s, n, gated);
#if defined(KVSERVE_BF16)  // the AMX tile layout
      for (int64_t c = 0; c < chunks; ++c)
        pack_tile(src + row * k + c * 32, k, std::min<int64_t>(16, n - row), dst + (s * chunks + c) * kTile);
#else  // K-major strips of 16 channels, in kPosChannel's order
      for (int64_t kk = 0; kk < k; ++kk)
        for (int p = 0; p < 16; ++p) {
          const int64_t r = row + kPosChannel[p];
          dst[(s * k + kk) * 16 + p] = r < n && r < row + 16 ? src[r * k + kk] : 0;
        }
#endif
    }
  });
#endif
  return out;
}

// The checks packed_linear and packed_strips share: x and the packed weight agree, and the kernels can run.
static void check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool gated, bool silu_mul) {
  TORCH_CHECK(packed_linear_supported(), "the packed bf16 layout needs AVX512-BF16 or AVX2");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == 16 && packed.size(3) == 32 && n > 0 && (n + 15) / 16 == packed.size(0),
              "packed must be pack_bf16_weight's [N / 16, K / 32, 16, 32] of an [n, K] weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.size(1) == packed.size(1) * 32,
              "x must be a contiguous bfloat16 [M, K] matrix, K = ", packed.size(1) * 32);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0, "packed must start on a cache line");
  TORCH_CHECK(gated || !silu_mul, "silu_mul needs a weight packed as gated");
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool gated, bool silu_mul) {
  check_packed(x, packed, n, gated, silu_mul);
  TORCH_CHECK(!gated || n % 32 == 0, "a gated weight has N a multiple of 32");
  at::Tensor y = at::empty({x.size(0), silu_mul ? n / 2 : n}, x.options());
#if defined(KVSERVE_BF16)
  const uint16_t* w = static_cast<const uint16_t*>(packed.data_ptr());
  const Output out{y.data_ptr<c10::BFloat16>(), n, gated, silu_mul};
  if (x.size(0) == 0) return y;
  if (vector_rows_serve(x.size(0))) vector_linear(x, w, out);
#if defined(KVSERVE_AMX)
  else if (simd::amx_ready()) amx_linear(x, w, out);
#endif
  else if (x.size(0) <= kPassRows) vector_linear_passes(x, w, out);
  else vector_linear_blocked(x, w, out);
#elif defined(KVSERVE_AVX2)
  if (x.size(0) == 0) return y;
  avx2_linear(x, static_cast<const uint16_t*>(packed.data_ptr()), Output{y.data_ptr<c10::BFloat16>(), n, gated, silu_mul});
#endif
  return y;
}

std::unique_ptr<ExpertStrips> packed_strips(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool gated,
                                            bool silu_mul, const at::Tensor& y) {
  check_packed(x, packed, n, gated, silu_mul);
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == at::kBFloat16 && y.size(0) == x.size(0) &&
                  y.size(1) == (silu_mul ? n / 2 : n),
              "y must be a contiguous bfloat16 [M, N] matrix ([M, N / 2] for silu_mul)");
#if defined(KVSERVE_BF16) || defined(KVSERVE_AVX2)
  if (x.size(0) == 0 || packed_rows_elsewhere(x.size(0))) return nullptr;
  auto out = std::make_unique<PackedStrips>(x, static_cast<const uint16_t*>(packed.data_ptr()),
                                            Output{y.data_ptr<c10::BFloat16>(), n, gated, silu_mul});
  const int64_t strips = packed.size(0);
  out->units = (strips + 1) / 2;
  out->weight_bytes = packed.nbytes();
  out->unit_bytes = 2 * (packed.nbytes() / strips);
  return out;
#else
  return nullptr;
#endif
}
