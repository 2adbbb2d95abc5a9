"""Structural rules of the code base that a reviewer would otherwise check by hand."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("router_client", "predictor")
MAX_FUNCTION_LINES = 80


def _functions():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield path.relative_to(ROOT), node


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_over_the_limit(package):
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, node in _functions() if path.parts[0] == package
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


def test_no_assert_statements_in_the_packages():
    """Contract violations raise the project's errors: ``python -O`` strips asserts."""
    found = [f"{path}:{node.lineno}" for package in PACKAGES
             for path in sorted((ROOT / package).rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Assert)]
    assert found == []
