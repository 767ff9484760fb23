"""What a person sees in MLflow's UI, read from a real browser: Debian's Chromium, headless, driven by
Playwright. The browser test (tests/ui/test_mlflow_browser.py) asserts on it, and
scripts/mlflow_ui_screenshot.py takes the screenshots of docs/mlflow.md through the same functions.

    missing() -> why the browser cannot run here, or None
    chromium() -> a Playwright Browser (context manager); first_visit(browser) -> a Page, storage empty
    serve(command) -> the base URL of the printed `mlflow ui` command, run on a free port (context manager)
    where_printed(stdout) -> the `mlflow ui` command and the links a klbench run or sweep printed

The page functions take a Playwright Page and return what shows: view() the sidebar and breadcrumb that
tell the Model training view from GenAI's, run_names() the runs table's names as far as they are not cut,
frontier_figure() the parent run's interactive figure, compare_params() the compare view's parameters.

Playwright's own browser download is never used: executable_path is Debian's package.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
# no network beyond 127.0.0.1, no first-run or sync machinery, no GPU in a container
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1400, "height": 900}
TIMEOUT_MS = 90_000  # a page's first load on a busy 2-core machine


def missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[test]')"
    if not os.access(CHROMIUM, os.X_OK):
        return f"no Chromium at {CHROMIUM} (apt-get install -y chromium; .ci/install_servers.sh does)"
    return None


@contextlib.contextmanager
def chromium():
    """The browser; Playwright gives it a fresh temporary profile (--user-data-dir) of its own."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def first_visit(browser):
    """A page in a context of its own, its storage empty: what a first visit shows (MLflow keeps a
    person's view choices in the browser's storage)."""
    page = browser.new_context(viewport=VIEWPORT).new_page()
    page.set_default_timeout(TIMEOUT_MS)
    return page


# ---- the record side: what klbench printed, and the UI it names ----

def where_printed(stdout: str) -> dict:
    """{"command": argv of the printed `mlflow ui ...`, "links": every `open`/`then open` URL}, from the
    `klbench: <label>  <value>` lines a run or a sweep ends with."""
    values = [m[1] for m in re.finditer(r"^klbench: (?:[\w .]+?)?\s{2,}(.*)$", stdout, re.M)]
    commands = [shlex.split(v) for v in values if v.startswith("mlflow ui ")]
    links = [re.sub(r"^(then )?open ", "", v) for v in values if v.startswith(("then open ", "open "))]
    return {"command": commands[-1] if commands else None, "links": links}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(command: list[str], log: Path, wait_s: float = 180):
    """Runs the printed `mlflow ui` command on a free port (and one worker, for a small machine); yields
    its base URL once it answers, and stops it."""
    argv = list(command)
    if "--port" in argv:
        del argv[argv.index("--port"):argv.index("--port") + 2]
    port = free_port()
    argv = [os.path.join(os.path.dirname(sys.executable), "mlflow"), *argv[1:], "--host", "127.0.0.1",
            "--port", str(port), "--workers", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + wait_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"`{shlex.join(argv)}` exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"`{shlex.join(argv)}` did not answer in {wait_s:.0f} s: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield base
    finally:
        # the command's own process group (start_new_session): `mlflow ui` and the server it starts
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)  # uvicorn would wait for the browser's open connections
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def local(link: str, base: str) -> str:
    """A printed link (http://127.0.0.1:<port>/#/...) on the UI at `base`."""
    return re.sub(r"^https?://[^/]+", base, link)


# ---- the pages ----

def view(page) -> dict:
    """What tells the views apart (MLflow 3.17.2): the sidebar's entries under the GenAI / Model training
    switch (Model training: Runs, Models, Traces; GenAI: Overview, ..., Evaluation runs), the breadcrumb
    (a run under GenAI sits under "Evaluations"), and what the page says."""
    page.locator("aside").first.wait_for()
    page.wait_for_function("document.querySelector('aside') && document.querySelector('aside').innerText"
                           ".split('\\n').length > 6")  # the experiment's entries, not just the switch
    crumbs = page.evaluate("""[...document.querySelectorAll('nav[aria-label=breadcrumb] li, ol li')]
                              .map(e => e.innerText.trim()).filter(Boolean)""")
    return {"sidebar": [s.strip() for s in page.inner_text("aside").split("\n") if s.strip()],
            "breadcrumb": crumbs, "text": page.inner_text("body")}


