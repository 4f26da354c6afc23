"""The engine options as command-line flags, shared by every subcommand that loads a model, and
`kvserve generate`."""

from __future__ import annotations

import argparse
import sys

from kvserve.config import Option, engine_options


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options as flags, made from the config fields (kvserve/config.py ``option``). A flag
    not given is left out of the namespace, so the config's own default applies."""
    for o in engine_options():
        kwargs: dict = {"dest": o.name, "default": argparse.SUPPRESS, "help": _help(o)}
        if o.kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = o.parse or {"int": int, "float": float, "str": str}[o.kind]
            if o.choices is not None:
                kwargs["choices"] = o.choices
        p.add_argument(o.flag, **kwargs)


def _help(o: Option) -> str:
    if o.kind == "bool" or o.default is None or "default" in o.help:
        return o.help
    return f"{o.help} (default: {o.default})"


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options given on the command line, as ``LLM(...)`` / ``engine_config`` keywords."""
    return {o.name: getattr(args, o.name) for o in engine_options() if hasattr(args, o.name)}


def _generate(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.llm import LLM
    from kvserve.types import SamplingParams

    llm = LLM(**engine_kwargs(args))
    prompt = args.prompt
    if args.chat:
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    out = llm.generate([prompt], params)[0]
    print(out.text)
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, ttft={out.ttft * 1000:.0f} ms, "
          f"total={out.e2e_latency:.2f} s]", file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt (offline)")
    p.add_argument("prompt")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the model's chat template (default on)")
    p.set_defaults(func=_generate)
