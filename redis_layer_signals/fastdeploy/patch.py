"""``rls fastdeploy patch``: the integration guide applied to FastDeploy's ``cache_messager.py``.

A codemod on the file's concrete syntax tree (libcst): it edits ``CacheMessagerV1`` at the places
the *Patching* section of docs/fastdeploy.md names, and leaves every other byte of the file as it
was (the older ``CacheMessager`` class, the file's encoding and line endings included).

Each place is found by one line of FastDeploy's file and must be in its fixed form (patched then)
or in its patched form (left alone), so patching twice changes nothing. The code it removes must
be, statement by statement, what a release it knows has there (``RELEASES``): a local patch or
another fork's line inside a removed block refuses the whole file with ``StructureMismatch``
naming that line. A file of another release is never half patched, and code the codemod does not
know is never deleted.
"""

from __future__ import annotations

import ast
import difflib
import functools
import io
import os
import tokenize
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import libcst as cst
from libcst.metadata import CodeRange, PositionProvider

CLASS = "CacheMessagerV1"

IMPORT_ANCHOR = "import paddle"
"""The import goes after this one: with the third-party imports, where isort puts them."""
IMPORTS = ("from redis_layer_signals.fastdeploy import bridge_for_messager",)

QUEUE_ANCHOR = "self.cache_prefilled_engine_ids_queue ="
THREADS = 'if splitwise_role == "prefill":'
TASK_LOCK = "with self.engine_cache_task_thread_lock:"
PENDING_LOCK = "with self.pending_layer0_signal_lock:"
SENDER_FINISH = "if end_layer_idx == self.num_layers - 1:"
ENTRY_LOOP = "for bi in range(tasks_count):"
TASK_ENTERS = "self.idx_cache_task_dict[current_id] = current_info"

BRIDGE = """\
# redis-layer-signals: early layer-0 signals wait in Redis (docs/fastdeploy.md).
# None unless the role is "prefill"; the RLS_* variables configure it.
self.layer0 = bridge_for_messager(
    splitwise_role=splitwise_role,
    pod_ip=pod_ip,
    engine_worker_queue_port=engine_worker_queue_port,
    rank=self.rank_id,
    nranks=self.nranks,
    block_size=block_size,
    num_layers=num_layers,
    ready=lambda: self.cache_prefilled_engine_ids_queue,
    logger=logger,
)
"""
ON_KV_SIGNAL = """\
# redis-layer-signals: queues the layer-0 batch of live tasks, keeps the others for their tasks
self.layer0.on_kv_signal(kv_signal_data)
"""
ON_CACHE_TASK = """\
# redis-layer-signals: registers the task, queues its early batch if one waited
self.layer0.on_cache_task(current_info)
"""
ON_TASK_FINISHED = """\
# redis-layer-signals: release the finished slots in the buffer before they are reported
for engine_idx, _ in batch_engine_signals:
    task = self.idx_cache_task_dict[engine_idx]
    if task["status"] == "finished" or ("error" in task["status"]):
        self.layer0.on_task_finished(engine_idx, task["request_id"])
"""

REPLACED_NAMES = frozenset(
    {"pending_layer0_signals", "pending_layer0_signal_lock", "ready_engine_signals", "pending_engine_signals"}
)
"""What the bridge replaces: none of it may remain in the patched class."""

MAX_DEPTH = 100
"""Deeper syntax trees are refused before libcst reads them: its parser recurses per level (and
crashes the interpreter far enough down). FastDeploy's file nests about 20 deep."""


# -- what each release has where the codemod removes code ---------------------------------------

LOG = "logger.LOG(...)"
"""In a known block: one log line, ``logger.<level>(...)`` whose arguments call nothing. Their
wording is not compared (releases and forks reword them); their place and number are."""
LOG_LEVELS = frozenset({"debug", "info", "warning", "error", "exception", "critical"})
COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
"""A log line's arguments iterate nothing either: an iterator they consumed would be gone."""


