"""Which packages the wheel holds: every package under slurmddp/, found, never listed by hand (a
list once left slurmddp.watchdog out of the wheel), and templates/ (data at the repository root)
as slurmddp.templates. Everything else about the build is in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["slurmddp", "slurmddp.*"]), "slurmddp.templates"])
