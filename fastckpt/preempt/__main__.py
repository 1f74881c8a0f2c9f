"""``python -m fastckpt.preempt EVENTS_DIR [LAUNCHER_RC]``: print the job's exit code.

The stop code the ranks logged in this run (143 preempted, 0 cancelled, 144 failed), else
LAUNCHER_RC (the launcher's own code: a normal finish or a crash). Always prints a number, so
``torchrun ...; exit $(python -m fastckpt.preempt ROOT/events $?)`` works after a normal finish
too. Without LAUNCHER_RC and without a logged stop it prints 1 and says why on stderr.
"""

import sys

from ..tools.events import job_exit_code

if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and not sys.argv[2].lstrip("-").isdigit()):
    print("usage: python -m fastckpt.preempt EVENTS_DIR [LAUNCHER_RC]", file=sys.stderr)
    print(2)
    sys.exit(2)
code = job_exit_code(sys.argv[1])
if code is None:
    if len(sys.argv) == 3:
        code = int(sys.argv[2]) & 0xFF
    else:
        print(f"fastckpt.preempt: no stop logged in {sys.argv[1]} and no launcher exit code "
              "given (pass $? as the second argument): printing 1", file=sys.stderr)
        code = 1
print(code)
sys.exit(code)
