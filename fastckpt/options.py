"""Options, validated at construction, and the one place environment variables are read."""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass, replace


#: the longest ``commit_timeout_s``/``lease_ttl_s`` (about 31 years): the deadlines derived
#: from them must stay within what the platform's waits and time stamps take
MAX_TIMEOUT_S = 1e9


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """How a :class:`~fastckpt.Checkpointer` saves and loads. Immutable; thread-safe.

    keep_last: after each commit keep only the newest N committed steps (None: keep all).
    commit_timeout_s: the deadline for all ranks to report and for the commit decision; also
        each rank's write phase (its shard files: a write that has not finished 5 s past it
        fails the save, local disks included) and the housekeeping after a commit.
    collective: True (default): ``save``/``load`` are collective over the default process group.
        False: this process saves and loads alone (as rank 0 of 1) whatever the process group:
        for a state that is replicated and saved by one process (Lightning's DDP strategy calls
        its CheckpointIO on rank 0 only). Each process then writes its own full checkpoint.
    plan_timeout_s: how long a rank waits at the exchanges before the writes (the save plan,
        the first save's claim of the root, the load's agreement) for every other rank; past
        it, CollectiveTimeoutError names the ranks that did not arrive (a rank that never
        called, or died). FASTCKPT_PLAN_TIMEOUT_S.
    lease_ttl_s: the writer lease of the root (fastckpt/lease.py) expires this long after its
        holder last renewed it (every lease_ttl_s / 4); a crashed holder's lease is taken over
        at once on the same host or by a later run of the same job, else after this long.
    native: "auto" (native I/O if built), "require" (fail if not built), "off" (pure Python).
    direct_io: use O_DIRECT for local shard files when the file system supports it.
    zero_copy: blocking saves (``save(..., block=True)``, one-off ``fastckpt.save``) on a local
        file system write each large contiguous CPU tensor straight from its memory, without
        staging it (no copy, no staging memory); False stages them like an async save.
    cuda_stage: how ``save`` orders the training stream after the device-to-host copies of CUDA
        tensors (run on a side stream into pinned staging buffers): "stream" (the current stream
        waits for them on the GPU; ``save`` returns without a host wait) or "sync" (``save``
        waits on the host until they are done; use it when the saved tensors may be written
        from other streams). See fastckpt/engine/device.py.
    verify: check every chunk's checksum on load.
    fingerprint: how a regular (non-DTensor) tensor above 1 MiB that several ranks hold is
        compared across them to tell a replicated tensor (written once) from a per-rank one:
        "sampled" (default: 33 KiB of it, evenly spread; a per-rank tensor that differs only
        between the samples is taken as replicated) or "full" (all of it, on the training
        thread at every save: ~13 GB/s of hashing per rank here).
    rank_indexes: from this world size on, each rank writes its chunk list to its own index
        file and the manifest names the indexes (format version 4, docs/design.md): the
        coordinator's commit work stays O(N) small entries (docs/scale.md). None: never (one
        self-contained manifest, readable by fastckpt before version 4); 1: always. Rank 0's
        value decides for every rank. FASTCKPT_RANK_INDEXES.
    staging_cap_bytes: host memory the staging buffers may use (None: as much as the rank's
        state, allocated once and reused; ``save`` then stalls for one memcpy). Above the cap the
        pieces are staged as the writer frees buffers, so the stall grows with the overflow.
    copy_threads: threads of an async save's staging copy of CPU tensors (the training stall;
        one glibc memcpy thread does not saturate a host's memory bandwidth). None: torch's
        intra-op thread count (``torch.get_num_threads()``, 1 under torchrun with several ranks
        a node unless OMP_NUM_THREADS says otherwise), at most 16.
    strict: a key the state has but the checkpoint lacks (or a module key the checkpoint has
        but the module lacks) is an error on load.

    Preemption (see docs/preemption.md; the trap is installed when ``grace_s`` is set, when
    ``preempt`` is true, or at the first ``save(..., on_preempt=True)``):

    grace_s: seconds from the first stop signal to the platform's SIGKILL (None: the platform
        default, see ``platform_grace``). FASTCKPT_GRACE_S.
    signal_grace_s: {signal name: seconds} for signals whose window differs from ``grace_s``,
        e.g. under Slurm ``{"SIGUSR1": 95, "SIGTERM": 10}`` (``--signal=B:USR1@95``; scancel,
        the time limit and preemption give KillWait). FASTCKPT_SIGNAL_GRACE_S="SIGTERM=10,...".
    preempt: install the signal trap at construction even without ``grace_s``.
    preempt_signals: signals that mean "preempted, save and restart me" (names; one name alone is
        taken as a tuple of it). FASTCKPT_PREEMPT_SIGNALS.
    cancel_signals: signals that mean "save and stop for good" (exit 0), e.g. ("SIGINT",).
    preempt_consensus: "store" (out of band over the c10d store, no per-step collective) or
        "allreduce" (a gather of the stop flags on every ``on_preempt`` call).
    preempt_margin_s: seconds of the grace window kept for the barrier and the exit.
    teardown_s: seconds a rank needs after its exit event until the process is gone (torch's
        and the launcher's teardown), kept out of the grace window. None: the longest teardown
        ``fastckpt resume --supervise`` measured in ``<root>/events/supervisor.jsonl`` (its
        last 5 runs), else ``min(2, grace_s / 10)``. FASTCKPT_TEARDOWN_S.
    preempt_exit: exit the process after the emergency checkpoint (False: ``save`` returns and
        ``Checkpointer.preemption.exit_code`` says what to exit with).
    assumed_write_mibps: shard write bandwidth assumed before any save was measured.
    event_log: directory for the JSON-lines event log (one file per rank); None: ``<root>/events``
        for local roots, no log for remote ones. FASTCKPT_EVENT_LOG.

    compression: None (default), "zstd" or "auto": each chunk compressed by zstd over
        independent 4 MiB blocks, float bytes grouped (fastckpt/storage/codec.py); "auto"
        compresses only when the encoders outrun the measured write bandwidth (the slower tier
        with a remote one), so it never slows a save down. FASTCKPT_COMPRESSION.
    compression_level: the zstd level (1: the fastest and, with byte grouping, the best ratio
        on weights; see docs/benchmarks.md).
    compression_threads: encoder threads per rank (None: the cores split among the node's
        ranks, at most 8).

    Object stores (``s3://``; see fastckpt/storage/s3.py):

    remote_part_bytes: the size of one multipart part and of one ranged GET (>= 5 MiB).
        FASTCKPT_REMOTE_PART_BYTES.
    remote_concurrency: S3 requests in flight per process (every file and thread of a rank
        shares them). FASTCKPT_REMOTE_CONCURRENCY.
    remote_max_attempts: tries of one S3 request: throttling (503 SlowDown), server errors and
        broken connections are retried with capped, jittered backoff, within the deadline.
    remote_keep_last: retention of the remote tier (``Checkpointer(local, remote=url)``):
        "same" (default: ``keep_last``), a positive int, or None (keep all).
    local_survives: whether the local root outlives a preemption (a cluster's shared file
        system: True; a Spot VM's NVMe, lost with the node: False, the default). With a remote
        tier it decides the emergency upload (docs/preemption.md). FASTCKPT_LOCAL_SURVIVES.
    assumed_upload_mibps: per-rank upload bandwidth to the remote tier assumed before any
        upload was measured.
    conditional_put: the manifest is put only if absent (``If-None-Match: *``), or over the
        manifest just read (``If-Match``), where the store honours it: "auto" (probed once;
        plain PUTs with a warning where not), "require" (an error where not), "off".
    """

    keep_last: int | None = None
    collective: bool = True
    rank_indexes: int | None = 16
    plan_timeout_s: float = 120.0
    lease_ttl_s: float = 60.0
    commit_timeout_s: float = 600.0
    native: str = "auto"
    direct_io: bool = True
    zero_copy: bool = True
    cuda_stage: str = "stream"
    verify: bool = True
    fingerprint: str = "sampled"
    strict: bool = True
    staging_cap_bytes: int | None = None
    copy_threads: int | None = None
    grace_s: float | None = None
    signal_grace_s: dict | None = None
    preempt: bool = False
    preempt_signals: tuple = ("SIGTERM", "SIGUSR1")
    cancel_signals: tuple = ()
    preempt_consensus: str = "store"
    preempt_margin_s: float = 1.0
    teardown_s: float | None = None
    preempt_exit: bool = True
    assumed_write_mibps: float = 200.0
    event_log: str | None = None
    compression: str | None = None
    compression_level: int = 1
    compression_threads: int | None = None
    remote_keep_last: int | None | str = "same"
    local_survives: bool = False
    assumed_upload_mibps: float = 100.0
    remote_part_bytes: int = 8 << 20
    remote_concurrency: int = 32
    remote_max_attempts: int = 8
    conditional_put: str = "auto"

    def __post_init__(self) -> None:
        if self.keep_last is not None and (not _is_int(self.keep_last) or self.keep_last < 1):
            # (a bool too: keep_last=True kept one step and deleted the others)
            raise ValueError(f"keep_last must be a positive int or None, got {self.keep_last!r}")
        if self.rank_indexes is not None and (not isinstance(self.rank_indexes, int)
                                              or self.rank_indexes < 1):
            raise ValueError(f"rank_indexes must be a positive int (a world size) or None, got "
                             f"{self.rank_indexes!r}")
        # (past MAX_TIMEOUT_S: infinity or 1e300 passed here, then every save failed with a
        # StorageError "timestamp out of range for platform time_t", or a raw ValueError)
        if not (1 <= self.lease_ttl_s <= MAX_TIMEOUT_S):
            raise ValueError(f"lease_ttl_s must be >= 1 second and at most {MAX_TIMEOUT_S:g}, "
                             f"got {self.lease_ttl_s!r}")
        if not (self.plan_timeout_s > 0):
            raise ValueError(f"plan_timeout_s must be > 0, got {self.plan_timeout_s!r}")
        if not (0 < self.commit_timeout_s <= MAX_TIMEOUT_S):
            raise ValueError(f"commit_timeout_s must be > 0 and at most {MAX_TIMEOUT_S:g} "
                             f"seconds, got {self.commit_timeout_s!r}")
        if self.staging_cap_bytes is not None and self.staging_cap_bytes < 0:
            raise ValueError(f"staging_cap_bytes must be >= 0 or None, got "
                             f"{self.staging_cap_bytes!r}")
        if self.copy_threads is not None and (not isinstance(self.copy_threads, int)
                                              or isinstance(self.copy_threads, bool)
                                              or not 1 <= self.copy_threads <= 64):
            raise ValueError(f"copy_threads must be an int in 1..64 or None, got "
                             f"{self.copy_threads!r}")
        if self.native not in ("auto", "require", "off"):
            raise ValueError(f"native must be 'auto', 'require' or 'off', got {self.native!r} "
                             "(FASTCKPT_NATIVE)")
        if self.fingerprint not in ("sampled", "full"):
            raise ValueError(f"fingerprint must be 'sampled' or 'full', got {self.fingerprint!r}")
        if self.cuda_stage not in ("stream", "sync"):
            raise ValueError(f"cuda_stage must be 'stream' or 'sync', got {self.cuda_stage!r}")
        if self.grace_s is not None and not (self.grace_s > 0):
            raise ValueError(f"grace_s must be > 0 seconds or None, got {self.grace_s!r}")
        if self.preempt_consensus not in ("store", "allreduce"):
            raise ValueError("preempt_consensus must be 'store' or 'allreduce', got "
                             f"{self.preempt_consensus!r}")
        import signal as _signal
        for field_name in ("preempt_signals", "cancel_signals"):  # one name: a tuple of it
            if isinstance(getattr(self, field_name), str):  # (was "unknown signal 'S'")
                object.__setattr__(self, field_name, (getattr(self, field_name),))
        for name in tuple(self.preempt_signals) + tuple(self.cancel_signals):
            if not isinstance(name, str) or not isinstance(getattr(_signal, name, None),
                                                           _signal.Signals):
                raise ValueError(f"unknown signal {name!r} in preempt_signals/cancel_signals "
                                 "(use names such as 'SIGTERM', 'SIGUSR1', 'SIGINT')")
        if set(self.preempt_signals) & set(self.cancel_signals):
            raise ValueError("a signal cannot be in both preempt_signals and cancel_signals")
        for name, secs in (self.signal_grace_s or {}).items():
            if not isinstance(name, str) or not isinstance(getattr(signal, name.upper(), None),
                                                          signal.Signals):
                raise ValueError(f"signal_grace_s: {name!r} is not a signal name (e.g. SIGTERM)")
            if not (isinstance(secs, (int, float)) and secs > 0):
                raise ValueError(f"signal_grace_s[{name!r}] must be > 0 seconds, got {secs!r}")
        if self.teardown_s is not None and not (self.teardown_s >= 0):
            raise ValueError(f"teardown_s must be >= 0 seconds or None, got {self.teardown_s!r}")
        if not (self.preempt_margin_s >= 0) or not (self.assumed_write_mibps > 0):
            raise ValueError("preempt_margin_s must be >= 0 and assumed_write_mibps > 0")
        if self.compression not in (None, "zstd", "auto"):
            raise ValueError(f"compression must be None, 'zstd' or 'auto', got "
                             f"{self.compression!r}")
        if not (isinstance(self.compression_level, int) and 1 <= self.compression_level <= 19):
            raise ValueError(f"compression_level must be an int from 1 to 19, got "
                             f"{self.compression_level!r}")
        if self.compression_threads is not None and not (
                isinstance(self.compression_threads, int) and self.compression_threads >= 1):
            raise ValueError(f"compression_threads must be a positive int or None, got "
                             f"{self.compression_threads!r}")
        if self.remote_keep_last != "same" and self.remote_keep_last is not None and (
                not _is_int(self.remote_keep_last) or self.remote_keep_last < 1):
            raise ValueError("remote_keep_last must be 'same', a positive int or None, got "
                             f"{self.remote_keep_last!r}")
        if not (self.assumed_upload_mibps > 0):
            raise ValueError(f"assumed_upload_mibps must be > 0, got {self.assumed_upload_mibps!r}")
        if not (isinstance(self.remote_part_bytes, int) and self.remote_part_bytes >= 5 << 20):
            raise ValueError("remote_part_bytes must be an int >= 5 MiB (S3's smallest part), "
                             f"got {self.remote_part_bytes!r}")
        if not (isinstance(self.remote_concurrency, int) and 1 <= self.remote_concurrency):
            raise ValueError(f"remote_concurrency must be a positive int, got "
                             f"{self.remote_concurrency!r}")
        if not (isinstance(self.remote_max_attempts, int) and self.remote_max_attempts >= 1):
            raise ValueError(f"remote_max_attempts must be a positive int, got "
                             f"{self.remote_max_attempts!r}")
        if self.conditional_put not in ("auto", "require", "off"):
            raise ValueError("conditional_put must be 'auto', 'require' or 'off', got "
                             f"{self.conditional_put!r}")

    def with_changes(self, **changes) -> "CheckpointOptions":
        return replace(self, **changes)

    def remote_settings(self) -> dict:
        """The object-store settings ``open_storage(..., remote=...)`` takes."""
        return {"part_bytes": self.remote_part_bytes, "concurrency": self.remote_concurrency,
                "max_attempts": self.remote_max_attempts, "conditional": self.conditional_put}


