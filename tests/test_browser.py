"""The course in JupyterLab, in a real browser: a chapter's slider and an exercise cell.

JupyterLab runs on a free loopback port with a token; Debian's ``chromium`` (headless, driven by
Selenium through ``chromedriver``: no browser is downloaded) opens a notebook made of chapter 03's
real slider cell, with the heavy cells before it replaced by the results its saved notebook
recorded, and chapter 02's ``sink_visible`` exercise cell with the worked solution pasted in. It
runs all cells from the UI (JupyterLab's own command), waits for the kernel to go idle and checks
what a learner sees: no cell shows an error, the page logs no error, the slider renders (not
"Error displaying widget") and moving it changes its output, and the exercise prints its pass.
Screenshots of each step go to the test's temporary folder; their paths are printed on failure.

Without chromium, chromedriver or selenium the test is skipped with the reason, except where
``MINISPARSE_BROWSER_TEST=required`` (CI sets it, after installing them), where it fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
REQUIRED = os.environ.get("MINISPARSE_BROWSER_TEST") == "required"


def _missing() -> str | None:
    for tool in ("chromium", "chromedriver"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    return None


def _cell(path: Path, marker: str) -> str:
    """The source of the first code cell of ``path`` that contains ``marker``."""
    for cell in nbformat.read(path, 4).cells:
        if cell.cell_type == "code" and marker in cell.source:
            return cell
    raise AssertionError(f"No cell of {path.name} contains {marker!r}")


def _recorded_curve() -> str:
    """Chapter 03's measured sparsity curve, read from the table its saved slider cell printed."""
    cell = _cell(NOTEBOOKS / "03_activation_sparsity.ipynb", "widgets.interact(")
    text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
    rows = re.findall(r"^\s*(\d+)%\s+([\d.]+)%\s+([\d.]+)\s+([+-][\d.]+)%", text, re.M)
    assert len(rows) >= 2, f"chapter 03's slider cell printed no table:\n{text}"
    curve = {int(t) / 100: (float(p), float(m) / 100) for t, m, p, _ in rows}
    dense = float(rows[0][2]) / (1 + float(rows[0][3]) / 100)
    return f"curve = {curve!r}\ndense = {{'ppl': {dense!r}}}\n"


def _exercise_with_solution() -> str:
    """Chapter 02's sink_visible cell with the worked solution pasted over the stub."""
    stub = _cell(NOTEBOOKS / "02_kv_cache.ipynb", "def my_sink_visible(").source
    after = stub[stub.index("sink_visible = use(") :]
    solution = (NOTEBOOKS / "solutions" / "sink_visible.py").read_text()
    solution = solution.replace("def sink_visible(", "def my_sink_visible(")
    return f"from minisparse.course import use\n\n{solution}\n\n{after}"


def _notebook(folder: Path) -> Path:
    slider = _cell(NOTEBOOKS / "03_activation_sparsity.ipynb", "widgets.interact(").source
    cells = [
        nbformat.v4.new_markdown_cell(
            "Chapter 03's slider on its recorded results; chapter 02's exercise."
        ),
        nbformat.v4.new_code_cell(_recorded_curve()),
        nbformat.v4.new_code_cell(slider),
        nbformat.v4.new_code_cell(_exercise_with_solution()),
    ]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    path = folder / "lab_check.ipynb"
    nbformat.write(nb, path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, check, seconds: float, shots: list[Path]):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(
        f"timed out after {seconds:.0f} s waiting for {what}; screenshots: {shots}"
    )


CELLS_JS = """const w = window.jupyterapp.shell.currentWidget; const cells = w.content.model.cells;
const out = []; for (let i = 0; i < cells.length; i++) { const c = cells.get(i);
  if (c.type !== 'code') continue; const o = [];
  for (let j = 0; j < c.outputs.length; j++) o.push(c.outputs.get(j).toJSON());
  out.push({count: c.executionCount, outputs: o}); }
return [w.sessionContext.session.kernel.status, out];"""


