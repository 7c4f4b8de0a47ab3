"""``python -m slurmddp.agent [torchrun options] ...``: torchrun's agent
(`slurmddp.launch.agent`)."""

from slurmddp.launch.agent import main

if __name__ == "__main__":
    main()
