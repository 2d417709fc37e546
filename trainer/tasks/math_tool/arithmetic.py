"""Arithmetic problems too hard to do in the head (ReTool-style cold start and RL data).

Each problem is a short integer expression ("What is 4817 * 392?", "What is 73 * 845 +
129 * 64?"); solving it reliably needs the Python tool. Problems come from one
deterministic, de-duplicated stream per ``seed``: rows ``[offset, offset + n)`` of the
stream, so ``retool_arithmetic_samples(n, seed)`` and
``retool_arithmetic_samples(m, seed, offset=n)`` never share a problem (disjoint
train / held-out splits; :func:`arithmetic_splits` does exactly that).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

#: Problem kinds, drawn uniformly: ``mul`` = 4-digit × 3-digit with a 7-digit product (one fixed
#: shape: copying it is a fixed-offset copy, the easiest for tiny models);
#: ``sum_of_products`` = 2-digit × 3-digit + 3-digit × 2-digit; ``mul_minus`` = 3 × 3-digit − 4-digit.
KINDS = ("mul", "sum_of_products", "mul_minus")


def _expression(rng: random.Random, kinds: Sequence[str]) -> tuple[str, int]:
    """One random expression (Python syntax, spaces around operators) and its value."""
    kind = rng.choice(kinds)
    if kind == "mul":  # 4-digit × 3-digit with a 7-digit product: every problem has one shape
        while True:
            a, b = rng.randint(1000, 9999), rng.randint(100, 999)
            if a * b >= 1_000_000:
                return f"{a} * {b}", a * b
    if kind == "sum_of_products":  # 2-digit × 3-digit + 3-digit × 2-digit
        a, b, c, d = rng.randint(10, 99), rng.randint(100, 999), rng.randint(100, 999), rng.randint(10, 99)
        return f"{a} * {b} + {c} * {d}", a * b + c * d
    a, b, c = rng.randint(100, 999), rng.randint(100, 999), rng.randint(1000, 9999)  # mul_minus
    return f"{a} * {b} - {c}", a * b - c


def expression_of(problem: str) -> str:
    """The expression inside ``"What is <expr>?"`` (the text a solver passes to Python).

    Raises:
        ValueError: if ``problem`` is not of that form.
    """
    if not (problem.startswith("What is ") and problem.endswith("?")):
        raise ValueError(f"problem={problem!r}: expected 'What is <expression>?'")
    return problem[len("What is "):-1]


def retool_arithmetic_samples(n: int, seed: int, offset: int = 0,
                              kinds: Sequence[str] = KINDS) -> list[dict[str, str]]:
    """Rows ``[offset, offset + n)`` of the de-duplicated problem stream of ``seed``.

    Args:
        n: number of problems (>= 0).
        seed: stream seed (``random.Random(seed)``; the same on every platform).
        offset: rows of the stream to skip (>= 0); use disjoint ranges for disjoint splits.
        kinds: subset of :data:`KINDS` (the stream depends on it: use the same for all splits).

    Returns:
        ``n`` dicts ``{"id": "arith-<seed>-<index>", "problem": "What is 4817 * 392?",
        "answer": "1888264"}``; ``answer`` is the exact integer value as a decimal string.

    Raises:
        ValueError: if ``n`` or ``offset`` is negative or not an int, or ``kinds`` is empty or
            has an unknown kind.
    """
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad or isinstance(kinds, str):
        raise ValueError(f"retool_arithmetic_samples: kinds={kinds!r} must be a non-empty sequence "
                         f"of {KINDS}")
    for name, v in (("n", n), ("offset", offset)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"retool_arithmetic_samples: {name}={v!r} must be an int >= 0")
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict[str, str]] = []
    index = 0
    while len(rows) < n:
        expr, value = _expression(rng, tuple(kinds))
        if expr in seen:
            continue
        seen.add(expr)
        if index >= offset:
            rows.append({"id": f"arith-{seed}-{index}", "problem": f"What is {expr}?",
                         "answer": str(value)})
        index += 1
    return rows


def arithmetic_splits(n_train: int, n_eval: int, seed: int, kinds: Sequence[str] = KINDS
                      ) -> tuple[list[dict], list[dict]]:
    """Disjoint ``(train, held_out)`` problem lists: stream rows ``[0, n_train)`` and
    ``[n_train, n_train + n_eval)`` of ``seed`` (see :func:`retool_arithmetic_samples`)."""
    return (retool_arithmetic_samples(n_train, seed, kinds=kinds),
            retool_arithmetic_samples(n_eval, seed, offset=n_train, kinds=kinds))
