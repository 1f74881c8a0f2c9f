"""A process that saves checkpoints and can be killed anywhere (by a test or a fault point).

    [FASTCKPT_TEST_FAULT=<point>] python -m tests.crash_worker ROOT STEP_FROM STEP_TO MIB [SALT]

saves steps STEP_FROM..STEP_TO-1 one after the other (each blocks until committed) and prints
``committed N`` after each. The state of a step is a pure function of (step, MIB, SALT). With
``FASTCKPT_TEST_FAULT`` its storage is wrapped by ``fastckpt.testing.faults`` and the process
SIGKILLs itself at that point of the save.
"""

from __future__ import annotations

import os
import sys

import torch

import fastckpt
from fastckpt.testing import faults


def state_for(step: int, mib: float, salt: int = 0) -> dict:
    n = int(mib * (1 << 20)) // 4
    w = torch.arange(n, dtype=torch.float32)
    w.mul_(1e-3).add_(step * 10 + salt)
    return {"w": w, "b": torch.full((1000,), float(step), dtype=torch.float64),
            "h": torch.arange(3 * step + 1, 3 * step + 301, dtype=torch.int32).reshape(3, 100),
            "step": step, "salt": salt, "note": f"step {step}"}


def blank(mib: float) -> dict:
    s = state_for(0, mib)
    return {"w": torch.zeros_like(s["w"]), "b": torch.zeros_like(s["b"]),
            "h": torch.zeros_like(s["h"]), "step": -1, "salt": -1, "note": ""}


def main(argv: list[str]) -> None:
    root, a, b, mib = argv[0], int(argv[1]), int(argv[2]), float(argv[3])
    salt = int(argv[4]) if len(argv) > 4 else 0
    storage = faults.open_faulty(root, rank=0, spec=os.environ.get("FASTCKPT_TEST_FAULT"))
    with fastckpt.Checkpointer(storage, commit_timeout_s=30) as ck:
        for step in range(a, b):
            ck.save(state_for(step, mib, salt), step=step).wait()
            print(f"committed {step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
