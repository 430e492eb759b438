"""Whole ``lit-offpolicy fit`` runs judged by what they learn (reward, accuracy, time to an accuracy) or
hold steady over thousands of steps (soak): sync against async, distillation against RL, each recipe."""
