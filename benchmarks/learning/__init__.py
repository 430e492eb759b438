"""Whole ``lit-offpolicy fit`` runs judged by what they learn (reward, accuracy, time to an accuracy) or
hold steady over thousands of steps (soak): sync against async, distillation against RL, each recipe."""

import argparse


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a count of jobs or steps)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed values: a whole number of at least 1")
    return value
