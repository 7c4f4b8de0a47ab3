"""A job's story: what happened to each of its runs, recorded as it happens, and told.

One file per job, ``<output dir>/<job id>/events.jsonl`` (``$SLURMDDP_EVENTS_FILE``), holds one
JSON object a line, appended by the processes that know each fact:

- the supervisor (`slurmddp.supervisor`): a run started on its nodes (``run``), the hang
  watchdog's verdict (``hang``), what happens to the job (``decision``: requeued k of N, a node
  left behind, ended) and, once no run follows, ``end``;
- global rank 0: the first step (``training``), the agreed stop (``stop``), a checkpoint written
  (``checkpoint``), a resume (``resumed``), the work done (``done``), torchrun's agents' lost
  nodes (``agent``);
- the hang watchdog's monitor: each rank's step count, a period apart (``progress``).

It is the single source of what ``slurmddp logs -f`` and ``submit --follow`` interleave with
rank 0's output, of ``slurmddp status``'s columns and ``--json``, and of ``slurmddp report``'s
page. `events` writes and reads it; `summary` turns it into runs, steps and time lost by cause,
and goodput (pure); `report` draws it (pure). Writing an event never fails the training: a file
that cannot be written is said once, and the job goes on without its story.
"""
