"""Presenting a drill's result: the pass/fail matrix (:func:`matrix_rows`,
:func:`format_matrix`), the lines under it (:func:`notes`, :func:`failures`) and the
timeline chart (:func:`write_timeline_png`, with matplotlib)."""

from __future__ import annotations

import os

def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def matrix_rows(result: dict) -> list[list[str]]:
    """One row per scenario: scenario, result, propagation ms, consensus ms, save s / window
    s, decision, stop step, exit codes, restart bit-exact (from step)."""
    rows = []
    for s in result["scenarios"]:
        if s.get("skipped"):
            rows.append([s["name"], "skipped"] + ["-"] * (len(MATRIX_HEADERS) - 2))
            continue
        m, r = s["measured"], s["restart"]
        save = "-" if m.get("save_s") is None else f"{m['save_s']:.2f}"
        be = r.get("bit_exact")
        rows.append([
            s["name"], "pass" if s["passed"] else "FAIL", _ms(m.get("propagation_ms")),
            _ms(m.get("consensus_ms")), f"{save} / {s['window_s']:g}",
            m.get("decision") or "-", str(m.get("stop_step", "-")),
            " ".join(str(c) for c in m.get("exit_codes") or []) or "-",
            ("-" if be is None else "yes" if be else "NO") +
            (f" (from {r.get('from_step')})" if r.get("from_step") is not None else ""),
        ])
    return rows


MATRIX_HEADERS = ("scenario", "result", "propagation ms", "consensus ms", "save s / window s",
                  "decision", "stop step", "exit codes", "restart bit-exact")


def failures(result: dict) -> list[str]:
    """One line per failed check: ``scenario: check: detail``."""
    out = []
    for s in result["scenarios"]:
        for c in s["checks"]:
            if not c["ok"]:
                out.append(f"{s['name']}: {c['check']}: {c['detail']}")
    return out


def notes(result: dict) -> list[str]:
    """Lines printed under the matrix: each skipped scenario and why
    (``slurm: skipped: no Slurm cluster answers (sinfo: ...)``), and what the ``slurm``
    scenario saw of Slurm (job ids, queue waits, sacct states)."""
    out = []
    for s in result["scenarios"]:
        if s.get("skipped"):
            out.append(f"{s['name']}: skipped: {s['skipped']}")
            continue
        sl = (s.get("measured") or {}).get("slurm")
        if not sl:
            continue
        out.append(
            f"{s['name']}: job {sl.get('job_id')} ({sl.get('partition') or 'default partition'}"
            f", {sl.get('ntasks')} srun tasks) queued {_sec(sl.get('queue_wait_s'))}, steps "
            f"after {_sec(sl.get('submit_to_steps_s'))}; scancel -> SIGTERM on every rank in "
            f"{_ms(sl.get('scancel_to_signal_ms'))} ms (window KillWait "
            f"{_sec(sl.get('kill_wait_s'))}); sacct {sl.get('state') or '?'}, "
            f"{'requeued' if sl.get('requeued') else 'not requeued'}; restart job "
            f"{sl.get('restart_job_id')} (the same script) queued "
            f"{_sec(sl.get('restart_queue_wait_s'))}, sacct {sl.get('restart_state') or '?'}")
    return out


def _sec(v: float | None) -> str:
    return "?" if v is None else f"{v:g} s"


def format_matrix(result: dict) -> str:
    """The pass/fail matrix as plain text (the CLI prints it with rich), then :func:`notes`."""
    rows = [list(MATRIX_HEADERS)] + matrix_rows(result)
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
                     + notes(result))


_MARKS = {  # event -> (marker, colour, label)
    "sent": ("1", "tab:red", "signal sent (driver)"),
    "signal": ("v", "tab:red", "signal received"),
    "consensus": ("o", "tab:blue", "consensus"),
    "save_start": (">", "tab:green", "save start"),
    "save_end": ("<", "tab:green", "save end"),
    "commit": ("*", "black", "commit"),
    "exit": ("s", "tab:purple", "exit event"),
    "killed": ("X", "tab:red", "SIGKILL"),
    "gone": ("|", "tab:gray", "process gone"),
}


def write_timeline_png(result: dict, path: str) -> str | None:
    """Per scenario a panel, per rank a row: signal, consensus, save start/end, commit, exit
    event, SIGKILL and the process's end, in seconds after the first signal; the grace
    deadline as a vertical line. Returns ``path``, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    scs = [s for s in result["scenarios"] if s["ranks"]]
    if not scs:
        return None
    fig, axes = plt.subplots(len(scs), 1, figsize=(10, 1.6 + sum(
        0.7 + 0.35 * len(s["ranks"]) for s in scs)), squeeze=False)
    seen: set[str] = set()
    for ax, s in zip(axes[:, 0], scs):
        xmax = s["window_s"]
        t0 = (s["measured"] or {}).get("first_signal_t")
        for x in s["ranks"]:
            y = x["rank"]
            tl = dict(x["timeline"])
            if t0 is not None:
                tl["sent"] = [round(e["t"] - t0, 4) for e in s["sent"]
                              if e["rank"] == y and e["signal"] != "SIGKILL"]
            if tl.get("save_start") is not None and tl.get("save_end") is not None:
                ax.plot([tl["save_start"], tl["save_end"]], [y, y], color="tab:green", lw=4,
                        alpha=0.4)
            for key, (mk, col, label) in _MARKS.items():
                vals = tl.get(key)
                for v in (vals if isinstance(vals, list) else [vals]):
                    if v is None:
                        continue
                    xmax = max(xmax, v)
                    ax.plot([v], [y], marker=mk, color=col, ls="", ms=9,
                            label=None if label in seen else label)
                    seen.add(label)
            ax.annotate(f"exit {x['exit_code']}", (max(v for v in [tl.get("gone") or 0,
                                                                   tl.get("exit") or 0]), y),
                        xytext=(8, -3), textcoords="offset points", fontsize=8)
        ax.axvline(s["window_s"], color="tab:red", ls="--", lw=1,
                   label=None if "grace deadline" in seen else "grace deadline")
        seen.add("grace deadline")
        ax.axvline(0, color="tab:gray", lw=0.5)
        ax.set_yticks([x["rank"] for x in s["ranks"]])
        ax.set_yticklabels([f"rank {x['rank']}" for x in s["ranks"]])
        ax.set_ylim(-0.7, len(s["ranks"]) - 0.3)
        ax.invert_yaxis()
        # the first second (signal, consensus, save) linear and wide, the rest of the window
        # logarithmic: both the milliseconds and the deadline are readable
        ax.set_xscale("symlog", linthresh=1.0, linscale=1.5)
        ax.set_xlim(-0.05, xmax * 1.3 + 0.5)
        ticks = [t for t in (0, 0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300, 600)
                 if t <= xmax * 1.3 + 0.5]
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in ticks])
        ax.minorticks_off()
        m = s["measured"]
        ax.set_title(f"{s['name']}: {'pass' if s['passed'] else 'FAIL'}  (decision "
                     f"{m.get('decision')}, stop step {m.get('stop_step')}, window "
                     f"{s['window_s']:g} s)", fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds after the first signal (linear to 1 s, then logarithmic)")
    fig.suptitle(f"fastckpt drill, {result['options']['ranks']} ranks x "
                 f"{result['options']['size']}, {result['date']}", fontsize=11, x=0.01,
                 ha="left")
    legend_h = 0.5 / fig.get_figheight()
    fig.legend(loc="lower center", fontsize=8, ncol=5, frameon=False)
    fig.tight_layout(rect=(0, legend_h + 0.02, 1, 0.97))
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
