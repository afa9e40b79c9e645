r"""MkDocs hooks of this site (mkdocs.yml ``hooks:``), with no plugin and nothing fetched:

- the CLI reference page is rendered from the typer application itself (each command's help and
  options), so it cannot drift from ``rls``;
- the benchmark results the Performance page links to and shows (``benchmarks/results/``) are
  published beside it, so those links resolve in the site as they do in the repository;
- a pipe inside a code span of a table row is written ``\|`` so that GitHub keeps the cell
  whole; Python-Markdown already does, and would show the backslash, so the hook drops it;
- in tables, a name (``--chunk-tokens``, ``sentinel-redis-1``) never breaks, and a metric with
  labels (``rls_dropped_total{reason="over_need"}``) only before its ``{``, in a later column
  (with docs/stylesheets/extra.css);
- a code block that draws a table in box-drawing characters (``rls stats``) is marked
  ``rls-drawing``, so that it scrolls on a phone where every other code block wraps;
- mermaid.js, which draws the diagrams, and iframe-worker's shim, which runs the search worker
  when the site is opened from the file system, are published from the pinned npm packages
  `make docs` installs (``RLS_DOCS_NODE``, default ``.cache/docs-node``), so no page loads a
  script from a CDN. A build without them fails: the diagrams would be fetched from the network
  or not drawn, and search would not work from ``file://``.
"""

from __future__ import annotations

import os
import re
from enum import Enum
from pathlib import Path
from typing import Any

import typer

CLI_MARKER = "<!-- rls-cli-reference -->"
ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = ("benchmarks/results",)
"""Repository folders published as they are, under the same path in the site."""
NPM_SCRIPTS = {
    "js/mermaid.min.js": "mermaid/dist/mermaid.min.js",
    "js/iframe-worker-shim.js": "iframe-worker/shim/index.js",
}
"""Where the site serves each script of an npm package (mkdocs.yml ``extra_javascript`` and
``extra.polyfills``), and the file of node_modules it is."""


def node_modules() -> Path:
    """The npm packages `make docs-env` installs (mermaid, and jsdom for the tests)."""
    return Path(os.environ.get("RLS_DOCS_NODE") or ROOT / ".cache" / "docs-node") / "node_modules"


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File, InclusionLevel

    for folder in PUBLISHED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file():
                uri = path.relative_to(ROOT).as_posix()
                files.append(File.generated(config, uri, abs_src_path=str(path), inclusion=InclusionLevel.NOT_IN_NAV))
    for uri, package_file in NPM_SCRIPTS.items():
        script = node_modules() / package_file
        if not script.is_file():
            raise PluginError(f"{script} is missing: run `make docs-env` (it installs the pinned npm packages)")
        files.append(File.generated(config, uri, abs_src_path=str(script), inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    markdown = unescape_table_code(markdown)
    if CLI_MARKER not in markdown:
        return markdown
    return markdown.replace(CLI_MARKER, cli_reference())


CODE_SPAN = re.compile(r"`[^`\n]*`")


def unescape_table_code(markdown: str) -> str:
    r"""``\|`` back to ``|`` inside the code spans of table rows (lines that start with a pipe)."""
    lines = markdown.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("|") and "\\|" in line:
            lines[i] = CODE_SPAN.sub(lambda span: span.group(0).replace("\\|", "|"), line)
    return "\n".join(lines)


TABLE_CELL = re.compile(r"<td[^>]*>.*?</td>", re.DOTALL)
TABLE_ROW = re.compile(r"(<tr>\s*<td[^>]*>.*?</td>)(.*?</tr>)", re.DOTALL)
CELL_CODE = re.compile(r"<code>([^<]*)</code>")
MARKED_CODE = re.compile(r"<code[^>]*>[^<]*</code>")


CODE_BLOCK = re.compile(r'<div class="([^"]*\bhighlight\b[^"]*)">(<pre.*?</pre>)</div>', re.DOTALL)
BOX_DRAWING = re.compile("[\u2500-\u257f]")
"""The characters a command draws its tables with (``rls stats``, ``rls inspect``)."""


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """In tables: a name (a code span without a space) is marked ``rls-name`` and never wraps,
    not even at its hyphens (extra.css); a ``{`` in the code of a later column gets a break
    opportunity before it (the first column keeps its names whole: Chrome breaks at a
    ``<wbr>`` even under ``nowrap``). A code block that draws a table with box-drawing
    characters is marked ``rls-drawing``: it scrolls in its box instead of wrapping, which would
    tear its rows apart."""
    html = TABLE_CELL.sub(lambda cell: CELL_CODE.sub(_mark_name, cell.group(0)), html)
    html = TABLE_ROW.sub(lambda row: row.group(1) + MARKED_CODE.sub(_break_before_labels, row.group(2)), html)
    return CODE_BLOCK.sub(_mark_drawing, html)


def _mark_drawing(block: re.Match[str]) -> str:
    if not BOX_DRAWING.search(block.group(2)):
        return block.group(0)
    return f'<div class="{block.group(1)} rls-drawing">{block.group(2)}</div>'


def _break_before_labels(code: re.Match[str]) -> str:
    return code.group(0).replace("{", "<wbr>{")


def _mark_name(code: re.Match[str]) -> str:
    text = code.group(1)
    if any(c.isspace() for c in text):
        return code.group(0)
    return f'<code class="rls-name">{text}</code>'


def cli_reference() -> str:
    """Markdown for every command of ``rls``: its help, usage and options."""
    from redis_layer_signals.cli import app

    # typer ships its own copy of click: its objects are used through their methods only.
    root: Any = typer.main.get_command(app)
    context = root.context_class(root, info_name="rls")
    return "\n".join(_references(root, context, ""))


def _references(group: Any, context: Any, prefix: str) -> list[str]:
    """Each command of ``group``, the commands of a subgroup (``rls fastdeploy patch``) under it."""
    parts = []
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        assert command is not None, name
        sub = command.context_class(command, info_name=name, parent=context)
        if hasattr(command, "list_commands"):
            parts += _references(command, sub, f"{prefix}{name} ")
        else:
            parts.append(command_reference(prefix + name, command, sub))
    return parts


def command_reference(name: str, command: Any, context: Any) -> str:

    lines = [f"## `rls {name}`", "", (command.help or "").strip(), "", "```text", command.get_usage(context), "```", ""]
    options = [p for p in command.params if p.param_type_name == "option" and not p.hidden]
    if options:
        # The values an option takes have a column of their own: an option whose help says
        # nothing more would otherwise read "At least 1." as its meaning.
        lines += ["| option | default | values | meaning |", "|---|---|---|---|"]
        for option in options:
            names = " ".join(f"`{o}`" for o in [*option.opts, *option.secondary_opts])
            env = f"<br>env `{option.envvar}`" if isinstance(option.envvar, str) else ""
            lines.append(f"| {names}{env} | {_default(option)} | {_range(option)} | {_cell(option.help or '')} |")
        lines.append("")
    return "\n".join(lines)


def _default(option: Any) -> str:
    if option.required:
        return "required"
    default = option.default
    if default is None or callable(default):
        return ""
    if option.is_flag:
        return "on" if default else "off"
    return f"`{getattr(default, 'value', default)}`"


def _range(option: Any) -> str:
    """The values an option takes: an enum's members, else the range `rls --help` prints."""
    from redis_layer_signals.cli_help import range_words

    annotation = getattr(getattr(option, "type_descriptor", None), "annotation", None)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return ", ".join(f"`{member.value}`" for member in annotation)
    return range_words(option)


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())
