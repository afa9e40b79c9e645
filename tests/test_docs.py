"""The README and the documentation site cannot rot: every Python example runs (against
``memory://``, or against a redis-server this test starts when a marker says it needs one), the
README stays a few screens long and its links resolve, and the CLI reference renders every
command of ``rls``. (`make test` also builds the site with ``mkdocs build --strict``.)

Markers, an HTML comment on the line before a ```python block:

- none, or ``<!-- example: run -->``: run as it is, with ``RLS_REDIS_URL=memory://``;
- ``<!-- example: redis -->``: run with ``redis://localhost:6379/0`` replaced by the URL of a
  redis-server started here;
- ``<!-- example: skip: <reason> -->``: not run (it names servers or files of a deployment).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
README_MAX_BYTES = 10 * 1024
LOCAL_URL = "redis://localhost:6379/0"
"""What a `redis` example names; the test swaps in its own server (never the machine's 6379)."""
MARKER = re.compile(r"^<!-- example: (run|redis|skip)(?::\s*(.+?))? -->$")
EXAMPLE_TIMEOUT_S = 60


@dataclass(frozen=True)
class Example:
    page: Path
    line: int
    mode: str
    reason: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def examples(page: Path) -> list[Example]:
    """Every ```python block of a page, with the marker on the line before it."""
    lines = page.read_text().splitlines()
    found = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            marker = MARKER.match(lines[i - 1].strip()) if i > 0 else None
            if i > 0 and lines[i - 1].startswith("<!-- example") and marker is None:
                raise AssertionError(f"{page}:{i}: unknown example marker {lines[i - 1]!r}")
            i += 1
            body = []
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            mode = marker.group(1) if marker else "run"
            reason = (marker.group(2) or "") if marker else ""
            found.append(Example(page, start + 1, mode, reason, "\n".join(body) + "\n"))
        i += 1
    return found


ALL_EXAMPLES = [e for page in PAGES for e in examples(page)]


def run_example(example: Example, url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLS_")}
    env["RLS_REDIS_URL"] = url
    code = example.code.replace(LOCAL_URL, url) if example.mode == "redis" else example.code
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S
    )


def test_the_pages_hold_examples_of_every_kind() -> None:
    modes = [e.mode for e in ALL_EXAMPLES]
    assert modes.count("run") >= 5 and modes.count("redis") >= 1, modes
    for example in ALL_EXAMPLES:
        if example.mode == "skip":
            assert len(example.reason) > 10, f"{example.name}: a skipped example says why"
        if example.mode == "redis":
            assert LOCAL_URL in example.code, f"{example.name}: a redis example names {LOCAL_URL}"


@pytest.mark.parametrize("example", [e for e in ALL_EXAMPLES if e.mode == "run"], ids=lambda e: e.name)
def test_example_runs_on_memory(example: Example) -> None:
    done = run_example(example, "memory://")
    assert done.returncode == 0, f"{example.name}\n{example.code}\n{done.stderr}"


@pytest.mark.parametrize("example", [e for e in ALL_EXAMPLES if e.mode == "redis"], ids=lambda e: e.name)
def test_example_runs_on_a_real_server(example: Example, redis_server: RedisServer) -> None:
    done = run_example(example, redis_server.url)
    assert done.returncode == 0, f"{example.name}\n{example.code}\n{done.stderr}"


def test_readme_is_a_few_screens_that_start_with_an_install_that_works_then_the_commands_for_a_clone() -> None:
    text = README.read_text()
    assert len(text.encode()) <= README_MAX_BYTES, len(text.encode())
    # Nothing is released: the first install lines work from a clone; the registry's comes after.
    parts = ("pip install .", "pip install '.[fastdeploy]'", "make dist", "<!-- example: run -->", "## From a clone")
    order = [text.index(part) for part in parts]
    assert order == sorted(order), order
    install = " ".join(text[: text.index("<!-- example: run -->")].split())
    assert "After the first release: `pip install redis-layer-signals`" in install
    quick_start = text.split("## From a clone", 1)[1].split("##", 1)[0]
    commands = [line.split("#")[0].strip() for line in quick_start.splitlines() if line.startswith("make ")]
    assert commands == ["make demo", "make check", "make test", "make dist"]
    for needed in ("root", "pyenv", "20 minutes", "prints at the end what it left out"):
        assert needed in " ".join(quick_start.split()), needed
    for needed in ("Redis 7.0", "Valkey 7.2", "## Guarantees", "```mermaid"):
        assert needed in text, needed


def test_home_page_installs_from_a_clone_first_and_from_the_registry_after_the_first_release() -> None:
    text = (DOCS / "index.md").read_text()
    first_block = text.split("```bash", 1)[1].split("```", 1)[0]
    assert "pip install .  " in first_block and "pip install '.[fastdeploy]'" in first_block
    install = " ".join(text[: text.index("<!-- example: run -->")].split())
    assert "After the first release: `pip install redis-layer-signals`" in install
    assert "make dist" in install


@pytest.mark.parametrize("page", [README, *sorted(DOCS.rglob("*.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link of a page names a file or folder that exists (anchors aside)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    missing = []
    for link in links:
        target = link.split("#", 1)[0]
        if not target or re.match(r"^[a-z]+:", target):
            continue
        base = ROOT if page.parent == DOCS and target.startswith("benchmarks/") else page.parent
        if not (base / target).exists():
            missing.append(link)
    assert missing == []
    if page == README:
        assert len(links) >= 10  # the README links into the site


def test_cli_reference_renders_every_rls_command() -> None:
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    rendered: str = hooks.cli_reference()
    for command in (
        "simulate",
        "node",
        "registrar",
        "inspect",
        "stats",
        "purge",
        "metrics",
        "bench",
        "fastdeploy patch",
    ):
        assert f"## `rls {command}`" in rendered, command
    assert "`--redis`" in rendered and "`RLS_REDIS_URL`" in rendered
    assert hooks.CLI_MARKER in (DOCS / "reference" / "cli.md").read_text()
