"""One process of a Lightning or Hugging Face Trainer run killed mid-epoch and resumed through
safepoint's integration, for tests/python/test_exact_resume_frameworks.py.

    python exact_resume_frameworks.py {lightning|hf} --root DIR --shm DIR --job JOB --work DIR
                                      --ids FILE [--loader global|shuffle] [--kill-at K]
                                      [--resume]

Both train a small model with dropout on a shuffled map-style data set whose items carry their
index, and append one JSON line per optimizer step to ``--ids``: the global step and the sample
ids it trained on (a killed run's lines end with the step it was killed after). ``--kill-at K``
SIGKILLs the process right after the integration saved global step K (mid-epoch). The last
line on stdout is ``DONE <sha256 of the final weights> <where the resume loaded from>``.

- lightning: ``SafepointCheckpointIO`` with ``ModelCheckpoint(every_n_train_steps=...,
  save_last=True)`` and ``trainer.fit(ckpt_path="last")``; the data position is a torchdata
  ``StatefulDataLoader`` over ``safepoint.data.GlobalBatchSampler`` (``--loader global``) or
  over torchdata's shuffling ``RandomSampler`` (``--loader shuffle``: its generator's state is
  in the loader's state). Lightning saves a stateful loader's state in its checkpoint and
  restores it; with a plain DataLoader it restarts the epoch, and warns.
- hf: ``SafepointCallback(every_n_steps=...)`` and ``trainer.train(resume_from_checkpoint=
  cb.prepare_resume(trainer))``; the Trainer's own shuffled sampler, and its own resume logic
  (skipping the batches of the epoch already trained on).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys

import torch

SAMPLES, BATCH, STEPS, EVERY = 40, 4, 24, 3  # 10 steps an epoch
VOCAB, LENGTH = 64, 12


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Log:
    """Appends (step, ids) lines to a file, flushed at once (the process may be killed)."""

    def __init__(self, path: str):
        self.f = open(path, "a")

    def write(self, step: int, ids: torch.Tensor) -> None:
        self.f.write(json.dumps({"step": step, "ids": ids.tolist()}) + "\n")
        self.f.flush()


def lightning(a, log: Log) -> tuple[str, str]:
    import pytorch_lightning as pl
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    from safepoint.data import GlobalBatchSampler
    from safepoint.lightning import SafepointCheckpointIO

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(7)
            self.x, self.y = torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 1,
                                                                              generator=g)

        def __len__(self):
            return SAMPLES

        def __getitem__(self, i):
            return i, self.x[i], self.y[i]

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(),
                                           torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))

        def training_step(self, batch, _):
            ids, x, y = batch
            log.write(self.trainer.global_step + 1, ids)
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.01)
            return {"optimizer": opt,
                    "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.99)}

    class KillAfterSave(SafepointCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            super().save_checkpoint(checkpoint, path, storage_options)
            if checkpoint["global_step"] == a.kill_at and os.path.basename(path) == "last.ckpt":
                os.kill(os.getpid(), signal.SIGKILL)

    pl.seed_everything(1, verbose=False)
    data = Data()
    if a.loader == "shuffle":  # torchdata's shuffling sampler: its generator's state is saved
        # A generator of its own: with shuffle=True and the loader's generator= the two share
        # one, and a restored loader's next epoch is drawn one draw behind (torchdata 0.11).
        shuffled = RandomSampler(data, generator=torch.Generator().manual_seed(4))
        loader = StatefulDataLoader(data, batch_size=BATCH, sampler=shuffled, drop_last=True,
                                    generator=torch.Generator().manual_seed(2))
    else:
        loader = StatefulDataLoader(data, batch_sampler=GlobalBatchSampler(data, BATCH, seed=3),
                                    generator=torch.Generator().manual_seed(2))
    plugin = KillAfterSave(a.root, job=a.job, shm_dir=a.shm)
    trainer = pl.Trainer(max_steps=STEPS, plugins=[plugin], logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, accelerator="cpu", devices=1,
                         callbacks=[pl.callbacks.ModelCheckpoint(
                             dirpath=a.work, every_n_train_steps=EVERY, save_last=True,
                             save_top_k=-1)])
    source = []
    load = plugin.load_checkpoint

    def load_and_note(*args, **kw):  # where the plugin loaded from (its Checkpointer closes)
        out = load(*args, **kw)
        source.append(plugin.checkpointer.last_load_source if plugin.checkpointer else "storage")
        return out

    plugin.load_checkpoint = load_and_note  # type: ignore[method-assign]
    module = Module()
    trainer.fit(module, loader, ckpt_path="last" if a.resume else None)
    return digest(module), source[0] if source else "None"


def hf(a, log: Log) -> tuple[str, str]:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from safepoint.hf import SafepointCallback

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(5)
            self.ids = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=g)

        def __len__(self):
            return SAMPLES

        def __getitem__(self, i):
            return {"idx": i, "input_ids": self.ids[i], "labels": self.ids[i]}

    class Recording(Trainer):
        def training_step(self, model, inputs, *args, **kw):
            log.write(self.state.global_step + 1, inputs.pop("idx"))
            return super().training_step(model, inputs, *args, **kw)

    class Kill(TrainerCallback):  # after SafepointCallback's save of the step (it runs first)
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == a.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2, resid_pdrop=0.2, embd_pdrop=0.2,
                                       attn_pdrop=0.2, bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=a.work, max_steps=STEPS, per_device_train_batch_size=BATCH,
                             learning_rate=1e-2, lr_scheduler_type="linear",
                             save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0,
                             remove_unused_columns=False)
    cb = SafepointCallback(a.root, every_n_steps=EVERY, job=a.job, shm_dir=a.shm)
    trainer = Recording(model=model, args=args, train_dataset=Tokens(),
                        callbacks=[cb, *([Kill()] if a.kill_at else [])])
    resume = cb.prepare_resume(trainer) if a.resume else None
    trainer.train(resume_from_checkpoint=resume)
    return digest(model), str(cb.resumed_from)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("framework", choices=["lightning", "hf"])
    for name in ("--root", "--shm", "--job", "--work", "--ids"):
        ap.add_argument(name, required=True)
    ap.add_argument("--loader", choices=["global", "shuffle"], default="global")
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    log = Log(a.ids)
    weights, source = (lightning if a.framework == "lightning" else hf)(a, log)
    print("DONE", weights, source, flush=True)
    # Everything is saved and closed: skip the interpreter's finalization (seconds of CPU).
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
