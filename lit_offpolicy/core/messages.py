"""Errors from other libraries, told in one line: vLLM's pydantic reports, C++ stacks, HTTP errors."""

from __future__ import annotations


def one_line(error: BaseException, limit: int = 300) -> str:
    """``error``'s message as one line: its lines joined, links left out, at most ``limit`` characters;
    its type's name where it has no message."""
    lines = [line.strip() for line in str(error).splitlines()]
    text = " ".join(line for line in lines if line and "https://" not in line)
    if not text:
        return type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
