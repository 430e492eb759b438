"""Everything the update needs: teacher-forced forward passes, packing and per-sample attention,
micro-batches, compile, the step's metrics and non-finite guard, strategies, checkpointing, the
module's option groups, the optimizer and schedule, and reward/advantage shaping of a batch."""
