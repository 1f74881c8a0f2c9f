"""A Kubernetes Job for a training command checkpointed by fastckpt (``fastckpt k8s``).
Torch-free; plain dicts, written out as YAML by :func:`to_yaml`.

What the Job encodes, and why:

- ``terminationGracePeriodSeconds``: the window between the kubelet's SIGTERM and its SIGKILL,
  from the grace window ``fastckpt bench ROOT`` measured (or ``--grace``); the ranks get
  ``FASTCKPT_GRACE_S`` a few seconds shorter, for their teardown.
- The container's command is fastckpt's supervised resume in exec form (``fastckpt resume
  ROOT --supervise -- CMD``): the container's PID 1, which the kubelet signals, is the
  supervisor, not a shell that would not pass the signal on, nor the training process (the
  kernel drops a signal to PID 1 that has no handler: SIGTERM before the trap is installed
  and after it is closed); it passes the signal on (as SIGTERM to torchrun, which sets
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT from the window) and exits with the ranks' code (see
  docs/preemption.md). Before 2026-12-06 only torchrun was supervised.
- ``restartPolicy: Never`` with a ``podFailurePolicy``: exit 143 (preempted, checkpoint
  committed) and a pod the cluster disrupted (``DisruptionTarget``: preemption, eviction, node
  drain) start a new pod without counting against ``backoffLimit``; a crash (1) or a failed
  emergency path (144) count; exit 0 (finished or cancelled) completes the Job.
- ``--parallelism N`` > 1: an Indexed Job of N pods (``JOB_COMPLETION_INDEX`` is each pod's
  node rank); the rendezvous between pods (a headless Service, torchrun's ``--rdzv-endpoint``)
  is the user's, as with any multi-pod PyTorch Job.
"""

from __future__ import annotations

import json
import re
from typing import Any

#: seconds of the pod's grace window kept from the ranks, for their teardown after the exit
TEARDOWN_RESERVE_S = 5
#: exit code of a preempted rank whose checkpoint is committed (fastckpt.preempt.EXIT_PREEMPTED)
EXIT_PREEMPTED = 143
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def job_manifests(*, name: str, image: str, root: str, cmd: list[str], grace_s: int,
                  parallelism: int = 1, backoff_limit: int = 3, supervise: bool = False,
                  priority_class: str | None = None, priority: int | None = None,
                  namespace: str | None = None) -> list[dict]:
    """The Job (and, with ``priority``, its PriorityClass) as Kubernetes objects."""
    if not _NAME.match(name):
        raise ValueError(f"job name {name!r} is not a Kubernetes name (lowercase letters, digits "
                         "and '-', at most 63)")
    if not cmd:
        raise ValueError("no command to run (give it after --)")
    if grace_s <= TEARDOWN_RESERVE_S:
        raise ValueError(f"a grace window of {grace_s} s leaves no time to save (the ranks get "
                         f"it minus {TEARDOWN_RESERVE_S} s for their teardown)")
    if parallelism < 1:
        raise ValueError("parallelism must be at least 1")
    if priority is not None and not priority_class:
        raise ValueError("--priority needs --priority-class (the class it defines)")
    command = ["fastckpt", "resume", root, *(["--supervise"] if supervise else []), "--", *cmd]
    container = {
        "name": "train",
        "image": image,
        "command": command,
        "env": [{"name": "FASTCKPT_GRACE_S", "value": str(grace_s - TEARDOWN_RESERVE_S)}],
    }
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": int(grace_s),
        "containers": [container],
    }
    if priority_class:
        pod["priorityClassName"] = priority_class
    spec: dict[str, Any] = {
        "backoffLimit": int(backoff_limit),
        "podFailurePolicy": {"rules": [
            {"action": "Ignore", "onExitCodes": {"containerName": "train", "operator": "In",
                                                 "values": [EXIT_PREEMPTED]}},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]},
        "template": {"metadata": {"labels": {"app.kubernetes.io/name": name}}, "spec": pod},
    }
    if parallelism > 1:
        spec.update(parallelism=parallelism, completions=parallelism, completionMode="Indexed")
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": name}}
    if namespace:
        meta["namespace"] = namespace
    out: list[dict] = []
    if priority is not None:
        out.append({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                    "metadata": {"name": priority_class}, "value": int(priority),
                    "preemptionPolicy": "PreemptLowerPriority", "globalDefault": False,
                    "description": f"training jobs checkpointed by fastckpt ({name})"})
    out.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec})
    return out


def to_yaml(docs: list[dict]) -> str:
    """YAML documents (``---`` separated); strings double-quoted (JSON escapes are YAML's)."""
    return "".join("---\n" + _node(d, 0) for d in docs)


def _scalar(x: Any) -> str:
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, (int, float)):
        return json.dumps(x)
    # JSON writes a character outside the BMP as a surrogate pair ("\\ud83d\\ude00"), which
    # YAML reads as two lone surrogates (or refuses): YAML's own 8-digit escape instead
    return _PAIR.sub(lambda m: m[1] + "\\U%08X" % (
        0x10000 + ((int(m[2], 16) - 0xD800) << 10) + int(m[3], 16) - 0xDC00), json.dumps(str(x)))


#: a surrogate pair's escapes, not preceded by an escaped backslash (a literal "\\ud83d")
_PAIR = re.compile(r"(?<!\\)((?:\\\\)*)\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})")


def _node(x: Any, indent: int) -> str:
    pad = " " * indent
    if isinstance(x, dict):
        if not x:
            return pad + "{}\n"
        out = []
        for k, v in x.items():
            if isinstance(v, (dict, list)) and v:
                out.append(f"{pad}{k}:\n" + _node(v, indent + 2))
            else:
                out.append(f"{pad}{k}: {_inline(v)}\n")
        return "".join(out)
    if isinstance(x, list):
        out = []
        for v in x:
            if isinstance(v, (dict, list)) and v:
                body = _node(v, indent + 2)
                out.append(f"{pad}- " + body[indent + 2:])
            else:
                out.append(f"{pad}- {_inline(v)}\n")
        return "".join(out)
    return pad + _scalar(x) + "\n"


def _inline(v: Any) -> str:
    if isinstance(v, dict):
        return "{}"
    if isinstance(v, list):
        return "[]"
    return _scalar(v)
