"""Hugging Face ``transformers.Trainer`` (5.x) checkpoints through fastckpt, resumed by the
Trainer's own resume path; and the state of an ``accelerate`` training loop.

    import fastckpt.hf

    ckpt = fastckpt.hf.FastCkptCallback("/nvme/ckpt/run42", every=100, keep_last=3)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[ckpt])
    trainer.train(resume_from_checkpoint=ckpt.resume(trainer))  # None when there is nothing yet

Call sequence (every rank runs the same script; docs/integrations/huggingface.md):

1. ``ckpt.resume(trainer)`` (all ranks, before ``train``): binds the callback to this trainer:
   three of its checkpoint methods are replaced *on this instance only* (``_save_checkpoint``,
   ``_load_from_checkpoint``, ``_load_rng_state``). Finds the newest committed step (every
   rank agrees, as in any fastckpt load), reads its ``TrainerState`` (plain JSON, no tensors
   read) and writes it as ``trainer_state.json`` into a private temporary directory, whose
   path it returns (None when the root has no committed step: a fresh start).
2. ``trainer.train(resume_from_checkpoint=that_dir)``: the Trainer's own resume runs: it reads
   ``trainer_state.json`` (global step, epoch, log history, stateful callbacks) and works out
   the epochs and batches to skip. Its loaders find no Hugging Face files in the directory: the
   model loader is a no-op for it, the optimizer, scheduler and scaler loaders skip.
3. ``on_train_begin`` (all ranks, once the Trainer has prepared the model (FSDP2: sharded), the
   optimizer and the scheduler): fastckpt loads the model, the optimizer, the LR scheduler and
   the grad scaler in place (strict: every key must match), resharding DTensors; the RNG
   states are kept aside.
4. The Trainer's ``_load_rng_state(that_dir)``, called where its own resume restores the
   generators (after fast-forwarding past the consumed batches): the saved Python, NumPy and
   torch generators are restored, so dropout and shuffling continue bit-exact.
5. Saves: whenever the Trainer decides to save (``save_strategy``/``save_steps``, the end of
   training, a new best metric) and, with ``every=N``, every N optimizer steps, the Trainer
   calls ``_save_checkpoint`` at its usual place (after logging and evaluation), replaced by a
   fastckpt save (collective, asynchronous: training continues once the state is staged) of
   ``{"model", "scaler" (if any), "optimizer", "lr_scheduler", "rng", "trainer_state"}`` as step
   ``global_step``. The Trainer writes no ``checkpoint-N`` directory; ``on_save`` callbacks run
   as usual. Retention: ``keep_last`` (default ``args.save_total_limit``).
6. ``on_train_end``: waits for the last save to commit and closes the Checkpointer.

A save changes nothing: the Trainer's flop counter is summed into the saved ``TrainerState``
without being reset, and the callback states are serialised into the saved copy only.

For ``accelerate`` loops, :func:`accelerate_state` builds the dict to hand to a
:class:`fastckpt.Checkpointer` (accelerate's ``save_state`` pre-hooks see the model weights
only, not the optimizer or RNG states it pickles, so they cannot route a checkpoint here).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import weakref
from typing import Any

from .checkpointer import Checkpointer
from .errors import CheckpointNotFoundError, StateMismatchError
from .rng import RNGState

try:  # the callback must be a real TrainerCallback; `import fastckpt` never imports this module
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - transformers is an optional extra
    raise ImportError("fastckpt.hf needs transformers (pip install 'fastckpt[hf]')") from e

__all__ = ["FastCkptCallback", "accelerate_state"]

log = logging.getLogger("fastckpt")

#: the Trainer methods replaced on a bound instance (present, with these names, since 4.x)
_PATCHED = ("_save_checkpoint", "_load_from_checkpoint", "_load_rng_state")
#: TrainerState fields that describe this process, not the run (reset by the Trainer on resume)
_PROCESS_FIELDS = ("is_local_process_zero", "is_world_process_zero")


class _PendingRNG:
    """Loads like :class:`fastckpt.RNGState` but keeps the saved states until ``apply()``: the
    Trainer restores the generators later than the weights (after skipping batches)."""

    def __init__(self) -> None:
        self.saved: dict | None = None

    def state_dict(self) -> dict:
        return RNGState().state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.saved = sd

    def apply(self) -> None:
        if self.saved is not None:
            RNGState().load_state_dict(self.saved)
            self.saved = None


class FastCkptCallback(TrainerCallback):
    """Makes fastckpt write a ``transformers.Trainer``'s checkpoints and resume them.

    ``root``: a path or fsspec URL (one root per run). ``every``: also save every N optimizer
    steps (None: only when the Trainer's own ``save_strategy`` says so; with
    ``save_strategy="no"`` set ``every``). ``keep_last``: committed steps to keep (default:
    ``args.save_total_limit``; None keeps all). Other keyword arguments are
    :class:`fastckpt.CheckpointOptions` (e.g. ``staging_cap_bytes``, ``storage_options``).

    Use with ``trainer.train(resume_from_checkpoint=ckpt.resume(trainer))``; see the module
    docstring for what happens when.
    """

    def __init__(self, root: str | os.PathLike, *, every: int | None = None,
                 keep_last: int | None = None, **options: Any) -> None:
        if every is not None and (not isinstance(every, int) or isinstance(every, bool)
                                  or every < 1):
            raise ValueError(f"every must be a positive int or None, got {every!r}")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
        if "collective" in options:
            raise ValueError("FastCkptCallback saves on every rank together (the Trainer calls "
                             "its save on every rank); collective cannot be changed")
        if options.get("grace_s") is not None or options.get("preempt"):
            raise ValueError("preemption (emergency saves at a stop signal) is not wired into "
                             "FastCkptCallback: save with every=N (docs/integrations/"
                             "huggingface.md)")
        self.root = os.fspath(root)
        self.every = every
        self.keep_last = keep_last
        self.options = options
        self._trainer: Any = None
        self._ck: Checkpointer | None = None
        self._last_saved: int | None = None
        self._saved: set[int] = set()  # steps saved under root by this run
        #: committed steps found under root on resume, listed at the first save that needs
        #: them (not in the restart's critical path: every manifest is read); None: not yet
        self._found: set[int] | None = set()
        self._best_saved: int | None = None  # the best step that has a checkpoint
        self._epoch_save: int | None = None  # an ``every`` step that ends an epoch
        self._resume_dir: str | None = None
        self._resume_step: int | None = None
        self._resume_best: int | None = None
        self._resume_has_best = False
        self._armed = False  # the Trainer took the resume directory (its model loader ran)
        self._rng = _PendingRNG()
        self._cleanup: Any = None

    # -- public --------------------------------------------------------------------------------
    @property
    def checkpointer(self) -> Checkpointer:
        """The :class:`fastckpt.Checkpointer` of ``root`` (created at first use, every rank
        together; closed at the end of training)."""
        if self._ck is None or self._ck._closed:
            keep = self.keep_last
            if keep is None and self._trainer is not None:
                keep = self._trainer.args.save_total_limit
            # no signal trap, whatever FASTCKPT_GRACE_S says: nothing here would act on it
            opts = {**self.options, "grace_s": None, "preempt": False}
            self._ck = Checkpointer(self.root, keep_last=keep, **opts)
        return self._ck

    @property
    def resume_step(self) -> int | None:
        """The step ``resume`` prepared (None: a fresh start), until training ends."""
        return self._resume_step

    def resume(self, trainer: Any, *, step: int | None = None) -> str | None:
        """Bind to ``trainer`` and prepare the resume of ``step`` (default: the newest committed
        one). Every rank calls it, before ``trainer.train``. Returns the directory to pass as
        ``resume_from_checkpoint`` (None when the root has no committed step yet)."""
        self._bind(trainer)
        self._drop_resume()
        holder: dict = {"trainer_state": "", "best_saved_step": -1}  # (-1: not in the step)
        try:  # plain values only: the TrainerState (strict=False leaves every tensor out)
            found = self.checkpointer.load(holder, step=step, strict=False)
        except CheckpointNotFoundError:
            if step is not None:
                raise
            return None
        if not isinstance(holder["trainer_state"], str) or not holder["trainer_state"]:
            raise StateMismatchError(
                f"step {found} under {self.root} was not written by fastckpt.hf (it holds no "
                "'trainer_state'); load it with fastckpt.load instead")
        d = tempfile.mkdtemp(prefix=f"fastckpt-hf-step{found}-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, d, True)
        with open(os.path.join(d, "trainer_state.json"), "w", encoding="utf-8") as f:
            f.write(holder["trainer_state"])
        self._resume_dir, self._resume_step = d, found
        best = holder["best_saved_step"]  # (absent from steps saved before 2026-12-06)
        self._resume_has_best = best != -1
        self._resume_best = best if type(best) is int and best >= 0 else None
        log.info("fastckpt.hf: resuming step %d of %s", found, self.root)
        return d

    # -- Trainer events ------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if self._trainer is None:
            raise RuntimeError(
                "FastCkptCallback is not bound to its Trainer: start training with "
                "trainer.train(resume_from_checkpoint=ckpt.resume(trainer)) (it returns None "
                "when there is nothing to resume)")
        if self._resume_dir is not None and not self._armed:
            raise RuntimeError(
                f"ckpt.resume(trainer) prepared step {self._resume_step} but train() was not "
                "given its directory: pass trainer.train(resume_from_checkpoint="
                "ckpt.resume(trainer))")
        if self._armed:
            if state.global_step != self._resume_step:
                raise RuntimeError(
                    f"the Trainer resumed global step {state.global_step}, fastckpt prepared "
                    f"step {self._resume_step}: pass the directory ckpt.resume() returned")
            step = self.checkpointer.load(self._state("", loading=True), step=self._resume_step)
            log.info("fastckpt.hf: loaded step %d (model, optimizer, scheduler)", step)
        self._last_saved = self._resume_step if self._armed else None
        self._saved, self._found = set(), None if self._armed else set()
        self._best_saved = self._resume_best if self._armed else None
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.every is not None and state.global_step % self.every == 0:
            if state.epoch is not None and float(state.epoch).is_integer():
                # the epoch's last step: its end events (an epoch's evaluation, which draws
                # random numbers and updates the TrainerState) come after this step's save,
                # so the save waits for them (on_epoch_end), as the Trainer's epoch save does
                self._epoch_save = state.global_step
            else:
                control.should_save = True  # the Trainer then calls _save_checkpoint (ours)
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if self._epoch_save == state.global_step:
            control.should_save = True  # (the Trainer saves after this epoch's evaluation)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self._epoch_save == state.global_step and self._last_saved != state.global_step \
                and self._trainer is not None:  # (no epoch end came: the step's save now)
            self._save_checkpoint(self._trainer.model, None)
        self._epoch_save = None
        self._drop_resume()
        ck, self._ck = self._ck, None
        if ck is not None:
            ck.close()  # waits for the last save (under the engine's commit deadline)
        return control

    # -- the Trainer's replaced methods --------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        """(replaces ``Trainer._save_checkpoint``; all ranks) The fastckpt save of this step."""
        trainer = self._trainer
        step = trainer.state.global_step
        if step == self._last_saved and step == self._resume_step:
            return  # (the step just loaded: nothing changed since)
        # a second save of one step (the Trainer's step save, then its epoch save after the
        # epoch's evaluation) replaces the first: the state after the epoch's end events is
        # what an uninterrupted run goes on from (before 2026-12-06 the first one stayed)
        ck = self.checkpointer
        best = trainer.state.best_global_step if trainer.args.metric_for_best_model else None
        # retention keeps the best step that has a checkpoint, as the Trainer's rotation keeps
        # best_model_checkpoint: moved to the best step only when that step is saved (before
        # 2026-12-06 a best step that was never saved was kept, and the saved best removed)
        if best is not None and best != self._best_saved and best != step \
                and best not in self._saved and self._found is None:
            self._found = set(ck.steps())
        if best is not None and (best == step or best in self._saved
                                 or best in (self._found or ())):
            self._best_saved = best
        text = self._trainer_state_json(trainer, trial)
        ck.keep_steps({self._best_saved} if self._best_saved is not None else set())
        ck.save(self._state(text), step=step,
                user_meta={"written_by": "fastckpt.hf.FastCkptCallback",
                           "global_step": step, "epoch": trainer.state.epoch})
        self._last_saved = step
        self._saved.add(step)

    def _load_from_checkpoint(self, orig: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        if self._resume_dir is not None and path == self._resume_dir:
            self._armed = True  # the weights are fastckpt's, loaded at on_train_begin
            return None
        return orig(path, *args, **kwargs)

    def _load_rng_state(self, orig: Any, checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
        if self._resume_dir is not None and checkpoint == self._resume_dir:
            self._rng.apply()
            return None
        return orig(checkpoint, *args, **kwargs)

    # -- internals -----------------------------------------------------------------------------
    def _bind(self, trainer: Any) -> None:
        if self._trainer is trainer:
            return
        if self._trainer is not None:
            raise ValueError("this FastCkptCallback is bound to another Trainer; make one "
                             "callback per Trainer")
        missing = [n for n in _PATCHED if not callable(getattr(type(trainer), n, None))]
        if missing:
            import transformers
            raise RuntimeError(f"transformers {transformers.__version__}: Trainer has no "
                               f"{', '.join(missing)}; fastckpt.hf supports transformers 5.x")
        args = trainer.args
        if getattr(trainer, "is_deepspeed_enabled", False):
            raise ValueError("fastckpt.hf does not checkpoint DeepSpeed engines (their state "
                             "lives inside DeepSpeed); use DeepSpeed's own checkpoints")
        if args.load_best_model_at_end:
            raise ValueError("load_best_model_at_end reloads a Trainer checkpoint-N directory; "
                             "with FastCkptCallback the Trainer writes none. Set it to False "
                             "(trainer.save_model() exports weights at the end)")
        if args.save_only_model:
            log.warning("fastckpt.hf: save_only_model is ignored: the whole training state is "
                        "saved so that training can resume")
        if args.push_to_hub:
            log.warning("fastckpt.hf: push_to_hub: the Trainer pushes its checkpoint-N "
                        "directories, which it no longer writes; call trainer.push_to_hub()")
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        self._trainer = trainer
        trainer._save_checkpoint = self._save_checkpoint
        for name in ("_load_from_checkpoint", "_load_rng_state"):
            orig = getattr(trainer, name)
            mine = getattr(self, name)
            setattr(trainer, name, lambda *a, _o=orig, _m=mine, **k: _m(_o, *a, **k))

    def _drop_resume(self) -> None:
        if self._cleanup is not None:
            self._cleanup()  # removes the temporary directory
            self._cleanup = None
        self._resume_dir = self._resume_step = None
        self._armed = False
        self._rng.saved = None

    def _state(self, trainer_state: str, *, loading: bool = False) -> dict:
        """What is saved and loaded. The model is the Trainer's (FSDP2: sharded in place); the
        optimizer is the torch optimizer inside accelerate's wrapper, so that it is saved by
        parameter name (DCP's layout, reshardable)."""
        t = self._trainer
        state: dict = {"model": t.model}
        scaler = getattr(t.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        state["optimizer"] = _inner_optimizer(t.optimizer)
        if t.lr_scheduler is not None:
            state["lr_scheduler"] = t.lr_scheduler
        state["rng"] = self._rng if loading else RNGState()
        state["trainer_state"] = trainer_state
        if not loading or self._resume_has_best:  # (read by resume(); none in older steps)
            state["best_saved_step"] = self._best_saved
        return state

    def _trainer_state_json(self, trainer: Any, trial: Any) -> str:
        """Rank 0's TrainerState as the Trainer would write it to trainer_state.json at this
        point (flops summed over the ranks, callback states current), built as a copy: the
        Trainer's own state and counters are left as they are."""
        from transformers.trainer_callback import ExportableState

        ck = self.checkpointer
        flos = float(getattr(trainer, "current_flos", 0.0) or 0.0)
        if getattr(trainer, "hp_search_backend", None) is not None or trial is not None:
            flos = 0.0  # the Trainer does not count flops into the state during a search
        d = dataclasses.asdict(trainer.state)
        for f in _PROCESS_FIELDS:
            d.pop(f, None)
        callbacks: dict = {}
        for cb in trainer.callback_handler.callbacks + [trainer.control]:
            if isinstance(cb, ExportableState):
                name = type(cb).__name__
                if name in callbacks:
                    if not isinstance(callbacks[name], list):
                        callbacks[name] = [callbacks[name]]
                    callbacks[name].append(cb.state())
                else:
                    callbacks[name] = cb.state()
        d["stateful_callbacks"] = callbacks
        mine = json.dumps(d, indent=2, sort_keys=True) + "\n" if ck.rank == 0 else None
        # one value for every rank (the checkpoint then loads at any world size), through
        # rank 0 alone (O(N) through the store where a gather is O(N^2))
        text, total = ck.group.decide([mine, flos], _trainer_state,
                                      timeout_s=ck.options.plan_timeout_s,
                                      what="fastckpt.hf: the trainer state")
        if total:
            d = json.loads(text)
            d["total_flos"] = d.get("total_flos", 0) + total
            text = json.dumps(d, indent=2, sort_keys=True) + "\n"
        return text


def _trainer_state(values: list) -> list:
    """(rank 0) Every rank's ``[trainer state text (rank 0's) or None, its flos]``: rank 0's
    text and the flos of every rank."""
    return [values[0][0], sum(f for _, f in values)]


def _inner_optimizer(opt: Any) -> Any:
    """accelerate's ``AcceleratedOptimizer`` (its own ``state_dict``, by parameter index) ->
    the torch optimizer it wraps (saved by parameter name: DCP's layout, reshardable)."""
    try:
        from accelerate.optimizer import AcceleratedOptimizer
    except ImportError:  # pragma: no cover - transformers' Trainer requires accelerate
        return opt
    return opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt


def accelerate_state(accelerator: Any, model: Any, optimizer: Any, lr_scheduler: Any = None,
                     **extra: Any) -> dict:
    """The state of an ``accelerate`` training loop, for :class:`fastckpt.Checkpointer`:

        state = fastckpt.hf.accelerate_state(accelerator, model, optimizer, scheduler, step=0)
        ckpt = fastckpt.Checkpointer(root, keep_last=3)
        if ckpt.resume(state) is not None:                  # model, optimizer, ... in place
            dl = accelerator.skip_first_batches(train_dl, state["step"] % len(train_dl))
        ...
        state["step"] = step; ckpt.save(state, step=step)   # every rank

    The prepared model unwrapped (``accelerator.unwrap_model``: DDP, compile; an FSDP2 model is
    itself), the torch optimizer inside accelerate's wrapper (saved by parameter name, so an
    FSDP2 state reshards), the scheduler, accelerate's grad scaler when there is one, the RNG
    states (:class:`fastckpt.RNGState`) and ``extra`` (plain values, Stateful objects).
    """
    state: dict = {"model": accelerator.unwrap_model(model)}
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        state["scaler"] = scaler
    state["optimizer"] = _inner_optimizer(optimizer)
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler
    state["rng"] = RNGState()
    state.update(extra)
    return state
