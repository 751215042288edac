"""Batches explicit (issue 71): the model holds no batch, a decoder never touches one, and every model call
of a decoder says at the call whether it joins its generation's batch (``joins=``) and so may yield to the
other sequences. Read from the source with :mod:`ast`; nothing is imported but the import graph's reader.

A decoder hands the batch it was given (:attr:`selfspec.decoding.base.DecodeState.joins`) to the runtime
as an opaque value: ``model.forward(..., joins=state.joins)``. The batch's scheduling
(:mod:`selfspec.models.batch`: parking, greenlets, its counters) is the runtime's business.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_imports import SRC, imports

DECODING = SRC / "selfspec" / "decoding"
#: what only the batch and the runtime touch: the batch's parking calls, its greenlet, the batched walk
BATCH_INTERNALS = {"parked_walk", "parked_head", "_parks", "_main", "run_batched"}
#: the model calls (and a decoder's helpers around them) that may join a batch: each call of one of these
#: in a decoder module hands the batch on, or is listed in :data:`ALONE` with the reason it runs alone
JOINING = {"forward", "run_layers", "logits", "head", "draft_logits", "model_logits", "sublayer_states",
           "knapspec_search", "_next_candidates"}
#: (module, function holding the call, called name) -> why that call is handed no batch
ALONE = {
    ("branches", "branch_pass", "forward"): "a search's branch pass runs alone, within its generation, as it did "
                                            "when the search called the sublayers directly",
}


def _decoder_modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(), str(path)) for path in sorted(DECODING.glob("*.py"))}


def _where(module: str, node: ast.AST) -> str:
    return f"src/selfspec/decoding/{module}.py:{node.lineno}"


def _called(node: ast.Call) -> str | None:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _enclosing_functions(tree: ast.Module) -> dict[ast.AST, str]:
    """Each node of ``tree`` -> the name of the innermost function holding it ("" at module level)."""
    out: dict[ast.AST, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else name
            out[child] = inner
            visit(child, inner)

    visit(tree, "")
    return out


def _hands_joins(call: ast.Call) -> bool:
    """Whether ``call`` hands a batch on: a ``joins=`` keyword, or an argument that is ``joins`` or
    ``<something>.joins`` (``joins=None`` hands none: a call that runs alone is listed in :data:`ALONE`
    with its reason)."""
    def is_joins(v: ast.AST) -> bool:
        return isinstance(v, ast.Name) and v.id == "joins" or isinstance(v, ast.Attribute) and v.attr == "joins"

    return any(k.arg == "joins" and is_joins(k.value) for k in call.keywords) or any(map(is_joins, call.args))


def test_no_decoder_module_imports_the_batch():
    """No module of ``selfspec.decoding`` imports :mod:`selfspec.models.batch` (anywhere: at module level,
    in a function, under ``TYPE_CHECKING``) or ``greenlet``: the type a decoder names is
    :data:`selfspec.models.layered.Joins`."""
    found = [f"{imp.path.relative_to(SRC.parent)}:{imp.line}: {imp.source} imports {imp.target}" for imp in imports()
             if imp.source.startswith("selfspec.decoding") and imp.target == "selfspec.models.batch"]
    for module, tree in _decoder_modules().items():
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{_where(module, node)}: imports {n}" for n in names if n.split(".")[0] == "greenlet"]
            if isinstance(node, ast.ImportFrom) and any(a.name == "Batch" for a in node.names):
                found.append(f"{_where(module, node)}: imports Batch from {node.module}")
    assert not found, "decoder modules importing the batch:\n" + "\n".join(found)


def test_no_decoder_module_touches_batch_state():
    """A decoder module reads no batch off anything (``model.batch`` and the like), sets none, builds
    none, and does nothing with the batch it is handed but hand it on: no attribute of a ``joins`` value
    is read, no ``joins`` attribute is assigned, none of the batch's internals is named."""
    found = []
    for module, tree in _decoder_modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                if node.attr == "batch" or node.attr in BATCH_INTERNALS:
                    found.append(f"{_where(module, node)}: .{node.attr}")
                if (isinstance(node.value, ast.Attribute) and node.value.attr == "joins"
                        or isinstance(node.value, ast.Name) and node.value.id == "joins"):
                    found.append(f"{_where(module, node)}: reads .{node.attr} of a batch it was handed")
                if node.attr == "joins" and isinstance(node.ctx, (ast.Store, ast.Del)):
                    found.append(f"{_where(module, node)}: sets .joins")
            elif isinstance(node, ast.Name) and node.id in ("Batch", "Walk"):
                found.append(f"{_where(module, node)}: names {node.id}")
            elif isinstance(node, ast.Call) and _called(node) in ("setattr", "getattr", "delattr") and any(
                    isinstance(a, ast.Constant) and a.value in ("batch", "joins") for a in node.args):
                found.append(f"{_where(module, node)}: {_called(node)}(..., {node.args[1].value!r})")
    assert not found, "decoder modules touching batch state:\n" + "\n".join(found)


