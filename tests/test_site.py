"""The built documentation site is whole: `mkdocs build --strict` passes, every image a page
shows is in the site, the site serves mermaid.js itself (no CDN), and every Mermaid diagram of
the README and the pages parses with that very mermaid (in node, tests/mermaid_check.mjs). Opened
from the file system in headless Chromium (tests/browser.py; Debian's ``chromium``, which
`make docs-browser` installs), its links, search and diagrams work, and every page reads at a
phone's 390 px and a desktop's 1,280 px.

The site builds with the docs environment `make docs-env` creates (``RLS_DOCS_PYTHON``, else
``.venv-docs``, else this interpreter) and the npm packages it installs (``RLS_DOCS_NODE``, else
``.cache/docs-node``); without them the tests fail, naming `make docs-env`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

import pytest
import yaml

from tests.browser import Browser

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
CHECKER = ROOT / "tests" / "mermaid_check.mjs"
MERMAID_FENCE = re.compile(r"^```mermaid\n(.*?)^```$", re.DOTALL | re.MULTILINE)
PAGES_WITH_DIAGRAMS = ("README.md", "docs/index.md", "docs/concepts.md", "docs/key-layout.md")
PLOTS = ("benchmarks/results/latency_vs_batch.png", "benchmarks/results/latency_vs_pending.png")
BUILD_TIMEOUT_S = 240
SITE_NAME = "redis-layer-signals"


def docs_python() -> str:
    named = os.environ.get("RLS_DOCS_PYTHON")
    if named and Path(named).exists():
        return named
    venv = ROOT / ".venv-docs" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def node_modules() -> Path:
    modules = Path(os.environ.get("RLS_DOCS_NODE") or ROOT / ".cache" / "docs-node") / "node_modules"
    assert (modules / "mermaid").is_dir() and (modules / "jsdom").is_dir(), f"{modules}: run `make docs-env`"
    return modules


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "RLS_DOCS_NODE": str(node_modules().parent)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [docs_python(), "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed (make docs-env?):\n{done.stdout}\n{done.stderr}"
    return out


class _Refs(HTMLParser):
    """The images and scripts an HTML page loads, and its Mermaid blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.scripts: list[str] = []
        self.diagrams = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "img" and values.get("src"):
            self.images.append(values["src"] or "")
        if tag == "script" and values.get("src"):
            self.scripts.append(values["src"] or "")
        if tag == "pre" and "mermaid" in (values.get("class") or "").split():
            self.diagrams += 1


def refs(page: Path) -> _Refs:
    parser = _Refs()
    parser.feed(page.read_text())
    return parser


def built_page(site: Path, source: str) -> Path:
    """The HTML file mkdocs writes for a page of docs/ (``use_directory_urls: false``)."""
    return site / Path(source).relative_to("docs").with_suffix(".html")


def diagrams(page: Path) -> list[str]:
    return MERMAID_FENCE.findall(page.read_text())


