"""The operators' pages seen in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
driven by selenium) opens a validator's and a miner's live dashboard during one short local network, then the
network's ``report.html``, at 1280 px, and saves a screenshot of each.

One ``python -m template.localnet --dashboard`` run (2 miners — the second a ``module:Class`` behaviour, so that long
names are shown — and 3 rounds: the validator's dashboard must be seen between its first scored round and the end of
the run) serves every neuron's dashboard on 127.0.0.1. The test checks what a person would look at: the per-UID
table lists every miner with a score, the plots have data points, the miner's publications show who fetched them,
the page loaded nothing but itself and its ``/api/state`` and logged no error (a Content-Security-Policy violation
would be one); the report's tables fit a 1280 px window, with hotkeys shortened and complete on hover. Chromium
starts with a fresh profile and every background service off (this machine has no network).

Run with ``make test-browser`` (it installs Chromium from the system packages when missing); ``make test`` leaves
these tests out (``-m "not browser"`` in pytest.ini). Screenshots land in the test's tmp directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

from tests.e2e.test_localnet import assert_nothing_left

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,1500")
LONG_BEHAVIOUR = "template.base.behaviours:Honest"  # honest, under a plug-in's long module:Class name
ADDRESS = re.compile(r"dashboard of (\w+): (http://127\.0\.0\.1:\d+/)")


def chromium(profile: Path) -> webdriver.Chrome:
    """Headless Chromium with a fresh profile, driven through Debian's chromedriver (nothing is downloaded)."""
    assert CHROMIUM.exists() and CHROMEDRIVER.exists(), "run `make test-browser`: it installs chromium"
    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(30)
    return driver


def wait_for(driver: webdriver.Chrome, script: str, timeout: float, what: str):
    """Poll ``script`` (JavaScript returning a value) until it returns something true; that value."""
    return WebDriverWait(driver, timeout, poll_frequency=0.5).until(lambda d: d.execute_script(script),
                                                                    f"timed out waiting for {what}")


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())