@dataclass(frozen=True)
class Release:
    """The statements one FastDeploy release has in each run of code the codemod removes, as
    source, compared statement by statement after normalising (``ast.unparse``): formatting and
    comments do not count, anything else does."""

    name: str
    init: str
    """``__init__``: the pending dict and its lock, before the sender's queue."""
    adder_pop: str
    """``_add_cache_task_thread``: the pop from the pending dict, last in the task lock."""
    adder_recover: str
    """``_add_cache_task_thread``: the recovered signal queued, right after the task lock."""
    sender_pop: str
    """The sender's finish: the pop from the pending dict, in the task lock."""
    consumer_lists: str
    """``consume_signals``: the lists, before the task lock."""
    consumer_layer0: str
    """``consume_signals``: the layer-0 sorting, last in the loop over the message's entries."""
    consumer_store: str
    """``consume_signals``: the early signals stored in the pending dict, last in the task lock."""
    consumer_queue: str
    """``consume_signals``: the logs and the queue put, right after the task lock."""


RELEASE_7872 = Release(
    name="release/2.6 with PR 7872",
    init="""
self.pending_layer0_signals = {}
self.pending_layer0_signal_lock = threading.Lock()
""",
    adder_pop="""
with self.pending_layer0_signal_lock:
    recovered_signal = self.pending_layer0_signals.pop(current_id, None)
""",
    adder_recover=f"""
if recovered_signal is not None:
    _, prefilled_token_num = recovered_signal
    if prefilled_token_num <= current_info["need_prefill_tokens"]:
        recovered_signal_batch = [recovered_signal]
        {LOG}
        self.cache_prefilled_engine_ids_queue.put(recovered_signal_batch)
    else:
        {LOG}
""",
    sender_pop="""
with self.pending_layer0_signal_lock:
    self.pending_layer0_signals.pop(current_id, None)
""",
    consumer_lists="""
ready_engine_signals = []
pending_engine_signals = []
""",
    consumer_layer0="""
if layer_id == 0:
    if engine_idx in self.idx_cache_task_dict:
        ready_engine_signals.append((engine_idx, prefilled_token_num))
    else:
        pending_engine_signals.append((engine_idx, prefilled_token_num))
""",
    consumer_store="""
if pending_engine_signals:
    with self.pending_layer0_signal_lock:
        for engine_idx, prefilled_token_num in pending_engine_signals:
            self.pending_layer0_signals[engine_idx] = (engine_idx, prefilled_token_num)
""",
    consumer_queue=f"""
if pending_engine_signals:
    {LOG}
if ready_engine_signals:
    {LOG}
    self.cache_prefilled_engine_ids_queue.put(ready_engine_signals)
""",
)

RELEASE_8035 = Release(
    name="release/2.6 after PR 8035",
    init=RELEASE_7872.init,
    adder_pop=RELEASE_7872.adder_pop,
    adder_recover=RELEASE_7872.adder_recover,
    sender_pop=RELEASE_7872.sender_pop,
    # Every layer-0 entry waits in the pending dict; the adder recovers it per request.
    consumer_lists="""
pending_engine_signals = []
""",
    consumer_layer0="""
if layer_id == 0:
    pending_engine_signals.append((engine_idx, prefilled_token_num))
""",
    consumer_store=RELEASE_7872.consumer_store,
    consumer_queue=f"""
if pending_engine_signals:
    {LOG}
""",
)

RELEASES = (RELEASE_7872, RELEASE_8035)
"""Tried in order; a file is patched by the first whose structure it has."""


# -- errors and result --------------------------------------------------------------------------


class UnreadableSource(ValueError):
    """The bytes are not text Python reads (binary, undeclared encoding, NUL bytes): nothing is
    written."""


class StructureMismatch(ValueError):
    """The file is not one the codemod knows (another release, or edited by hand): nothing is
    written. ``place`` names the first place that did not match, ``problem`` its line."""

    def __init__(self, place: str, problem: str) -> None:
        super().__init__(place, problem)
        self.place = place
        self.problem = problem
        self.release = ""
        """The release compared, when the releases found different problems."""

    def __str__(self) -> str:
        known = " or ".join(release.name for release in RELEASES)
        return f"{self.place}: {self.problem} (the codemod knows {CLASS} of {known}); nothing written"


