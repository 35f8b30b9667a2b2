"""Open a report in headless Chromium and check that it works as a page, not just as a string.

Drives Chromium over the DevTools protocol with a small stdlib WebSocket client (no new deps):
- records console errors, uncaught exceptions, CSP violations and log errors while loading;
- records every network request; anything other than the file itself (or data:) is a failure;
- measures #summary-chart, #candidates-table, #timeline and every `.dataflow svg` (non-zero
  rendered size, not display:none / visibility:hidden), one dataflow per candidate row; and a distributed
  run's #ranks-table, where there is one, with every rank's row;
- clicks a numeric header of the candidates table and checks the rows come back sorted;
- checks the page does not overflow horizontally at 1366 px;
- saves a PNG screenshot (the 1366x900 viewport, the top --height px, or the full page).

Usage: python tests/browser_check.py report.html [--screenshot out.png] [--full-page | --height PX] [--width PX]
Prints the result as JSON; exit status 0 when every check passes.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio"]
VIEW_W, VIEW_H = 1366, 900


def find_chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        p = shutil.which(name)
        if p:
            return p
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


class WebSocket:
    """Just enough RFC 6455 for one local CDP connection: masked text frames out, any frames in."""

    def __init__(self, url: str, timeout: float = 30.0):
        assert url.startswith("ws://"), url
        hostport, _, path = url[5:].partition("/")
        host, _, port = hostport.partition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("websocket handshake: connection closed")
            head += chunk
        status = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status:
            raise ConnectionError(f"websocket handshake refused: {status!r}")
        self.buf = head.split(b"\r\n\r\n", 1)[1]

    def send(self, text: str) -> None:
        data = text.encode()
        hdr = bytearray([0x81])
        n = len(data)
        if n < 126:
            hdr.append(0x80 | n)
        elif n < 65536:
            hdr += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            hdr += bytes([0x80 | 127]) + struct.pack(">Q", n)
        mask = os.urandom(4)
        self.sock.sendall(bytes(hdr) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("websocket closed")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def recv(self) -> str:
        parts = []
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            payload = self._read(n)
            op = b0 & 0x0F
            if op == 0x8:
                raise ConnectionError("websocket closed by peer")
            if op in (0x9, 0xA):  # ping/pong: Chromium does not ping, ignore either way
                continue
            parts.append(payload)
            if b0 & 0x80:
                return b"".join(parts).decode("utf-8", "replace")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class CDP:
    def __init__(self, ws: WebSocket):
        self.ws, self.next_id, self.events = ws, 0, []

    def call(self, method: str, timeout: float = 30.0, **params):
        self.next_id += 1
        mid = self.next_id
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        deadline = time.time() + timeout
        while time.time() < deadline:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)
        raise TimeoutError(method)

    def wait_event(self, method: str, timeout: float = 30.0):
        for ev in self.events:
            if ev["method"] == method:
                return ev
        deadline = time.time() + timeout
        while time.time() < deadline:
            msg = json.loads(self.ws.recv())
            if "method" in msg:
                self.events.append(msg)
                if msg["method"] == method:
                    return msg
        raise TimeoutError(method)


# Runs inside the page after load; returns a JSON string with everything the checks need.
PAGE_PROBE = r"""
(function () {
  function box(el) {
    if (!el) return null;
    var r = el.getBoundingClientRect(), cs = getComputedStyle(el);
    return {w: r.width, h: r.height, display: cs.display, visibility: cs.visibility};
  }
  var out = {};
  out.summary_chart = box(document.querySelector('#summary-chart'));
  out.candidates_table = box(document.querySelector('#candidates-table'));
  out.timeline = box(document.querySelector('#timeline'));
  out.ranks_table = box(document.querySelector('#ranks-table'));  // a distributed run's only
  out.rank_rows = Array.prototype.map.call(document.querySelectorAll('#ranks-table tbody tr'), function (r) {
    return {text: r.cells[0].textContent, straggler: r.classList.contains('straggler'), box: box(r)};
  });
  out.dataflows = Array.prototype.map.call(document.querySelectorAll('.dataflow svg'), box);
  var table = document.querySelector('#candidates-table');
  out.candidate_rows = table ? table.tBodies[0].rows.length : 0;
  out.scroll_width = document.documentElement.scrollWidth;
  out.inner_width = window.innerWidth;
  out.page_height = document.documentElement.scrollHeight;
  // Content wider than its scrolling box means a sideways scrollbar on a laptop screen.
  out.clipped = [];
  Array.prototype.forEach.call(document.querySelectorAll('.tablewrap, .dataflow'), function (el) {
    if (el.scrollWidth > el.clientWidth + 1) {
      var what = el.querySelector('[id]') || el;
      out.clipped.push([(what.id ? '#' + what.id : el.className), el.scrollWidth, el.clientWidth]);
    }
  });
  // Sorting: click the "Est. saved" header (falls back to the last numeric one), read the column back.
  out.sort = null;
  if (table) {
    var ths = Array.prototype.slice.call(table.tHead.rows[0].cells), idx = -1;
    ths.forEach(function (th, i) { if (/Est\.\s*saved/.test(th.textContent)) idx = i; });
    if (idx < 0) ths.forEach(function (th, i) { if (th.getAttribute('data-type') === 'num') idx = i; });
    if (idx >= 0) {
      var read = function () {
        return Array.prototype.map.call(table.tBodies[0].rows, function (r) {
          return parseFloat(r.cells[idx].getAttribute('data-v'));
        });
      };
      var body = table.tBodies[0], original = Array.prototype.slice.call(body.rows);
      var aria = ths.map(function (th) { return th.getAttribute('aria-sort'); });
      ths[idx].click();
      var first = read();
      ths[idx].click();
      var second = read();
      // Put the page back as it loaded, for the screenshot.
      original.forEach(function (r) { body.appendChild(r); });
      ths.forEach(function (th, i) {
        if (aria[i] === null) th.removeAttribute('aria-sort'); else th.setAttribute('aria-sort', aria[i]);
      });
      out.sort = {column: ths[idx].textContent, first: first, second: second};
    }
  }
  return JSON.stringify(out);
})()
"""


def _visible(b) -> bool:
    return bool(b) and b["w"] > 0 and b["h"] > 0 and b["display"] != "none" and b["visibility"] != "hidden"


def _sorted(xs, descending) -> bool:
    ys = [x for x in xs if x is not None and x == x]  # empty cells (NaN -> null) sort last, unchecked
    return ys == sorted(ys, reverse=descending)


@contextlib.contextmanager
def open_page(html_path, chromium=None, timeout=60.0):
    """Yield (cdp, url) with the page loaded in a fresh headless Chromium; events stay in cdp.events."""
    url = Path(html_path).resolve().as_uri()
    chromium = chromium or find_chromium()
    if not chromium:
        raise FileNotFoundError("chromium not found")
    # Chromium's helper processes (zygote, crashpad, GPU) outlive the browser process and may still
    # write into the profile while it is removed: run them in a session of their own, end the
    # whole group, and remove the profile only then, tolerating a straggler's last file.
    prof = tempfile.mkdtemp(prefix="fa-chromium-")
    try:
        cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={prof}", "--remote-debugging-port=0",
               f"--window-size={VIEW_W},{VIEW_H}", "about:blank"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        ws = None
        try:
            # Port 0 lets Chromium pick a free port; it announces it in this file.
            port_file = Path(prof) / "DevToolsActivePort"
            deadline = time.time() + timeout
            while not (port_file.exists() and port_file.read_text().strip()):
                if proc.poll() is not None:
                    raise RuntimeError(f"chromium exited early: {proc.stderr.read()[-2000:]}")
                if time.time() > deadline:
                    raise TimeoutError("chromium did not open its DevTools port")
                time.sleep(0.05)
            port = int(port_file.read_text().split()[0])
            targets = []
            while not targets:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                    targets = [t for t in json.load(r) if t.get("type") == "page"]
                if not targets:
                    if time.time() > deadline:
                        raise TimeoutError("chromium opened no page target")
                    time.sleep(0.05)
            ws = WebSocket(targets[0]["webSocketDebuggerUrl"], timeout=timeout)
            cdp = CDP(ws)
            for domain in ("Page", "Runtime", "Log", "Network"):
                cdp.call(f"{domain}.enable")
            cdp.call("Emulation.setDeviceMetricsOverride", width=VIEW_W, height=VIEW_H, deviceScaleFactor=1, mobile=False)
            cdp.call("Page.navigate", url=url)
            cdp.wait_event("Page.loadEventFired", timeout=timeout)
            yield cdp, url
        finally:
            if ws:
                ws.close()
            _end_group(proc)
    finally:
        shutil.rmtree(prof, ignore_errors=True)


def _end_group(proc) -> None:
    """End the browser and every helper it started (they share its session's process group)."""
    def signal_group(sig):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    signal_group(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    signal_group(signal.SIGKILL)  # helpers still alive after the browser left
    proc.wait()


def screenshot(cdp, path, y=0, height=VIEW_H, timeout=60.0) -> Path:
    """PNG of the page strip [y, y+height) at full width."""
    clip = {"x": 0, "y": y, "width": VIEW_W, "height": height, "scale": 1}
    data = cdp.call("Page.captureScreenshot", timeout=timeout, format="png", captureBeyondViewport=True, clip=clip)["data"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(data))
    return path


def check(html_path, screenshot_path=None, full_page=False, chromium=None, timeout=60.0, height=None) -> dict:
    with open_page(html_path, chromium, timeout) as (cdp, url):
        probe = json.loads(cdp.call("Runtime.evaluate", expression=PAGE_PROBE, returnByValue=True)["result"]["value"])
        if screenshot_path:
            h = probe["page_height"] if full_page else min(height or VIEW_H, probe["page_height"])
            screenshot(cdp, screenshot_path, 0, h, timeout)
        cdp.call("Runtime.evaluate", expression="1")  # drain events queued during the probe

    errors, requests = [], []
    for ev in cdp.events:
        m, p = ev["method"], ev.get("params", {})
        if m == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            errors.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
        elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            errors.append("console.error: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            errors.append("log: " + p["entry"].get("text", ""))
        elif m == "Network.requestWillBeSent":
            requests.append(p.get("request", {}).get("url", ""))
    external = [u for u in requests if u != url and not u.startswith("data:")]

    failures = list(errors)
    failures += [f"network request besides the file: {u}" for u in external]
    for key, sel in (("summary_chart", "#summary-chart"), ("candidates_table", "#candidates-table"), ("timeline", "#timeline")):
        if not _visible(probe.get(key)):
            failures.append(f"{sel} missing or not visible: {probe.get(key)}")
    if probe.get("ranks_table") is not None:
        if not _visible(probe["ranks_table"]):
            failures.append(f"#ranks-table not visible: {probe['ranks_table']}")
        failures += [f"#ranks-table row {r['text']!r} not visible" for r in probe.get("rank_rows") or []
                     if not _visible(r["box"])]
    flows = probe.get("dataflows") or []
    if not flows:
        failures.append("no .dataflow svg")
    failures += [f".dataflow svg #{i} not visible: {b}" for i, b in enumerate(flows) if not _visible(b)]
    if len(flows) != probe.get("candidate_rows"):
        failures.append(f"{len(flows)} dataflow svgs for {probe.get('candidate_rows')} candidate rows")
    srt = probe.get("sort")
    if not srt:
        failures.append("no sortable numeric column in #candidates-table")
    elif not (_sorted(srt["first"], True) and _sorted(srt["second"], False)):
        failures.append(f"clicking {srt['column']!r} did not sort the rows: {srt}")
    if probe.get("scroll_width", 0) > probe.get("inner_width", 0) + 1:
        failures.append(f"page overflows horizontally: {probe['scroll_width']} > {probe['inner_width']} px")
    failures += [f"{sel} is wider than its box ({w} > {cw} px)" for sel, w, cw in probe.get("clipped", [])]
    return {"ok": not failures, "failures": failures, "requests": requests, "probe": probe,
            "screenshot": str(screenshot_path) if screenshot_path else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("html")
    ap.add_argument("--screenshot")
    ap.add_argument("--full-page", action="store_true")
    ap.add_argument("--height", type=int, help="screenshot the top HEIGHT px of the page (default: the viewport)")
    ap.add_argument("--width", type=int, default=1366, help="viewport width in px (default 1366)")
    args = ap.parse_args(argv)
    globals()["VIEW_W"] = args.width  # read by open_page and screenshot at call time
    res = check(args.html, args.screenshot, args.full_page, height=args.height)
    print(json.dumps({k: v for k, v in res.items() if k != "probe"} | {"probe_keys": sorted(res["probe"])}, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
