"""The preflight (``slurmddp submit --preflight``): is this node fit to train on? Run on every
node, one task each, by ``python -m slurmddp.run -m slurmddp.launch.preflight`` before the job's
step.

First this node's own checks: every GPU it shows computes a matrix product right. A failure
raises `NodeCheckError`, which the supervisor's decision lays on this node
(`slurmddp.preemption.nodes`): the job is requeued without it. Then the collectives of
``slurmddp doctor --check`` across the nodes; their failure cannot be laid on one node, and ends
the job with the doctor's table in the preflight log.
"""

from __future__ import annotations

from slurmddp.errors import NodeCheckError

# Seconds each collective may take: a healthy allocation answers in well under one.
COLLECTIVE_TIMEOUT_S = 60.0
_SIZE = 256  # a matrix product big enough to run on every GPU core, small enough to take ms


def check_gpus() -> int:
    """Raise `NodeCheckError` unless each visible GPU multiplies two matrices as the CPU does;
    the number of GPUs checked."""
    import torch

    if not torch.cuda.is_available():
        return 0
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(_SIZE, _SIZE, generator=gen), torch.randn(_SIZE, _SIZE, generator=gen)
    want = a @ b
    for i in range(torch.cuda.device_count()):
        try:
            name = torch.cuda.get_device_name(i)
            got = (a.to(f"cuda:{i}") @ b.to(f"cuda:{i}")).cpu()
        except Exception as e:  # a broken GPU fails in many ways: each is this node's
            raise NodeCheckError(f"GPU {i} failed a matrix product: {type(e).__name__}: "
                                 f"{e}".splitlines()[0]) from e  # fmt: skip
        error = (got - want).abs().max().item()
        if not error < 1e-2 * _SIZE ** 0.5:  # TF32 may be on: its rounding, not a broken GPU
            raise NodeCheckError(f"GPU {i} ({name}) computed a wrong matrix product "
                                 f"(largest error {error:g})")  # fmt: skip
    return torch.cuda.device_count()


def main() -> int:
    """This node's checks, then the collectives across the nodes; 0 when all pass."""
    from slurmddp.launch import doctor
    from slurmddp.rank.bootstrap import bootstrap

    check_gpus()
    return doctor.run_checks(bootstrap(), "auto", COLLECTIVE_TIMEOUT_S)


if __name__ == "__main__":
    raise SystemExit(main())