@dataclass(frozen=True)
class PatchResult:
    original: bytes
    patched: bytes
    encoding: str
    """The file's encoding (its coding cookie, ``utf-8-sig`` for a BOM): the patched file and
    the diff are in it."""

    @property
    def changed(self) -> bool:
        return self.original != self.patched

    def diff(self, name: str) -> bytes:
        """The unified diff from the file to its patched form, ``a/NAME`` to ``b/NAME``, in the
        file's encoding: ``patch -p1`` applies it from the directory NAME is relative to."""
        codec = "utf-8" if self.encoding == "utf-8-sig" else self.encoding  # the BOM stays in line 1
        before, after = _lines(self.original.decode(codec)), _lines(self.patched.decode(codec))
        header = os.fsencode(f"--- a/{name}\n+++ b/{name}\n")
        body = list(difflib.unified_diff(before, after, n=3))[2:]
        if not body:
            return b""
        text = "".join(line if line.endswith("\n") else f"{line}\n\\ No newline at end of file\n" for line in body)
        return header + text.encode(codec)


def _lines(text: str) -> list[str]:
    """Lines as ``patch`` counts them: split at ``\\n`` only (``str.splitlines`` also splits
    at form feeds and other separators Python files may hold)."""
    parts = text.split("\n")
    return [f"{part}\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def decode_source(data: bytes) -> tuple[str, str]:
    """The file's text and encoding, as Python reads them (PEP 263); raises UnreadableSource."""
    if b"\0" in data:
        line = data[: data.index(b"\0")].count(b"\n") + 1
        raise UnreadableSource(f"line {line}: a NUL byte; not a Python source file")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:
        raise UnreadableSource(f"not a Python source file: {exc}") from exc
    try:
        return data.decode(encoding), encoding
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        declared = b"coding" in b"".join(data.splitlines(keepends=True)[:2])
        why = "which its coding line declares" if declared else "and no coding line declares another"
        raise UnreadableSource(f"line {line}: byte {data[exc.start]:#04x} is not {encoding}, {why}") from exc


def patch_source(source: bytes) -> PatchResult:
    """Apply the integration to the bytes of a ``cache_messager.py``; raises UnreadableSource
    or StructureMismatch (naming the place and line)."""
    text, encoding = decode_source(source)
    tree = _parse(text)
    try:
        wrapper = cst.MetadataWrapper(cst.parse_module(text))
        failures: list[StructureMismatch] = []
        for release in RELEASES:
            try:
                patched = _Codemod(release, wrapper, _method_lines(tree)).run()
            except StructureMismatch as exc:
                exc.release = release.name
                failures.append(exc)
                continue
            _check_leftovers(ast.parse(patched))
            return PatchResult(source, patched.encode(encoding), encoding)
        raise _closest(failures)
    except cst.ParserSyntaxError as exc:
        raise StructureMismatch("module", f"line {exc.raw_line}: not Python libcst reads: {exc.message}") from exc
    except RecursionError as exc:
        raise StructureMismatch("module", "nested too deeply for the codemod to read") from exc


def _parse(text: str) -> ast.Module:
    """The file's syntax tree, refused before libcst reads it when it is not Python or nests
    deeper than ``MAX_DEPTH``."""
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise StructureMismatch("module", f"line {exc.lineno}: not Python that parses: {exc.msg}") from exc
    except (RecursionError, MemoryError) as exc:
        raise StructureMismatch("module", f"{_too_deep(text)}nested too deeply for Python's parser") from exc
    level: list[tuple[ast.AST, int, int]] = [(tree, 0, 1)]  # a node, its depth, its (or its parent's) line
    while level:
        node, depth, line = level.pop()
        if depth > MAX_DEPTH:
            raise StructureMismatch("module", f"line {line}: nested more than {MAX_DEPTH} deep")
        for child in ast.iter_child_nodes(node):
            level.append((child, depth + 1, getattr(child, "lineno", line)))
    return tree


def _too_deep(text: str) -> str:
    """``line N: `` for the first line that alone is too deep for Python's parser, else nothing
    (the expression spans lines)."""
    for number, line in enumerate(text.split("\n"), start=1):
        try:
            ast.parse(line.strip())
        except (RecursionError, MemoryError):
            return f"line {number}: "
        except SyntaxError:
            continue
    return ""


def _closest(failures: list[StructureMismatch]) -> StructureMismatch:
    """One error for the releases that did not match: theirs when they all say the same, else
    what each release found (they part at the place of the first)."""
    first = failures[0]
    if all((f.place, f.problem) == (first.place, first.problem) for f in failures):
        return first
    found = [f"{f.release}: {'' if f.place == first.place else f.place + ': '}{f.problem}" for f in failures]
    return StructureMismatch(first.place, "; ".join(found))


# -- the places -------------------------------------------------------------------------------

Statements = list[cst.BaseStatement]
Edit = Callable[[Statements, int, str], Statements]


@dataclass(frozen=True)
class _Line:
    """One line of code as the codemod compares it: a simple statement, or a block's header."""

    depth: int
    text: str
    """Normalised (``ast.unparse``): what is compared."""
    line: int
    node: ast.stmt | None
    written: str
    """The line as the file (or the known source) has it: what messages show."""

    @property
    def shown(self) -> str:
        text = " ".join(self.written.split())
        return text if len(text) <= 100 else text[:97] + "..."


class _Codemod:
    """The edits of one release on one parsed file (its nodes carry their original lines)."""

    def __init__(self, release: Release, wrapper: cst.MetadataWrapper, lines: dict[str, int]) -> None:
        self.release = release
        self.module = wrapper.module
        self.positions = wrapper.resolve(PositionProvider)
        self.lines = lines

    def run(self) -> str:
        module = self._add_imports(self.module)
        body: Statements = list(module.body)
        at = _unique(body, lambda s: isinstance(s, cst.ClassDef) and s.name.value == CLASS, "module", f"class {CLASS}")
        cls = body[at]
        assert isinstance(cls, cst.ClassDef)
        methods = _body(cls)
        points: tuple[tuple[str, Callable[[cst.BaseStatement], bool], Edit], ...] = (
            ("__init__", lambda s: _head(s).startswith(QUEUE_ANCHOR), self._init),
            ("_add_cache_task_thread", lambda s: _head(s) == TASK_LOCK, self._add_cache_task),
            ("prefill_layerwise_send_cache_thread", lambda s: _head(s) == SENDER_FINISH, self._sender_finish),
            ("consume_signals", lambda s: _head(s) == TASK_LOCK, self._consume_signals),
        )
        for name, anchor, edit in points:
            place = f"{CLASS}.{name} (def at line {self.lines.get(name, '?')})"
            where = _unique(methods, _is_def(name), place, f"def {name}")
            methods[where] = _edit_block(methods[where], anchor, edit, place)
        body[at] = _with_body(cls, methods, CLASS)
        return module.with_changes(body=body).code

    # Each edit gets the block holding the place's line and that line's index.

    def _init(self, stmts: Statements, i: int, place: str) -> Statements:
        """Build the bridge right after the sender's queue, before the threads start; the
        pending dict and its lock go."""
        threads = _find(stmts, THREADS)
        if threads is None or threads < i:
            raise StructureMismatch(
                place, f"no `{THREADS}` (the consumer and adder threads) after `{QUEUE_ANCHOR} ...`"
            )
        bridge = _find(stmts, "self.layer0 =", prefix=True)
        if bridge is not None:
            if (bridge, threads) == (i + 1, i + 2) and _same_code(stmts[bridge], BRIDGE):
                return stmts
            raise StructureMismatch(
                place,
                f"line {self._line(stmts[bridge])}: `self.layer0 = ...` is not this codemod's bridge "
                "between the queue and the threads",
            )
        new = [*stmts[: i + 1], *_statements(BRIDGE), *stmts[i + 1 :]]
        return self._take(new, self.release.init, place, stop=i)

    def _add_cache_task(self, stmts: Statements, i: int, place: str) -> Statements:
        """The task enters ``idx_cache_task_dict`` under the lock; the pop from the pending dict
        and the recovered-signal block go; the bridge registers the task after the lock."""
        if i + 1 < len(stmts) and _calls(stmts[i + 1], "self.layer0.on_cache_task"):
            return stmts
        inner = _body(stmts[i])
        entered = _find(inner, TASK_ENTERS)
        if entered is None:
            raise StructureMismatch(place, f"no `{TASK_ENTERS}` in `{TASK_LOCK}`")
        inner = self._take(inner, self.release.adder_pop, place, start=entered + 1)
        tail = self._take(stmts[i + 1 :], self.release.adder_recover, place, first=True)
        return [*stmts[:i], _with_body(stmts[i], inner, place), *_statements(ON_CACHE_TASK), *tail]

    def _sender_finish(self, stmts: Statements, i: int, place: str) -> Statements:
        """The finished slots are released in the buffer before the lock; the pop from the
        pending dict at the end of the loop goes."""
        block = _body(stmts[i])
        if block and _calls(block[0], "self.layer0.on_task_finished"):
            return stmts
        at = _find(block, TASK_LOCK)
        if at is None:
            raise StructureMismatch(place, f"no `{TASK_LOCK}` in `{SENDER_FINISH}`")
        dropper = _Drop(self, self.release.sender_pop, place)
        released = block[at].visit(dropper)
        if dropper.dropped != 1:
            raise StructureMismatch(place, f"{dropper.dropped} `{PENDING_LOCK}` in `{SENDER_FINISH}`, expected 1")
        assert isinstance(released, cst.BaseStatement)
        block = [*block[:at], *_statements(ON_TASK_FINISHED), released, *block[at + 1 :]]
        return [*stmts[:i], _with_body(stmts[i], block, place), *stmts[i + 1 :]]

    def _consume_signals(self, stmts: Statements, i: int, place: str) -> Statements:
        """Progress stays under the lock; the layer-0 sorting, the pending dict, the logs and the
        queue put go; the bridge sees the signal after the lock."""
        if i + 1 < len(stmts) and _calls(stmts[i + 1], "self.layer0.on_kv_signal"):
            return stmts
        inner = _body(stmts[i])
        loop = _find(inner, ENTRY_LOOP)
        if loop is None:
            raise StructureMismatch(place, f"no `{ENTRY_LOOP}` in `{TASK_LOCK}`")
        entries = self._take(_body(inner[loop]), self.release.consumer_layer0, place)
        inner[loop] = _with_body(inner[loop], entries, place)
        inner = self._take(inner, self.release.consumer_store, place, start=loop + 1)
        tail = self._take(stmts[i + 1 :], self.release.consumer_queue, place, first=True)
        new = [*stmts[:i], _with_body(stmts[i], inner, place), *_statements(ON_KV_SIGNAL), *tail]
        return self._take(new, self.release.consumer_lists, place, stop=i)

    # -- removing known code ----------------------------------------------------------------

    def _take(
        self, stmts: Statements, known: str, place: str, *, start: int = 0, stop: int | None = None, first: bool = False
    ) -> Statements:
        """``stmts`` without the run of statements ``known`` (located by its first line, from
        ``start``, before ``stop``; at ``start`` itself when ``first``), after checking every
        statement of the run, nested ones included, is what the release has there."""
        expected = _known(known)
        head = expected[0].text
        end = len(stmts) if stop is None else stop
        at = next((k for k in range(start, end) if self.lines_of([stmts[k]])[0].text == head), None)
        if at is None or (first and at != start):
            raise StructureMismatch(place, f"no `{expected[0].shown}` where the codemod removes it")
        count = len(_parsed(known))
        self.match(stmts[at : at + count], expected, place)
        return [*stmts[:at], *stmts[at + count :]]

    def match(self, run: Statements, expected: list[_Line], place: str) -> None:
        actual = self.lines_of(run)
        for k, want in enumerate(expected):
            if k == len(actual):
                where = actual[-1].line if actual else self._line(run[-1]) if run else 0
                raise StructureMismatch(place, f"line {where}: the block ends where `{want.shown}` is expected")
            got = actual[k]
            if got.depth != want.depth or not _same_line(got, want):
                wanted = "a log line" if want.text == LOG else f"`{want.shown}`"
                raise StructureMismatch(
                    place,
                    f"line {got.line}: `{got.shown}` where {wanted} is expected; "
                    "the codemod removes this block and deletes no code it does not know",
                )
        if len(actual) > len(expected):
            extra = actual[len(expected)]
            raise StructureMismatch(
                place,
                f"line {extra.line}: `{extra.shown}` is not in the block the codemod removes, "
                "and it deletes no code it does not know",
            )

    def lines_of(self, run: Sequence[cst.BaseStatement]) -> list[_Line]:
        lines: list[_Line] = []
        for stmt in run:
            first = self._line(stmt)
            code = self.module.code_for_node(stmt.with_changes(leading_lines=[]))
            try:
                nodes = ast.parse(code).body
            except SyntaxError:
                lines.append(_Line(0, " ".join(code.split()), first, None, code))
                continue
            lines += _lines_of(code, nodes, first)
        return lines

    def _line(self, node: cst.CSTNode) -> int:
        position = self.positions.get(node)
        return position.start.line if isinstance(position, CodeRange) else 0

    def _add_imports(self, module: cst.Module) -> cst.Module:
        body = list(module.body)
        present = {_head(s) for s in body if isinstance(s, cst.SimpleStatementLine)}
        missing = [line for line in IMPORTS if line not in present]
        if not missing:
            return module
        at = _unique(body, lambda s: _head(s) == IMPORT_ANCHOR, "module", IMPORT_ANCHOR)
        return module.with_changes(body=[*body[: at + 1], *_statements("\n".join(missing) + "\n"), *body[at + 1 :]])


def _flatten(nodes: Sequence[ast.stmt], depth: int = 0) -> Iterator[tuple[int, str, int, ast.stmt]]:
    """Each statement as one line, a block as its header then its statements one level down;
    ``elif`` reads as ``else:`` then ``if``, which Python makes it."""
    for node in nodes:
        blocks: list[tuple[str, list[ast.stmt]]]
        if isinstance(node, ast.If):
            blocks = [(f"if {ast.unparse(node.test)}:", node.body), ("else:", node.orelse)]
        elif isinstance(node, ast.For):
            header = f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}:"
            blocks = [(header, node.body), ("else:", node.orelse)]
        elif isinstance(node, ast.While):
            blocks = [(f"while {ast.unparse(node.test)}:", node.body), ("else:", node.orelse)]
        elif isinstance(node, ast.With):
            blocks = [("with " + ", ".join(ast.unparse(item) for item in node.items) + ":", node.body)]
        else:
            yield depth, ast.unparse(node), node.lineno, node
            continue
        for header, block in blocks:
            if block:
                line = node.lineno if header != "else:" else block[0].lineno - 1
                yield depth, header, line, node
                yield from _flatten(block, depth + 1)


