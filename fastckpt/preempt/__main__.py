"""``python -m fastckpt.preempt EVENTS_DIR [LAUNCHER_RC [SINCE]]``: print the job's exit code.

The stop code the ranks logged in this run (143 preempted, 0 cancelled, 144 failed), else
LAUNCHER_RC (the launcher's own code: a normal finish or a crash). Always prints a number, so
``start=$(date +%s); torchrun ...; exit $(python -m fastckpt.preempt ROOT/events $? $start)``
works after a normal finish too. SINCE (Unix time, the launch): only stops logged from then on
count. Without it the last run's stop counts, so a run that crashed before any rank armed its
trap would report an earlier run's 143 ("restart me") for its own crash. Without LAUNCHER_RC
and without a logged stop it prints 1 and says why on stderr.
"""

import sys


def _number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


argc = len(sys.argv)
if argc not in (2, 3, 4) or (argc >= 3 and not sys.argv[2].lstrip("-").isdigit()) \
        or (argc == 4 and not _number(sys.argv[3])):
    print("usage: python -m fastckpt.preempt EVENTS_DIR [LAUNCHER_RC [SINCE]]", file=sys.stderr)
    print(2)
    sys.exit(2)

from ..tools.events import job_exit_code  # noqa: E402

code = job_exit_code(sys.argv[1], since=float(sys.argv[3]) if len(sys.argv) == 4 else None)
if code is None:
    if len(sys.argv) >= 3:
        code = int(sys.argv[2]) & 0xFF
    else:
        print(f"fastckpt.preempt: no stop logged in {sys.argv[1]} and no launcher exit code "
              "given (pass $? as the second argument): printing 1", file=sys.stderr)
        code = 1
print(code)
sys.exit(code)