GENAI_WORDS = ("Evaluation runs", "Evaluations", "Detect Issues", "Sessions", "Judges")


def genai_words(v: dict) -> list[str]:
    """The GenAI view's words on a page (its sidebar entries, its run breadcrumb, its traces pop-up)."""
    shown = set(v["sidebar"]) | set(v["breadcrumb"])
    return [w for w in GENAI_WORDS if w in shown or (w == "Detect Issues" and w in v["text"])]


def open_run(page, url: str) -> None:
    page.goto(url)
    page.get_by_text("Child runs", exact=True).or_(page.get_by_text("Run ID", exact=True)).first.wait_for()
    page.get_by_text("Child runs loading").wait_for(state="hidden")  # the children's names, once fetched


def to_runs_table(page) -> None:
    """From a run's page to its experiment's runs, as a person would: the breadcrumb's "Runs"."""
    page.locator("a", has_text=re.compile(r"^Runs$")).first.click()
    page.get_by_text("matching runs").wait_for()


# the characters of an element's text that show: up to the first ancestor that clips it, less the ellipsis
VISIBLE_TEXT = """(el) => {
  let right = Infinity;
  for (let e = el; e && e !== document.body; e = e.parentElement) {
    const s = getComputedStyle(e);
    if (s.overflowX !== 'visible') right = Math.min(right, e.getBoundingClientRect().right - parseFloat(s.paddingRight));
  }
  const chars = [], range = document.createRange();
  const walk = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
  for (let n; (n = walk.nextNode());)
    for (let i = 0; i < n.length; i++) {
      range.setStart(n, i); range.setEnd(n, i + 1);
      chars.push([n.data[i], range.getBoundingClientRect().right]);
    }
  if (chars.every(([, r]) => r <= right + 0.5)) return chars.map(([c]) => c).join('');
  const ellipsis = 12;  // the '…' drawn over the last characters that would fit
  return chars.filter(([, r]) => r <= right - ellipsis).map(([c]) => c).join('');
}"""
# the + left of a collapsed parent run's name (the button stays, drawing a -, once the parent is expanded)
EXPANDER = ("button[data-component-id$='runnamecellrenderer.tsx_46']:has(path[d^='M7.25 7.25V4.5'])")
NAMES = "[role=gridcell] a[href*='/runs/']"


def run_names(page) -> list[tuple[str, str]]:
    """(name, the part of it the runs table shows) for every row, parents expanded."""
    page.locator(NAMES).first.wait_for()
    while page.locator(EXPANDER).count():
        n = page.locator(NAMES).count()
        page.locator(EXPANDER).first.click()
        page.wait_for_function(f"document.querySelectorAll(\"{NAMES}\").length > {n}")
    links = page.locator(NAMES)
    return [(links.nth(i).inner_text(), links.nth(i).evaluate(VISIBLE_TEXT)) for i in range(links.count())]


def frontier_figure(page) -> dict:
    """The run's Artifacts tab, its interactive figure (an .html artifact) opened: {"artifacts": names listed,
    "file": the one opened, "traces": the plotly traces' names, "points": markers drawn, "title": its title}."""
    page.get_by_role("tab", name="Artifacts").click()
    nodes = page.locator("[data-testid=artifact-tree-node]")
    nodes.first.wait_for()
    names = [nodes.nth(i).get_attribute("artifact-name") for i in range(nodes.count())]
    html = [n for n in names if n.endswith(".html")]
    if not html:
        return {"artifacts": names, "file": None}
    page.locator(f"[data-testid=artifact-tree-node][artifact-name='{html[0]}']").click()
    frame = page.frame_locator("iframe").first
    frame.locator(".js-plotly-plot").first.wait_for()
    frame.locator(".js-plotly-plot .legendtext").first.wait_for()
    info = frame.locator(".js-plotly-plot").first.evaluate(
        """p => ({traces: (p.data || []).map(t => t.name || ''),
                  legend: [...p.querySelectorAll('.legendtext')].map(e => e.textContent),
                  points: p.querySelectorAll('.scatterlayer .point').length,
                  title: (p.querySelector('.gtitle') || {}).textContent || ''})""")
    return {"artifacts": names, "file": html[0], **info}


