"""The probe after submitit's TorchDistributedEnvironment exported the env:// variables.

SUBMITIT_EXECUTOR is what submitit's own batch script sets; its job environment needs it.
"""

import os
import runpy
import sys
from pathlib import Path

import submitit

os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")
submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
sys.argv = sys.argv[:1]
runpy.run_path(str(Path(__file__).with_name("probe.py")), run_name="__main__")
