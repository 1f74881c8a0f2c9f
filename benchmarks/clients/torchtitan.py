"""torchtitan 0.3.0: its CheckpointManager (DCP FileSystemWriter, ``step-N``) against
``fastckpt.torchtitan.CheckpointManager``, sync and ``async_mode="async"``; ``manager.save`` then
``maybe_wait_for_saving`` (durable), ``manager.load`` in a fresh process. State: a llama3 model
built from torchtitan's own layer configs (dim 512, 8 heads, vocab 8192, as many layers as fit
the size), torchtitan's OptimizersContainer (AdamW, after one real step) and LR schedulers; a
gloo process group of one rank (what ``torchrun --nproc_per_node 1`` gives)."""

from __future__ import annotations

from typing import Any

from clients._common import Clock, fingerprint, init_single_rank_group, nbytes, warm_imports

CONTENDERS = ("torchtitan", "fastckpt", "torchtitan-async", "fastckpt-async")
LOADERS = ("torchtitan", "fastckpt")
PAIRS = [("torchtitan", "fastckpt"), ("torchtitan-async", "fastckpt-async")]
DESCRIPTIONS = {
    "torchtitan": "torchtitan CheckpointManager(async_mode='disabled').save / .load",
    "fastckpt": "fastckpt.torchtitan.CheckpointManager(async_mode='disabled').save / .load",
    "torchtitan-async": "torchtitan CheckpointManager(async_mode='async'); stall = save(), "
                        "durable = + maybe_wait_for_saving()",
    "fastckpt-async": "fastckpt.torchtitan.CheckpointManager(async_mode='async')",
}
DIM, HEADS, VOCAB = 512, 8, 8192


def _model(size_bytes: int, seed: int) -> Any:
    import torch
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import _build_llama3_layers, compute_ffn_hidden_dim
    from torchtitan.models.llama3.model import Llama3Model
    hidden = compute_ffn_hidden_dim(DIM, multiple_of=256)
    per_layer = 4 * DIM * DIM + 3 * DIM * hidden + 2 * DIM
    layers = max(1, int((size_bytes / 12 - 2 * VOCAB * DIM) // per_layer))
    cfg = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_llama3_layers(
            n_layers=layers, dim=DIM, n_heads=HEADS, hidden_dim=hidden, fuse_qkv=True,
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=4096, theta=500000,
                                    scaling="llama"), attn_backend="flex"))
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(seed)
    with torch.device("meta"):
        m = cfg.build()
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.init_states()
    return m


class _TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": 0}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def run(p: dict) -> dict[str, Any]:
    import warnings

    import torch
    from torchtitan.components.checkpointer import CheckpointManager as Titan
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from fastckpt.torchtitan import CheckpointManager as Fast
    warnings.filterwarnings("ignore")
    warm_imports()
    init_single_rank_group()
    loading = p["op"] != "save"
    seed = p["seed"] + (1 if loading else 0)
    m = _model(p["size_bytes"], seed)
    opt_cfg = default_adamw(lr=1e-3)
    opt_cfg.implementation = "foreach"
    optimizers = opt_cfg.build(model_parts=[m])
    lrs = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers,
                                                             training_steps=10)
    if not loading:  # (a restart loads into a fresh optimizer: no step before the load;
        # before 2026-12-06 the loader stepped too, and its moments existed before the clock)
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, VOCAB, (1, 17), generator=g)
        loss = torch.nn.functional.cross_entropy(m(tokens[:, :-1]).flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        optimizers.step()
        lrs.step()
        optimizers.zero_grad()
    state = _TrainState()
    c = p["contender"]
    cls = Fast if c.startswith("fastckpt") else Titan
    mgr = cls.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0,
                     async_mode="async" if c.endswith("-async") else "disabled",
                     last_save_model_only=False).build(
        dataloader=None, model_parts=[m], optimizers=optimizers, lr_schedulers=lrs,
        states={"train_state": state}, sd_adapter=None, base_folder=p["path"])
    out: dict[str, Any] = {}
    if not loading:
        state.step = 1
        with Clock() as total:
            with Clock() as stall:
                mgr.save(1)
            mgr.maybe_wait_for_saving()
        out.update(stall_s=stall.s, durable_s=total.s)
    else:
        with Clock() as t:
            mgr.load(step=-1)
        out["load_s"] = t.s
        assert state.step == 1, state.step
    mgr.close()
    full = {"model": m.state_dict(), "optim": optimizers.state_dict(),
            "lr": [s.get_last_lr() for s in lrs], "step": state.step}
    out.update(state_bytes=nbytes(full), fingerprint=fingerprint(full))
    return out
