"""`--report DIR` of `kvserve bench offline` and `roofline` on a tiny model and tiny runs: the PNGs,
the self-contained page and the saved figures, which are what `--json` prints. (`serve` and
`prefix` are checked against a live server in tests/e2e/test_server_bench.py, `spec` in
tests/spec_decode/test_spec_decode.py.)"""

from __future__ import annotations

import json

from kvserve.bench.report import Page, Table, write_page
from kvserve.cli import build_parser
from tests.conftest import check_report


def _run(argv: list[str], capsys) -> dict:
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_offline_report(tiny_llama, tmp_path, capsys):
    out = tmp_path / "offline"
    printed = _run(["bench", "offline", "--model", str(tiny_llama), "--dtype", "float32", "--block-size", "8",
                    "--num-kv-blocks", "64", "--num-requests", "3", "--prompt-min", "4", "--prompt-max", "8",
                    "--output-min", "2", "--output-max", "4", "--hf-sequential-requests", "1", "--json",
                    "--report", str(out)], capsys)
    page, saved = check_report(out, ("throughput.png",))
    assert saved == printed and [r["name"] for r in saved["results"]][0] == "kvserve"
    assert len(saved["results"]) == 3 and page.count("<tr><td>") == 3
    assert "transformers (b) static batch" in page and "3 requests" in page


def test_bench_roofline_report(tiny_llama, tmp_path, capsys):
    out = tmp_path / "roofline"
    printed = _run(["bench", "roofline", "--model", str(tiny_llama), "--dtype", "float32", "--prompt-len", "8",
                    "--single-output-len", "8", "--single-rounds", "2", "--output-len", "4", "--batch-sizes", "1,2",
                    "--copy-mib", "8", "--measure-seconds", "0.05", "--json", "--report", str(out)], capsys)
    page, saved = check_report(out, ("single.png", "batched.png", "flops.png"))
    assert saved == printed and [b["batch_size"] for b in saved["batched"]] == [1, 2]
    assert "<td>round 2</td>" in page and "Batched" in page and "Single stream" in page


def test_bench_roofline_shipped(tiny_llama, tmp_path, capsys):
    """--shipped: single streams of the quantized model, bounded by the bytes that engine keeps."""
    out = tmp_path / "roofline"
    printed = _run(["bench", "roofline", "--model", str(tiny_llama), "--dtype", "float32", "--prompt-len", "8",
                    "--single-output-len", "8", "--single-rounds", "2", "--output-len", "4", "--batch-sizes", "1",
                    "--copy-mib", "8", "--measure-seconds", "0.05", "--shipped", "--shipped-quantization", "int8",
                    "--json", "--report", str(out)], capsys)
    page, saved = check_report(out, ("single.png", "batched.png", "flops.png"))
    shipped = printed["shipped"]
    assert saved == printed and "int8" in shipped["quantization"] and len(shipped["single_stream_rounds"]) == 2
    # int8 weights: about a quarter of float32's bytes per step (the KV and norms stay as they were)
    dense, quantized = printed["single_stream"]["bytes_per_step"], shipped["single_stream"]["bytes_per_step"]
    assert 0.2 * dense < quantized < 0.5 * dense
    mid = shipped["single_stream"]
    assert abs(mid["bound_tokens_per_s"] - mid["bandwidth"] / quantized) < 1e-6 * mid["bound_tokens_per_s"]
    assert shipped["over_dense_single_stream"] > 0 and "Single stream as shipped" in page


def test_a_page_escapes_what_it_shows(tmp_path):
    path = write_page(Page("t <b>", "d & e", [Table(("a", "b"), [("<script>", 1)])], [], {"x": 1}), tmp_path)
    page = path.read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page and "t &lt;b&gt;" in page
    assert json.loads((tmp_path / "results.json").read_text()) == {"x": 1}