def parse_diagrams(blocks: list[dict[str, str]]) -> list[dict[str, object]]:
    node = shutil.which("node")
    assert node is not None, "node is missing: `make docs-env` installs it"
    done = subprocess.run(
        [node, str(CHECKER), str(node_modules())], input=json.dumps(blocks), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_every_image_a_page_shows_is_in_the_site(site: Path) -> None:
    missing, shown = [], set()
    for page in site.rglob("*.html"):
        for src in refs(page).images:
            assert not re.match(r"^[a-z]+://", src), f"{page}: an image from the network: {src}"
            target = (page.parent / src.split("#")[0]).resolve()
            shown.add(target)
            if not target.is_file():
                missing.append(f"{page.relative_to(site)}: {src}")
    assert missing == []
    for plot in PLOTS:
        assert (site / plot).resolve() in shown, f"no page shows {plot}"


def test_the_site_serves_mermaid_itself(site: Path) -> None:
    assert (site / "js" / "mermaid.min.js").stat().st_size > 1_000_000
    for page in site.rglob("*.html"):
        for src in refs(page).scripts:
            assert not re.match(r"^([a-z]+:)?//", src), f"{page}: a script from the network: {src}"
    for source in PAGES_WITH_DIAGRAMS[1:]:
        page = refs(built_page(site, source))
        assert page.diagrams == len(diagrams(ROOT / source)) >= 1, source
        assert any(src.endswith("js/mermaid.min.js") for src in page.scripts), source


def test_every_mermaid_diagram_parses() -> None:
    blocks = [
        {"name": f"{page.relative_to(ROOT)}#{i}", "text": text}
        for page in PAGES
        for i, text in enumerate(diagrams(page))
    ]
    for source in PAGES_WITH_DIAGRAMS:
        assert any(b["name"].startswith(f"{source}#") for b in blocks), f"{source} has no diagram"
    results = parse_diagrams(blocks)
    assert [r["name"] for r in results] == [b["name"] for b in blocks]
    assert [r for r in results if not r["ok"]] == []
    assert {r["type"] for r in results} <= {"sequence", "flowchart-v2"}


def test_the_diagram_check_refuses_a_broken_diagram() -> None:
    results = parse_diagrams(
        [
            {"name": "arrow without a target", "text": "sequenceDiagram\n    G->>: record\n"},
            {"name": "unknown type", "text": "sequenceDiagrm\n    G->>B: record\n"},
        ]
    )
    assert [r["ok"] for r in results] == [False, False], results


SPHINX_ROLE = re.compile(r":(class|func|meth|data|mod|attr|exc|obj):`")
API_PAGE = "docs/reference/api.md"
INTERNALS = ("make_client", "sender_for", "BufferBase.protocol", "_InvalidValue", "LocalState", "Prepared")


def test_no_docstring_uses_a_sphinx_role() -> None:
    """mkdocstrings renders Markdown: a Sphinx role would show as raw text on the API page."""
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "redis_layer_signals").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if SPHINX_ROLE.search(line)
    ]
    assert found == []


def test_the_api_reference_shows_the_constructors_and_hides_internals(site: Path) -> None:
    html = built_page(site, API_PAGE).read_text()
    for buffer in ("SignalBuffer", "AsyncSignalBuffer"):
        start = html.index(f'id="redis_layer_signals.{buffer}"')
        constructor = html[start : html.index(f'id="redis_layer_signals.{buffer}.from_url"')]
        for option in ("namespace", "pending_ttl_s", "task_ttl_s", "max_slots", "retry_s", "wait_replicas"):
            assert f"<code>{option}</code>" in constructor, (buffer, option)
        from_url = html[html.index(f'id="redis_layer_signals.{buffer}.from_url"') :]
        assert "redis+cluster://" in from_url[:20_000] and "RLS_REDIS_URL" in from_url[:20_000], buffer
    assert not SPHINX_ROLE.search(html)
    assert 'href="#redis_layer_signals.SignalBuffer"' in html  # cross-references are links
    text = visible_text(built_page(site, API_PAGE))
    # Signatures one parameter a line (ruff formats them: the docs extra installs it) rather than
    # one line that scrolls; no return type a reader cannot look up (a bare type variable).
    assert re.search(r"SignalBuffer\(\n\s+client: Any,\n", text), "signatures on one line: is ruff installed?"
    assert re.findall(r"-> *([A-Z])\b", text) == []
    for internal in INTERNALS:
        assert f'id="redis_layer_signals.{internal}' not in html and f"{internal}(" not in html, internal


# -- the pages speak to users: no project history ------------------------------------------------

HISTORY = re.compile(
    r"\bissues?\s+#?\d+|\bissue's|(?<![\w&/#])#\d+\b|\brounds?\b(?![- ]trips?)|\bthis change\b|\bsessions?\b",
    re.IGNORECASE,
)
"""The project's own history: its issue numbers ("issue 13", "#17"), its rounds of work, "this
change", a session. A pull request of FastDeploy ("PR 7872") is the user's, and allowed."""


