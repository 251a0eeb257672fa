"""The built site in a real browser (headless Chromium from Debian's packages, driven by
Selenium): the home page, a guide and the CLI reference render; a navigation link leads to its
page; a search for a variable name finds the page that documents it."""
from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from .docs_blocks import REPO

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The site, built and served on loopback (the search index is fetched: file:// will not do)."""
    if not (CHROMIUM and DRIVER):
        pytest.skip("no chromium + chromedriver (scripts/bootstrap installs them as root)")
    pytest.importorskip("selenium", reason="selenium comes with the docs extra")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(out)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture(scope="module")
def browser(site: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=str(DRIVER)), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _h1(driver: object) -> str:
    from selenium.webdriver.common.by import By
    return driver.find_element(By.CSS_SELECTOR, "article h1").text  # type: ignore[attr-defined]


def test_home_guide_and_cli_reference_render(site: str, browser: object) -> None:
    from selenium.webdriver.common.by import By
    d = browser
    d.get(site + "/")  # type: ignore[attr-defined]
    assert "hpcckpt" in d.title and _h1(d) == "hpcckpt"  # type: ignore[attr-defined]
    assert d.find_elements(By.CSS_SELECTOR, "article table")  # type: ignore[attr-defined]  # the three ways in
    d.get(site + "/guides/slurm/")  # type: ignore[attr-defined]
    assert _h1(d).startswith("Slurm: templates, signals and requeue")
    assert "scancel" in d.find_element(By.CSS_SELECTOR, "article").text  # type: ignore[attr-defined]
    d.get(site + "/reference/cli/")  # type: ignore[attr-defined]
    assert _h1(d) == "Command line"
    headings = [h.text for h in d.find_elements(By.CSS_SELECTOR, "article h2")]  # type: ignore[attr-defined]
    assert "hpcckpt history" in headings and "hpcckpt run" in headings, headings


def test_a_navigation_link_leads_to_its_page(site: str, browser: object) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait
    d = browser
    d.get(site + "/")  # type: ignore[attr-defined]
    link = d.find_element(By.CSS_SELECTOR, "nav.md-nav--primary a.md-nav__link[href$='getting-started/']")  # type: ignore[attr-defined]
    d.execute_script("arguments[0].click();", link)  # type: ignore[attr-defined]  # hidden in a narrow layout
    WebDriverWait(d, 20).until(ec.url_contains("/getting-started/"))
    assert _h1(d) == "Getting started"


def test_a_search_for_a_variable_finds_its_page(site: str, browser: object) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait
    d = browser
    d.get(site + "/")  # type: ignore[attr-defined]
    box = WebDriverWait(d, 20).until(ec.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input")))
    box.click()
    box.send_keys("HPCCKPT_POLL_S")
    hits = WebDriverWait(d, 30).until(ec.presence_of_all_elements_located(
        (By.CSS_SELECTOR, ".md-search-result__item a.md-search-result__link")))
    targets = [h.get_attribute("href") for h in hits]
    assert any("/reference/options/" in t for t in targets), targets
    d.get(next(t for t in targets if "/reference/options/" in t))  # type: ignore[attr-defined]
    assert _h1(d).startswith("Options and") and "HPCCKPT_POLL_S" in d.find_element(By.CSS_SELECTOR, "article").text  # type: ignore[attr-defined]
