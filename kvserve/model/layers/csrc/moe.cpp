// The routed experts of a mixture-of-experts layer on the CPU, one call per layer (layers/moe.py).
//
// The input holds a step's (token, expert) pairs sorted by expert. Run expert by expert, every
// projection was a parallel region of its own, split over that expert's rows of W only: with a few
// tokens per expert the threads spent the step waking up and waiting at barriers, and Python
// dispatched three calls per expert. Here each projection (gate_up, then down) of all active
// experts is one parallel region whose items are (expert, strip of W's output channels), a few per
// thread, so every expert's W is still read once per step and no thread waits on one expert.
// An item calls the expert's own few-row kernel (ExpertStrips), so each result is bitwise what the
// expert's LinearSpec computes. An expert with more rows than those kernels serve, or a weight kind
// without one (a float32 W: at::linear), runs alone through its LinearSpec.
#include "kernels.h"

namespace {

constexpr int64_t kItemsPerThread = 4;
// An item reads at least this much of W: a few microseconds of work, against the cost of taking it.
constexpr int64_t kMinItemBytes = int64_t{1} << 16;

using Grouped = std::vector<std::pair<int64_t, std::unique_ptr<ExpertStrips>>>;  // (expert, its strips)

int64_t out_features(const LinearSpec& s) { return s.kind == LinearSpec::kPacked ? s.out_features : s.weight.size(0); }

int64_t optional_bytes(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined() ? t->nbytes() : 0; }

int64_t weight_bytes(const LinearSpec& s) {
  return s.weight.nbytes() + optional_bytes(s.scales) + optional_bytes(s.zeros) + optional_bytes(s.factors);
}

// The expert's projection of x into y as strips, or nullptr: it then runs alone.
std::unique_ptr<ExpertStrips> strips_for(const LinearSpec& s, const at::Tensor& x, const at::Tensor& y, bool silu_mul) {
  if (s.bias.has_value()) return nullptr;
  switch (s.kind) {
    case LinearSpec::kPacked: return packed_strips(x, s.weight, s.out_features, s.gated, silu_mul, y);
    case LinearSpec::kQuant:
      return quant_strips(x, s.weight, *s.scales, s.zeros, s.factors, s.group, s.bits, s.max_fused_rows, y);
    case LinearSpec::kDense: return dense_strips(x, s.weight, s.max_fused_rows, y);
    default: return nullptr;
  }
}

// Every expert's units in one parallel region: each expert cut into items of about 1 / (4 threads)
// of all the experts' W, handed out one at a time. bytes_read: expert e's count at [2 e].
void run_grouped(const Grouped& work, int64_t* bytes_read) {
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
  run_grouped(grouped, bytes_read);
  for (int64_t e : unfused)
    out.narrow(0, offset[e], counts[e]).copy_(silu_mul(full.narrow(0, offset[e], counts[e])));
  for (int64_t e : alone) {
    const at::Tensor xe = x.narrow(0, offset[e], counts[e]);
    out.narrow(0, offset[e], counts[e]).copy_(silu ? specs[e].apply_silu_mul(xe) : specs[e].apply(xe));
    if (bytes_read != nullptr) bytes_read[2 * e] += weight_bytes(specs[e]);
  }
  return out;
}

}  // namespace

MoeExperts::MoeExperts(std::vector<LinearSpec> gate_up, std::vector<LinearSpec> down)
    : gate_up_(std::move(gate_up)), down_(std::move(down)) {
  TORCH_CHECK(!gate_up_.empty() && gate_up_.size() == down_.size(), "one gate_up and one down projection per expert");
}

at::Tensor MoeExperts::forward(const at::Tensor& x, const std::vector<int64_t>& counts,
                               const c10::optional<at::Tensor>& bytes_read) const {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [pairs, hidden] matrix");
  TORCH_CHECK(counts.size() == gate_up_.size(), "one count per expert: ", gate_up_.size());
  int64_t pairs = 0;
  for (int64_t c : counts) {
    TORCH_CHECK(c >= 0, "counts must not be negative");
    pairs += c;
  }
  TORCH_CHECK(pairs == x.size(0), "counts add up to ", pairs, " rows, x has ", x.size(0));
  int64_t* bytes = nullptr;
  if (bytes_read.has_value()) {
    TORCH_CHECK(bytes_read->is_contiguous() && bytes_read->scalar_type() == at::kLong && bytes_read->dim() == 2 &&
                    bytes_read->size(0) == static_cast<int64_t>(counts.size()) && bytes_read->size(1) == 2,
                "bytes_read must be a contiguous int64 [experts, 2] tensor");
    bytes = bytes_read->data_ptr<int64_t>();
  }
  if (pairs == 0) return at::empty({0, out_features(down_[0])}, x.options());
  const at::Tensor act = project(x, counts, gate_up_, true, bytes);
  return project(act, counts, down_, false, bytes == nullptr ? nullptr : bytes + 1);
}