def test_the_model_holds_no_batch():
    """Nothing in ``src/selfspec`` sets a ``batch`` attribute on anything (the model's, which a batch
    set and a method swapped around its scratch pass, is gone)."""
    found = []
    for path in sorted((SRC / "selfspec").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "batch" and isinstance(node.ctx, (ast.Store, ast.Del)):
                found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}")
    assert not found, "a batch set on an object:\n" + "\n".join(found)


def test_every_model_call_of_a_decoder_says_whether_it_joins():
    """Every call in a decoder module of a model pass or head product (or a helper around them:
    :data:`JOINING`) hands its generation's batch on (``joins=...``: the call may yield to the other
    sequences), or is one of :data:`ALONE`, each with its reason; and every listed call still exists."""
    found, seen = [], set()
    for module, tree in _decoder_modules().items():
        where = _enclosing_functions(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or _called(node) not in JOINING:
                continue
            key = (module, where[node], _called(node))
            if key in ALONE:
                seen.add(key)
                continue
            if not _hands_joins(node):
                found.append(f"{_where(module, node)}: {_called(node)}(...) in {where[node]}() says nothing of joins")
    assert not found, ("model calls that do not say whether they join the generation's batch (hand joins=..., "
                       "or list the call in ALONE with why it runs alone):\n" + "\n".join(found))
    assert seen == set(ALONE), f"listed in ALONE, no longer in the code: {sorted(set(ALONE) - seen)}"


def test_the_reader_sees_each_kind_of_breach(tmp_path, monkeypatch):
    """The scans find what they look for (a guard against scans that find nothing and so pass
    everything): an import of the batch, a batch read off the model and swapped, a batch's counter
    read, a model call that says nothing of joins and one handed ``joins=None`` outside :data:`ALONE`;
    the calls that hand the batch on pass."""
    import test_joins

    bad = tmp_path / "decoding"
    bad.mkdir()
    (bad / "bad.py").write_text(
        "from selfspec.models.batch import Batch\n"
        "def step(model, state, x):\n"
        "    saved, model.batch = model.batch, None\n"
        "    n = state.joins.rounds\n"
        "    return model.forward(x, state.cache, ledger=state.ledger)\n"
        "def fine(model, state, x):\n"
        "    return model.logits(model.forward(x, state.cache, joins=state.joins), state.ledger, state.joins)\n"
        "def alone_unsaid(model, state, x):\n"
        "    return model.run_layers(x, state.cache, joins=None)\n")
    monkeypatch.setattr(test_joins, "DECODING", bad)
    monkeypatch.setattr(test_joins, "ALONE", {})
    for check, says in ((test_no_decoder_module_imports_the_batch, ("bad.py:1: imports Batch",)),
                        (test_no_decoder_module_touches_batch_state, ("bad.py:3: .batch", "bad.py:4: reads .rounds")),
                        (test_every_model_call_of_a_decoder_says_whether_it_joins, ("bad.py:5: forward",
                                                                                     "bad.py:9: run_layers"))):
        try:
            check()
        except AssertionError as err:
            assert all(s in str(err) for s in says), str(err)
            assert "bad.py:7" not in str(err)
        else:
            raise AssertionError(f"{check.__name__} found nothing in {bad / 'bad.py'}")
