"""``rls fastdeploy patch``: the integration guide applied to FastDeploy's ``cache_messager.py``.

A codemod on the file's concrete syntax tree (libcst): it edits ``CacheMessagerV1`` as it stands
in release/2.6 with PR 7872, at the places the *Patching* section of docs/fastdeploy.md names, and
leaves every other byte of the file as it was (the older ``CacheMessager`` class included).

Each place is found by one line of FastDeploy's file and must be in its fixed form (patched then)
or in its patched form (left alone), so patching twice changes nothing. Anything else refuses the
whole file with ``StructureMismatch`` naming the first place that did not match: a file of
another release is never half patched, and code the guide does not know is never deleted (a block
the codemod removes may only log, build the signal lists, touch the pending dict and put on the
sender's queue).
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import libcst as cst

CLASS = "CacheMessagerV1"
RELEASE = "FastDeploy release/2.6 with PR 7872"

IMPORT_ANCHOR = "import paddle"
"""The imports go after this one: with the third-party imports, where isort puts them."""
IMPORTS = (
    "from redis_layer_signals import SignalBuffer",
    "from redis_layer_signals.fastdeploy import Layer0Bridge",
)

QUEUE_ANCHOR = "self.cache_prefilled_engine_ids_queue ="
THREADS = 'if splitwise_role == "prefill":'
TASK_LOCK = "with self.engine_cache_task_thread_lock:"
PENDING_LOCK = "with self.pending_layer0_signal_lock:"
SENDER_FINISH = "if end_layer_idx == self.num_layers - 1:"

BRIDGE = """\
# redis-layer-signals: early layer-0 signals wait in Redis (docs/fastdeploy.md). Built before the
# consumer and adder threads start; RLS_REDIS_URL, RLS_NAMESPACE, RLS_RETRY_S, ... configure it.
self.layer0 = Layer0Bridge(
    SignalBuffer.from_url(),
    instance=f"{pod_ip}-{engine_worker_queue_port}".replace(":", "-"),
    rank=self.rank_id,
    block_size=block_size,
    num_layers=num_layers,
    ready=lambda: self.cache_prefilled_engine_ids_queue,
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
REPLACED_STATE = ("self.pending_layer0_signals", "self.pending_layer0_signal_lock")
"""The messager's attributes the bridge replaces: a removed statement may write them."""
REMOVABLE_CALLS = ("threading.Lock", "self.pending_layer0_signals.pop", "self.cache_prefilled_engine_ids_queue.put")
"""Besides ``logger.*`` and ``<list>.append``, the only calls a removed block may make."""


class StructureMismatch(ValueError):
    """The file is not the one the codemod knows (another release, or edited by hand): nothing
    is written. ``place`` names the first place that did not match."""

    def __init__(self, place: str, problem: str) -> None:
        super().__init__(f"{place}: {problem} (the codemod knows {CLASS} of {RELEASE}); nothing written")
        self.place = place
        self.problem = problem


@dataclass(frozen=True)
class PatchResult:
    original: bytes
    patched: bytes

    @property
    def changed(self) -> bool:
        return self.original != self.patched

    def diff(self, name: str) -> str:
        """The unified diff from the file to its patched form, ``a/NAME`` to ``b/NAME``."""
        before = self.original.decode("utf-8").splitlines(keepends=True)
        after = self.patched.decode("utf-8").splitlines(keepends=True)
        return "".join(difflib.unified_diff(before, after, f"a/{name}", f"b/{name}"))


def patch_source(source: bytes) -> PatchResult:
    """Apply the integration to the text of a ``cache_messager.py``; raises StructureMismatch."""
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        raise StructureMismatch("module", f"not Python that parses: {exc.message}") from exc
    lines = _method_lines(source)
    module = _add_imports(module)
    body: Statements = list(module.body)
    at = _unique(body, lambda s: isinstance(s, cst.ClassDef) and s.name.value == CLASS, "module", f"class {CLASS}")
    cls = body[at]
    assert isinstance(cls, cst.ClassDef)
    methods = _body(cls)
    for name, anchor, edit in _POINTS:
        place = f"{CLASS}.{name} (def at line {lines.get(name, '?')})"
        where = _unique(methods, _is_def(name), place, f"def {name}")
        methods[where] = _edit_block(methods[where], anchor, edit, place)
    body[at] = _with_body(cls, methods, CLASS)
    patched = module.with_changes(body=body).bytes
    _check_leftovers(patched)
    return PatchResult(source, patched)


# -- the places -------------------------------------------------------------------------------

Statements = list[cst.BaseStatement]
Edit = Callable[[Statements, int, str], Statements]


def _init(stmts: Statements, i: int, place: str) -> Statements:
    """Build the bridge right after the sender's queue, before the threads start; the pending
    dict and its lock go."""
    threads = _find(stmts, THREADS)
    if threads is None or threads < i:
        raise StructureMismatch(place, f"no `{THREADS}` (the consumer and adder threads) after `{QUEUE_ANCHOR} ...`")
    if _find(stmts, "self.layer0 = Layer0Bridge(", prefix=True) is not None:
        if _head(stmts[i + 1]).startswith("self.layer0 = Layer0Bridge(") and threads == i + 2:
            return stmts
        raise StructureMismatch(place, "`self.layer0 = Layer0Bridge(...)` is not between the queue and the threads")
    new = [*stmts[: i + 1], *_statements(BRIDGE), *stmts[i + 1 :]]
    new = _take(new, "self.pending_layer0_signals = {}", place, before=i)
    return _take(new, "self.pending_layer0_signal_lock = threading.Lock()", place, before=i)


def _consume_signals(stmts: Statements, i: int, place: str) -> Statements:
    """Progress stays under the lock; the ready/pending split, its logs and the queue put go; the
    bridge sees the signal after the lock."""
    if i + 1 < len(stmts) and _calls(stmts[i + 1], "self.layer0.on_kv_signal"):
        return stmts
    with_lock = stmts[i]
    inner = _body(with_lock)
    loop = _find(inner, "for bi in range(tasks_count):")
    if loop is None:
        raise StructureMismatch(place, f"no `for bi in range(tasks_count):` in `{TASK_LOCK}`")
    inner[loop] = _with_body(inner[loop], _take(_body(inner[loop]), "if layer_id == 0:", place), place)
    inner = _take(inner, "if pending_engine_signals:", place)
    new = [*stmts[:i], _with_body(with_lock, inner, place), *_statements(ON_KV_SIGNAL)]
    tail = stmts[i + 1 :]
    tail = _take(tail, "if pending_engine_signals:", place, before=1)
    tail = _take(tail, "if ready_engine_signals:", place, before=1)
    new = _take(new, "ready_engine_signals = []", place, before=i)
    new = _take(new, "pending_engine_signals = []", place, before=i - 1)
    return [*new, *tail]


def _add_cache_task(stmts: Statements, i: int, place: str) -> Statements:
    """The task enters ``idx_cache_task_dict`` under the lock; the pop from the pending dict and
    the recovered-signal block go; the bridge registers the task after the lock."""
    if i + 1 < len(stmts) and _calls(stmts[i + 1], "self.layer0.on_cache_task"):
        return stmts
    with_lock = stmts[i]
    inner = _body(with_lock)
    if _find(inner, "self.idx_cache_task_dict[current_id] = current_info") is None:
        raise StructureMismatch(place, f"no `self.idx_cache_task_dict[current_id] = current_info` in `{TASK_LOCK}`")
    new = [*stmts[:i], _with_body(with_lock, _take(inner, PENDING_LOCK, place), place), *_statements(ON_CACHE_TASK)]
    return [*new, *_take(stmts[i + 1 :], "if recovered_signal is not None:", place, before=1)]


def _sender_finish(stmts: Statements, i: int, place: str) -> Statements:
    """The finished slots are released in the buffer before the lock; the pop from the pending
    dict at the end of the loop goes."""
    block = _body(stmts[i])
    if block and _calls(block[0], "self.layer0.on_task_finished"):
        return stmts
    at = _find(block, TASK_LOCK)
    if at is None:
        raise StructureMismatch(place, f"no `{TASK_LOCK}` in `{SENDER_FINISH}`")
    dropper = _Drop(PENDING_LOCK, place)
    released = block[at].visit(dropper)
    if dropper.dropped != 1:
        raise StructureMismatch(place, f"{dropper.dropped} `{PENDING_LOCK}` in `{SENDER_FINISH}`, expected 1")
    assert isinstance(released, cst.BaseStatement)
    block = [*block[:at], *_statements(ON_TASK_FINISHED), released, *block[at + 1 :]]
    return [*stmts[:i], _with_body(stmts[i], block, place), *stmts[i + 1 :]]


_POINTS: tuple[tuple[str, Callable[[cst.BaseStatement], bool], Edit], ...] = (
    ("__init__", lambda s: _head(s).startswith(QUEUE_ANCHOR), _init),
    ("_add_cache_task_thread", lambda s: _head(s) == TASK_LOCK, _add_cache_task),
    ("prefill_layerwise_send_cache_thread", lambda s: _head(s) == SENDER_FINISH, _sender_finish),
    ("consume_signals", lambda s: _head(s) == TASK_LOCK, _consume_signals),
)
"""Each place: the method, the line that locates it, and the edit of the block holding that line."""


def _add_imports(module: cst.Module) -> cst.Module:
    body = list(module.body)
    present = {_head(s) for s in body if isinstance(s, cst.SimpleStatementLine)}
    missing = [line for line in IMPORTS if line not in present]
    if not missing:
        return module
    at = _unique(body, lambda s: _head(s) == IMPORT_ANCHOR, "module", f"`{IMPORT_ANCHOR}`")
    return module.with_changes(body=[*body[: at + 1], *_statements("\n".join(missing) + "\n"), *body[at + 1 :]])


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
    assert isinstance(block, cst.IndentedBlock)
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


def _take(stmts: Statements, head: str, place: str, *, before: int | None = None) -> Statements:
    """``stmts`` without the statement ``head`` (which must be there, before index ``before``
    when given) after checking it only does what the bridge replaces."""
    at = _find(stmts, head)
    if at is None or (before is not None and at >= before):
        raise StructureMismatch(place, f"no `{head}` where the guide removes it")
    _check_removable(stmts[at], place)
    return [*stmts[:at], *stmts[at + 1 :]]


def _check_removable(stmt: cst.BaseStatement, place: str) -> None:
    tree = ast.parse(_code(stmt.with_changes(leading_lines=[])))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            call = ast.unparse(node.func)
            if not (call.startswith("logger.") or call.endswith(".append") or call in REMOVABLE_CALLS):
                raise StructureMismatch(place, f"`{_head(stmt)}` calls `{call}`, which the guide does not remove")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                names = [target] if not isinstance(target, ast.Tuple) else target.elts
                for name in names:
                    state = name.value if isinstance(name, ast.Subscript) else name
                    ok = isinstance(name, ast.Name) or ast.unparse(state) in REPLACED_STATE
                    if not ok:
                        text = ast.unparse(name)
                        raise StructureMismatch(place, f"`{_head(stmt)}` writes `{text}`, which the guide keeps")


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
    """Applies ``edit`` to the block holding the (single) anchor statement."""

    def __init__(self, anchor: Callable[[cst.BaseStatement], bool], edit: Edit, place: str) -> None:
        self.anchor, self.edit, self.place = anchor, edit, place

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        for at, stmt in enumerate(updated.body):
            if self.anchor(stmt):
                return updated.with_changes(body=self.edit(list(updated.body), at, self.place))
        return updated


class _Drop(cst.CSTTransformer):
    """Removes every statement ``head`` from the blocks below (each checked as removable)."""

    def __init__(self, head: str, place: str) -> None:
        self.head, self.place = head, place
        self.dropped = 0

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        kept: Statements = []
        for stmt in updated.body:
            if _head(stmt) == self.head:
                _check_removable(stmt, self.place)
                self.dropped += 1
            else:
                kept.append(stmt)
        if not kept:
            raise StructureMismatch(self.place, f"`{self.head}` is all its block holds")
        return updated.with_changes(body=kept)


def _method_lines(source: bytes) -> dict[str, int]:
    """Line of each method of the class in the original file, to name places by."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == CLASS:
            return {m.name: m.lineno for m in node.body if isinstance(m, ast.FunctionDef)}
    return {}


def _check_leftovers(patched: bytes) -> None:
    """Nothing the bridge replaces is used in the patched class any more."""
    for node in ast.parse(patched).body:
        if isinstance(node, ast.ClassDef) and node.name == CLASS:
            for method in node.body:
                for sub in ast.walk(method):
                    name = sub.attr if isinstance(sub, ast.Attribute) else sub.id if isinstance(sub, ast.Name) else ""
                    if name in REPLACED_NAMES:
                        method_name = getattr(method, "name", "?")
                        raise StructureMismatch(
                            f"{CLASS}.{method_name}", f"`{name}` is still used (line {getattr(sub, 'lineno', '?')})"
                        )