@functools.cache
def _parsed(known: str) -> tuple[ast.stmt, ...]:
    return tuple(ast.parse(known).body)


@functools.cache
def _known_lines(known: str) -> tuple[_Line, ...]:
    return tuple(_lines_of(known, _parsed(known), 1))


def _lines_of(code: str, nodes: Sequence[ast.stmt], first: int) -> list[_Line]:
    """The lines of ``nodes`` parsed from ``code``, numbered from ``first``."""
    written = code.splitlines()
    return [
        _Line(depth, text, first + line - 1, node, written[line - 1] if 0 < line <= len(written) else text)
        for depth, text, line, node in _flatten(nodes)
    ]


def _known(known: str) -> list[_Line]:
    return list(_known_lines(known))


def _same_line(got: _Line, want: _Line) -> bool:
    return _is_log_line(got.node) if want.text == LOG else got.text == want.text


def _is_log_line(node: ast.stmt | None) -> bool:
    """``logger.<level>(...)`` whose arguments call, assign, await and iterate nothing: removing
    it removes a log line and nothing else."""
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return False
    call = node.value
    func = call.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
        return False
    if func.value.id != "logger" or func.attr not in LOG_LEVELS:
        return False
    effects = (ast.Call, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom, ast.Lambda, ast.Starred, *COMPREHENSIONS)
    arguments = [*call.args, *(keyword.value for keyword in call.keywords)]
    return not any(isinstance(sub, effects) for argument in arguments for sub in ast.walk(argument))


