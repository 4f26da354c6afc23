"""schemathesis over the server's own OpenAPI schema: generated requests (valid and not) to every
route, with bounded examples, and no 5xx anywhere; the responses must match the schema's status
codes and media types too."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.conftest import API_KEY, assert_idle, start_server

EXAMPLES = 25  # per operation and phase: ~1-2 minutes in all on two cores


def test_generated_requests_get_no_5xx(chat_model, tmp_path):
    cli = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    if not Path(cli).exists():
        pytest.fail("schemathesis is not installed: pip install -e '.[test]'")
    with start_server(chat_model, "--max-queue", "64", "--max-model-len", "128") as server:
        run = subprocess.run(
            [cli, "run", server.url("/openapi.json"), "--checks",
             "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
             "--max-examples", str(EXAMPLES), "--workers", "1", "--seed", "37", "-H", f"Authorization: Bearer {API_KEY}",
             "--phases", "examples,coverage,fuzzing", "--request-timeout", "60", "--no-color"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path)
        summary = run.stdout[-3000:]
        print(summary)
        assert run.returncode == 0, summary + run.stderr[-2000:]
        assert not re.search(r"\b5\d\d\b.*(?:Server error|Internal)", run.stdout), summary
        assert_idle(server, timeout=30)
