"""The layout docs/design.md describes ("A short tour of the code") holds: imports flow one way
between the concerns, no module is over 600 lines, the command-line tools run without torch,
and the modules that are "the only one" to do something are."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest
import torch

import fastckpt

PKG = os.path.dirname(os.path.abspath(fastckpt.__file__))
REPO = os.path.dirname(PKG)

#: concern -> the concerns it may import (lazily or not); bottom to top
ALLOWED = {
    # (every concern may also import the package's __version__)
    "errors": set(),
    "options": {"errors"},
    "storage": {"errors", "options"},
    "manifest": {"errors", "storage", "__init__"},
    "retention": {"manifest", "storage"},
    "lease": {"errors", "options", "storage"},
    "tools": {"errors", "options", "storage", "manifest", "retention", "__init__"},
    "engine": {"errors", "options", "storage", "manifest", "retention", "lease", "bench.record"},
    "bench.record": set(),
    "preempt": {"errors", "options", "engine", "bench.record", "tools"},
    "checkpointer": {"engine", "preempt", "storage"},
    "bench": {"errors", "options", "storage", "manifest", "tools", "engine", "checkpointer",
              "bench.record", "__init__"},
    # the preemption drill: a torch-free driver over tools/bench; its ranks (drill.worker)
    # are a training job on the public API with testing's slow disk
    "drill": {"tools", "bench", "testing", "__init__"},
    "cli": {"errors", "options", "storage", "manifest", "retention", "tools", "bench",
            "bench.record", "convert", "drill", "__init__"},
    "testing": {"storage", "manifest", "options"},
    "rng": set(),
    # integrations: on top of the public API
    "dcp": {"errors", "options", "storage", "manifest", "engine"},
    "convert": {"errors", "options", "storage", "manifest", "engine", "dcp", "convert_dcp"},
    "convert_dcp": {"errors"},  # convert.py's reading of a DCP directory (untrusted input)
    "torchtitan": {"errors", "options", "storage", "manifest", "retention", "engine", "dcp"},
    "lightning": {"errors", "options", "storage", "manifest", "retention", "engine",
                  "checkpointer", "dcp", "rng", "lightning_values", "__init__"},
    "lightning_values": {"errors", "manifest"},  # lightning.py's value helpers
    "hf": {"errors", "options", "storage", "manifest", "retention", "engine", "checkpointer",
           "dcp", "rng", "__init__"},
    "trackers": {"errors", "preempt"},  # on top of the public API, like the integrations
    "__init__": {"errors"},
}


def _modules():
    for dp, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dp, f)
                rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                yield rel, path


def _concern(mod: str) -> str:
    parts = mod.split(".")[1:]  # without "fastckpt"
    if not parts or parts == ["__version__"]:
        return "__init__"
    if parts[:2] == ["bench", "record"]:
        return "bench.record"
    return parts[0]


def _imports(mod: str, path: str) -> set[str]:
    """The fastckpt modules ``mod`` imports anywhere in its body (lazy imports included)."""
    pkg = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("fastckpt"):
                for n in node.names:
                    out.add(f"{target}.{n.name}" if not node.module else target)
        elif isinstance(node, ast.Import):
            out |= {n.name for n in node.names if n.name.startswith("fastckpt")}
    return out


def test_imports_flow_one_way():
    bad = []
    for mod, path in _modules():
        me = _concern(mod)
        for target in _imports(mod, path):
            other = _concern(target)
            if other != me and other not in ALLOWED[me] and target != "fastckpt._native_ext":
                bad.append(f"{mod} ({me}) imports {target} ({other})")
    assert not bad, "\n".join(bad)


def test_no_module_over_600_lines():
    long = {mod: n for mod, path in _modules() if (n := len(open(path).readlines())) > 600}
    assert not long, long


@pytest.fixture(scope="module")
def small_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("layout") / "ckpt")
    for s in (1, 2, 3):
        fastckpt.save({"w": torch.ones(10) * s, "step": s}, root, step=s)
    return root


@pytest.mark.parametrize("argv", [["ls"], ["resume", "--json"], ["gc", "--keep", "2"],
                                  ["verify"], ["inspect"], ["info"]])
def test_tools_run_without_torch(small_root, argv):
    """torch made unimportable: every step command still works (job scripts call them before
    every start; importing torch alone takes seconds)."""
    args = [argv[0]] + ([small_root] if argv[0] != "info" else []) + argv[1:]
    code = ("import sys; sys.modules['torch'] = None; from fastckpt.cli import main; "
            f"main({args!r})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       timeout=60)
    assert r.returncode == 0, (r.stdout, r.stderr)


def _env_reads(tree: ast.AST) -> list[str]:
    """FASTCKPT_* names read from ``os.environ`` / ``os.getenv`` (a subscript or ``.get``)."""
    out = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            key = node.slice
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "os.environ.get", "os.getenv") and node.args:
            key = node.args[0]
        if isinstance(key, ast.Constant) and str(key.value).startswith("FASTCKPT_"):
            out.append(key.value)
    return out


def test_the_only_ones():
    """One module installs signal handlers, one talks to torch.distributed's process groups,
    one loads the native extension, one reads the FASTCKPT_* environment."""
    found: dict[str, set] = {"signal": set(), "dist": set(), "ext": set(), "env": set()}
    for mod, path in _modules():
        src = open(path).read()
        if re.search(r"signal\.signal\(|set_wakeup_fd\(", src):
            found["signal"].add(mod)
        if re.search(r"import torch\.distributed as|torch\.distributed\.(init_process_group|"
                     r"all_gather|barrier|destroy_process_group)", src):
            found["dist"].add(mod)
        if re.search(r"import _native_ext", src):
            found["ext"].add(mod)
        if _env_reads(ast.parse(src)):
            found["env"].add(mod)
    # the drill's ranks are a training job, a user of torch.distributed like examples/
    found["dist"].discard("fastckpt.drill.worker")
    # `fastckpt resume ROOT -- CMD` gives the command it execs the default signal dispositions
    # (it installs no handler of its own); with --supervise, the supervisor (a separate
    # process, the ranks' parent) passes the signals on to CMD
    assert found == {"signal": {"fastckpt.preempt.signals", "fastckpt.cli.steps",
                                "fastckpt.cli.supervise"},
                     "dist": {"fastckpt.engine.dist"}, "ext": {"fastckpt.storage.native"},
                     "env": set()}, found
    # options.py reads the environment through a mapping it is given (testable); nobody else
    # mentions a FASTCKPT_ variable next to os.environ
    others = [mod for mod, path in _modules() if mod != "fastckpt.options"
              and re.search(r"env(iron)?\[\s*\"FASTCKPT_|env\.get\(\s*\"FASTCKPT_",
                            open(path).read())]
    assert others == [], others
