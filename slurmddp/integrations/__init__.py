"""The frameworks users train with, under slurmddp's stop protocol: one line each.

Each module imports its framework only when it is imported itself (importing slurmddp never
requires one) and turns the agreed stop (`slurmddp.should_stop`) into the framework's own
checkpoint, then `slurmddp.requeue`; the next run resumes from that checkpoint, and the end of
the work is `slurmddp.mark_done`. `transformers`: the Hugging Face Trainer (`train`);
`accelerate`: an Accelerate loop (`Preemptible`); `lightning`: a Lightning fit (`fit`).
"""
