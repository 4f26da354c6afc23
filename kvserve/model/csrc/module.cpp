// The Python module of kvserve's C++ CPU kernels (declared in kernels.h, built by cpu_kernels.py).
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL, as torch's own ops do: the server's event loop thread streams
  // tokens meanwhile instead of stalling the engine thread (up to the 5 ms switch interval) for it.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after adding into the residual in place (CPU)", no_gil);
  m.def("rotary_", &rotary_, "rotate-half rotary embedding of q and k in place (CPU)", no_gil);
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up (CPU)", no_gil);
  m.def("argmax_rows", &argmax_rows, "index of each row's largest value, first on ties (CPU)", no_gil);
  m.def("sample_rows", &sample_rows, "sampling by inverse CDF, one uniform number per row, with optional top-k/top-p/min-p (CPU)",
        py::arg("x"), py::arg("temperatures"), py::arg("uniforms"), py::arg("filters") = py::none(), no_gil);
  m.def("filtered_probs", &filtered_probs, "the normalised distributions sample_rows draws from, [rows, vocab] float32 (CPU)",
        py::arg("x"), py::arg("temperatures"), py::arg("filters") = py::none(), no_gil);
  m.def("row_logprobs", &row_logprobs, "log-softmax at each row's target and its largest values (CPU)", no_gil);
  m.def("quant_linear", &quant_linear, "weight-only int8/int4 linear (CPU)", no_gil);
  m.def("dequantize", &dequantize, "dequantize an int8/int4 weight (CPU)", no_gil);
  m.def("quant_embed", &quant_embed, "rows of an int8/int4 weight (row-major or strips), dequantized: an embedding lookup (CPU)",
        py::arg("qweight"), py::arg("scales"), py::arg("zeros"), py::arg("factors"), py::arg("bits"), py::arg("ids"),
        py::arg("dtype"), no_gil);
  m.def("dense_linear", &dense_linear, "x W^T for a dense bf16 weight that is not packed: fused loop for a few rows, else at::mm (CPU)", no_gil);
  m.def("has_amx", &has_amx, "AMX tiles usable in this process");
  m.def("vector_bits", &vector_bits, "the kernels' vector width: 512 (AVX-512), 256 (AVX2 + FMA + F16C) or 0 (scalar loops)");
  m.def("has_int8_activations", &has_int8_activations,
        "few-row int4/int8 linears can quantize x to int8 per 32 inputs (quant_linear's quantize_x: AVX512-VNNI "
        "or AVX2); else x stays float");
  m.def("int8_x_serves", &int8_x_serves,
        "few rows of x against an int4/int8 W of these bits, group, inputs and coded scales meet an integer "
        "kernel when quant_linear's quantize_x asks for one (else the float loop runs)",
        py::arg("bits"), py::arg("group"), py::arg("k"), py::arg("coded"));
  m.def("packed_linear_supported", &packed_linear_supported,
        "the packed bf16 weight layout is usable here (AVX512-BF16, or AVX2 + FMA with float32 products)");
  m.def("native_bf16", &native_bf16, "this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX)");
  m.def("pack_bf16_weight", &pack_bf16_weight, "a bf16 [N, K] weight in the packed layout: AMX tiles (AMX, AVX512-BF16) or K-major strips (AVX2) (CPU)", py::arg("weight"),
        py::arg("gated") = false, no_gil);
  m.def("packed_linear", &packed_linear,
        "x W^T for a weight from pack_bf16_weight, or SiLU(gate) * up of it (silu_mul, a gated weight) (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("gated") = false, py::arg("silu_mul") = false, no_gil);
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("kind"), py::arg("window"), py::arg("split_batch") = 0, no_gil);
  m.def("write_kv_cache", &write_kv_cache, "store a step's k, v at their slots of the paged KV cache (CPU)", no_gil);
  m.def("paged_prefill_supported", &paged_prefill_supported, "paged prefill attention (AMX or AVX512-BF16) available for this head_dim");
  m.def("paged_prefill_attention", &paged_prefill_attention, "paged causal prefill attention, bf16 on AMX or AVX512-BF16 (CPU)",
        no_gil);

  py::class_<LinearSpec>(m, "LinearSpec", py::module_local())
      .def(py::init([](int64_t kind, at::Tensor weight, c10::optional<at::Tensor> scales,
                       c10::optional<at::Tensor> zeros, c10::optional<at::Tensor> factors,
                       c10::optional<at::Tensor> bias, int64_t group, int64_t bits, int64_t max_fused_rows,
                       int64_t max_mid_rows, int64_t tile_bytes, int64_t out_features, bool gated, bool quantize_x) {
             TORCH_CHECK(kind >= LinearSpec::kDense && kind <= LinearSpec::kPacked, "unknown linear kind ", kind);
             TORCH_CHECK(kind != LinearSpec::kQuant || scales.has_value(), "a quantized weight needs its scales");
             return LinearSpec{kind, std::move(weight), std::move(scales), std::move(zeros), std::move(factors),
                               std::move(bias), group, bits, max_fused_rows, max_mid_rows,
                               tile_bytes, quantize_x, out_features, gated};
           }),
           py::arg("kind"), py::arg("weight"), py::arg("scales") = py::none(), py::arg("zeros") = py::none(),
           py::arg("factors") = py::none(), py::arg("bias") = py::none(), py::arg("group") = 0,
           py::arg("bits") = 0, py::arg("max_fused_rows") = 0, py::arg("max_mid_rows") = 0,
           py::arg("tile_bytes") = 0, py::arg("out_features") = 0, py::arg("gated") = false,
           py::arg("quantize_x") = false)
      .def("__call__", &LinearSpec::apply, no_gil)
      .def("silu_mul", &LinearSpec::apply_silu_mul, "SiLU(gate) * up of the layer's output", no_gil);
  py::class_<MoeExperts>(m, "MoeExperts", py::module_local())
      .def(py::init<std::vector<LinearSpec>, std::vector<LinearSpec>>(), py::arg("gate_up"), py::arg("down"))
      .def("__call__", &MoeExperts::forward,
           "sum over each token's experts of weight * down(SiLU(gate) * up) of its row of x (CPU)",
           py::arg("x"), py::arg("weights"), py::arg("ids"), py::arg("bytes_read") = py::none(), no_gil);
  py::class_<MoeSpec>(m, "MoeSpec", py::module_local())
      .def(py::init([](LinearSpec router, const MoeExperts& experts, int64_t top_k, bool renormalize,
                       bool float32_weights) {
             TORCH_CHECK(top_k >= 1, "top_k must be at least 1");
             return MoeSpec{std::move(router), experts, top_k, renormalize, float32_weights};
           }),
           py::arg("router"), py::arg("experts"), py::arg("top_k"), py::arg("renormalize"), py::arg("float32_weights"))
      .def("__call__", &MoeSpec::forward, "the MoE MLP's output for x [tokens, hidden] (CPU)", no_gil);
  py::class_<LayerSpec>(m, "LayerSpec", py::module_local())
      .def(py::init([](LinearSpec qkv, LinearSpec o, std::optional<LinearSpec> gate_up, std::optional<LinearSpec> down,
                       at::Tensor input_norm, at::Tensor post_norm, c10::optional<at::Tensor> q_norm,
                       c10::optional<at::Tensor> k_norm, std::optional<MoeSpec> moe) {
             TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
             TORCH_CHECK(moe.has_value() != (gate_up.has_value() && down.has_value()),
                         "a layer's MLP is either gate_up and down, or moe");
             return LayerSpec{std::move(qkv), std::move(o), gate_up.value_or(LinearSpec{}),
                              down.value_or(LinearSpec{}), std::move(input_norm), std::move(post_norm),
                              std::move(q_norm), std::move(k_norm), std::move(moe)};
           }),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("input_norm"),
           py::arg("post_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("moe") = py::none());
  py::class_<LlamaDecoder>(m, "LlamaDecoder", py::module_local())
      .def(py::init<std::vector<LayerSpec>, at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>, int64_t,
                    int64_t, int64_t, double, double, int64_t, std::vector<int64_t>>())
      .def("forward", &LlamaDecoder::forward, "hidden states after the final norm, each row one token decoded",
           py::arg("x"), py::arg("positions"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("seq_lens"),
           py::arg("split_batch") = 0, no_gil);
}