#: the variable that sets the ``event_log`` option (the supervisor sets it for a remote ROOT)
EVENT_LOG_ENV = "FASTCKPT_EVENT_LOG"


def options_from_env(base: CheckpointOptions | None = None,
                     environ: dict | None = None) -> CheckpointOptions:
    """Apply FASTCKPT_* environment variables on top of ``base``.

    FASTCKPT_NATIVE=auto|require|off, FASTCKPT_DIRECT_IO=0|1, FASTCKPT_ZERO_COPY=0|1,
    FASTCKPT_COMMIT_TIMEOUT_S=seconds, FASTCKPT_PLAN_TIMEOUT_S=seconds,
    FASTCKPT_GRACE_S=seconds, FASTCKPT_SIGNAL_GRACE_S=SIGTERM=10,..., FASTCKPT_TEARDOWN_S=seconds,
    FASTCKPT_PREEMPT_SIGNALS=SIGTERM,SIGUSR1, FASTCKPT_EVENT_LOG=dir,
    FASTCKPT_REMOTE_PART_BYTES=bytes, FASTCKPT_REMOTE_CONCURRENCY=n, FASTCKPT_LOCAL_SURVIVES=0|1,
    FASTCKPT_COMPRESSION=none|zstd|auto, FASTCKPT_RANK_INDEXES=world size|none.
    """
    env = os.environ if environ is None else environ
    base = base or CheckpointOptions()
    changes: dict = {}
    if "FASTCKPT_NATIVE" in env:
        changes["native"] = env["FASTCKPT_NATIVE"].strip().lower()
    if "FASTCKPT_DIRECT_IO" in env:
        changes["direct_io"] = _flag(env["FASTCKPT_DIRECT_IO"])
    if "FASTCKPT_ZERO_COPY" in env:
        changes["zero_copy"] = _flag(env["FASTCKPT_ZERO_COPY"])
    if "FASTCKPT_RANK_INDEXES" in env:
        v = env["FASTCKPT_RANK_INDEXES"].strip().lower()
        try:
            changes["rank_indexes"] = None if v in ("none", "off", "never", "") else int(v)
        except ValueError:
            raise ValueError(f"FASTCKPT_RANK_INDEXES: {v!r} is not a world size or 'none'"
                             ) from None
    if "FASTCKPT_GRACE_S" in env:
        changes["grace_s"] = float(env["FASTCKPT_GRACE_S"])
    if "FASTCKPT_SIGNAL_GRACE_S" in env:
        grace = {}
        for item in env["FASTCKPT_SIGNAL_GRACE_S"].split(","):
            if not item.strip():
                continue
            name, sep, secs = item.partition("=")
            try:
                grace[name.strip().upper()] = float(secs)
            except ValueError:
                raise ValueError(f"FASTCKPT_SIGNAL_GRACE_S: {item.strip()!r} is not "
                                 "SIGNAL=SECONDS (e.g. SIGTERM=10,SIGUSR1=95)") from None
            if not sep:
                raise ValueError(f"FASTCKPT_SIGNAL_GRACE_S: {item.strip()!r} has no '='")
        changes["signal_grace_s"] = grace
    if "FASTCKPT_TEARDOWN_S" in env:
        changes["teardown_s"] = float(env["FASTCKPT_TEARDOWN_S"])
    if "FASTCKPT_PREEMPT_SIGNALS" in env:
        changes["preempt_signals"] = tuple(
            n.strip().upper() for n in env["FASTCKPT_PREEMPT_SIGNALS"].split(",") if n.strip())
    if EVENT_LOG_ENV in env:
        changes["event_log"] = env[EVENT_LOG_ENV]
    if "FASTCKPT_COMMIT_TIMEOUT_S" in env:
        changes["commit_timeout_s"] = float(env["FASTCKPT_COMMIT_TIMEOUT_S"])
    if "FASTCKPT_PLAN_TIMEOUT_S" in env:
        changes["plan_timeout_s"] = float(env["FASTCKPT_PLAN_TIMEOUT_S"])
    if "FASTCKPT_COMPRESSION" in env:
        v = env["FASTCKPT_COMPRESSION"].strip().lower()
        changes["compression"] = None if v in ("", "none", "off", "0") else v
    if "FASTCKPT_LOCAL_SURVIVES" in env:
        changes["local_survives"] = _flag(env["FASTCKPT_LOCAL_SURVIVES"])
    if "FASTCKPT_REMOTE_PART_BYTES" in env:
        changes["remote_part_bytes"] = int(env["FASTCKPT_REMOTE_PART_BYTES"])
    if "FASTCKPT_REMOTE_CONCURRENCY" in env:
        changes["remote_concurrency"] = int(env["FASTCKPT_REMOTE_CONCURRENCY"])
    return base.with_changes(**changes) if changes else base


