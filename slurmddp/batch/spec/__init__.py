"""What a job is: its options declared once (`options`), configuration files and cluster
profiles with the source of every value (`config`, `profiles`), and the frozen, valid-by-
construction `JobSpec` (`jobspec`). Pure: nothing here asks Slurm or writes a file."""
