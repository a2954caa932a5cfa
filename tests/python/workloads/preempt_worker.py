"""A training loop that a preemption notice stops (tests/python/test_preemption.py).

    python preempt_worker.py CKPT SHM_DIR JOB MODE [options]

MODE:
  train    saves every step (a snapshot every --snapshot-every steps) until ``ckpt.preempted``,
           printing ``step N`` after each save; then one JSON line: the step it preempted at, the
           committed steps right after that save returned, the saves that copied nothing, and
           SIGTERM's handler after close() ("default", "user" or "other"). ``--user-handler``
           installs a SIGTERM handler of its own first (it prints ``user handler ran``).
           ``--self-signal STEP`` sends the process SIGTERM after STEP.
           ``--thread`` makes the Checkpointer in a thread other than the main one and gives
           the notice with ``notify_preemption()`` from another thread after step 3.
  plain    saves every step up to --steps and never looks at ``ckpt.preempted`` (a plain
           loop), printing ``step N`` after each save; then ``finished`` and, after close(), exit
           status 0. With the default ``on_preemption="exit"``, a signal ends it after the
           preemption save instead.
  hang     saves steps 1..3, prints ``hanging`` and then makes no further save (a step that
           never ends), so that only a second signal or the grace period can end the process.
  resume   restores into a zeroed state and prints the step and whether it is bit-exact.

With --ranks 2 and --rank R (and --store FILE), the process is one rank of a gloo job.
``--on-preemption`` passes ``on_preemption`` (default: the Checkpointer's).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import torch

import safepoint


def make_state(step: int, rank: int = 0) -> dict:
    """The state after `step` steps: a pure function of (step, rank). The tensors are named by
    rank: they differ between ranks (dedupe takes same-named tensors for replicas)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {f"w{rank}": torch.randn(4096, generator=g, dtype=torch.float64),
            f"b{rank}": torch.randint(0, 1 << 30, (257,), generator=g), "step": step}


def exact(state: dict, step: int, rank: int) -> bool:
    want = make_state(step, rank)
    return all(torch.equal(state[k], v) if isinstance(v, torch.Tensor) else state[k] == v
               for k, v in want.items())


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("shm")
    ap.add_argument("job")
    ap.add_argument("mode", choices=["train", "plain", "hang", "resume"])
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--on-preemption", default=None)
    ap.add_argument("--snapshot-every", type=int, default=1000)
    ap.add_argument("--persist-every", type=int, default=1000)
    ap.add_argument("--grace", type=float, default=None)
    ap.add_argument("--user-handler", action="store_true")
    ap.add_argument("--self-signal", type=int, default=None)
    ap.add_argument("--thread", action="store_true")
    ap.add_argument("--pause", type=float, default=0.02, help="seconds per step")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--store", default=None)
    args = ap.parse_args()
    rank = args.rank
    if args.ranks > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank,
                                world_size=args.ranks)

    if args.user_handler:
        def user_handler(signum, frame):
            print("user handler ran", flush=True)
        signal.signal(signal.SIGTERM, user_handler)

    def make():
        kw = {} if args.on_preemption is None else {"on_preemption": args.on_preemption}
        return safepoint.Checkpointer(
            args.ckpt, job=args.job, shm_dir=args.shm, snapshot_every=args.snapshot_every,
            persist_every=args.persist_every, preemption_grace_s=args.grace, keep=5, **kw)

    if args.thread:
        box: list = []
        t = threading.Thread(target=lambda: box.append(make()))
        t.start()
        t.join()
        ckpt = box[0]
    else:
        ckpt = make()
    emit({"handlers": ckpt.preemption_handlers_installed,
          "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL})

    if args.mode == "resume":
        state = make_state(0, rank)
        for v in state.values():
            if isinstance(v, torch.Tensor):
                v.zero_()
        step = ckpt.restore(state)
        emit({"step": step, "exact": step is not None and exact(state, step, rank),
              "source": ckpt.last_load_source})
        ckpt.close()
        return

    if args.mode == "plain":
        for step in range(1, args.steps + 1):
            ckpt.save(step, make_state(step, rank))
            print(f"step {step}", flush=True)
            if args.self_signal == step:
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(args.pause)
        print("finished", flush=True)
        ckpt.close()
        return

    step = 0
    while True:
        step += 1
        state = make_state(step, rank)
        ckpt.save(step, state)
        print(f"step {step}", flush=True)
        if ckpt.preempted:
            # committed before close(): the preemption save itself waited
            result = {"preempted_at": step, "committed": safepoint.steps(args.ckpt),
                      "saves_not_due": ckpt.status()["saves_not_due"]}
            break
        if args.mode == "hang" and step == 3:
            print("hanging", flush=True)
            while True:
                time.sleep(0.05)
        if args.self_signal == step:
            os.kill(os.getpid(), signal.SIGTERM)
        if args.thread and step == 3:
            t = threading.Thread(target=ckpt.notify_preemption)
            t.start()
            t.join()
        if step > 100000:
            sys.exit("never preempted")
        time.sleep(args.pause)
    ckpt.close()
    after = signal.getsignal(signal.SIGTERM)
    result["after_close_sigterm"] = ("default" if after == signal.SIG_DFL else "user"
                                     if getattr(after, "__name__", "") == "user_handler"
                                     else "other")
    emit(result)


if __name__ == "__main__":
    main()