def _same_code(stmt: cst.BaseStatement, code: str) -> bool:
    return ast.dump(ast.parse(_code(stmt.with_changes(leading_lines=[])))) == ast.dump(ast.parse(code))


# -- syntax-tree helpers ----------------------------------------------------------------------

_EMPTY = cst.Module(body=[])


def _code(node: cst.CSTNode) -> str:
    return _EMPTY.code_for_node(node)


def _head(stmt: cst.CSTNode) -> str:
    """The statement's first line as written, whitespace normalised: what the guide locates by."""
    if isinstance(stmt, cst.SimpleStatementLine):
        text = "; ".join(_code(s) for s in stmt.body)
    elif isinstance(stmt, cst.If):
        text = f"if {_code(stmt.test)}:"
    elif isinstance(stmt, cst.With):
        text = "with " + ", ".join(_code(item.item) for item in stmt.items) + ":"
    elif isinstance(stmt, cst.For):
        text = f"for {_code(stmt.target)} in {_code(stmt.iter)}:"
    else:
        return type(stmt).__name__
    return " ".join(text.split())


def _statements(code: str) -> Statements:
    """Parsed after a first statement, so that a leading comment stays with its statement."""
    return list(cst.parse_module("pass\n" + code).body[1:])


def _is_def(name: str) -> Callable[[cst.BaseStatement], bool]:
    return lambda stmt: isinstance(stmt, cst.FunctionDef) and stmt.name.value == name


