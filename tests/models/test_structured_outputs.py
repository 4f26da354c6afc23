"""Structured outputs on the bundled model: every output parses, free rows are untouched, and
n > 1, preemption and n-gram speculation keep both true."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import assert_no_leak

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}


def _chat(llm: LLM, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(default_llm, temperature):
    prompt = _chat(default_llm, "Describe a person as JSON.")
    params = SamplingParams(max_tokens=120, temperature=temperature, seed=7, n=3, structured_outputs={"json": SCHEMA})
    out = default_llm.generate([prompt], params)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert_no_leak(default_llm)


def test_regex_choice_and_grammar(default_llm):
    prompt = _chat(default_llm, "Answer.")
    specs = [({"regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
             ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
             ({"grammar": 'start: "x=" NUM ";"\nNUM: /[1-9][0-9]?/'}, lambda t: re.fullmatch(r"x=[1-9][0-9]?;", t)),
             ({"json_object": True}, lambda t: isinstance(json.loads(t), dict))]
    # json_object allows any object, which a sampled small model may never close: greedy for that one
    params = [SamplingParams(max_tokens=150, temperature=0.0 if "json_object" in s else 1.0, seed=i,
                             structured_outputs=s) for i, (s, _) in enumerate(specs)]
    outs = default_llm.generate([prompt] * len(specs), params)
    for (spec, check), out in zip(specs, outs):
        assert out.finish_reason == "stop" and check(out.text), (spec, out.text)


def test_free_rows_are_untouched_in_a_mixed_batch(default_llm):
    prompts = [_chat(default_llm, p) for p in ("Name a colour.", "Count to five.", "Say hi.")]
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = [o.token_ids for o in default_llm.generate(prompts, free)]
    constrained = SamplingParams(max_tokens=24, temperature=0, structured_outputs={"json": SCHEMA})
    mixed = default_llm.generate([prompts[0], prompts[0], prompts[1], prompts[2]],
                                 [constrained, free, constrained, free])
    assert [mixed[1].token_ids, mixed[3].token_ids] == [alone[0], alone[2]]
    assert mixed[0].text.startswith('{"name": ')


def test_unfinished_grammar_ends_with_length(default_llm):
    out = default_llm.generate([_chat(default_llm, "JSON please.")],
                               SamplingParams(max_tokens=4, temperature=0, structured_outputs={"json": SCHEMA}))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


@pytest.mark.parametrize("spec, problem", [({"regex": "a(b"}, "structured_outputs regex is invalid"),
                                           ({"json": {"type": "nope"}}, "structured_outputs json schema is invalid"),
                                           ({"json": "{not json"}, "not valid JSON"),
                                           ({"grammar": "start: foo"}, "structured_outputs grammar is invalid")])
def test_invalid_specs_are_value_errors(default_llm, spec, problem):
    with pytest.raises(ValueError, match=problem):
        default_llm.generate(["hi"], SamplingParams(structured_outputs=spec))
    assert not default_llm.engine.has_unfinished()


def _ngram_prompts(llm: LLM) -> list[str]:
    # Outputs that copy from the prompt give n-gram lookup something to propose.
    records = json.dumps([{"name": "Ann", "age": 31, "address": {"zip": "12345"}},
                          {"name": "Bob", "age": 42, "address": {"zip": "54321"}}])
    return [_chat(llm, f"Here are records: {records}. Repeat record {i} exactly as JSON.") for i in range(4)]


def test_greedy_identical_with_ngram_speculation():
    # Two fresh engines: the shared default_llm's prefix cache would split the plain run's prefill
    # differently, and other matmul shapes may round a near-tie the other way (AMX vs VNNI tiles).
    plain_llm = LLM(dtype="float32", kv_cache_memory_bytes=128 * 1024**2)
    spec_llm = LLM(dtype="float32", kv_cache_memory_bytes=128 * 1024**2, speculative_method="ngram",
                   num_speculative_tokens=4)
    prompts = _ngram_prompts(plain_llm)
    params = SamplingParams(max_tokens=60, temperature=0, structured_outputs={"json": SCHEMA})
    plain = [o.token_ids for o in plain_llm.generate(prompts, params)]
    fast = spec_llm.generate(prompts, params)
    assert [o.token_ids for o in fast] == plain
    for o in fast:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    stats = spec_llm.engine.core.spec.stats
    assert stats.accepted > 0 and stats.proposed > stats.accepted, "proposals were made, some rejected"
    assert_no_leak(spec_llm)


def test_identical_under_preemption():
    # The reference chunks its prefills as the small pool does, so only the preemptions differ.
    roomy = LLM(dtype="float32", block_size=4, num_kv_blocks=1024, max_num_batched_tokens=64)
    small = LLM(dtype="float32", block_size=4, num_kv_blocks=72, max_num_batched_tokens=64)
    prompts = _ngram_prompts(roomy) * 2
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=i, structured_outputs={"json": SCHEMA})
              for i in range(len(prompts))]
    expected = [o.text for o in roomy.generate(prompts, params)]
    assert [o.text for o in small.generate(prompts, params)] == expected
    assert small.engine.core.scheduler.num_preemptions > 0
    assert_no_leak(small)
