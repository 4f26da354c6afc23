// An embedding lookup in a quantized table: rows `ids` of an int8 / int4 W, dequantized into x's
// dtype, in either layout GroupQuant keeps (quant_linear.cpp: row-major, or strips of 16 channels).
// A decode step looks up one row per sequence; the same lookup as tensor ops (packing.py,
// dequantize_strip_rows / dequantize) took ~10 dispatched ops, 70-130 us a step on the default model.
//
// The result is bitwise packing.dequantize's: each weight is (q * scale) + zero in float32, rounded
// after the product and after the sum (no fused multiply-add), with coded scales and zeros first
// multiplied by their row's step, then converted to the output dtype.
#include "kernels.h"
#include "quant_rows.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <vector>

namespace {

// Where a weight sits, by layout. value(n, i): the stored value of input i of row n (int4 0..15, int8
// -127..127); params(n, ...): row n's scales and zero points as floats (0 without zero points).
struct Layout {
  QuantWeightRef ref;  // n, k, group of the row-major W; data, scales, zeros, factors as stored
  int64_t bits;
  bool strips;

  int value(int64_t n, int64_t i) const {
    const int64_t k = ref.k, c = i / 32, r = i % 32;
    if (!strips) {
      if (bits == 8) return static_cast<int8_t>(ref.data[n * k + i]);
      const uint8_t b = ref.data[n * (k / 2) + 16 * c + r % 16];
      return r < 16 ? b & 15 : b >> 4;
    }
    const int64_t s = n / 16, lane = n % 16, chunks = k / 32;
    if (bits == 8)  // vector j = r / 4, byte r % 4, stored as w + 128
      return static_cast<int>(ref.data[(s * chunks + c) * 512 + (r / 4) * 64 + lane * 4 + r % 4]) - 128;
    const uint8_t b = ref.data[(s * chunks + c) * 256 + (r / 8) * 64 + lane * 4 + r % 4];  // vector j = r / 8
    return r % 8 < 4 ? b & 15 : b >> 4;
  }

  void params(int64_t n, float* scales, float* zeros) const {
    if (!strips) return row_scales_zeros(ref, n, scales, zeros);  // the linears' own conversion
    // Strips: group g of row n at [n / 16][g][n % 16], its code steps at [n / 16][0 or 1][n % 16].
    const int64_t groups = ref.k / ref.group, s = n / 16, lane = n % 16;
    const float* steps = ref.factors ? ref.factors + s * 32 + lane : nullptr;
    scales_zeros_at(ref, s * groups * 16 + lane, 16, steps ? steps[0] : 0.f, steps ? steps[16] : 0.f, scales, zeros);
  }
};

template <typename T>
void lookup(const Layout& w, const int64_t* ids, int64_t rows, T* out) {
  const int64_t k = w.ref.k, group = w.ref.group, groups = k / group;
  std::vector<float> scales(groups), zeros(groups);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = ids[r];
    TORCH_CHECK(n >= 0 && n < w.ref.n, "quant_embed: id ", n, " is outside the table's ", w.ref.n, " rows");
    w.params(n, scales.data(), zeros.data());
    for (int64_t i = 0; i < k; ++i) {
      // volatile: the product is rounded on its own, as torch's separate multiply rounds it
      volatile float product = static_cast<float>(w.value(n, i)) * scales[i / group];
      out[r * k + i] = static_cast<T>(w.ref.zeros ? product + zeros[i / group] : static_cast<float>(product));
    }
  }
}

}  // namespace

at::Tensor quant_embed(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                       const c10::optional<at::Tensor>& factors, int64_t bits, const at::Tensor& ids,
                       at::ScalarType dtype) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_embed: bits must be 4 or 8");
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous(), "quant_embed: the weight must be contiguous");
  const bool strips = qweight.dim() == 3, coded = factors.has_value() && factors->defined();
  const int64_t n_rows = strips ? qweight.size(0) * 16 : qweight.size(0);
  const int64_t k = strips ? qweight.size(1) * 32 : (bits == 4 ? qweight.size(1) * 2 : qweight.size(1));
  const int64_t groups = scales.size(1);  // [N, G] rows, [S, G, 16] strips
  TORCH_CHECK(groups > 0 && k % groups == 0, "quant_embed: the scales do not divide the row into groups");
  TORCH_CHECK(scales.scalar_type() == (coded ? at::kByte : at::kHalf), "quant_embed: scales must be float16 or uint8 codes");
  const bool has_zeros = zeros.has_value() && zeros->defined();
  if (has_zeros) TORCH_CHECK(zeros->is_contiguous() && zeros->sizes() == scales.sizes(), "quant_embed: zeros must be shaped like scales");
  if (coded) TORCH_CHECK(factors->is_contiguous() && factors->scalar_type() == at::kFloat && factors->numel() == 2 * n_rows,
                         "quant_embed: factors must be float32, two per row");
  const at::Tensor q = qweight.scalar_type() == at::kChar ? qweight.view(at::kByte) : qweight;
  const Layout w{{q.data_ptr<uint8_t>(), scales.data_ptr(), has_zeros ? zeros->data_ptr() : nullptr,
                  coded ? factors->data_ptr<float>() : nullptr, n_rows, k, k / groups},
                 bits, strips};
  const at::Tensor flat = ids.reshape(-1).to(at::kLong).contiguous();
  const int64_t rows = flat.numel();
  at::Tensor out = at::empty({rows, k}, qweight.options().dtype(dtype));
  const int64_t* id = flat.data_ptr<int64_t>();
  switch (dtype) {
    case at::kFloat: lookup(w, id, rows, out.data_ptr<float>()); break;
    case at::kBFloat16: lookup(w, id, rows, out.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: lookup(w, id, rows, out.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "quant_embed: the output must be float32, bfloat16 or float16");
  }
  return out;
}
