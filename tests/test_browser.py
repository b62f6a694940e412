"""Open lesson 09 in JupyterLab in headless Chromium, run every cell, and use its widgets."""

import os
import pathlib
import shutil
import time

import nbformat
import pytest

from browser_helpers import CHROMIUM_ARGS, find_chromium, jupyter_lab, wait_for_connected_kernel

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]

LESSON = pathlib.Path(__file__).resolve().parents[1] / "lessons" / "09_cost_model.ipynb"
# Appended to the lesson so one page holds both widgets (lesson 04 shows the stepper too).
STEPPER_CELL = ("from dpcourse.widgets import RingStepper\n"
                "stepper = RingStepper(world_size=4)\n"
                "stepper")
SCREENSHOT_DIR = os.environ.get("DPCOURSE_SCREENSHOT_DIR")


def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    return sync_playwright


READY_JS = """() => {
    const text = document.querySelector('.jp-Notebook').innerText;
    if (text.includes('Error displaying widget')) return 'lost';
    const images = [...document.querySelectorAll('.jp-OutputArea-output img')]
        .filter(i => i.complete && i.naturalWidth > 100);
    return document.querySelector('.ring-frame') && document.querySelector('.costmodel-summary')
        && images.length >= 2 ? 'ok' : null;
}"""


def _menu(page, menu, command):
    for dialog in page.query_selector_all(".jp-Dialog .jp-mod-accept"):
        dialog.click()  # e.g. "Select Kernel": keep the preselected Python 3
    page.click(f".lm-MenuBar-item:has-text('{menu}')")
    page.click(f".lm-Menu-item[data-command='{command}']")


def run_all_cells(page, url, token, attempts=3):
    """Run every cell from the Run menu until the widgets and plots show.

    Widget messages sent while the page is still (re)connecting to a new kernel
    can be lost ("model not found"); running the cells again then fixes it.
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    wait_for_connected_kernel(url, token)
    for attempt in range(attempts):
        if attempt:
            _menu(page, "Edit", "editmenu:clear-all")
        _menu(page, "Run", "runmenu:run-all")
        try:
            # The lesson measures on 2 ranks before its plots and widgets appear.
            if page.wait_for_function(READY_JS, timeout=180_000).json_value() == "ok":
                return attempt + 1
        except PlaywrightTimeout:
            pass
    raise AssertionError(f"the widgets did not render after running the notebook {attempts} times")


def test_widgets_render_and_respond_in_jupyterlab(tmp_path):
    chromium, sync_playwright = find_chromium(), _playwright()
    if chromium is None or sync_playwright is None:
        pytest.skip("needs Chromium (apt-get install chromium) and Playwright for Python "
                    f"(pip install playwright); found chromium={chromium}, "
                    f"playwright={'yes' if sync_playwright else 'no'}")
    # The lesson as a learner opens it: committed outputs cleared, so everything on the
    # page comes from running it here.
    nb = nbformat.read(LESSON, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.cells.append(nbformat.v4.new_code_cell(STEPPER_CELL))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, tmp_path / LESSON.name)
    shot = tmp_path / "jupyterlab_widgets.png"
    t0 = time.monotonic()
    with jupyter_lab(str(tmp_path)) as (url, token), sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=chromium, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1800})
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(f"{url}/lab/tree/{LESSON.name}?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell")
            tries = run_all_cells(page, url, token)

            frame = page.wait_for_selector(".ring-frame[data-phase='start']")
            before = frame.inner_text()
            assert "rank 3" in before
            page.click("button:has-text('next')")
            page.wait_for_selector(".ring-frame[data-phase='reduce_scatter'][data-step='0']")
            after = page.inner_text(".ring-frame")
            assert after != before and "Reduce-scatter step 1" in after

            # The simulator updates live: dragging the ranks slider one notch changes the numbers.
            summary = page.wait_for_selector(".costmodel-summary").inner_text()
            plot_src = page.get_attribute("img.widget-image", "src")
            ranks = ".widget-slider:has(.widget-label:has-text('ranks'))"
            page.locator(f"{ranks} .noUi-handle").nth(0).focus()  # nth(1): the stepper's slider
            page.keyboard.press("ArrowRight")
            page.wait_for_function(
                "old => document.querySelector('.costmodel-summary').innerText !== old", arg=summary)
            assert "16" in page.locator(ranks).nth(0).inner_text()
            # Plots: the simulator's PNG widget and the inline matplotlib figure both loaded
            # (READY_JS checked); the simulator's plot is redrawn for the new ranks value.
            page.wait_for_function(
                "old => document.querySelector('img.widget-image').src !== old", arg=plot_src)
            page.screenshot(path=str(shot), full_page=True)
        except Exception:
            page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
            dialogs = [d.inner_text() for d in page.query_selector_all(".jp-Dialog")]
            print(f"\nscreenshot at failure: {tmp_path / 'failure.png'}; dialogs: {dialogs}")
            raise
        finally:
            browser.close()
    print(f"\nbrowser test: {time.monotonic() - t0:.1f} s, notebook run {tries}x; "
          f"screenshot: {shot}")
    if SCREENSHOT_DIR:
        os.makedirs(SCREENSHOT_DIR, exist_ok=True)
        print("copied to", shutil.copy(shot, SCREENSHOT_DIR))
