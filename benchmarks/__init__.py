"""Benchmarks: each one measures slurmddp against a baseline in the same invocation.

    python -m benchmarks                 # all of them, a table of medians and ratios
    python -m benchmarks checkpoint      # one of them

Contenders alternate run by run, so drift of the machine (page cache, other load) hits both.
Numbers are only ever compared within one run on one machine; no test asserts a time.
"""
