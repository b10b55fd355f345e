"""The status page in a real browser: Debian's headless Chromium, driven by Selenium through
its chromedriver, against a real ``twistd nixlproxy`` in front of fake vLLM instances.

Selenium's calls block, so each runs in a thread (``deferToThread``): the
reactor keeps serving the fakes the proxy checks. ``NIXLPROXY_STATUS_SCREENSHOT=1``
writes what the browser shows to ``docs/status-page.png`` (``docs/status-page.md``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest

from nixl_twisted.testing.process import listening_addresses
from tests.process.support import TwistdCase
from tests.support import CHAT

T = TypeVar("T")

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: As root on a closed network: no sandbox, no GPU, nothing that reaches out by itself.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,1500",
)
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "status-page.png"
SCREENSHOT_ENV = "NIXLPROXY_STATUS_SCREENSHOT"
SCRIPTED = "<script>alert('owned')</script>"
#: Each instance row as the page shows it now: (pool, URL, state), read at once.
ROWS = (
    "return Array.from(document.querySelectorAll('tr.instance'))"
    ".map(r => [r.dataset.pool, r.dataset.url, r.cells[2].textContent]).sort()"
)

#: The requests chart has points (two samples, a second apart, have been taken).
CHARTED = (
    "const f = document.querySelector('figure.chart');"
    "return f !== null && f.querySelector('li').textContent !== 'none'"
)


def chromium(profile: str) -> Any:
    """A headless Chromium with ``profile``, a new, empty directory, as its user data."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM  # (and the driver's path: Selenium Manager never runs)
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


def waited(driver: Any, condition: Callable[[Any], T], seconds: float = 20.0) -> T:
    """What ``condition`` returned once true, asked of the page as it changes (no reload)."""
    from selenium.webdriver.support.ui import WebDriverWait

    result: T = WebDriverWait(driver, seconds, poll_frequency=0.1).until(condition)
    return result


class StatusPageInBrowserTests(TwistdCase):
    timeout = 90

    def browser_or_skip(self) -> None:
        """Without chromium and chromedriver: skipped, or failed with CI set (``make chromium``)."""
        missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
        if missing:
            message = f"{', '.join(missing)} missing: `make chromium` installs them"
            if os.environ.get("CI"):
                self.fail(message)
            raise SkipTest(message)

    async def test_the_page_shows_the_backends_and_an_instance_going_down_without_a_reload(
        self,
    ) -> None:
        self.browser_or_skip()
        await self.start(decodes=2, tokens=4)
        self.decodes[1].model = SCRIPTED
        process = self.spawn(
            "--listen",
            "tcp:0:interface=127.0.0.1",
            "--admin-listen",
            "tcp:0:interface=127.0.0.1",
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decodes[0].url,
            "--decode",
            self.decodes[1].url,
            "--health-interval",
            "0.5",
            "--unhealthy-threshold",
            "1",
        )
        await process.said(b"nixlproxy listening on", times=2)
        client, admin = (f"http://{a}" for a in listening_addresses(process.output))

        profile = tempfile.mkdtemp(prefix="nixlproxy-chromium-")
        self.addCleanup(shutil.rmtree, profile, True)
        driver = await deferToThread(chromium, profile)
        self.addCleanup(lambda: deferToThread(driver.quit))
        await deferToThread(driver.get, admin + "/")

        # Every instance, up, in the page the server rendered (no script needed for it).
        up = sorted(
            [["prefill", self.prefill.url, "up"]]
            + [["decode", fake.url, "up"] for fake in self.decodes]
        )
        self.assertEqual(await deferToThread(driver.execute_script, ROWS), up)
        # The script refreshes it from /status.json: its policy let it run.
        await deferToThread(
            waited, driver, lambda d: d.find_element("id", "updated").text.startswith("updated")
        )
        await deferToThread(driver.execute_script, "window.notReloaded = true")
        for _ in range(3):  # (something for the charts to show)
            answer = await self.http.post(client + "/v1/chat/completions", json=CHAT)
            self.assertEqual(answer.code, 200)
            await answer.content()

        await self.decodes[1].stop()
        down = [row if row[1] != self.decodes[1].url else [*row[:2], "down"] for row in up]
        rows = await deferToThread(
            waited, driver, lambda d: (d.execute_script(ROWS) == down) and d.execute_script(ROWS)
        )
        self.assertEqual(rows, down)
        self.assertTrue(await deferToThread(driver.execute_script, "return window.notReloaded"))
        lines = await deferToThread(
            waited,
            driver,
            lambda d: [li.text for li in d.find_elements("css selector", "#warning-lines li")],
        )
        self.assertIn(f"decode instance {self.decodes[1].url} marked down", lines[0])

        # The model named with markup is text: a heading that says it, and no script of its.
        titles = await deferToThread(
            driver.execute_script,
            "return Array.from(document.querySelectorAll('section.model h3'))"
            ".map(h => h.textContent)",
        )
        self.assertIn(SCRIPTED, titles)
        scripts = await deferToThread(
            driver.execute_script, "return document.querySelectorAll('script').length"
        )
        self.assertEqual(scripts, 1)  # (status.js alone)
        logged = await deferToThread(driver.get_log, "browser")
        self.assertEqual([e for e in logged if e["level"] == "SEVERE"], [])

        if os.environ.get(SCREENSHOT_ENV):
            await deferToThread(waited, driver, lambda d: d.execute_script(CHARTED))
            await deferToThread(driver.save_screenshot, str(SCREENSHOT))
        # On a narrow screen nothing runs off the side: wide tables scroll in their section.
        await deferToThread(driver.set_window_size, 380, 900)
        width = await deferToThread(
            driver.execute_script,
            "return [document.documentElement.scrollWidth, window.innerWidth]",
        )
        self.assertLessEqual(width[0], width[1])
        await self.terminate(process)
