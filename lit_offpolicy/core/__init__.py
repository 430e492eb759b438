"""The bottom layer, shared by the update and the rollout sides: the records they exchange
(``Experience``, ``Generation``, ``RolloutResult``, ``StepRecord``), the registry, argument checks,
masked reductions, the log-prob maths, cross-rank collectives, file modes and process metrics.
Nothing here imports from another ``lit_offpolicy`` package."""
