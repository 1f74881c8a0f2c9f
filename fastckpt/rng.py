"""``RNGState``: the random number generators of this process, as a Stateful object.

    state = {"model": model, "optim": optim, "rng": fastckpt.RNGState()}

captures, at each save, Python's ``random``, NumPy's global generator (when NumPy is
installed) and torch's CPU generator and CUDA generators (when CUDA is initialised), and
restores them at load, so that dropout, data shuffling and sampling resume bit-exact. Ranks
seeded differently save one state per rank (a regular tensor or plain value that differs
between ranks is stored per rank, and each rank gets its own back at the same world size); a
checkpoint of per-rank generator states loads at the same world size only, and says so.
"""

from __future__ import annotations

import random
from typing import Any

import torch


class RNGState:
    """The process's random generators; ``state_dict``/``load_state_dict`` (not thread-safe:
    generators are process-wide)."""

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            kind, keys, pos, has_gauss, gauss = np.random.get_state()
            sd["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos),
                           int(has_gauss), float(gauss))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = list(torch.cuda.get_rng_state_all())
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        random.setstate(_tuples(sd["python"]))
        # a copy of its own: torch.set_rng_state crashes (torch 2.13) on a tensor that starts
        # part-way into its storage, which is how loaded tensors share a read buffer
        torch.set_rng_state(sd["torch"].clone())
        if "numpy" in sd:
            import numpy as np
            kind, keys, pos, has_gauss, gauss = sd["numpy"]
            np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([t.clone() for t in sd["cuda"]])


def _tuples(x: Any) -> Any:
    """random.setstate wants the tuples it gave (a checkpoint may hand back lists)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
