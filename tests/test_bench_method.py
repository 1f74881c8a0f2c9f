"""Benchmark-method checks from a review of the published figures (docs/benchmarks.md,
2026-12-06): each failed while the flaw it names was in the measuring code.
"""

from __future__ import annotations


def test_bench_cli_passes_compression_to_the_run(tmp_path, monkeypatch):
    """``fastckpt bench --compression zstd`` measures compressed saves (before 2026-12-06 the
    CLI accepted the option but never handed it to ``run_bench``: the run saved uncompressed
    whatever the flag said, and the report did not record the setting)."""
    from click.testing import CliRunner

    from fastckpt.bench import storage as B
    from fastckpt.cli.base import cli
    import fastckpt.cli.benchcmd  # noqa: F401  (registers the command)

    seen: dict = {}

    def fake_run_bench(target, size, **kw):
        seen.update(kw)
        raise B.BenchError("stopped by the test")
    monkeypatch.setattr(B, "run_bench", fake_run_bench)
    CliRunner().invoke(cli, ["bench", str(tmp_path / "t"), "--create", "--size", "16MiB",
                             "--compression", "zstd", "--no-record", "--report", "",
                             "--png", ""])
    assert seen, "run_bench was not reached"
    assert seen.get("compression") == "zstd"
