"""A Python function as a job, run on every rank: `executor` submits it in submitit's style
(results, arrays, `Checkpointable`), `call` runs it on each rank and keeps its outcome."""
