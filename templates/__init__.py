"""The Jinja templates, shipped inside the wheel as the package slurmddp.templates."""