def wait_until(predicate, timeout: float, what: str, process: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the local network ended early:\n{log.read_text()[-4000:]}"
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")


def answers(url: str) -> bool:
    try:
        return get_json(url + "api/state")["neuron"]["uid"] is not None  # up, and the neuron said who it is
    except OSError:
        return False


def page_health(driver: webdriver.Chrome, origin: str) -> None:
    """Nothing but this neuron was asked for, and the console holds no error."""
    resources = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(name.startswith(origin) for name in resources), resources
    errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors


def plot_points(driver: webdriver.Chrome, figure: str) -> int:
    return int(driver.execute_script(f"return document.querySelector('#{figure} svg').dataset.points || 0"))


def screenshot(driver: webdriver.Chrome, path: Path) -> None:
    assert driver.save_screenshot(str(path)) and path.read_bytes()[:4] == b"\x89PNG"


VALIDATOR_TABLE = """
const rows = [...document.querySelectorAll('#miners tbody tr')].map(row => {
  const cell = key => (row.querySelector(`td[data-key="${key}"]`) || {}).textContent;
  return {uid: cell('uid'), score: cell('score'), hotkey: cell('hotkey')};
});
return rows.length && rows.every(r => /^[0-9.e+-]+$/.test(r.score || '')) ? rows : null;
"""


@pytest.mark.timeout(900)
def test_dashboards_and_report_in_chromium(tmp_path):
    out, log = tmp_path / "run", tmp_path / "localnet.log"
    command = [sys.executable, "-m", "template.localnet", "--out", str(out), "--miners", "2", "--rounds", "3",
               "--miner-behaviours", f"honest,{LONG_BEHAVIOUR}", "--dashboard", "--timeout", "700"]
    network = subprocess.Popen(command, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    driver = None
    try:
        driver = chromium(tmp_path / "chromium-profile")  # starts while the network does
        found = wait_until(lambda: dict(ADDRESS.findall(log.read_text())) if log.read_text().count("dashboard of ") == 3
                           else None, 120, "the dashboard addresses printed at start", network, log)
        assert set(found) == {"validator", "miner1", "miner2"} and len(set(found.values())) == 3
        validator, miner = found["validator"], found["miner1"]
        wait_until(lambda: answers(miner) and answers(validator), 180, "the dashboards", network, log)

        driver.get(miner)
        wait_for(driver, "return document.querySelectorAll('#rounds tbody tr').length > 0 && "
                         "document.querySelectorAll('#publications tbody tr').length > 0", 240,
                 "the miner's first round and publication")
        assert plot_points(driver, "plot-loss") > 0 and plot_points(driver, "plot-rounds") > 0
        assert driver.execute_script("return document.getElementById('title').textContent") == "miner uid 1"
        page_health(driver, miner.rstrip("/"))

        driver.get(validator)
        rows = wait_for(driver, VALIDATOR_TABLE, 240, "the validator's first scored round")
        assert sorted(row["uid"] for row in rows) == ["1", "2"]  # every miner, each with a score
        wait_for(driver, "return ['plot-weights', 'plot-ema', 'plot-heldout', 'plot-scoring'].every(id => "
                         "Number(document.querySelector(`#${id} svg`).dataset.points) > 0)", 120,
                 "data in every plot of the validator")
        state = get_json(validator + "api/state")  # the same data, for scripts
        assert {row["uid"] for row in state["miners"]} == {1, 2} and state["weights"]
        hotkeys = {row["uid"]: row["hotkey"] for row in state["miners"]}
        titles = driver.execute_script("return [...document.querySelectorAll('#miners td[data-key=hotkey]')]"
                                       ".map(td => td.title)")
        assert sorted(titles) == sorted(hotkeys.values())  # shortened in the cell, whole on hover
        page_health(driver, validator.rstrip("/"))
        screenshot(driver, tmp_path / "validator_dashboard.png")

        driver.get(miner)  # by now the validator has fetched the miner's publication
        fetcher = get_json(validator + "api/state")["neuron"]["hotkey"]
        wait_for(driver, "return [...document.querySelectorAll('#publications td[data-key=fetched_by]')]"
                         f".some(td => td.title.includes('{fetcher}'))", 60, "the validator among the fetchers")
        screenshot(driver, tmp_path / "miner_dashboard.png")

        assert network.wait(timeout=600) == 0, log.read_text()[-4000:]
        report = json.loads((out / "report.json").read_text())
        assert report["passed"] and set(report["run"]["dashboards"]) == {"validator", "miner1", "miner2"}
        driver.set_window_size(1280, 1100)
        driver.get((out / "report.html").as_uri())
        layout = driver.execute_script("""
            const tables = [...document.querySelectorAll('table')];
            return {width: window.innerWidth, scroll: document.documentElement.scrollWidth,
                    right: Math.max(...tables.map(t => t.getBoundingClientRect().right)),
                    images: [...document.images].map(i => i.complete && i.naturalWidth > 0),
                    titles: [...document.querySelectorAll('td[title]')].map(td => [td.textContent, td.title])};
        """)
        assert layout["width"] <= 1280 and layout["scroll"] <= layout["width"] and layout["right"] <= layout["width"]
        assert layout["images"] == [True, True]
        shortened = dict((title, text) for text, title in layout["titles"])
        for row in report["neurons"]:
            assert shortened[row["hotkey"]] != row["hotkey"] and "…" in shortened[row["hotkey"]]
        assert shortened[LONG_BEHAVIOUR] != LONG_BEHAVIOUR
        screenshot(driver, tmp_path / "report.png")
    finally:
        if driver is not None:
            driver.quit()
        if network.poll() is None:
            os.killpg(network.pid, signal.SIGINT)  # the local network stops every neuron it started
            network.wait(timeout=120)
    assert_nothing_left(out)
    if os.environ.get("SCREENSHOTS_DIR"):  # to refresh docs/screenshots/ by hand
        for name in ("validator_dashboard.png", "miner_dashboard.png", "report.png"):
            shutil.copy(tmp_path / name, Path(os.environ["SCREENSHOTS_DIR"]) / name)
