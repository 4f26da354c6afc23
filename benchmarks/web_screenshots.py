"""Screenshots of the playground mid-stream and of the dashboard under the W2 load, for the README.

    .venv/bin/python benchmarks/web_screenshots.py            # writes docs/images/playground.png, dashboard.png

One `kvserve serve` on the default model (the W2 settings of compare_engines.py), headless Chromium
(tests/e2e/browser.py) at 1400x900.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from benchmarks.compare_engines import WORKLOADS, bench_serve, kvserve_server, stop, wait_healthy  # noqa: E402
from kvserve.bench.launch import free_port  # noqa: E402
from tests.e2e.browser import chrome  # noqa: E402

PROMPT = "Write a short Python function that checks whether a number is prime, then explain it in two sentences."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    p.add_argument("--load-seconds", type=float, default=15.0, help="W2 running before the dashboard shot")
    p.add_argument("--kvserve-args", type=str.split, default=[])
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    server = kvserve_server(args, WORKLOADS["W2"], free_port())
    proc = subprocess.Popen(server.cmd, env={**os.environ, **server.env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{server.port}"
    driver = None
    try:
        wait_healthy(server, proc)
        driver = chrome()
        wait = WebDriverWait(driver, 120, poll_frequency=0.05)
        driver.get(base + "/")
        wait.until(lambda d: d.find_element(By.ID, "model").get_attribute("value"))
        driver.execute_script("document.getElementById('system').value = 'You are a concise assistant.';"
                              "document.getElementById('temperature').value = '0.3';")
        driver.find_element(By.ID, "prompt").send_keys(PROMPT)
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: len(d.find_element(By.CSS_SELECTOR, ".msg.assistant .content").text) > 250)
        driver.save_screenshot(str(args.out / "playground.png"))
        wait.until(lambda d: "done" in d.find_element(By.CSS_SELECTOR, ".msg.assistant").get_attribute("class"))

        driver.get(base + "/dashboard")
        wait.until(lambda d: d.find_element(By.ID, "status").text == "live")
        time.sleep(3)  # an idle stretch before the load, as a baseline on the charts
        load = threading.Thread(target=bench_serve, args=(server, WORKLOADS["W2"], 49152, []), daemon=True)
        load.start()
        WebDriverWait(driver, 300, poll_frequency=0.2).until(
            lambda d: int(d.find_element(By.ID, "v-running").text or 0) >= 32)
        time.sleep(args.load_seconds)
        driver.save_screenshot(str(args.out / "dashboard.png"))
        load.join()
    finally:
        if driver is not None:
            driver.quit()
        stop(proc)
    print(f"wrote {args.out / 'playground.png'} and {args.out / 'dashboard.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
