"""The playground and the live dashboard in a real headless Chromium, against a real server on a tiny
random model: a streamed reply appears, stop aborts the request and its KV blocks come back, the
dashboard's numbers move under load, both pages work behind an API key, and behind a two-replica
front end the dashboard shows one panel per replica."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import make_tiny_model
from tests.e2e.browser import chrome
from tests.e2e.server import ServerProcess

KEY = "sekret-key"
# Long contexts so a reply runs long enough to be stopped mid-stream; 512 blocks make a visible map.
ENGINE_ARGS = ["--num-kv-blocks", "512", "--block-size", "8", "--max-model-len", "1024", "--dtype", "float32"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w3{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-web"), "LlamaForCausalLM")
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    proc = ServerProcess([str(model_dir), *ENGINE_ARGS, "--served-model-name", "tiny", "--api-key", KEY])
    yield proc
    assert proc.stop() == 0, proc.log_text()


@pytest.fixture(scope="module")
def browser():
    driver = chrome()
    # The "user" answers the pages' key prompt (a native dialog would block the page), and it is noted.
    answer = f"window.prompt = () => {{ localStorage.setItem('prompted', '1'); return {json.dumps(KEY)}; }};"
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": answer})
    yield driver
    driver.quit()


def _open(browser, server, path: str) -> None:
    browser.get(server.url(path))


def _wait(browser, condition, timeout: float = 30.0):
    return WebDriverWait(browser, timeout, poll_frequency=0.05).until(lambda d: condition(d))


def _set(browser, element_id: str, value: str) -> None:
    browser.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1]; "
                           "e.dispatchEvent(new Event('change'));", element_id, value)


def _replies(browser):
    return browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def test_pages_and_static_files_are_served_without_the_key(server):
    for path in ("/", "/dashboard", "/static/playground.js", "/static/vendor/purify.min.js"):
        assert httpx.get(server.url(path), timeout=10).status_code == 200, path
    assert httpx.get(server.url("/v1/engine/events"), timeout=10).status_code == 401


def test_playground_asks_for_the_key_on_401_then_streams_a_reply(server, browser):
    browser.get(server.url("/"))
    browser.execute_script("localStorage.clear();")
    browser.refresh()
    _wait(browser, lambda d: d.find_element(By.ID, "model").get_attribute("value") == "tiny")
    assert browser.execute_script("return [localStorage.getItem('prompted'), localStorage.getItem('kvserve.apiKey')]") \
        == ["1", KEY]
    _set(browser, "max_tokens", "24")
    _set(browser, "temperature", "0")
    browser.find_element(By.ID, "prompt").send_keys("hello there")
    browser.find_element(By.ID, "send").click()
    _wait(browser, lambda d: _replies(d) and "done" in _replies(d)[-1].get_attribute("class"))
    reply = _replies(browser)[-1]
    assert reply.find_element(By.CSS_SELECTOR, ".content").text.strip(), reply.get_attribute("innerHTML")
    stats = reply.find_element(By.CSS_SELECTOR, ".stats").text
    assert "TTFT" in stats and "tokens/s" in stats, stats
    saved = browser.execute_script("return JSON.parse(localStorage.getItem('kvserve.conversations'))")
    user, answer = saved[0]["messages"]
    assert user == {"role": "user", "content": "hello there"}
    assert answer["content"] and 1 <= answer["stats"]["tokens"] <= 24 and answer["stats"]["finish"] in ("stop", "length")


def test_markdown_is_rendered_and_sanitized(server, browser):
    _open(browser, server, "/")
    html = browser.execute_script(
        "return renderMarkdown('**bold** `code`\\n\\n<img src=x onerror=\"window.pwned=1\"><script>window.pwned=2</script>')")
    assert "<strong>bold</strong>" in html and "<code>code</code>" in html
    assert "onerror" not in html and "<script" not in html
    assert browser.execute_script("return window.pwned === undefined")


def test_stop_aborts_the_request_and_frees_its_kv_blocks(server, browser):
    _open(browser, server, "/")
    _wait(browser, lambda d: d.find_element(By.ID, "model").get_attribute("value") == "tiny")
    browser.find_element(By.ID, "new-chat").click()
    _set(browser, "max_tokens", "1000")
    _set(browser, "temperature", "1")
    _set(browser, "seed", "7")
    browser.find_element(By.ID, "prompt").send_keys("tell me a long story")
    aborts = server.metric("kvserve:request_success_total", finished_reason="abort") or 0.0
    browser.find_element(By.ID, "send").click()
    # seed 7 streams ~700 tokens before its EOS, well under a second on a fast CPU: click stop as
    # soon as the first text shows; the abort counter below proves the request was still running.
    _wait(browser, lambda d: _replies(d)[-1].find_element(By.CSS_SELECTOR, ".content").text)
    browser.find_element(By.ID, "stop").click()
    _wait(browser, lambda d: "done" in _replies(d)[-1].get_attribute("class"))
    assert "stopped" in _replies(browser)[-1].find_element(By.CSS_SELECTOR, ".stats").text
    assert server.wait_metric("kvserve:kv_cache_usage_perc", 0.0) == 0.0
    assert server.wait_metric("kvserve:num_requests_running", 0.0) == 0.0
    # this request's abort alone, whatever the module's other tests left in the counter
    assert server.metric("kvserve:request_success_total", finished_reason="abort") == aborts + 1


def _load(server, stop: threading.Event, concurrency: int = 6, url: str | None = None) -> None:
    """Streams of greedy requests until ``stop`` is set, ``concurrency`` at a time (to ``url``, else
    the server's completions endpoint)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    url = url or server.url("/v1/completions")

    def worker(i: int) -> None:
        with httpx.Client(timeout=60, headers=headers) as http:
            while not stop.is_set():
                body = {"model": "tiny", "prompt": [1 + i, 2, 3, 4] * (8 + 4 * i), "max_tokens": 64,
                        "temperature": 0, "ignore_eos": True}
                http.post(url, json=body)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    return threads


def test_dashboard_numbers_move_under_load(server, browser):
    _open(browser, server, "/dashboard")
    _wait(browser, lambda d: d.find_element(By.ID, "status").text == "live")
    _wait(browser, lambda d: d.find_element(By.ID, "v-gen").text not in ("–", ""))
    assert float(browser.find_element(By.ID, "v-gen").text) == 0.0  # idle
    # an idle engine's map comes at once, all free or cached
    _wait(browser, lambda d: " 0 in use by 0 requests" in d.find_element(By.ID, "blockinfo").text)
    stop = threading.Event()
    threads = _load(server, stop)
    try:
        _wait(browser, lambda d: float(d.find_element(By.ID, "v-gen").text or 0) > 0)
        _wait(browser, lambda d: int(d.find_element(By.ID, "v-running").text or 0) > 0)
        _wait(browser, lambda d: "in use by" in d.find_element(By.ID, "blockinfo").text
              and not d.find_element(By.ID, "blockinfo").text.startswith("512 blocks × 8 tokens: 0 in use"))
        assert browser.find_element(By.ID, "v-ttft").text.endswith("ms")
        time.sleep(2)  # a few samples of history on the charts
        assert browser.execute_script("return panels.main.series.t.length") >= 4
        assert max(browser.execute_script("return panels.main.series.decode")) > 0
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    _wait(browser, lambda d: d.find_element(By.ID, "v-running").text == "0")
    _wait(browser, lambda d: float(d.find_element(By.ID, "v-gen").text) == 0.0)


def _text(browser, element_id: str) -> str:
    found = browser.find_elements(By.ID, element_id)
    return found[0].text if found else ""


@pytest.mark.slow
def test_dashboard_behind_a_front_end_has_a_panel_per_replica(model_dir, browser):
    import psutil

    args = [str(model_dir), *ENGINE_ARGS, "--served-model-name", "tiny", "--api-key", KEY,
            "--data-parallel-size", "2", "--distributed-backend", "mp"]
    with ServerProcess(args, startup_timeout=600) as front:
        replicas = httpx.get(front.url("/health"), timeout=10).json()["replicas"]
        _open(browser, front, "/dashboard")
        _wait(browser, lambda d: d.find_element(By.ID, "status").text == "live")
        for i in (0, 1):
            _wait(browser, lambda d, i=i: _text(d, f"r{i}-v-gen") not in ("–", ""))
            assert _text(browser, f"r{i}-name") == f"Replica {i}" and _text(browser, f"r{i}-state") == "live"
            _wait(browser, lambda d, i=i: "512 blocks × 8 tokens: 0 in use" in _text(d, f"r{i}-blockinfo"))
        assert not browser.find_elements(By.ID, "v-gen"), "no panel of the front end's own"
        # load on replica 1 alone (straight to its port): only its panel moves
        stop = threading.Event()
        threads = _load(front, stop, concurrency=3, url=replicas[1]["url"] + "/v1/completions")
        try:
            _wait(browser, lambda d: int(_text(d, "r1-v-running") or 0) > 0 and float(_text(d, "r1-v-gen") or 0) > 0)
            assert browser.execute_script("return Math.max(...panels[0].series.running)") == 0
            assert float(_text(browser, "r0-v-gen")) == 0.0
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        # a replica that dies is shown as down; the other's panel stays live
        pid = next(p.pid for p in psutil.Process(front.proc.pid).children(recursive=True)
                   if any(c.laddr.port == int(replicas[0]["url"].rsplit(":", 1)[1]) and c.status == psutil.CONN_LISTEN
                          for c in p.net_connections("tcp")))
        psutil.Process(pid).kill()
        _wait(browser, lambda d: _text(d, "r0-state").startswith("down"))
        seen = browser.execute_script("return panels[1].series.t.length")
        _wait(browser, lambda d: d.execute_script("return panels[1].series.t.length") > seen + 2)
        assert _text(browser, "r1-state") == "live" and _text(browser, "status") == "live"
