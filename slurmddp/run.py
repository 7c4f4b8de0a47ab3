"""``python -m slurmddp.run [options] SCRIPT [ARGS...]``: the runner, `slurmddp.rank.runner`."""

from slurmddp.rank.runner import exit_process, main

if __name__ == "__main__":
    exit_process(main())