def _body(stmt: cst.BaseStatement) -> Statements:
    block = getattr(stmt, "body", None)
    return list(block.body) if isinstance(block, cst.IndentedBlock) else []


def _with_body(stmt: cst.BaseStatement, body: Statements, place: str) -> cst.BaseStatement:
    """``stmt`` with ``body`` as its block, which must not be left empty."""
    block = getattr(stmt, "body", None)
    if not isinstance(block, cst.IndentedBlock):
        raise StructureMismatch(place, f"`{_head(stmt)}` holds its statements on its own line")
    if not body:
        raise StructureMismatch(place, f"`{_head(stmt)}` would be left empty")
    return stmt.with_changes(body=block.with_changes(body=body))


def _calls(stmt: cst.BaseStatement, name: str) -> bool:
    return f"{name}(" in _code(stmt)


def _find(stmts: Sequence[cst.BaseStatement], head: str, *, prefix: bool = False) -> int | None:
    for at, stmt in enumerate(stmts):
        if _head(stmt) == head or (prefix and _head(stmt).startswith(head)):
            return at
    return None


def _unique(
    stmts: Sequence[cst.BaseStatement], match: Callable[[cst.BaseStatement], bool], place: str, what: str
) -> int:
    hits = [at for at, stmt in enumerate(stmts) if match(stmt)]
    if len(hits) != 1:
        raise StructureMismatch(place, f"{len(hits)} `{what}`, expected 1")
    return hits[0]


