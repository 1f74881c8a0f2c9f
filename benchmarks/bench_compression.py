#!/usr/bin/env python3
"""Compression of checkpoint tensors: fastckpt's codec (zstd over byte-grouped 4 MiB blocks,
``fastckpt.storage.codec``) against plain zstd on the raw bytes, on tensors of a trained model.

The tensors: a small GPT (token + position embeddings, ``--layers`` pre-norm
``nn.TransformerEncoderLayer`` blocks with a causal mask, an untied LM head; GPT-2 init, normal
std 0.02) trained with AdamW for ``--steps`` steps on CPU on a synthetic language with structure
(a random Markov chain: every token has 4 possible successors; the loss falls from ln(vocab)
toward ln(4)). Families, each the model's tensors back to back in one buffer (as in a shard
file; a real model's tensors are 10-1000 MiB, so a chunk spans many blocks):

- ``w_fp32`` / ``w_bf16``: the trained weights, fp32 and a bf16 copy
- ``adam_m`` / ``adam_v``: AdamW's ``exp_avg`` / ``exp_avg_sq`` (fp32)
- ``init_fp32`` / ``init_bf16``: the same model at initialization (contrast; ``--no-init``)

Contenders, at each ``--levels`` zstd level:

- ``zstd``: ``ZstdCompressor(level).compress`` of the whole buffer, one frame (2 threads:
  zstd's own multithreading of that frame; decompression of one frame is single-threaded)
- ``fastckpt``: ``codec.encode`` / ``codec.decode_into`` at ``--threads`` (1 and 2 by default;
  2 on a long-lived ``ThreadPoolExecutor``, as the writer would hold one)
- ``fastckpt-py`` (level 1, 1 thread): the same with the pure-Python grouping kernels
  (``native="off"``: the extension not built)

Every repetition runs the contenders in a new shuffled order (seeded); one untimed warm-up
each; the table gives medians of ``--reps``. ``GB/s`` is raw bytes per wall second; ``/core``
is raw bytes per CPU second of the process (all threads), i.e. the speed of one core. Every
decode is checked bit-exact. Also measured: the byte grouping kernels alone (C vs pure
Python), and what ``codec.measure`` (the probe of ``compression="auto"``) reports per family
and how long it takes.

    python benchmarks/bench_compression.py --out compression.json          # 40-80 s, 2 cores
    python benchmarks/bench_compression.py --steps 50 --reps 1 --levels 1   # quick look
    python benchmarks/bench_compression.py --blocks 1M,4M,16M --levels 1,3,-1   # the sweeps

The JSON holds every repetition, the machine (CPU model, cores), the date, the git commit and
the versions; the table is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
sys.path.insert(0, REPO_ROOT)  # the working tree's fastckpt

from fastckpt.bench import common as C  # noqa: E402
from fastckpt.storage import codec  # noqa: E402
from fastckpt.storage import native as _native  # noqa: E402

MiB = 1 << 20


# --------------------------------------------------------------------------------------------
# the model and its training
# --------------------------------------------------------------------------------------------


def train(args) -> tuple[dict[str, tuple[bytes, int]], dict[str, Any]]:
    """Families name -> (raw bytes, group width), and what the training did."""
    import torch
    from torch import nn

    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    V, D, L, T, B = args.vocab, args.width, args.layers, args.seq, args.batch

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
            layer = nn.TransformerEncoderLayer(D, max(1, D // 64), 4 * D, dropout=0.0,
                                               activation="gelu", batch_first=True,
                                               norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, L, enable_nested_tensor=False)
            self.ln = nn.LayerNorm(D)
            self.head = nn.Linear(D, V, bias=False)
            for name, p in self.named_parameters():  # GPT-2 init
                if p.dim() >= 2:
                    nn.init.normal_(p, 0.0, 0.02)
                elif "norm" in name or name.startswith("ln."):
                    nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
                else:
                    nn.init.zeros_(p)

        def forward(self, x):
            t = x.shape[1]
            mask = nn.Transformer.generate_square_subsequent_mask(t)
            h = self.tok(x) + self.pos(torch.arange(t))
            return self.head(self.ln(self.blocks(h, mask=mask, is_causal=True)))

    model = GPT()
    init = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(args.seed + 1)
    succ = torch.randint(0, V, (V, 4), generator=g)  # the language: 4 successors per token

    def batch():
        x = torch.empty(B, T + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, V, (B,), generator=g)
        pick = torch.randint(0, 4, (B, T + 1), generator=g)
        for t in range(1, T + 1):
            x[:, t] = succ[x[:, t - 1], pick[:, t]]
        return x[:, :-1], x[:, 1:]

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = batch()
        loss = nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if args.verbose and step % 50 == 0:
            print(f"  step {step} loss {loss.item():.3f}", file=sys.stderr)
    seconds = time.perf_counter() - t0
    params = list(model.parameters())

    def cat(ts, dtype) -> bytes:
        return b"".join(t.detach().to(dtype).contiguous().view(torch.uint8).numpy().tobytes()
                        for t in ts)

    fams = {"w_fp32": (cat(params, torch.float32), 4), "w_bf16": (cat(params, torch.bfloat16), 2)}
    if args.steps:
        st = [opt.state[p] for p in params]
        fams["adam_m"] = (cat([s["exp_avg"] for s in st], torch.float32), 4)
        fams["adam_v"] = (cat([s["exp_avg_sq"] for s in st], torch.float32), 4)
    if not args.no_init:
        fams["init_fp32"] = (cat(init, torch.float32), 4)
        fams["init_bf16"] = (cat(init, torch.bfloat16), 2)
    info = {"params": sum(p.numel() for p in params), "tensors": len(params),
            "vocab": V, "width": D, "layers": L, "seq": T, "batch": B, "steps": args.steps,
            "lr": args.lr, "optimizer": "AdamW(weight_decay=0.01)", "train_seconds": seconds,
            "loss_first": losses[0] if losses else None,
            "loss_last10": statistics.mean(losses[-10:]) if losses else None,
            "loss_floor_ln4": math.log(4), "loss_start_ln_vocab": math.log(V)}
    return fams, info


# --------------------------------------------------------------------------------------------
# contenders
# --------------------------------------------------------------------------------------------


def timed(fn) -> tuple[float, float, Any]:
    c0, t0 = time.process_time(), time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, time.process_time() - c0, r


def run_zstd(data: bytes, level: int, threads: int) -> dict[str, float]:
    import zstandard
    c = zstandard.ZstdCompressor(level=level, threads=threads if threads > 1 else 0)
    cw, cc, out = timed(lambda: c.compress(data))
    d = zstandard.ZstdDecompressor()
    dw, dc, back = timed(lambda: d.decompress(out))
    assert back == data, "zstd round trip differs"
    return {"stored": len(out), "cw": cw, "cc": cc, "dw": dw, "dc": dc}


def run_codec(data: bytes, width: int, level: int, threads: int, block: int, native: str,
              pool) -> dict[str, float]:
    ex = pool if threads > 1 else None
    cw, cc, enc = timed(lambda: codec.encode(data, width=width, level=level, block=block,
                                             threads=threads, executor=ex, native=native))
    stored, out = enc.tobytes(), bytearray(len(data))
    dw, dc, _ = timed(lambda: codec.decode_into(stored, enc.desc, out, threads=threads,
                                                executor=ex, native=native))
    assert out == data, "codec round trip differs"
    return {"stored": len(stored), "cw": cw, "cc": cc, "dw": dw, "dc": dc,
            "frames": len(enc.desc["frames"])}


def contenders(args) -> list[dict[str, Any]]:
    out = []
    for level in args.levels:
        for t in args.threads:
            out.append({"method": "zstd", "level": level, "threads": t, "block": None})
            for b in args.blocks:
                out.append({"method": "fastckpt", "level": level, "threads": t, "block": b})
    if 1 in args.levels and 1 in args.threads:
        out.append({"method": "fastckpt-py", "level": 1, "threads": 1,
                    "block": codec.DEFAULT_BLOCK})
    return out


def run_one(c: dict, data: bytes, width: int, pool) -> dict[str, float]:
    if c["method"] == "zstd":
        return run_zstd(data, c["level"], c["threads"])
    native = "off" if c["method"] == "fastckpt-py" else "auto"
    return run_codec(data, width, c["level"], c["threads"], c["block"], native, pool)


def summarize(raw: int, reps: list[dict[str, float]]) -> dict[str, Any]:
    med = {k: statistics.median(r[k] for r in reps) for k in ("cw", "cc", "dw", "dc")}
    stored = reps[0]["stored"]
    return {"ratio": raw / stored, "stored_bytes": stored,
            "compress_gbps": raw / med["cw"] / 1e9, "compress_gbps_per_core": raw / med["cc"] / 1e9,
            "decompress_gbps": raw / med["dw"] / 1e9,
            "decompress_gbps_per_core": raw / med["dc"] / 1e9}


# --------------------------------------------------------------------------------------------
# grouping kernels alone
# --------------------------------------------------------------------------------------------


def bench_kernels(nbytes: int, reps: int) -> list[dict[str, Any]]:
    src = random.Random(0).randbytes(nbytes)
    dst, back = bytearray(nbytes), bytearray(nbytes)
    kinds = [("python", (codec._py_group, codec._py_ungroup))]
    ks = _native.byte_regroup_kernels()
    if ks is not None:
        kinds.insert(0, ("c", ks))
    rows = []
    for width in (2, 4, 8):
        for name, (group, ungroup) in kinds:
            g = statistics.median(timed(lambda: group(src, dst, width))[0] for _ in range(reps))
            u = statistics.median(timed(lambda: ungroup(dst, back, width))[0]
                                  for _ in range(reps))
            assert back == src
            rows.append({"kernel": name, "width": width, "group_gbps": nbytes / g / 1e9,
                         "ungroup_gbps": nbytes / u / 1e9, "releases_gil": name == "c"})
    return rows


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--width", type=int, default=256, help="model width (default 256)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-init", action="store_true", help="skip the random-init families")
    ap.add_argument("--levels", default="1,3", help="zstd levels (default 1,3)")
    ap.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    ap.add_argument("--blocks", default="4M", help="codec block sizes (default 4M)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (default 3)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]
    args.threads = [int(x) for x in args.threads.split(",")]
    args.blocks = [C.parse_size(x) for x in args.blocks.split(",")]

    import zstandard
    started = C.utc_now()
    print(f"training: {args.steps} steps ...", file=sys.stderr)
    fams, model = train(args)
    print(f"  {model['params']:,} parameters, {model['train_seconds']:.0f} s, loss "
          f"{model['loss_first']:.2f} -> {model['loss_last10']:.2f} (floor {math.log(4):.2f})",
          file=sys.stderr)

    cs = contenders(args)
    pool = ThreadPoolExecutor(max(args.threads), thread_name_prefix="bench")
    rng = random.Random(args.seed)
    results, measures = [], {}
    for fam, (data, width) in fams.items():
        for c in cs:  # warm-up: contexts, pool threads, scratch buffers
            run_one(c, data[:8 * MiB], width, pool)
        reps: list[list[dict]] = [[] for _ in cs]
        for _ in range(args.reps):
            order = list(range(len(cs)))
            rng.shuffle(order)
            for i in order:
                reps[i].append(run_one(cs[i], data, width, pool))
        for c, r in zip(cs, reps):
            results.append({"family": fam, "raw_bytes": len(data), "group": width, **c,
                            **summarize(len(data), r), "reps": r})
        w0 = time.perf_counter()
        m = codec.measure(data, width, level=1)
        measures[fam] = {**m, "wall_seconds": time.perf_counter() - w0}
        print(f"  {fam} done", file=sys.stderr)
    pool.shutdown()
    kernels = bench_kernels(16 * MiB, max(3, args.reps))

    # ---------------------------------------------------------------------------------- report
    print(f"\nraw GB/s (wall) and per core (CPU time); medians of {args.reps}")
    hdr = (f"{'family':10} {'MiB':>6} {'method':12} {'lvl':>3} {'thr':>3} {'block':>5} "
           f"{'ratio':>6} {'comp':>6} {'/core':>6} {'decomp':>6} {'/core':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        blk = "-" if not r["block"] else (f"{r['block'] >> 20}M" if r["block"] >= MiB
                                          else f"{r['block'] >> 10}K")
        print(f"{r['family']:10} {r['raw_bytes'] / MiB:6.1f} {r['method']:12} {r['level']:3d} "
              f"{r['threads']:3d} {blk:>5} {r['ratio']:6.3f} {r['compress_gbps']:6.2f} "
              f"{r['compress_gbps_per_core']:6.2f} {r['decompress_gbps']:6.2f} "
              f"{r['decompress_gbps_per_core']:6.2f}")
    print("\ncodec.measure(level=1) (the compression='auto' probe, 4 MiB sample, CPU time):")
    for fam, m in measures.items():
        print(f"  {fam:10} ratio {m['ratio']:.3f}  {m['bytes_per_s'] / 1e9:.2f} GB/s  decode "
              f"{m['decode_bytes_per_s'] / 1e9:.2f} GB/s  ({m['wall_seconds'] * 1e3:.0f} ms)")
    print("\nbyte grouping kernels alone (16 MiB, GB/s, one thread):")
    for k in kernels:
        print(f"  {k['kernel']:7} width {k['width']}: group {k['group_gbps']:5.2f}  ungroup "
              f"{k['ungroup_gbps']:5.2f}  (GIL {'released' if k['releases_gil'] else 'held'})")

    doc = {"benchmark": "compression", "started": started, "finished": C.utc_now(),
           "machine": C.machine_info(), "git": C.git_commit(),
           "versions": {**C.base_versions(), "zstandard": zstandard.__version__,
                        "zstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
                        "native_kernels": _native.byte_regroup_kernels() is not None},
           "config": {k: v for k, v in vars(args).items() if k != "out"},
           "model": model, "results": results, "measure": measures, "kernels": kernels}
    m = doc["machine"]
    print(f"\n{m.get('cpu_model')}, {m.get('nproc_affinity', m.get('nproc'))} cores; "
          f"commit {doc['git'].get('commit')}{' (dirty)' if doc['git'].get('dirty') else ''}; "
          f"{doc['finished']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
