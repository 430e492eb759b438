"""The ``calculator`` tool: arithmetic on numbers, evaluated from the expression's syntax tree (no
``eval``): + − × / // % ** and parentheses; anything else is refused with a ValueError."""

from __future__ import annotations

import ast
import operator

MAX_EXPRESSION_LENGTH = 200
MAX_EXPONENT = 64

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """The value of an arithmetic ``expression`` such as "3+4*5" or "(7-9)+2"; an integral result
    is written without a decimal point ("23", not "23.0")."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_LENGTH:
        raise ValueError(f"expression must be a string of at most {MAX_EXPRESSION_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large; at most {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(
        f"{ast.unparse(node)!r} is not arithmetic: numbers, + - * / // % ** and parentheses only"
    )
