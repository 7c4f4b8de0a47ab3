"""How the ranks are started and run, above the pure placement of `slurmddp.rank`.

`runner` is ``python -m slurmddp.run``: it places the rank (`slurmddp.rank`), takes the stop
signal (`slurmddp.preemption`), runs the script and reports its failure in one line; `agent` is
torchrun's agent (``python -m slurmddp.agent``), which relays the stop signal to its workers and
gives each restart a store of its own; `startup` is the bounded rendezvous that names who is
missing; `process_group` initialises torch.distributed (`slurmddp.init`); `doctor` is ``slurmddp
doctor``, with `network` the interface gloo and NCCL would take on this node, and `preflight` a
node's checks before training (``submit --preflight``).

Layers: `slurmddp.rank` below (where a rank is, pure), then `watchdog`, `preemption` and
`training`, then this package, then the command line (`slurmddp.cli`); each imports only from
below (tests/test_layers.py).
"""
