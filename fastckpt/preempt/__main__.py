"""``python -m fastckpt.preempt EVENTS_DIR``: print the job's exit code from its event logs."""

import sys

from .events import job_exit_code

code = job_exit_code(sys.argv[1])
print("none" if code is None else code)
sys.exit(1 if code is None else code)
