"""Open the built documentation site in headless Chromium and check what a reader would see.

Usage (after ``sphinx-build -W -b html docs docs/_build/html``)::

    python docs/check_site.py [docs/_build/html] [--out docs/_build/site-check]

Needs Debian's ``chromium`` (``apt-get install -y chromium``; or ``--chromium PATH``). The
site is served from a local HTTP server and one Chromium run walks every page in an iframe
of a checking page, then a few more runs take screenshots. It checks that

- every HTML page loads (HTTP 200, the theme's article is there, it has a title) with no
  JavaScript error and no missing local file (every request the server answered 404);
- every image on every page shows (loaded, with a non-zero size); the gallery's index has a
  thumbnail per example and every example page at least one figure;
- the search works: ``searchindex.js`` loads and queries for an API name, a word of the guide
  and a word of the gallery return results that link to pages that exist.

Screenshots of the main kinds of page (home, guide, API, gallery, search) go to ``--out``,
with ``report.json``. Exit status 0 when every check passes, 1 otherwise (the failures are
printed). External resources (MathJax from its CDN) are not required: a machine without
network renders formulas as TeX source, and that is not counted as a failure.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

# (query, a page the results must include). An API name, a word of the guide, a word of the gallery.
SEARCHES = [
    ("weight_matching", "api/generated/pyperm.nn.weight_matching.html"),
    ("OMP_WAIT_POLICY", "guide/performance.html"),
    ("REPAIR", "auto_examples/plot_activation_repair.html"),
]
# Pages to photograph: (file name, path and query, window height).
SCREENSHOTS = [
    ("home.png", "index.html", 1000),
    ("guide-barriers.png", "guide/barriers.html", 2200),
    ("api-weight-matching.png", "api/generated/pyperm.nn.weight_matching.html", 1600),
    ("gallery-index.png", "auto_examples/index.html", 1200),
    ("gallery-weight-matching.png", "auto_examples/plot_weight_matching.html", 2600),
    ("search.png", "search.html?q=weight_matching", 1000),
]
CHECK_PAGE = "/__check__.html"

# Runs inside Chromium: visits every page in an iframe, then writes the findings into <pre id=result>.
CHECKER_JS = r"""
const pages = __PAGES__, searches = __SEARCHES__;
const sleep = ms => new Promise(r => setTimeout(r, ms));
const frame = document.createElement("iframe");
frame.style.width = "1280px"; frame.style.height = "900px";
document.body.appendChild(frame);
function visit(url) {
  return new Promise(resolve => { frame.onload = () => resolve(); frame.src = url; });
}
async function images(doc) {
  const imgs = Array.from(doc.images);
  for (let k = 0; k < 50 && imgs.some(i => !i.complete); k++) await sleep(100);
  return imgs.map(i => ({src: i.getAttribute("src"), ok: i.complete && i.naturalWidth > 0,
                         cls: i.className}));
}
async function checkPage(path) {
  await visit("/" + path);
  await sleep(50);
  const doc = frame.contentDocument;
  return {path, title: doc.title, article: !!doc.querySelector("article, .bd-article, main"),
          h1: (doc.querySelector("h1") || {}).textContent || "",
          images: await images(doc),
          thumbs: doc.querySelectorAll(".sphx-glr-thumbcontainer").length,
          traceback: /Traceback \(most recent call last\)/.test(doc.body.innerText),
          figures: doc.querySelectorAll("img.sphx-glr-single-img, img.sphx-glr-multi-img").length};
}
async function search(query) {
  await visit("/search.html?q=" + encodeURIComponent(query));
  let items = [];
  for (let k = 0; k < 150; k++) {
    const doc = frame.contentDocument;
    const summary = doc.querySelector(".search-summary");
    items = Array.from(doc.querySelectorAll("#search-results ul.search li a"));
    if (summary && /finished/i.test(summary.textContent)) break;
    await sleep(100);
  }
  const win = frame.contentWindow;
  // Sphinx's searchtools.js declares Search with const: not a window property, so ask the page.
  const indexLoaded = win.eval("typeof Search !== 'undefined' && Search._index !== null")
    && win.performance.getEntriesByType("resource").some(e => e.name.endsWith("/searchindex.js"));
  return {query, indexLoaded, links: items.map(a => a.getAttribute("href"))};
}
(async () => {
  const out = {pages: [], searches: []};
  for (const p of pages) out.pages.push(await checkPage(p));
  for (const [q] of searches) out.searches.push(await search(q));
  const pre = document.createElement("pre"); pre.id = "result";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
"""


class Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the site, and the checking page at CHECK_PAGE; remembers every request answered 404."""

    missing: list[str] = []
    checker = ""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if urllib.parse.urlsplit(self.path).path == CHECK_PAGE:
            body = self.checker.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        if code == 404 and not self.path.endswith("favicon.ico"):
            self.missing.append(self.path)
        super().send_error(code, message, explain)

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass


def find_chromium(given: str | None) -> str:
    for name in ([given] if given else ["chromium", "chromium-browser", "google-chrome", "chrome"]):
        path = shutil.which(name) if name else None
        if path:
            return path
    sys.exit("check_site: no Chromium found; install Debian's: apt-get install -y chromium (or pass --chromium)")


def chromium_args(binary: str, *extra: str) -> list[str]:
    # --no-sandbox: CI and containers run as root, where Chromium's sandbox refuses to start.
    # Every host but the local server resolves to nothing, so an external resource (MathJax's
    # CDN) fails at once instead of holding each page's load event until a network timeout.
    return [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--enable-logging=stderr", "--v=0", *extra]


def console_errors(stderr: str, base: str) -> list[str]:
    """JavaScript errors Chromium logged for the site's own pages (not for external resources)."""
    errors = []
    for line in stderr.splitlines():
        if ":CONSOLE" not in line:
            continue
        message = line.split("] ", 1)[-1]
        if base in message and re.search(r"Uncaught|Error|error|Failed", message):
            errors.append(message)
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", nargs="?", default=str(Path(__file__).parent / "_build" / "html"))
    parser.add_argument("--out", default=None, help="screenshots and report.json (default: SITE/../site-check)")
    parser.add_argument("--chromium", default=None, help="the Chromium binary (default: found on PATH)")
    args = parser.parse_args(argv)
    site = Path(args.site).resolve()
    if not (site / "index.html").is_file():
        print(f"check_site: {site} has no index.html; build the site first", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else site.parent / "site-check"
    out.mkdir(parents=True, exist_ok=True)
    binary = find_chromium(args.chromium)

    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html")
                   if not p.relative_to(site).parts[0].startswith("_"))
    Handler.checker = ("<!doctype html><html><head><title>site check</title></head><body><script>"
                       + CHECKER_JS.replace("__PAGES__", json.dumps(pages))
                       .replace("__SEARCHES__", json.dumps(SEARCHES)) + "</script></body></html>")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    failures: list[str] = []
    try:
        run = subprocess.run(chromium_args(binary, "--virtual-time-budget=600000", "--dump-dom", base + CHECK_PAGE),
                             capture_output=True, text=True, timeout=600)
        found = re.search(r'<pre id="result">(.*?)</pre>', run.stdout, re.S)
        if not found:
            print(run.stderr[-3000:], file=sys.stderr)
            print("check_site: the checking page did not finish (see Chromium's log above)", file=sys.stderr)
            return 1
        import html

        report = json.loads(html.unescape(found.group(1)))
        report["console_errors"] = console_errors(run.stderr, base)
        for shot, target, height in SCREENSHOTS:
            shot_run = subprocess.run(chromium_args(binary, f"--window-size=1280,{height}", "--virtual-time-budget=5000",
                                                    f"--screenshot={out / shot}", f"{base}/{target}"),
                                      capture_output=True, text=True, timeout=120)
            report["console_errors"] += console_errors(shot_run.stderr, base)
            if not (out / shot).is_file():
                failures.append(f"screenshot of {target} was not written")
        report["missing"] = list(Handler.missing)
    finally:
        server.shutdown()

    # ---------------------------------------------------------------- the verdict
    for page in report["pages"]:
        where = page["path"]
        if not page["article"] or not page["title"]:
            failures.append(f"{where}: no article or no title (did it load?)")
        for img in page["images"]:
            if not img["ok"]:
                failures.append(f"{where}: image {img['src']} does not show")
        if where == "auto_examples/index.html":
            examples = [p for p in pages if re.fullmatch(r"auto_examples/plot_\w+\.html", p)]
            if page["thumbs"] < len(examples) or not examples:
                failures.append(f"{where}: {page['thumbs']} thumbnails for {len(examples)} examples")
        if re.fullmatch(r"auto_examples/plot_\w+\.html", where):
            if page["figures"] == 0:
                failures.append(f"{where}: no figure")
            if page["traceback"]:
                failures.append(f"{where}: the example's output shows a traceback (it failed)")
    for (query, expected), result in zip(SEARCHES, report["searches"]):
        if not result["indexLoaded"]:
            failures.append(f"search {query!r}: searchindex.js did not load")
        targets = {urllib.parse.urlsplit(h).path for h in result["links"]}
        if expected not in targets:
            failures.append(f"search {query!r}: {len(result['links'])} results, none is {expected}")
        for t in targets:
            if t and not (site / t).is_file():
                failures.append(f"search {query!r}: result {t} does not exist")
    failures += [f"JavaScript: {e}" for e in report["console_errors"]]
    failures += [f"missing file: {m}" for m in report["missing"]]

    images = sum(len(p["images"]) for p in report["pages"])
    figures = sum(p["figures"] for p in report["pages"])
    searched = ", ".join(f"{q!r}: {len(r['links'])} results" for (q, _), r in zip(SEARCHES, report["searches"]))
    print(f"check_site: {len(report['pages'])} pages, {images} images ({figures} gallery figures), "
          f"searches {searched}; screenshots in {out}")
    report["failures"] = failures
    (out / "report.json").write_text(json.dumps(report, indent=1))
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
