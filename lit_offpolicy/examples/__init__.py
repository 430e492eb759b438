"""Runnable examples, not library code: ``python -m lit_offpolicy.examples.demo`` (``make demo``)
and ``python -m lit_offpolicy.examples.tool_demo``."""