def select_and_compare(page, names: list[str]) -> None:
    """In the runs table: tick these runs, then Compare."""
    for name in names:
        row = page.locator(".ag-row", has=page.get_by_role("link", name=name, exact=True))
        index = row.first.get_attribute("row-index")
        page.locator(f".ag-row[row-index='{index}'] input[type=checkbox]").first.click()
    page.get_by_role("button", name="Compare").click()
    page.get_by_text("Run details").wait_for()


def compare_params(page) -> dict[str, list[str]]:
    """The compare view's Parameters table: key -> one value per run; and its parallel-coordinates axes
    under "__axes__"."""
    page.locator(".pcp-plot, .js-plotly-plot").first.wait_for()
    return page.evaluate("""(() => {
      const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
      let label = null;
      for (let n; !label && (n = walk.nextNode());) if (n.data.trim() === 'Parameters') label = n;
      const table = [...document.querySelectorAll('table')].find(t =>
          label.compareDocumentPosition(t) & Node.DOCUMENT_POSITION_FOLLOWING);
      const out = {};
      for (const r of table.rows) { const c = [...r.cells].map(x => x.innerText.trim()); out[c[0]] = c.slice(1); }
      out.__axes__ = [...document.querySelectorAll('.pcp-plot .axis-title')].map(e => e.textContent);
      return out; })()""")


def shoot(page, out: Path) -> None:
    """A screenshot, 128 colours (small PNGs for the docs)."""
    from PIL import Image
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".full.png")
    page.screenshot(path=str(tmp))
    Image.open(tmp).convert("RGB").quantize(colors=128).save(out, optimize=True)
    tmp.unlink()


# ---- the chart view's scatter (docs/mlflow.md, "The same scatter in MLflow's own chart view") ----

# the "Add chart" button of the chart section titled `val` (sections follow metric-name prefixes)
MARK_VAL_ADD_CHART = """(() => { const b = [...document.querySelectorAll('[data-testid=experiment-view-compare-runs-add-chart]')]
  .find(b => { let e = b; const h = '[data-testid=experiment-view-compare-runs-section-header]';
               while (e && !e.querySelector(h)) e = e.parentElement;
               return e && e.querySelector(h).innerText.split('\\n')[0].trim() === 'val'; });
  if (b) b.setAttribute('data-klbench', 'val-add-chart'); return !!b; })()"""


def scatter_chart(page, x: str = "val/seq_kl", y: str = "val/reward") -> list[str]:
    """From the runs table, parents expanded: Chart view, Add chart on the `val` section, Scatter chart with
    these axes; the charts then shown for a search of `x`, by title."""
    # the radio input behind the second button above the list is hidden: clicked as a script would
    page.locator("input[name=runs-view-mode][value=CHART]").dispatch_event("click")
    page.get_by_text("Add section").first.wait_for()
    page.locator("[data-testid=experiment-view-compare-runs-add-chart]").first.wait_for()
    if not page.evaluate(MARK_VAL_ADD_CHART):
        raise LookupError("no `val` section in the chart view: are the parents expanded?")
    page.locator("[data-klbench=val-add-chart]").click()
    page.get_by_role("menuitem", name=re.compile("Scatter chart")).click()
    page.get_by_text("Add new chart").wait_for()
    for i, metric in enumerate((x, y)):
        # the select's search box takes no size until it opens: a click at its place opens it
        page.locator("[role=dialog] input[role=combobox]").nth(i).click(force=True)
        page.keyboard.insert_text(metric)
        page.wait_for_timeout(500)
        page.keyboard.press("Enter")  # the first match: the exact name
    page.locator("[data-testid=experiment-view-compare-runs-chart-modal-confirm]").click()
    page.locator("input[placeholder='Search metric charts']").fill(x)
    page.wait_for_timeout(2000)
    return [t.split("\n")[0] for t in
            page.locator("[data-testid=experiment-view-compare-runs-card]").all_inner_texts()]