class _Text(HTMLParser):
    """The text a reader sees: no tags, scripts, styles or comments."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = 0
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.hidden += tag in ("script", "style")

    def handle_endtag(self, tag: str) -> None:
        self.hidden -= tag in ("script", "style")

    def handle_data(self, data: str) -> None:
        if not self.hidden:
            self.parts.append(data)


def visible_text(page: Path) -> str:
    parser = _Text()
    parser.feed(page.read_text())
    return "".join(parser.parts)


def source_of(site: Path, page: Path) -> Path | None:
    """The Markdown file a built page came from (docs/, or benchmarks/results/ published as is)."""
    relative = page.relative_to(site).with_suffix("").as_posix()
    for candidate in (DOCS / f"{relative}.md", ROOT / f"{relative}.md"):
        if candidate.is_file():
            return candidate
    return None


def history_mentions(site: Path) -> list[str]:
    found = []
    for page in sorted(site.rglob("*.html")):
        text = visible_text(page)
        source = source_of(site, page)
        for match in HISTORY.finditer(text):
            where = f"{page.relative_to(site)}, text line {text.count(chr(10), 0, match.start()) + 1}"
            if source is not None:
                lines = [i for i, line in enumerate(source.read_text().splitlines(), 1) if match.group(0) in line]
                if lines:
                    where = f"{source.relative_to(ROOT)}:{lines[0]}"
            context = " ".join(text[max(0, match.start() - 40) : match.end() + 20].split())
            found.append(f"{where}: {match.group(0)!r} in ...{context}...")
    return found


def test_no_page_shows_an_escaped_pipe(site: Path) -> None:
    """A table cell's code written ``\\|`` for GitHub shows as ``|`` (docs/hooks.py)."""
    shown = [str(page.relative_to(site)) for page in sorted(site.rglob("*.html")) if "\\|" in visible_text(page)]
    assert shown == []


def test_names_in_tables_break_only_before_their_labels_and_never_in_the_first_column(site: Path) -> None:
    """docs/hooks.py: ``rls_dropped_total{reason=...}`` may wrap before ``{``; a key's name,
    in a first column, never (Chrome breaks at a ``<wbr>`` even under ``nowrap``)."""
    assert "rls_dropped_total<wbr>{" in built_page(site, "docs/operations/monitoring.md").read_text()
    key_layout = built_page(site, "docs/key-layout.md").read_text()
    assert '<td><code class="rls-name">rls:{prod/p0/0}:live</code>' in key_layout and "<wbr>" not in key_layout


def test_no_page_tells_the_project_s_history(site: Path) -> None:
    assert history_mentions(site) == []


def test_the_history_check_finds_issue_numbers_and_rounds_but_not_round_trips() -> None:
    said = "issue 13 measured it; fixed in #17 at the end of the round, this change's; a session"
    assert [m.group(0) for m in HISTORY.finditer(said)] == ["issue 13", "#17", "round", "this change", "session"]
    assert not HISTORY.search("one round trip per call, round-trips, PR 7872, slot 3, &#124;")


# -- the site opens from the file system ---------------------------------------------------------
# A reader opens site/index.html as a file, without a server: every link must name an HTML file
# (a folder would show the browser's directory listing), and search and the diagrams must work
# from there too. Checked in headless Chromium (tests/browser.py).

PHONE = (390, 844)
DESKTOP = (1280, 900)
SHOTS_ENV = "RLS_SITE_SHOTS"
"""A folder: the phone and desktop tests save there a screenshot of every page they look at."""


class _ConfigLoader(yaml.SafeLoader):
    """mkdocs.yml as data: the Python names it refers to (``!!python/name:``) read as None."""


_ConfigLoader.add_multi_constructor("tag:yaml.org,2002:python/name:", lambda loader, suffix, node: None)


def nav_pages() -> list[tuple[str, str]]:
    """(title, source) of every page of mkdocs.yml's nav, in order."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_ConfigLoader)
    pages: list[tuple[str, str]] = []

    def walk(items: list[dict[str, object]]) -> None:
        for item in items:
            for title, value in item.items():
                if isinstance(value, list):
                    walk(value)
                else:
                    pages.append((title, str(value)))

    walk(config["nav"])
    return pages


def file_of(url: str) -> Path:
    """The file a ``file://`` URL names (its anchor aside)."""
    parsed = urlparse(url)
    assert parsed.scheme == "file", url
    return Path(url2pathname(parsed.path))


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with Browser(*DESKTOP) as opened:
        yield opened


NAV_LINKS = """[...document.querySelectorAll("nav.md-nav--primary a.md-nav__link[href]")]
  .filter(a => !a.getAttribute("href").includes("#"))
  .map(a => [a.textContent.trim(), a.href])"""


