"""Options, validated at construction, and the one place environment variables are read."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """How a :class:`~fastckpt.Checkpointer` saves and loads. Immutable; thread-safe.

    keep_last: after each commit keep only the newest N committed steps (None: keep all).
    commit_timeout_s: the deadline for all ranks to report and for the commit decision.
    native: "auto" (native I/O if built), "require" (fail if not built), "off" (pure Python).
    direct_io: use O_DIRECT for local shard files when the file system supports it.
    verify: check every chunk's checksum on load.
    strict: a key the state has but the checkpoint lacks (or a module key the checkpoint has
        but the module lacks) is an error on load.
    """

    keep_last: int | None = None
    commit_timeout_s: float = 600.0
    native: str = "auto"
    direct_io: bool = True
    verify: bool = True
    strict: bool = True

    def __post_init__(self) -> None:
        if self.keep_last is not None and (not isinstance(self.keep_last, int)
                                           or self.keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None, got {self.keep_last!r}")
        if not (self.commit_timeout_s > 0):
            raise ValueError(f"commit_timeout_s must be > 0, got {self.commit_timeout_s!r}")
        if self.native not in ("auto", "require", "off"):
            raise ValueError(f"native must be 'auto', 'require' or 'off', got {self.native!r} "
                             "(FASTCKPT_NATIVE)")

    def with_changes(self, **changes) -> "CheckpointOptions":
        return replace(self, **changes)


def options_from_env(base: CheckpointOptions | None = None,
                     environ: dict | None = None) -> CheckpointOptions:
    """Apply FASTCKPT_* environment variables on top of ``base``.

    FASTCKPT_NATIVE=auto|require|off, FASTCKPT_DIRECT_IO=0|1, FASTCKPT_COMMIT_TIMEOUT_S=seconds.
    """
    env = os.environ if environ is None else environ
    base = base or CheckpointOptions()
    changes: dict = {}
    if "FASTCKPT_NATIVE" in env:
        changes["native"] = env["FASTCKPT_NATIVE"].strip().lower()
    if "FASTCKPT_DIRECT_IO" in env:
        changes["direct_io"] = env["FASTCKPT_DIRECT_IO"].strip() not in ("0", "false", "no", "")
    if "FASTCKPT_COMMIT_TIMEOUT_S" in env:
        changes["commit_timeout_s"] = float(env["FASTCKPT_COMMIT_TIMEOUT_S"])
    return base.with_changes(**changes) if changes else base
