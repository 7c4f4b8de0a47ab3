"""A job's batch script: `sbatch` renders a `JobSpec` through the shipped template (or the
user's), from one typed context (`sbatch.Context`); `templating` quotes what reaches a shell;
`container` has the words that start each rank in an image."""
