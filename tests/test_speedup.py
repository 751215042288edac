"""The speedup is defined once (:mod:`selfspec.measure.speedup`, docs/design/contracts.md §2.6)."""

from pathlib import Path

from selfspec.measure.speedup import per_token, speedup

ROOT = Path(__file__).resolve().parents[1]


def test_speedup_is_vanilla_seconds_per_token_over_the_methods():
    assert speedup(per_token(10.0, 100), per_token(5.0, 100)) == 2.0
    assert speedup(0.02, 0.04) == 0.5
    for missing in ((None, 1.0), (1.0, None), (0.0, 1.0), (1.0, 0.0)):
        assert speedup(*missing) is None
    assert per_token(1.0, 0) is None and per_token(None, 3) is None and per_token(0.0, 4) == 0.0


def _divides(node) -> bool:
    import ast

    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) for n in ast.walk(node))


def _named_speedup(node) -> bool:
    import ast

    text = ast.unparse(node)
    return "speedup" in text


def test_every_speedup_is_computed_by_the_one_function():
    """No module divides its own speedup: a name, attribute, subscript or dict key holding
    "speedup" set from a quotient is refused, wherever it is (the issue 53 review found ten such
    places in seven files)."""
    import ast

    found = []
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]:
        if path.name == "speedup.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            pairs = []
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                pairs = [(node.target, node.value)]
            elif isinstance(node, ast.Dict):
                pairs = [(k, v) for k, v in zip(node.keys, node.values) if k is not None]
            elif isinstance(node, ast.keyword) and node.arg:
                pairs = [(ast.Constant(node.arg), node.value)]
            for target, value in pairs:
                if _named_speedup(target) and _divides(value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno if hasattr(node, 'lineno') else value.lineno}: "
                                 f"{ast.unparse(value)}")
    assert not found, "\n".join(found)
