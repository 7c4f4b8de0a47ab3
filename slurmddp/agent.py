"""``python -m slurmddp.agent [torchrun options] ...``: torchrun's agent (`slurmddp.rank.agent`)."""

from slurmddp.rank.agent import main

if __name__ == "__main__":
    main()
