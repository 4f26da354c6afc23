"""Bad input gets a ValueError naming the field and the allowed range; the engine stays usable."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import assert_no_leak


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "(0, 1]"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(stop=[""]), "stop"),
    (dict(n=0), "n="),
])
def test_bad_sampling_params(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_engine_usable(tiny_llama):
    llm = LLM(model=str(tiny_llama), num_kv_blocks=64, block_size=8, max_model_len=128)
    good = SamplingParams(max_tokens=4, temperature=0)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], good)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], good)
    with pytest.raises(ValueError, match=r"prompts\[1\].*128"):
        llm.generate([[5, 6], list(range(3, 200))], good)
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        llm.generate([[5, 100000]], good)
    assert_no_leak(llm)
    assert len(llm.generate([[5, 6, 7]], good)[0].token_ids) == 4
    assert_no_leak(llm)


def test_generate_encodes_each_text_prompt_once(tiny_llama):
    """generate() checks every prompt before queuing any, and queues the ids it checked: the
    tokenizer runs once per text prompt, and the request's prompt is those ids."""
    llm = LLM(model=str(tiny_llama), num_kv_blocks=64, block_size=8, max_model_len=128)
    texts = ["hello there", "a second, longer prompt to encode"]
    calls = []
    encode = llm.engine.tokenizer.encode
    llm.engine.tokenizer.encode = lambda text, **kw: calls.append(text) or encode(text, **kw)
    outs = llm.generate(texts, SamplingParams(max_tokens=2, temperature=0))
    assert calls == texts
    assert [o.prompt_token_ids for o in outs] == [encode(t, add_special_tokens=True) for t in texts]
    assert_no_leak(llm)


def test_unknown_model_path_and_architecture(tmp_path):
    with pytest.raises(ValueError, match="model="):
        LLM(model=str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10, '
                                          '"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, '
                                          '"num_attention_heads": 2}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported"):
        LLM(model=str(tmp_path))


def test_bad_engine_options():
    with pytest.raises(ValueError, match="dtype"):
        LLM(dtype="int3")
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(max_num_seqs=0)


def test_quantization_group_size_options():
    from kvserve.config import QuantConfig

    assert QuantConfig("int8", -1).group_size == -1  # one scale per output channel
    with pytest.raises(ValueError, match="int8"):
        QuantConfig("int4", -1)
    with pytest.raises(ValueError, match="quantization_group_size"):
        QuantConfig("int8", 48)
    with pytest.raises(ValueError, match="needs quantization"):
        QuantConfig(None, 32)


def test_auto_dtype_follows_the_checkpoint_and_the_cpu(tmp_path, tiny_llama):
    """dtype="auto": a float32 checkpoint stays float32; a bfloat16 one (or a GGUF file) runs in
    bfloat16 where the CPU has the bf16 kernels, else float32. EngineCore hands the resolved name on."""
    import torch

    from kvserve.config import EngineConfig
    from kvserve.model.cpu_kernels import load_kernels
    from kvserve.model.loader import auto_dtype, resolve_model_path
    from tests.conftest import make_tiny_model

    kernels = load_kernels()
    native = "bfloat16" if kernels is not None and kernels.native_bf16() else "float32"
    cpu = torch.device("cpu")
    assert auto_dtype(tiny_llama, cpu) == "float32"
    bf16 = make_tiny_model(tmp_path / "bf16", "LlamaForCausalLM", dtype=torch.bfloat16)
    assert auto_dtype(bf16, cpu) == native
    assert auto_dtype(resolve_model_path(None), cpu) == native  # the bundled GGUF file
    llm = LLM(model=str(bf16), num_kv_blocks=16)
    assert llm.engine.config.dtype == native and llm.engine.core.config.dtype == native
    assert LLM(model=str(tiny_llama), num_kv_blocks=16).engine.config.dtype == "float32"
    with pytest.raises(RuntimeError, match="auto"):
        _ = EngineConfig(dtype="auto").torch_dtype


def test_activation_quantization_auto_follows_why_the_run_is_float32(tiny_llama, tmp_path):
    """"auto" quantizes x unless the run is float32 by choice: --dtype float32, or a float32
    checkpoint under dtype "auto"; a 16-bit checkpoint that runs in float32 for want of bf16 still
    quantizes. An explicit choice stands. Engine and benchmarks resolve both "auto"s in one place."""
    import torch

    from kvserve.config import QuantConfig
    from kvserve.model.loader import auto_dtype, resolve_auto
    from tests.conftest import make_tiny_model

    cpu = torch.device("cpu")
    bf16 = make_tiny_model(tmp_path / "bf16", "LlamaForCausalLM", dtype=torch.bfloat16)

    def resolved(dtype, path, activations="auto"):
        dtype, quant = resolve_auto(dtype, QuantConfig(activation_quantization=activations), path, cpu)
        return dtype, quant.activation_quantization

    assert resolved("auto", tiny_llama) == ("float32", "none")  # a float32 checkpoint
    assert resolved("auto", bf16) == (auto_dtype(bf16, cpu), "int8")  # float32 here only if the CPU lacks bf16
    assert resolved("float32", bf16) == ("float32", "none")
    assert resolved("bfloat16", tiny_llama) == ("bfloat16", "int8")
    assert resolved("float32", bf16, "int8") == ("float32", "int8")
    assert resolved("auto", bf16, "none")[1] == "none"


def test_activation_quantization_follows_why_the_run_is_float32(tmp_path, tiny_llama):
    """"auto" quantizes x to int8 except in a float32 run by choice: dtype="float32" asked for (the
    exact path quality comparisons run in), or a float32 checkpoint under dtype "auto". EngineCore
    resolves it with the dtype, into every quantized layer."""
    import torch

    from kvserve.config import QuantConfig
    from kvserve.model.quant.methods import GroupQuant
    from tests.conftest import make_tiny_model

    assert QuantConfig().int8_activations(float32_by_choice=False)
    assert not QuantConfig().int8_activations(float32_by_choice=True)
    assert QuantConfig(activation_quantization="int8").int8_activations(float32_by_choice=True)
    assert not QuantConfig(activation_quantization="none").int8_activations(float32_by_choice=False)
    with pytest.raises(ValueError, match="activation_quantization"):
        QuantConfig(activation_quantization="int4")
    bf16 = make_tiny_model(tmp_path / "bf16", "LlamaForCausalLM", dtype=torch.bfloat16)
    for model, options, expected in [
            (bf16, {}, True),  # bfloat16 where the CPU has it, else float32 for speed: int8 either way
            (bf16, {"dtype": "float32"}, False), (tiny_llama, {}, False),  # float32 by choice
            (tiny_llama, {"activation_quantization": "int8"}, True), (bf16, {"activation_quantization": "none"}, False)]:
        llm = LLM(model=str(model), quantization="int4", num_kv_blocks=16, **options)
        assert llm.engine.config.quant.activation_quantization == ("int8" if expected else "none"), (model, options)
        methods = [m.method for m in llm.engine.core.runner.model.modules()
                   if isinstance(getattr(m, "method", None), GroupQuant)]
        assert methods and all(m.int8_activations == expected for m in methods)
