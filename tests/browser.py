"""Headless Chromium for tests of our web pages (helper module, not a test module).

`render(url)` loads a page in Debian's `chromium` and returns its DOM after the page's scripts ran.
Waiting uses Chromium's virtual time (`--virtual-time-budget`): the page's clock runs only while
nothing is pending, and pending network fetches hold it, so a page that polls with
setTimeout/setInterval + fetch completes one poll per virtual interval. A 4000 ms budget with a
1 s poll gives 4-5 completed polls, usually in well under a second of real time (checked
empirically with Chromium 150: the live page's <body data-polls> counts its completed polls). A
server that never answers holds virtual time forever; the 60 s subprocess timeout catches that.

A missing browser fails loudly: `ensure_chromium()` installs it with apt-get or raises.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
TIMEOUT_S = 60.0
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio"]


def _run(argv: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run in its own process group; on timeout kill the whole group (chromium forks helpers)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        raise TimeoutError(f"{argv[0]} did not finish in {timeout:.0f} s: {' '.join(argv[1:])}\n"
                           f"stderr tail:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def ensure_chromium() -> str:
    """Path of Debian's chromium, installing it (apt-get, as root) when missing."""
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
    log = []
    for step in (install, ["apt-get", "update"], install):
        try:
            r = _run(step, 900.0, env)
        except (OSError, TimeoutError) as e:
            log.append(f"$ {' '.join(step)}\n{e}")
            continue
        log.append(f"$ {' '.join(step)}  (exit {r.returncode})\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        if step is install and r.returncode == 0 and os.access(CHROMIUM, os.X_OK):
            return CHROMIUM
    raise RuntimeError("could not install Debian's chromium for the browser tests:\n" + "\n".join(log))


def _chromium(url: str, extra: list[str], wait_ms: int, window: tuple[int, int]) -> subprocess.CompletedProcess:
    profile = tempfile.mkdtemp(prefix="kvevict-chromium-")
    try:
        argv = [ensure_chromium(), *FLAGS, f"--user-data-dir={profile}",
                f"--virtual-time-budget={int(wait_ms)}", f"--window-size={window[0]},{window[1]}",
                *extra, url]
        r = _run(argv, TIMEOUT_S)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    if r.returncode != 0:
        raise RuntimeError(f"chromium exited {r.returncode} on {url}:\n{r.stderr[-3000:]}")
    return r


def render(url: str, *, wait_ms: int = 4000, screenshot: str | os.PathLike | None = None,
           window: tuple[int, int] = (1280, 900)) -> str:
    """The page's DOM (serialized HTML) after `wait_ms` of virtual time; with `screenshot`, a
    second load of the page is saved there as PNG."""
    dom = _chromium(url, ["--dump-dom"], wait_ms, window).stdout
    if "<html" not in dom.lower():
        raise RuntimeError(f"chromium returned no DOM for {url}: {dom[:500]!r}")
    if screenshot is not None:
        path = Path(screenshot).resolve()
        path.unlink(missing_ok=True)
        r = _chromium(url, [f"--screenshot={path}"], wait_ms, window)
        if not path.is_file() or path.stat().st_size == 0:
            raise RuntimeError(f"chromium wrote no screenshot to {path}:\n{r.stderr[-3000:]}")
    return dom


class Element:
    def __init__(self, tag: str, attrs: dict[str, str]):
        self.tag, self.attrs, self.text = tag, attrs, ""

    def classes(self) -> list[str]:
        return self.attrs.get("class", "").split()

    def __repr__(self) -> str:
        return f"<{self.tag} {self.attrs}>"


class Dom(HTMLParser):
    """A flat list of the elements in dumped HTML, each with its attributes and its text."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
            "track", "wbr"}

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.elements: list[Element] = []
        self._open: list[Element] = []
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        e = Element(tag, {k: v or "" for k, v in attrs})
        self.elements.append(e)
        if tag not in self.VOID:
            self._open.append(e)

    def handle_startendtag(self, tag, attrs):
        self.elements.append(Element(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag):
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i].tag == tag:
                del self._open[i:]
                break

    def handle_data(self, data):
        for e in self._open:
            e.text += data

    def by_id(self, id_: str) -> Element | None:
        return next((e for e in self.elements if e.attrs.get("id") == id_), None)

    def by_class(self, cls: str, tag: str | None = None) -> list[Element]:
        return [e for e in self.elements if cls in e.classes() and (tag is None or e.tag == tag)]

    def body(self) -> Element:
        return next(e for e in self.elements if e.tag == "body")


def polls(dom: str) -> int:
    """Completed polls of our live page (its <body data-polls>), from a DOM that render returned."""
    return int(Dom(dom).body().attrs.get("data-polls", "0"))
