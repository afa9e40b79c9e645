"""The README and the documentation site cannot rot: every Python example runs (against
``memory://``, or against a redis-server this test starts when a marker says it needs one), the
README stays a few screens long and its links resolve, and the CLI reference renders every
command of ``rls``. (`make test` also builds the site with ``mkdocs build --strict``.)

Markers, an HTML comment on the line before a ```python block:

- none, or ``<!-- example: run -->``: run as it is, with ``RLS_REDIS_URL=memory://``;
- ``<!-- example: redis -->``: run with ``redis://localhost:6379/0`` replaced by the URL of a
  redis-server started here;
- ``<!-- example: skip: <reason> -->``: not run (it names servers or files of a deployment).

A command's output shown on a page is a real run's, and stays one. An HTML comment on the line
before a fenced block names the command that printed it:

- ``<!-- output: COMMAND -->``, with options after ``output`` (``<!-- output, exit 1: ... -->``):
  ``exit N``, the exit code the run must end with (0 if not given); ``numbers vary``, the
  digits of the output change from run to run (ages, timings) and are compared as ``#``;
  ``wide``, the output's lines may be wider than the column (a diff's code, which no one
  should rewrap);
- ``<!-- run: COMMAND -->``: a command run first, its output not shown (it sets up the state
  the next outputs show).

The commands of a page run in order, in a folder holding a copy of FastDeploy's cache messager
(``FastDeploy/fastdeploy/cache_manager/cache_messager.py``, from ``tests/fixtures/fastdeploy``)
as their working directory, with ``RLS_REDIS_URL`` naming a redis-server started for the page
(shown as ``redis.internal:6379``), ``RLS_NAMESPACE=prod`` and a terminal as wide as the column
the block renders in (``CODE_COLUMNS``, less its indentation). ``rls`` is
``python -m redis_layer_signals``, an argument starting ``tests/`` a file of this repository.
When a command's output changes on purpose, rewrite every shown output from a fresh run:

    PYTHONPATH=$PWD python -m tests.test_docs --rewrite
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.servers import RedisServer, running

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
README_MAX_BYTES = 10 * 1024
LOCAL_URL = "redis://localhost:6379/0"
"""What a `redis` example names; the test swaps in its own server (never the machine's 6379)."""
MARKER = re.compile(r"^<!-- example: (run|redis|skip)(?::\s*(.+?))? -->$")
EXAMPLE_TIMEOUT_S = 60
CODE_COLUMNS = 80
"""Characters of a code block's line that show without scrolling at 1,280 px (Material, the
system's monospace font, both sidebars: measured in Chromium). A block indented in a list item
or a collapsed block loses about one character per space of its indentation."""


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
    assert commands == ["make demo", "make check", "make test", "make dist", "make cluster-test", "make cluster-images"]
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
        path = Path(os.path.normpath(page.parent / target))
        if path.is_relative_to(DOCS / "benchmarks"):  # published beside the pages (docs/hooks.py)
            path = ROOT / path.relative_to(DOCS)
        if not path.exists():
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
    # The values an option takes have their own column: "At least 1." is never a meaning.
    assert "| option | default | values | meaning |" in rendered and "| `--layers` | `61` | at least 1 |" in rendered
    assert hooks.CLI_MARKER in (DOCS / "reference" / "cli.md").read_text()


# -- no code line runs past its column -------------------------------------------------------

WIDE_MARKER = re.compile(r"^<!-- wide: (.{10,}) -->$")
"""Before a block whose lines must stay whole (a command pasted as one line), saying why."""


def overlong_code_lines(name: str, text: str) -> list[str]:
    """Every line of a fenced block wider than the column it renders in, as ``name:line: width``.
    Diagrams (```mermaid) are drawn, not shown as text; a block marked ``wide`` is exempt."""
    lines = text.splitlines()
    found = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        before = lines[i - 1].strip() if i > 0 else ""
        output = OUTPUT_MARKER.match(before)
        exempt = (
            lines[i].strip().startswith("```mermaid")
            or WIDE_MARKER.match(before) is not None
            or (output is not None and "wide" in output.group(2).split(", "))
        )
        limit = CODE_COLUMNS - len(fence.group(1))
        i += 1
        while lines[i].strip() != "```":
            width = len(lines[i].removeprefix(fence.group(1)))
            if not exempt and width > limit:
                found.append(f"{name}:{i + 1}: {width} > {limit}")
            i += 1
        i += 1
    return found


@pytest.mark.parametrize("page", sorted(DOCS.rglob("*.md")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_code_line_is_wider_than_its_column(page: Path) -> None:
    assert overlong_code_lines(str(page.relative_to(ROOT)), page.read_text()) == []


def test_the_width_check_finds_a_long_line_and_honours_the_exemptions() -> None:
    text = "```bash\n" + "x" * 81 + "\n```\n\n- item\n\n    ```text\n    " + "y" * 77 + "\n    ```\n"
    exempt = "```mermaid\n" + "z" * 90 + "\n```\n<!-- wide: one command pasted whole -->\n```\n" + "w" * 90 + "\n```\n"
    assert overlong_code_lines("page", text + exempt) == ["page:2: 81 > 80", "page:8: 77 > 76"]


# -- the outputs a page shows are what the commands print ---------------------------------------

OUTPUT_MARKER = re.compile(r"^<!-- (output|run)((?:, [a-z0-9 ]+)*): (.+?) -->$")
FENCE = re.compile(r"^(\s*)```")
FASTDEPLOY_FILE = "fastdeploy/cache_manager/cache_messager.py"
FIXTURE = ROOT / "tests" / "fixtures" / "fastdeploy" / "cache_messager.py"
SHOWN_NAMESPACE = "prod"
SHOWN_SERVER = "redis.internal:6379"
"""What the pages call the Redis the outputs came from."""
COMMAND_TIMEOUT_S = 120


@dataclass(frozen=True)
class Step:
    """One ``output`` or ``run`` marker of a page; ``first``/``last`` are the 0-based lines of
    the shown block's body (``last`` excluded), ``indent`` its fence's indentation."""

    page: Path
    line: int
    kind: str
    options: tuple[str, ...]
    command: str
    first: int = 0
    last: int = 0
    indent: str = ""

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def exit_code(self) -> int:
        codes = [int(option.split()[1]) for option in self.options if option.startswith("exit ")]
        return codes[0] if codes else 0

    def shown(self, lines: list[str]) -> str:
        return "\n".join(line.removeprefix(self.indent) for line in lines[self.first : self.last])


def steps(page: Path) -> list[Step]:
    """Every ``output`` and ``run`` marker of a page, in order, with the block it names."""
    lines = page.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        marker = OUTPUT_MARKER.match(line.strip())
        if marker is None:
            if line.strip().startswith(("<!-- output", "<!-- run")):
                raise AssertionError(f"{page}:{i + 1}: unknown output marker {line.strip()!r}")
            continue
        kind, options, command = marker.group(1), tuple(marker.group(2).split(", ")[1:]), marker.group(3)
        known = {"numbers vary", "wide"}
        for option in options:
            assert option in known or re.fullmatch(r"exit \d+", option), f"{page}:{i + 1}: option {option!r}"
        if kind == "run":
            found.append(Step(page, i + 1, kind, options, command))
            continue
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        assert fence is not None, f"{page}:{i + 1}: an output marker stands right before a fenced block"
        last = i + 2
        while lines[last].strip() != "```":
            last += 1
        found.append(Step(page, i + 1, kind, options, command, i + 2, last, fence.group(1)))
    return found


PAGES_WITH_OUTPUTS = [page for page in PAGES if steps(page)]


def argv(command: str) -> list[str]:
    words = shlex.split(command)
    program = {"rls": [sys.executable, "-m", "redis_layer_signals"], "python": [sys.executable]}[words[0]]
    return program + [str(ROOT / word) if word.startswith("tests/") else word for word in words[1:]]


def run_steps(page: Path, server: RedisServer, folder: Path) -> list[tuple[Step, int, str]]:
    """Run a page's commands in order; each ``output`` step with its exit code and output."""
    clone = folder / "FastDeploy"
    (clone / FASTDEPLOY_FILE).parent.mkdir(parents=True)
    shutil.copy(FIXTURE, clone / FASTDEPLOY_FILE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLS_")}
    env.update(RLS_REDIS_URL=server.url, RLS_NAMESPACE=SHOWN_NAMESPACE, TERM="dumb")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    ran = []
    for step in steps(page):
        env["COLUMNS"] = str(CODE_COLUMNS - len(step.indent))
        done = subprocess.run(
            argv(step.command), cwd=clone, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
        if step.kind == "run":
            assert done.returncode == 0, f"{step.name}: {step.command}\n{done.stdout}{done.stderr}"
            continue
        ran.append((step, done.returncode, (done.stdout + done.stderr).replace(server_address(server), SHOWN_SERVER)))
    return ran


def server_address(server: RedisServer) -> str:
    return server.url.split("://", 1)[1].split("/", 1)[0]


def normalised(text: str, step: Step) -> str:
    lines = [line.rstrip() for line in text.splitlines()]
    if "numbers vary" in step.options:
        lines = [re.sub(r" +", " ", re.sub(r"\d+", "#", line)) for line in lines]
    return "\n".join(lines).strip("\n")


DURABLE = ("--appendonly", "yes", "--appendfsync", "always")
"""The pages' outputs come from a server set as the Redis settings page asks (an AOF), so they
show what a healthy deployment prints."""


@pytest.mark.parametrize("page", PAGES_WITH_OUTPUTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_outputs_a_page_shows_are_what_the_commands_print(page: Path, tmp_path: Path) -> None:
    lines = page.read_text().splitlines()
    with running(DURABLE) as server:
        ran = run_steps(page, server, tmp_path)
    wrong = []
    for step, code, output in ran:
        shown, printed = normalised(step.shown(lines), step), normalised(output, step)
        if code != step.exit_code:
            wrong.append(f"{step.name}: `{step.command}` exited {code}, the page says {step.exit_code}")
        if shown != printed:
            diff = difflib.unified_diff(shown.splitlines(), printed.splitlines(), "shown", "printed", lineterm="")
            wrong.append(f"{step.name}: `{step.command}`\n" + "\n".join(diff))
    assert wrong == [], "\n\n".join(wrong) + "\n\nrewrite them: PYTHONPATH=$PWD python -m tests.test_docs --rewrite"


def test_the_output_check_sees_a_changed_output() -> None:
    step = Step(DOCS / "x.md", 1, "output", ("numbers vary",), "rls stats")
    assert normalised("│ recorded │    10 │\n", step) == normalised("│ recorded │     7 │", step)
    assert normalised("│ recorded │ 10 │", step) != normalised("│ delivered │ 10 │", step)
    exact = Step(DOCS / "x.md", 1, "output", (), "rls stats")
    assert normalised("a: patched\n", exact) != normalised("a: already patched", exact)


def rewrite(pages: list[Path]) -> None:
    """Write each shown output (and its exit code) from a fresh run of its command."""
    for page in pages:
        lines = page.read_text().splitlines()
        with running(DURABLE) as server, tempfile.TemporaryDirectory() as folder:
            ran = run_steps(page, server, Path(folder))
        for step, code, output in reversed(ran):
            body = [(step.indent + line).rstrip() for line in output.splitlines()]
            while body and not body[-1]:
                body.pop()
            lines[step.first : step.last] = body
            options = [o for o in step.options if not o.startswith("exit ")]
            options = ([f"exit {code}"] if code else []) + options
            marker = f"<!-- output{''.join(', ' + o for o in options)}: {step.command} -->"
            lines[step.line - 1] = step.indent + marker
        page.write_text("\n".join(lines) + "\n")
        print(f"{page.relative_to(ROOT)}: {len(ran)} outputs written")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Rewrite the command outputs the pages show.")
    parser.add_argument("--rewrite", action="store_true", required=True)
    parser.parse_args()
    rewrite(PAGES_WITH_OUTPUTS)