#: (platform, grace window in seconds, how it is known) when ``grace_s`` is not configured.
#: None of these platforms exports its kill deadline to the process, so these are their
#: documented defaults; set ``grace_s``/FASTCKPT_GRACE_S when yours differs.
_PLATFORM_GRACE = (
    ("torchrun", "TORCHELASTIC_RUN_ID", 30.0, "agent SIGKILLs workers 30 s after forwarding"),
    ("slurm", "SLURM_JOB_ID", 30.0, "KillWait default 30 s"),
    ("kubernetes", "KUBERNETES_SERVICE_HOST", 30.0, "terminationGracePeriodSeconds default 30 s"),
)


def platform_grace(environ: dict | None = None) -> tuple[str, float, str]:
    """(platform, grace seconds, source) from the environment; ("unknown", 30, ...) if none."""
    env = os.environ if environ is None else environ
    for name, var, grace, why in _PLATFORM_GRACE:
        if var in env:
            return name, grace, f"{var} set: {why}"
    return "unknown", 30.0, "no platform detected: assumed 30 s"


#: environment variables naming the job: a writer lease left by the same job id is its own
_JOB_VARS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "FASTCKPT_JOB_ID")


def job_id(environ: dict | None = None) -> str | None:
    """This job's identity across restarts (a requeued Slurm job keeps SLURM_JOB_ID, a
    restarted torchrun keeps TORCHELASTIC_RUN_ID; FASTCKPT_JOB_ID for anything else)."""
    env = os.environ if environ is None else environ
    parts = [f"{v}={env[v]}" for v in _JOB_VARS if env.get(v)]
    return ",".join(parts) or None


