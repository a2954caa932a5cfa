"""safepoint demo: a training run that is killed with SIGKILL and resumes from memory.

    make demo

1. Trains a small GPT-style model on the CPU (examples/train.py) with a flash checkpoint every
   step (copied into shared memory; the node agent persists every 5th step in the background).
2. Kills the training process with SIGKILL in the middle of the run.
3. Restarts it: it resumes from the snapshot in host memory at the last saved step and trains
   on; its final weights are compared bit for bit with an uninterrupted run.
4. Prints how long each save blocked training against torch.save of the same state, how many
   steps were lost, how long resuming took and where the state came from; then shows the
   checkpoints with the safepoint CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

# Bit-reproducible MKL numerics for the demo's check of the final weights, here and in the
# training processes it starts (they inherit the environment). Without them, a demo run beside
# another CPU-heavy job failed that check in 4 of 10 runs: one of the processes' training steps
# came out different in the last bits (two reference runs in the same demo agreed with each
# other, and safepoint restored the bytes it had saved). With them: 8 of 8, a little slower.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tiny_gpt  # noqa: E402

import safepoint  # noqa: E402

STEPS, KILL_AFTER, PERSIST_EVERY = 30, 17, 5


def cli(*args: str) -> None:
    exe = os.path.join(os.path.dirname(sys.executable), "safepoint")
    exe = exe if os.path.exists(exe) else (shutil.which("safepoint") or "safepoint")
    print(f"\n$ safepoint {' '.join(args)}", flush=True)
    subprocess.run([exe, *args], check=False)


def run_training(ckpt: str, job: str, kill_after: int | None):
    """Runs examples/train.py; with kill_after, SIGKILLs it once that step's save returned."""
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--ckpt", ckpt, "--job", job,
           "--steps", str(STEPS), "--persist-every", str(PERSIST_EVERY)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    events = []
    for line in proc.stdout:
        ev = json.loads(line)
        events.append(ev)
        if ev["event"] == "resumed":
            print(f"  resumed at step {ev['step']} from {ev['source']} "
                  f"(load {ev['load_seconds'] * 1e3:.1f} ms)", flush=True)
        elif ev["event"] == "saved":
            print(f"  step {ev['step']:3d}  loss {ev['loss']:.4f}  save blocked "
                  f"{ev['blocking_seconds'] * 1e3:6.2f} ms", flush=True)
            if kill_after is not None and ev["step"] == kill_after:
                # Let it get into the next training step, then kill it mid-run.
                time.sleep(0.05)
                proc.send_signal(signal.SIGKILL)
                print(f"  ** SIGKILL to the training process (pid {proc.pid}) **", flush=True)
                break
    proc.wait()
    return events, proc.returncode


def main() -> None:
    root = tempfile.mkdtemp(prefix="safepoint-demo-")
    ckpt = os.path.join(root, "ckpt")
    job = f"demo-{os.getpid()}"
    print(f"checkpoint directory {ckpt}; job {job}\n")

    print("run 1: train, snapshot every step, persist every 5th; killed after step "
          f"{KILL_AFTER}", flush=True)
    first, rc = run_training(ckpt, job, KILL_AFTER)
    assert rc == -signal.SIGKILL, f"the training process was not killed (exit {rc})"
    last_saved = max(e["step"] for e in first if e["event"] == "saved")

    print("\nrun 2: restart the same command", flush=True)
    t_restart = time.perf_counter()
    second, rc = run_training(ckpt, job, None)
    assert rc == 0, f"the resumed run failed (exit {rc})"
    resumed = next(e for e in second if e["event"] == "resumed")

    # The uninterrupted reference run, in this process. The weights are compared bit for bit
    # (the printed loss is a multithreaded reduction whose last bits can vary run to run on the
    # CPU even without any interruption; the weights it trains do not).
    import train  # noqa: E402  (examples/train.py: the digest of the weights)

    model, opt = tiny_gpt.make(seed=0, dim=256)
    for s in range(1, STEPS + 1):
        tiny_gpt.train_step(model, opt, s)
    after = [e for e in second if e["event"] == "saved"]
    done = next(e for e in second if e["event"] == "done")
    identical = done["weights"] == train.weights_digest(model)

    # torch.save of the same state, for comparison (to a file in the same directory).
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": STEPS}
    nbytes = sum(t.numel() * t.element_size() for t in
                 list(state["model"].values()) + [v for s in state["optim"]["state"].values()
                                                  for v in s.values() if torch.is_tensor(v)])
    ts = []
    for i in range(5):
        path = os.path.join(root, f"torch-{i}.pt")
        t = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        ts.append(time.perf_counter() - t)
        os.unlink(path)
    blocking = [e["blocking_seconds"] for e in first + second if e["event"] == "saved"]

    print("\n+--------------------------------------+------------------------------+")
    rows = [
        ("state size", f"{nbytes / 2**20:.1f} MiB (model + AdamW)"),
        ("save blocking, median (safepoint)", f"{statistics.median(blocking) * 1e3:.2f} ms"),
        ("torch.save + fsync, median", f"{statistics.median(ts) * 1e3:.2f} ms "
                                        f"({statistics.median(ts) / statistics.median(blocking):.0f}x longer)"),
        ("killed after step", f"{last_saved} (its save had returned)"),
        ("resumed at step", f"{resumed['step']}"),
        ("steps lost", f"{last_saved - resumed['step']}"),
        ("state came from", f"{resumed['source']}"),
        ("time to resume", f"{resumed['since_process_start']:.2f} s from process start "
                           f"(load {resumed['load_seconds'] * 1e3:.1f} ms)"),
        ("final weights", "bit-identical to an uninterrupted run" if identical else "DIFFERENT"),
    ]
    for k, v in rows:
        print(f"| {k:<36} | {v:<28} |")
    print("+--------------------------------------+------------------------------+")
    print(f"(restart to end of run 2: {time.perf_counter() - t_restart:.1f} s, "
          f"{len(after)} steps trained after the resume)")

    cli("ls", ckpt)
    cli("verify", ckpt, "--all")
    shutil.rmtree(root)
    if not identical or resumed["step"] != last_saved or resumed["source"] != "memory":
        sys.exit(1)


if __name__ == "__main__":
    main()
