"""``python -m slurmddp.supervisor``: the batch script hands its job over (`supervise.main`)."""

from slurmddp.supervisor.supervise import main

raise SystemExit(main())