@pytest.mark.browser
def test_a_chapter_runs_in_jupyterlab_its_slider_moves_and_an_exercise_passes(tmp_path):
    reason = _missing()
    if reason:
        if REQUIRED:
            pytest.fail(f"MINISPARSE_BROWSER_TEST=required but {reason}")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.keys import Keys

    notebook = _notebook(tmp_path)
    port, token = _free_port(), os.urandom(12).hex()
    env = {k: v for k, v in os.environ.items() if k != "MINISPARSE_SOLUTIONS"}  # the learner's view
    root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    lab = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", "--LabApp.expose_app_in_browser=True",
         f"--ServerApp.root_dir={tmp_path}", f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
         f"--LabApp.user_settings_dir={tmp_path / 'settings'}", *root],
        stdout=open(tmp_path / "lab.log", "w"), stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    shots: list[Path] = []
    options = Options()
    options.binary_location = shutil.which("chromium")
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = None
    try:

        def up() -> bool:
            try:
                urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/api/status?token={token}", timeout=1
                )
                return True
            except OSError:
                return lab.poll() is not None and pytest.fail((tmp_path / "lab.log").read_text())

        _wait("JupyterLab to start", up, 120, shots)
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)

        def shot(name: str) -> None:
            shots.append(tmp_path / f"{len(shots) + 1:02d}_{name}.png")
            driver.save_screenshot(str(shots[-1]))

        driver.get(f"http://127.0.0.1:{port}/lab/tree/{notebook.name}?token={token}")
        ready = (
            "const a = window.jupyterapp; const w = a && a.shell.currentWidget;"
            "const s = w && w.sessionContext && w.sessionContext.session;"
            "return !!(s && s.kernel && s.kernel.status === 'idle');"
        )
        _wait("the notebook and its kernel", lambda: driver.execute_script(ready), 120, shots)
        shot("opened")
        driver.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells')")

        def finished():
            status, cells = driver.execute_script(CELLS_JS)
            return status == "idle" and all(c["count"] is not None for c in cells) and cells

        cells = _wait("every cell to run", finished, 300, shots)
        shot("ran_all")
        errors = [o for c in cells for o in c["outputs"] if o["output_type"] == "error"]
        assert not errors, f"cells show errors: {errors}; screenshots: {shots}"
        page = driver.find_element("css selector", ".jp-NotebookPanel").text
        assert "Error displaying widget" not in page, f"screenshots: {shots}"

        handle = _wait(
            "the slider to render",
            lambda: driver.find_elements("css selector", ".widget-slider .noUi-handle"),
            60,
            shots,
        )[0]
        widget = driver.find_element("css selector", ".widget-interact")
        before = widget.text
        assert "target:" in before and "perplexity" in before, f"{before!r}; screenshots: {shots}"
        handle.click()
        handle.send_keys(Keys.ARROW_RIGHT)
        _wait("the slider's output to change", lambda: widget.text != before, 60, shots)
        shot("slider_moved")
        after = widget.text
        assert re.search(r"(\d+)% target", after).group(1) != re.search(
            r"(\d+)% target", before
        ).group(1)

        exercise = "".join(o.get("text", "") for o in cells[-1]["outputs"])
        assert "sink_visible: correct on 3 rounds" in exercise, (
            f"{exercise!r}; screenshots: {shots}"
        )
        assert "runs sink_visible (yours)" in exercise, exercise
        assert (
            "sink_visible: correct on 3 rounds"
            in driver.find_element("css selector", ".jp-NotebookPanel").text
        )

        logged = driver.get_log("browser")
        severe = [e for e in logged if e["level"] == "SEVERE"]
        assert not severe, f"the page logged errors: {severe}; screenshots: {shots}"
    finally:
        if driver is not None:
            driver.quit()
        lab.terminate()
        lab.wait(timeout=30)


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem)
def test_a_saved_notebook_reads_without_a_kernel(path):
    """On GitHub or nbviewer no kernel runs: every slider's cell also prints its table (text
    output beside the widget), and the saved widget state stays small."""
    nb = nbformat.read(path, 4)
    for cell in nb.cells:
        if cell.cell_type != "code" or "widgets.interact" not in cell.source:
            continue
        printed = "".join(
            o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream"
        )
        assert printed.count("\n") >= 3, (
            f"{path.name}: a slider cell prints no table:\n{cell.source}"
        )
    state = nb.metadata.get("widgets", {})
    assert len(json.dumps(state)) < 64_000, (
        f"{path.name}: widget state of {len(json.dumps(state))} bytes"
    )
