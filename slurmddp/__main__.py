import sys

from slurmddp.cli import main

sys.exit(main())