def cli_settings(environ: dict | None = None) -> dict:
    """What the command-line tools read from the environment: FASTCKPT_NO_PROGRESS (no
    progress bars on a terminal), FASTCKPT_NATIVE (shown by ``fastckpt info``)."""
    env = os.environ if environ is None else environ
    return {"no_progress": bool(env.get("FASTCKPT_NO_PROGRESS")),
            "native": env.get("FASTCKPT_NATIVE")}



def _flag(value: str) -> bool:
    """An on/off environment setting: off for 0, false, no, off and the empty string."""
    return value.strip().lower() not in ("0", "false", "no", "off", "")


def huge_pages_on(environ: dict | None = None) -> bool | None:
    """Whether a load advises the memory it allocates to transparent huge pages
    (``storage.pyio.huge_pages``): FASTCKPT_THP=1 on, =0 off; None (unset or "auto"): the
    storage layer decides (off on a VM that reports free memory to its host)."""
    env = os.environ if environ is None else environ
    v = env.get("FASTCKPT_THP", "auto")
    return None if v.strip().lower() == "auto" else _flag(v)


def first_slurm_host(nodelist: str) -> str | None:
    """The first host of a Slurm hostlist (``gpu[007-010,12],cpu1`` -> ``gpu007``,
    ``rack[1-2]-n[3-4]`` -> ``rack1-n3``); None for an empty list."""
    out, i, nodelist = [], 0, nodelist.strip()
    while i < len(nodelist) and nodelist[i] != ",":
        if nodelist[i] == "[":
            j = nodelist.index("]", i)
            out.append(re.split(r"[,-]", nodelist[i + 1:j])[0])
            i = j + 1
        else:
            out.append(nodelist[i])
            i += 1
    return "".join(out) or None


def torch_env_from_slurm(environ: dict | None = None) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT for a rank that ``srun`` started
    (one task per rank, no torchrun), from SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID,
    the first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST) and a port from
    SLURM_JOB_ID (29500 + job id mod 20000). Only the variables not already set; {} outside
    an srun step (the batch script has SLURM_PROCID=0 too, but no SLURM_STEP_NUM_TASKS: mapping
    there would make one process wait for ranks that never start)."""
    env = os.environ if environ is None else environ
    if "SLURM_PROCID" not in env or not env.get("SLURM_STEP_NUM_TASKS", "").isdigit():
        return {}
    want = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"],
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}
    host = first_slurm_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
    if host:
        want["MASTER_ADDR"] = host
    if env.get("SLURM_JOB_ID", "").isdigit():
        want["MASTER_PORT"] = str(29500 + int(env["SLURM_JOB_ID"]) % 20000)
    return {k: v for k, v in want.items() if k not in env}
