"""``--local``: the same batch script and supervisor on this machine, with `emulation`'s
stand-ins of srun and scontrol."""
