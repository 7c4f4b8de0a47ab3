"""``python -m slurmddp.run [options] SCRIPT [ARGS...]``: the runner, `slurmddp.launch.runner`."""

from slurmddp.launch.runner import exit_process, main

if __name__ == "__main__":
    exit_process(main())
