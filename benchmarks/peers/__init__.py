"""Against another project: the same work done by TRL's ``GRPOTrainer`` (its side runs in ``.venv-bench``,
which ``make bench-env`` builds)."""
