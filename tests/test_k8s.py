"""``fastckpt k8s``: the Job it prints is valid against Kubernetes' own OpenAPI schemas
(kubernetes-validate, strict: no unknown field, offline), parses back as YAML to the objects
built, and carries the grace window ``fastckpt bench`` recorded. No cluster runs here: what a
cluster does with the Job (the podFailurePolicy's restarts) is not tested."""

from __future__ import annotations

import json

import pytest

from fastckpt.tools.k8s import job_manifests, to_yaml
from tests.clirun import call

kv = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")

K8S_VERSIONS = ("1.31.0", "1.34.0")  # podFailurePolicy is GA from 1.31


def _valid(doc: dict) -> None:
    for v in K8S_VERSIONS:
        kv.validate(doc, v, strict=True)  # raises ValidationError naming the field


@pytest.mark.parametrize("kw", [
    {},
    {"parallelism": 4, "priority_class": "train-high", "priority": 100000, "namespace": "ml"},
])
def test_manifests_validate_and_round_trip(kw):
    docs = job_manifests(name="llama-70b", image="ghcr.io/me/train:1", root="s3://b/run42",
                         cmd=["torchrun", "--nproc-per-node", "8", "train.py", "--x", "a: b"],
                         grace_s=120, supervise=True, **kw)
    for d in docs:
        _valid(d)
    assert list(yaml.safe_load_all(to_yaml(docs))) == docs
    job = docs[-1]
    pod = job["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 120 and pod["restartPolicy"] == "Never"
    c = pod["containers"][0]
    assert c["command"][:5] == ["fastckpt", "resume", "s3://b/run42", "--supervise", "--"]
    assert {"name": "FASTCKPT_GRACE_S", "value": "115"} in c["env"]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[0]["onExitCodes"]["values"] == [143] and rules[0]["action"] == "Ignore"
    if kw:
        assert docs[0]["kind"] == "PriorityClass" and docs[0]["value"] == 100000
        assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["parallelism"] == 4


def test_cli_takes_the_grace_window_from_the_bench_record(tmp_path, capsys):
    root = tmp_path / "run"
    root.mkdir()
    rc, out, err = call("k8s", str(root), "--image", "img", "--", "python", "train.py",
                        capsys=capsys)
    assert rc == 2 and "no grace window" in err and "fastckpt bench" in err
    (root / ".fastckpt-bench.json").write_text(json.dumps({
        "format": "fastckpt-bench", "version": 1, "measured": "2026-12-01",
        "grace": {"seconds": 77, "state_bytes": 10 << 30, "save_bytes_per_s": 1 << 30}}))
    rc, out, err = call("k8s", str(root), "--image", "img", "--", "python", "train.py",
                        capsys=capsys)
    assert rc == 0, err
    assert "grace window 77 s from fastckpt bench record" in out
    docs = list(yaml.safe_load_all(out))
    for d in docs:
        _valid(d)
    pod = docs[-1]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 77
    # exec form, supervised: the supervisor is PID 1 (it handles SIGTERM from the start)
    assert pod["containers"][0]["command"] == ["fastckpt", "resume", str(root), "--supervise",
                                               "--", "python", "train.py"]
    assert docs[-1]["metadata"]["name"] == "run"


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="not a Kubernetes name"):
        job_manifests(name="Bad_Name", image="i", root="r", cmd=["x"], grace_s=60)
    with pytest.raises(ValueError, match="leaves no time"):
        job_manifests(name="ok", image="i", root="r", cmd=["x"], grace_s=5)