def _edit_block(
    method: cst.BaseStatement, anchor: Callable[[cst.BaseStatement], bool], edit: Edit, place: str
) -> cst.BaseStatement:
    finder = _Anchor(anchor)
    method.visit(finder)
    if finder.found != 1:
        raise StructureMismatch(place, f"{finder.found} lines locating the hook point, expected 1")
    edited = method.visit(_Edit(anchor, edit, place))
    assert isinstance(edited, cst.BaseStatement)
    return edited


class _Anchor(cst.CSTVisitor):
    def __init__(self, anchor: Callable[[cst.BaseStatement], bool]) -> None:
        self.anchor = anchor
        self.found = 0

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self.found += sum(1 for stmt in node.body if self.anchor(stmt))


class _Edit(cst.CSTTransformer):
    """Applies ``edit`` to the block holding the (single) anchor statement, given the block's
    original statements: those carry their lines in the file."""

    def __init__(self, anchor: Callable[[cst.BaseStatement], bool], edit: Edit, place: str) -> None:
        self.anchor, self.edit, self.place = anchor, edit, place

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        for at, stmt in enumerate(original.body):
            if self.anchor(stmt):
                return updated.with_changes(body=self.edit(list(original.body), at, self.place))
        return updated


class _Drop(cst.CSTTransformer):
    """Removes every run ``known`` from the blocks below (each matched against the release)."""

    def __init__(self, codemod: _Codemod, known: str, place: str) -> None:
        self.codemod, self.known, self.place = codemod, known, place
        self.head = _known(known)[0].text
        self.dropped = 0

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        kept: Statements = []
        for before, after in zip(original.body, updated.body, strict=True):
            if self.codemod.lines_of([before])[0].text == self.head:
                self.codemod.match([before], _known(self.known), self.place)
                self.dropped += 1
            else:
                kept.append(after)
        if not kept:
            raise StructureMismatch(self.place, f"`{self.head}` is all its block holds")
        return updated.with_changes(body=kept)


def _method_lines(tree: ast.Module) -> dict[str, int]:
    """Line of each method of the class in the original file, to name places by."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == CLASS:
            return {m.name: m.lineno for m in node.body if isinstance(m, ast.FunctionDef)}
    return {}


def _check_leftovers(tree: ast.Module) -> None:
    """Nothing the bridge replaces is used in the patched class any more."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == CLASS:
            for method in node.body:
                for sub in ast.walk(method):
                    name = sub.attr if isinstance(sub, ast.Attribute) else sub.id if isinstance(sub, ast.Name) else ""
                    if name in REPLACED_NAMES:
                        method_name = getattr(method, "name", "?")
                        raise StructureMismatch(
                            f"{CLASS}.{method_name}",
                            f"`{name}` is still used (line {getattr(sub, 'lineno', '?')} of the patched form)",
                        )
