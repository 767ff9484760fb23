"""Walks docs/mlflow.md's clicks in a real browser and screenshots the result (docs/img/mlflow_ui_sweep.png).

Needs Debian's headless Chromium (`apt-get install -y chromium`) and a running `mlflow ui` on a store with
a sweep; drives the browser over the DevTools protocol with aiohttp, which MLflow already depends on:

    mlflow ui --backend-store-uri sqlite:///$PWD/outputs/mlflow.db --port 5000 --workers 1 &
    python scripts/mlflow_ui_screenshot.py --experiment-id 1 --out docs/img/mlflow_ui_sweep.png

It fails loudly when a step does not find what the walk-through says is there: then the walk-through
(or this script) no longer matches the UI.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import subprocess
import tempfile
import time

import aiohttp

CHARTS_SEARCH = "input[placeholder='Search metric charts']"
EXPANDERS = "button[data-component-id$='runnamecellrenderer.tsx_46']"  # the + left of a parent run's name
AXES = "[role=dialog] input[role=combobox]"
# The "Add chart" button of the chart section titled `val` (sections follow metric-name prefixes).
VAL_ADD_CHART = """[...document.querySelectorAll('[data-testid=experiment-view-compare-runs-add-chart]')].find(b => {
  let e = b; const h = '[data-testid=experiment-view-compare-runs-section-header]';
  while (e && !e.querySelector(h)) e = e.parentElement;
  return e && e.querySelector(h).innerText.split('\\n')[0].trim() === 'val'; })"""


class Page:
    def __init__(self, ws):
        self.ws, self.n = ws, 0

    async def call(self, method, **params):
        self.n += 1
        await self.ws.send_str(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads((await self.ws.receive()).data)
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def js(self, expr):
        r = await self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        return r["result"].get("value")

    async def wait_text(self, text, timeout=90):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if await self.js(f"!!document.body && document.body.innerText.includes({json.dumps(text)})"):
                return
            await asyncio.sleep(0.5)
        raise TimeoutError(f"the page never showed {text!r}")

    async def click(self, expr, what):
        """A real mouse click (the UI's menus open on pointer events, not on element.click())."""
        xy = await self.js(f"(() => {{ const e = ({expr}); if (!e) return null; e.scrollIntoView({{block: 'center'}});"
                           " const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        if xy is None:
            raise LookupError(f"no {what} on the page")
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            await self.call("Input.dispatchMouseEvent", type=kind, x=xy[0], y=xy[1], button="left", clickCount=1)
        await asyncio.sleep(1.5)

    async def choose(self, expr, text, what):
        await self.click(expr, what)
        await self.call("Input.insertText", text=text)
        await asyncio.sleep(1)
        for kind in ("keyDown", "keyUp"):  # Enter takes the first match, the exact name
            await self.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13)
        await asyncio.sleep(1)


async def walk(url: str, exp_id: str, out: str, port: int) -> None:
    chrome = subprocess.Popen(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               f"--remote-debugging-port={port}", f"--user-data-dir={tempfile.mkdtemp()}",
                               "--window-size=1400,900", "about:blank"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(100):
                try:
                    async with s.get(f"http://127.0.0.1:{port}/json") as r:
                        target = next(t for t in await r.json() if t["type"] == "page")
                    break
                except (aiohttp.ClientError, StopIteration):
                    await asyncio.sleep(0.3)
            else:
                raise RuntimeError("chromium did not start")
            p = Page(await s.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0))
            await p.call("Emulation.setDeviceMetricsOverride", width=1400, height=900, deviceScaleFactor=1, mobile=False)
            # A fresh browser opens GenAI's view; the URL parameter is the Model training switch.
            await p.call("Page.navigate", url=f"{url.rstrip('/')}/#/experiments/{exp_id}/runs?workflowType=machine_learning")
            await p.wait_text("matching runs")
            await asyncio.sleep(2)
            if await p.js("!!document.body.innerText.includes('MLflow Assistant')"):  # its side panel, if open
                await p.click("[...document.querySelectorAll('button[aria-label=Close]')].pop()", "Assistant close button")
            n = await p.js(f"(() => {{ const b = document.querySelectorAll(\"{EXPANDERS}\"); b.forEach(x => x.click());"
                           " return b.length; })()")
            if not n:
                raise LookupError("no parent run to expand: is this a sweep's experiment?")
            await asyncio.sleep(2)
            await p.js("document.querySelector('input[name=runs-view-mode][value=CHART]').click()")  # Chart view
            await p.wait_text("Add section")
            await asyncio.sleep(2)
            await p.click(VAL_ADD_CHART, "Add chart button of the val section")
            await p.click("[...document.querySelectorAll('[role=menuitem]')].find(e => e.innerText.includes('Scatter chart'))",
                          "Scatter chart menu item")
            await p.wait_text("Add new chart")
            await p.choose(f"document.querySelectorAll(\"{AXES}\")[0]", "val/seq_kl", "X axis")
            await p.choose(f"document.querySelectorAll(\"{AXES}\")[1]", "val/reward", "Y axis")
            await p.click("document.querySelector('[data-testid=experiment-view-compare-runs-chart-modal-confirm]')",
                          "Add chart confirm button")
            await p.click(f"document.querySelector(\"{CHARTS_SEARCH}\")", "Search metric charts box")
            await p.call("Input.insertText", text="val/seq_kl")
            await asyncio.sleep(4)
            titles = await p.js("[...document.querySelectorAll('[data-testid=experiment-view-compare-runs-card]')]"
                                ".map(c => c.innerText.split('\\n')[0])")
            if "val/seq_kl vs. val/reward" not in titles:
                raise LookupError(f"no scatter chart after the clicks; charts shown: {titles}")
            shot = await p.call("Page.captureScreenshot", format="png")
    finally:
        chrome.terminate()
        chrome.wait(10)
    from PIL import Image  # matplotlib's dependency: 128 colours keep the PNG small
    tmp = out + ".full.png"
    with open(tmp, "wb") as f:
        f.write(base64.b64decode(shot["data"]))
    Image.open(tmp).convert("RGB").quantize(colors=128).save(out, optimize=True)
    import os
    os.remove(tmp)
    print(f"wrote {out}; charts: {titles}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:5000", help="where `mlflow ui` serves")
    ap.add_argument("--experiment-id", required=True, help="a sweep experiment's id (the number in its UI address)")
    ap.add_argument("--out", default="docs/img/mlflow_ui_sweep.png")
    ap.add_argument("--port", type=int, default=9333, help="Chromium's DevTools port")
    a = ap.parse_args()
    asyncio.run(walk(a.url, a.experiment_id, a.out, a.port))


if __name__ == "__main__":
    main()