def test_every_nav_link_opened_from_the_file_system_shows_its_page(site: Path, browser: Browser) -> None:
    """Opened from site/index.html over file://, each nav link lands on an HTML file with its
    page's title, not on a folder (which Chromium shows as a directory listing)."""
    browser.open((site / "index.html").as_uri())
    expected = nav_pages()
    links = browser.evaluate(NAV_LINKS)
    assert [title for title, _ in links] == [title for title, _ in expected]
    for (title, url), (_, source) in zip(links, expected, strict=True):
        browser.open(url)
        landed = file_of(browser.evaluate("location.href"))
        assert landed.suffix == ".html" and landed.is_file(), f"{title}: {url} opens {landed}, not a page"
        assert landed == built_page(site, f"docs/{source}"), title
        shown = browser.evaluate("document.title")
        assert shown == (SITE_NAME if source == "index.md" else f"{title} - {SITE_NAME}"), (url, shown)


class _Links(HTMLParser):
    """The links of a page and the ids it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"] or "")
        if tag in ("a", "link") and values.get("href"):
            self.links.append(values["href"] or "")


def test_every_link_of_the_site_names_a_file_that_exists_and_the_anchor_it_points_to(site: Path) -> None:
    """Every relative link of every built page (nav, text, API cross-references, stylesheets)
    names a file, not a folder, and its anchor is an id of that page."""
    parsed: dict[Path, _Links] = {}

    def links_of(page: Path) -> _Links:
        if page not in parsed:
            parsed[page] = _Links()
            parsed[page].feed(page.read_text())
        return parsed[page]

    broken, checked = [], 0
    for page in site_pages(site):
        for href in links_of(page).links:
            if re.match(r"^([a-z]+:)?//|^[a-z]+:", href):
                continue
            path, _, anchor = href.partition("#")
            target = (page.parent / unquote(path)).resolve() if path else page
            checked += 1
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: {href} (no such file)")
            elif anchor and target.suffix == ".html" and unquote(anchor) not in links_of(target).ids:
                broken.append(f"{page.relative_to(site)}: {href} (no such anchor)")
    assert broken == []
    assert checked > 1000


def test_search_finds_pages_from_the_file_system(site: Path, browser: Browser) -> None:
    """Material's search, which fetches its index over HTTP, works from file:// too (the offline
    plugin: the index as a script, the worker in an iframe)."""
    browser.open((site / "index.html").as_uri())
    browser.evaluate(
        """(() => { const input = document.querySelector("input.md-search__input");
        input.focus(); input.value = "appendonly"; input.dispatchEvent(new Event("input", {bubbles: true})); })()"""
    )
    found = browser.wait_for("""[...document.querySelectorAll(".md-search-result__item a")].map(a => a.href)""")
    assert found, "search found nothing from file://"
    pages = [file_of(url) for url in found]
    assert all(page.suffix == ".html" and page.is_file() for page in pages), pages
    assert pages[0] == built_page(site, "docs/operations/redis-settings.md"), pages


def test_the_diagrams_are_drawn_from_the_file_system(site: Path, browser: Browser) -> None:
    for source in PAGES_WITH_DIAGRAMS[1:]:
        browser.open(built_page(site, source).as_uri())
        # Material swaps each <pre class="mermaid"> for a <div class="mermaid"> holding the drawing
        # (in a closed shadow root) once mermaid.js has drawn it.
        drawn = browser.wait_for(
            """document.querySelector("pre.mermaid") === null &&
              [...document.querySelectorAll("div.mermaid")].filter(d => d.getBoundingClientRect().height > 100)
                .length"""
        )
        assert drawn == len(diagrams(ROOT / source)), source


# -- every page reads on a phone -----------------------------------------------------------------

LAYOUT = """(() => {
  for (const details of document.querySelectorAll("details")) details.open = true;  // ??? blocks
  const width = window.innerWidth;
  const box = e => e.getBoundingClientRect();
  const meets = (a, b) => a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
  const covered = [], scrolling = [], miscopied = [], unbuttoned = [];
  for (const pre of document.querySelectorAll("pre")) {
    const code = pre.querySelector(":scope > code");
    if (!code || !pre.checkVisibility()) continue;
    const name = (pre.id || pre.parentElement.className) + ": " + code.textContent.split("\\n")[0].slice(0, 40);
    const drawing = pre.closest(".rls-drawing") !== null;  // a table drawn in characters scrolls
    if (code.scrollWidth > code.clientWidth + 1 && !drawing) scrolling.push(name);
    // What the copy button copies: the block's innerText while Material marks it copying.
    code.setAttribute("data-md-copying", "");
    if (code.innerText.trimEnd() !== code.textContent.trimEnd()) miscopied.push(name);
    code.removeAttribute("data-md-copying");
    const button = pre.querySelector(".md-code__nav");  // the copy button on its own background
    if (!button) { unbuttoned.push(name); continue; }
    // The words of the first line (it may wrap; spaces left hanging at a wrap show nothing),
    // against the copy button.
    const glyphs = [], walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(), ended = false; node && !ended; node = walker.nextNode()) {
      const end = node.data.indexOf("\\n");
      ended = end >= 0;
      for (const word of node.data.slice(0, ended ? end : undefined).matchAll(/\\S+/g)) {
        const range = document.createRange();
        range.setStart(node, word.index);
        range.setEnd(node, word.index + word[0].length);
        glyphs.push(...range.getClientRects());
      }
    }
    if (glyphs.some(r => meets(r, box(button)))) covered.push(name);
  }
  const blocks = document.querySelectorAll("pre > code").length;
  return {width, scrollWidth: document.documentElement.scrollWidth, blocks, covered, scrolling, miscopied, unbuttoned};
})()"""


def test_only_tables_drawn_in_characters_are_kept_from_wrapping(site: Path) -> None:
    """docs/hooks.py marks ``rls-drawing`` the code blocks that draw with box-drawing characters
    (they scroll on a phone rather than wrap), and no other block."""
    marked, drawn = 0, 0
    for page in site_pages(site):
        for block in re.finditer(
            r'<div class="([^"]*\bhighlight\b[^"]*)"><pre.*?</pre></div>', page.read_text(), re.DOTALL
        ):
            draws = re.search("[\u2500-\u257f]", block.group(0)) is not None
            assert draws == ("rls-drawing" in block.group(1).split()), (page.name, block.group(0)[:200])
            marked += draws
            drawn += "rls-drawing" in block.group(1)
    assert marked >= 1 and marked == drawn


def site_pages(site: Path) -> list[Path]:
    """The pages a reader opens; not 404.html, which a web server serves at any depth, so its
    links are absolute and it shows unstyled from the file system."""
    return sorted(page for page in site.rglob("*.html") if page.name != "404.html")


def layouts(site: Path, browser: Browser, size: tuple[int, int]) -> dict[str, dict[str, Any]]:
    """The LAYOUT of every page at a window size (and its screenshot, into RLS_SITE_SHOTS)."""
    shots = os.environ.get(SHOTS_ENV)
    browser.resize(*size)
    found = {}
    try:
        for page in site_pages(site):
            name = page.relative_to(site).as_posix()
            browser.open(page.as_uri())
            found[name] = browser.evaluate(LAYOUT)
            if shots:
                Path(shots).mkdir(parents=True, exist_ok=True)
                browser.screenshot(Path(shots) / f"{name.replace('/', '_')[:-5]}-{size[0]}.png")
    finally:
        browser.resize(*DESKTOP)
    return found


def blocks_where(found: dict[str, dict[str, Any]], problem: str) -> list[str]:
    """The code blocks of every page that LAYOUT lists under ``problem``, as ``page: block``."""
    return [f"{name}: {block}" for name, layout in found.items() for block in layout[problem]]


def test_on_a_phone_no_page_scrolls_sideways_no_code_runs_past_its_box_and_no_copy_button_covers_code(
    site: Path, browser: Browser
) -> None:
    """At 390 px: the page is no wider than the screen (a wide table scrolls in its own box),
    code wraps inside its box, the copy button sits beside the first line, not on it, and it
    copies the code as written."""
    found = layouts(site, browser, PHONE)
    assert sum(layout["blocks"] for layout in found.values()) > 100
    assert blocks_where(found, "unbuttoned") == []  # every code block was checked
    assert {layout["width"] for layout in found.values()} == {PHONE[0]}
    assert [
        f"{name}: {layout['scrollWidth']} px" for name, layout in found.items() if layout["scrollWidth"] != PHONE[0]
    ] == []
    assert blocks_where(found, "covered") == []
    assert blocks_where(found, "scrolling") == []
    assert blocks_where(found, "miscopied") == []


def test_on_a_desktop_no_copy_button_covers_code_and_it_copies_the_code_as_written(
    site: Path, browser: Browser
) -> None:
    found = layouts(site, browser, DESKTOP)
    assert blocks_where(found, "unbuttoned") == []
    assert blocks_where(found, "covered") == []
    assert blocks_where(found, "miscopied") == []
