"""A real browser (headless Chromium) force-releases, from the demo's admin, a lock another process holds.

Screenshots are saved under ``test-artifacts/`` (git-ignored).
"""

import json
import os
import time
import uuid

import pytest
from django.contrib.auth.models import User

from distlock.handler import locks
from tests.metrics_workers import spawn as spawn_metrics_worker
from tests.workers import ROOT, read_events, spawn

pytestmark = pytest.mark.django_db(transaction=True)

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = ROOT / "test-artifacts"
#: The demo project's own backend: the embedded database backend on the default database.
ALIAS = "default"


@pytest.fixture
def browser(tmp_path):
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("needs the Debian packages chromium and chromium-driver (`make test` installs them)")
    from selenium import webdriver  # noqa: PLC0415 - only this module needs Selenium
    from selenium.webdriver.chrome.service import Service  # noqa: PLC0415

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-quic", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1400,1800"):
        options.add_argument(flag)
    # The system's chromedriver, named explicitly: Selenium Manager must not download anything.
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.implicitly_wait(10)
    yield driver
    driver.quit()


def screenshot(driver, name):
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    # The whole content, not only the window: size the window to where the content ends first.
    height = driver.execute_script(
        "return document.getElementById('content').getBoundingClientRect().bottom + window.scrollY + 40"
        " + window.outerHeight - window.innerHeight")
    driver.set_window_size(1400, max(int(height), 700))
    driver.save_screenshot(str(path))
    return path


def test_force_release_from_the_admin_in_a_real_browser(browser, live_server):
    from selenium.webdriver.common.by import By  # noqa: PLC0415

    lock_name = f"nightly-report:{uuid.uuid4().hex[:8]}"
    User.objects.create_superuser("ops", "ops@example.com", "correct horse battery")
    # Traffic from other processes contending for one lock, so the metrics have figures to show: with a
    # 2 s TTL, waiting for the other processes' 25 turns takes more than half of it (an alert).
    start_at = time.monotonic() + 3  # after the children's start-up, so they overlap
    contenders = [spawn_metrics_worker("contend", alias=ALIAS, name="invoice:42", count=25, hold_ms=40,
                                       start_at=start_at, ttl=2) for _ in range(3)]
    holder = spawn("hold", alias=ALIAS, name=lock_name, ttl=300)
    try:
        # The browser logs in while the other processes start and contend.
        browser.get(f"{live_server.url}/admin/login/?next=/admin/")
        browser.find_element(By.NAME, "username").send_keys("ops")
        browser.find_element(By.NAME, "password").send_keys("correct horse battery")
        browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        browser.find_element(By.LINK_TEXT, "Held locks")
        for child in contenders:
            read_events(child)  # done, and their counts flushed at exit: the page shows them
        held = json.loads(holder.stdout.readline())
        browser.find_element(By.LINK_TEXT, "Held locks").click()

        row = browser.find_element(By.CSS_SELECTOR, f'tr.distlock-lock[data-alias="{ALIAS}"][data-name="{lock_name}"]')
        assert f"pid {held['pid']}" in row.text, "the row names the other process as the holder"
        assert str(held["token"]) in row.text
        screenshot(browser, "held-locks")

        row.find_element(By.CSS_SELECTOR, "button.force-release").click()  # a POST form: no owner id in a URL
        assert held["owner"] in browser.find_element(By.ID, "force-release-lock").text
        screenshot(browser, "force-release-confirmation")
        browser.find_element(By.ID, "confirm-force-release").click()

        message = browser.find_element(By.CSS_SELECTOR, "ul.messagelist li.success").text
        assert f"Released lock '{lock_name}'" in message
        # The page after the release is loaded (its message is there): look at it as it is, rather than wait
        # out the implicit wait for a row that must not come.
        browser.implicitly_wait(0)
        assert not browser.find_elements(By.CSS_SELECTOR, f'tr.distlock-lock[data-name="{lock_name}"]')
        browser.implicitly_wait(10)
        screenshot(browser, "held-locks-after-release")
        assert lock_name not in {info.name for info in locks[ALIAS].held_locks()}
        assert holder.poll() is None, "the holder process is still running; it learns at its next renewal"
    finally:
        for child in [*contenders, holder]:
            if child.poll() is None:
                child.kill()
            child.communicate()

