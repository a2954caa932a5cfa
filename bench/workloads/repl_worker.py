"""One rank of bench/replication.py's multi-node jobs (started by tests/common/nodes.py's Job
inside a node, with torchrun's environment). Prints "KIND {json}" lines on stdout.

    python repl_worker.py save  ARGS_JSON   flash saves with and without redundancy, alternated:
                                            blocking time, time until wait() returned (protected),
                                            the agent's push seconds and bytes; then one persisted
                                            save, prints "saved" and sleeps (the bench kills nodes)
    python repl_worker.py load  ARGS_JSON   restore() into zeroed tensors: step, source, seconds
    python repl_worker.py train ARGS_JSON   DDP (gloo) on examples/tiny_gpt.py, blocks of steps
                                            without checkpoints, with flash saves, with flash saves
                                            and redundancy (and lm-resiliency's GEMINI manager)
    python repl_worker.py gemini ARGS_JSON  lm-resiliency's InMemoryCheckpointManager on the same
                                            state: save blocking time, finalize_replication time;
                                            then sleeps (the bench kills a node and SIGTERMs)
    python repl_worker.py gemini-load ARGS_JSON  its load() after a restart
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "examples"))
LMRES_DEPS = os.path.join(REPO, "build", "bench", "lmres-deps")  # see bench/replication.py
if os.path.isdir(LMRES_DEPS):
    sys.path.append(LMRES_DEPS)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)
MiB = 1 << 20


def say(kind, **fields):
    print(kind, json.dumps(fields), flush=True)


def make_state(nbytes: int, rank: int) -> dict:
    """About `nbytes` of training-like state, different on every rank: a few large fp32/bf16
    tensors plus 500 small ones and step counters (filled cheaply: no RNG over 256 MiB)."""
    st: dict = {"model": {}, "optim": {}, "step": 0}
    small = 0
    for i in range(500):
        n = 256 + (i * 97) % 3840
        t = torch.full((n,), float(rank * 1000 + i), dtype=torch.bfloat16 if i % 3 == 0 else
                       torch.float32)
        st["model"][f"layers.{i // 8}.small.{i % 8}"] = t
        small += t.numel() * t.element_size()
        if i % 4 == 0:
            st["optim"][f"{i}.step"] = torch.tensor(float(i))
    left, i = nbytes - small, 0
    while left > 0:
        nb = min(32 * MiB, left)
        dt = torch.bfloat16 if i % 3 == 2 else torch.float32
        t = torch.arange(nb // (2 if dt == torch.bfloat16 else 4), dtype=torch.float32)
        t = t.mul_(1e-6).add_(rank + i).to(dt)
        st["model"][f"layers.{i}.weight"] = t
        left -= t.numel() * t.element_size()
        i += 1
    return st


def bump(st: dict, step: int) -> None:
    """A step's change: cheap, deterministic, so a restore can be checked against it."""
    st["step"] = step
    for k, v in st["optim"].items():
        v.fill_(float(step))


def tensors(st: dict) -> list:
    return list(st["model"].values()) + list(st["optim"].values())


def zeros_like(st: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in st["model"].items()},
            "optim": {k: torch.zeros_like(v) for k, v in st["optim"].items()}, "step": -1}


def equal(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(torch.equal(x, y) for x, y in
                                          zip(tensors(a), tensors(b)))


def nbytes_of(st: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(st))


def init() -> tuple[int, int]:
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def my_push(ck, rank: int) -> dict:
    rep = ck.status().get("replication") or {}
    for r in rep.get("ranks", []):
        if r["rank"] == rank:
            return r
    return {}


def agent_cpu_s(job: str):
    """CPU seconds (user + system) so far of this node's agent of `job` (its command line has
    "--job JOB"), or None."""
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            if not any(c.endswith(b"safepointd") for c in cmd) or job.encode() not in cmd:
                continue
            f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / tick
        except OSError:
            continue
    return None


def pin_self(cpu: int) -> None:
    """Every thread of this process onto `cpu` (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cpu})


def agents_of(jobs: list) -> list[int]:
    """Pids of this node's agents of `jobs` (their command lines name the job)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(c.endswith(b"safepointd") for c in cmd) and any(j.encode() in cmd for j in jobs):
            out.append(int(pid))
    return out


def pin_agents(jobs: list, cpu: int) -> dict:
    """Every thread of this node's agents of `jobs` onto `cpu` (the threads they start later
    inherit it); returns {pid: sorted CPUs of each of its threads} read back."""
    out = {}
    for pid in agents_of(jobs):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), {cpu})
            except OSError:
                pass
    for pid in agents_of(jobs):
        out[pid] = sorted({c for tid in os.listdir(f"/proc/{pid}/task")
                           for c in os.sched_getaffinity(int(tid))})
    return out


def affinities(jobs: list) -> dict:
    """{pid: CPUs any thread of each agent of `jobs` may run on}, read now."""
    out = {}
    for pid in agents_of(jobs):
        cpus: set = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                cpus |= os.sched_getaffinity(int(tid))
            except OSError:
                pass
        out[pid] = sorted(cpus)
    return out


def run_save(a: dict) -> None:
    import safepoint

    rank, world = init()
    st = make_state(a["size"], rank)
    cks = {"on": safepoint.Checkpointer(a["ckpt_on"], job=a["job_on"],
                                        redundancy=a["redundancy"], replication_bandwidth=0,
                                        dedupe=False, keep=2, peer_timeout=30.0)}
    if a.get("ckpt_off"):
        cks["off"] = safepoint.Checkpointer(a["ckpt_off"], job=a["job_off"], dedupe=False, keep=2)
    res: dict = {m: {"block": [], "protected": [], "push_s": [], "push_bytes": [],
                     "protected_flag": []} for m in cks}
    step = 0
    cpu_at_runs = None
    for i in range(a["warmup"] + a["runs"]):
        if i == a["warmup"]:
            dist.barrier()
            cpu_at_runs = agent_cpu_s(a["job_on"])  # after the warm-ups: the timed saves alone
        for m in (list(cks) if i % 2 == 0 else list(reversed(list(cks)))):
            step += 1
            bump(st, step)
            ck = cks[m]
            dist.barrier()
            t0 = time.perf_counter()
            ck.save(step, st, persist=False)
            t1 = time.perf_counter()
            ck.wait()
            t2 = time.perf_counter()
            dist.barrier()
            if i < a["warmup"]:  # the first save into each slot (one-time costs)
                res[m].setdefault("first_block", []).append(t1 - t0)
                res[m].setdefault("first_protected", []).append(t2 - t1)
                continue
            res[m]["block"].append(t1 - t0)
            res[m]["protected"].append(t2 - t1)
            p = my_push(ck, rank) if m == "on" else {}
            if p:
                res[m]["push_s"].append(p.get("seconds"))
                res[m]["push_bytes"].append(p.get("bytes"))
                res[m]["protected_flag"].append(bool(p.get("protected")) and p["step"] == step)
    dist.barrier()
    agent_cpu = agent_cpu_s(a["job_on"])
    runs_cpu = agent_cpu - cpu_at_runs if agent_cpu is not None and cpu_at_runs is not None \
        else None
    # The step the restores go back to: in memory (and replicated) and committed on storage.
    step += 1
    bump(st, step)
    dist.barrier()
    cks["on"].save(step, st, persist=True)
    cks["on"].wait()
    dist.barrier()  # every rank's push is done: what each node holds now is settled
    rep = cks["on"].status()["replication"]
    say("saved", rank=rank, step=step, bytes=nbytes_of(st), results=res, agent_cpu_s=agent_cpu,
        agent_cpu_runs_s=runs_cpu,
        held_bytes=rep.get("held_bytes"), held=rep.get("held"), push=my_push(cks["on"], rank),
        service=rep.get("service"))
    while True:
        time.sleep(60)


def run_load(a: dict) -> None:
    import safepoint

    rank, world = init()
    t0 = time.perf_counter()
    ck = safepoint.Checkpointer(a["ckpt"], job=a["job"], redundancy=a["redundancy"],
                                dedupe=False, keep=2, peer_timeout=30.0)
    t1 = time.perf_counter()
    ref = make_state(a["size"], rank)
    target = zeros_like(ref)
    dist.barrier()
    t2 = time.perf_counter()
    step = ck.restore(target)
    t3 = time.perf_counter()
    info = ck.last_restore
    ok = None
    if step is not None:
        bump(ref, step)
        ok = equal(ref, target)
    dist.barrier()
    say("loaded", rank=rank, step=step, source=info.source if info else None,
        seconds=info.seconds if info else None, peers=info.peers if info else None,
        restore_s=t3 - t2, start_s=t1 - t0, equal=ok)
    while True:  # the bench kills the job (no clean close: replicas stay where they are)
        time.sleep(60)


# --- lm-resiliency (GEMINI) ------------------------------------------------------------------

def gemini_manager(folder: str, run_id: str):
    from lm_resiliency import InMemoryCkptConfig
    from lm_resiliency.checkpointing.manager import InMemoryCheckpointManager

    cfg = InMemoryCkptConfig(interval=1, replication_jump=1, disk_flush_interval=0,
                             disk_folder=folder, run_id=run_id, pin_memory=False,
                             verify_integrity=True)
    return InMemoryCheckpointManager(cfg)


def run_gemini(a: dict) -> None:
    rank, world = init()
    st = make_state(a["size"], rank)
    try:
        mgr = gemini_manager(a["folder"], a["run_id"])
    except Exception as e:  # noqa: BLE001 - reported in the doc
        say("gemini_error", rank=rank, error=f"{type(e).__name__}: {e}")
        dist.barrier()
        return
    res: dict = {"block": [], "protected": [], "ok": []}
    step = 0
    for i in range(a["warmup"] + a["runs"] + 1):
        step += 1
        bump(st, step)
        dist.barrier()
        t0 = time.perf_counter()
        mgr.save(st, step)
        t1 = time.perf_counter()
        ok = mgr.finalize_replication()
        t2 = time.perf_counter()
        dist.barrier()
        if a["warmup"] <= i < a["warmup"] + a["runs"]:
            res["block"].append(t1 - t0)
            res["protected"].append(t2 - t1)
            res["ok"].append(bool(ok))
    say("gemini_saved", rank=rank, step=step, results=res)
    while True:  # SIGTERM: its handler flushes own + peer shards to disk_folder, then exits
        time.sleep(60)


def run_gemini_load(a: dict) -> None:
    rank, world = init()
    ref = make_state(a["size"], rank)
    t0 = time.perf_counter()
    try:
        mgr = gemini_manager(a["folder"], a["run_id"])
        dist.barrier()
        tl = time.perf_counter()
        got = mgr.load()
    except Exception as e:  # noqa: BLE001
        say("gemini_loaded", rank=rank, error=f"{type(e).__name__}: {e}",
            trace=traceback.format_exc()[-1500:])
        return
    t1 = time.perf_counter()
    ok, step = None, None
    if got is not None:
        sd, step = got
        bump(ref, step)
        try:
            ok = equal(ref, {"model": sd["model"], "optim": sd["optim"], "step": sd["step"]})
        except Exception as e:  # noqa: BLE001
            ok = f"{type(e).__name__}: {e}"
    say("gemini_loaded", rank=rank, step=step, seconds=t1 - tl, start_s=tl - t0, equal=ok)
    dist.barrier()


# --- training ----------------------------------------------------------------------------------

def run_train(a: dict) -> None:
    import safepoint
    from tiny_gpt import TinyGPT, batch

    if a.get("pin"):  # the rank (and every thread it starts) on CPU 0, before gloo's threads
        pin_self(0)
    rank, world = init()
    torch.manual_seed(0)
    model = TinyGPT(dim=a["dim"], layers=a["layers"], heads=4, context=64)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    cks = {"flash": safepoint.Checkpointer(a["ckpt_off"], job=a["job_off"], dedupe=False,
                                           keep=2),
           "flash+mirror": safepoint.Checkpointer(a["ckpt_on"], job=a["job_on"],
                                                  redundancy=a["redundancy"],
                                                  replication_bandwidth=0, dedupe=False, keep=2)}
    agents = [a["job_off"], a["job_on"]]
    pinned = pin_agents(agents, 1) if a.get("pin") else {}
    modes = ["none", "flash", "flash+mirror"]
    gem = None
    gem_error = None
    if a.get("gemini"):
        try:
            gem = gemini_manager(a["gemini_folder"], a["gemini_run_id"])
            modes.append("gemini")
        except Exception as e:  # noqa: BLE001 - reported in the doc
            gem_error = f"{type(e).__name__}: {e}"
    times: dict = {m: [] for m in modes}
    saves: dict = {m: [] for m in modes}
    cpus: dict = {m: [] for m in modes}  # the rank's own CPU time a step (all its threads)
    step = 0
    for blk in range(a["blocks"]):
        order = modes if blk % 2 == 0 else list(reversed(modes))
        for m in order:
            for j in range(a["steps"]):
                step += 1
                x, y = batch(step, batch_size=a["batch"], context=64)
                c0 = time.process_time()
                t0 = time.perf_counter()
                loss = torch.nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                t1 = time.perf_counter()
                if m in cks:
                    cks[m].save(step, state(), persist=False)
                elif m == "gemini":
                    gem.save(state(), step)
                t2 = time.perf_counter()
                c2 = time.process_time()
                if j > 0:  # the first step of a block pays for the switch
                    times[m].append(t2 - t0)
                    saves[m].append(t2 - t1)
                    cpus[m].append(c2 - c0)
    nparams = sum(p.numel() for p in model.parameters())
    sbytes = sum(t.numel() * t.element_size() for t in safepoint_tensors(state()))
    rep = cks["flash+mirror"].status()["replication"]
    say("trained", rank=rank, params=nparams, state_bytes=sbytes,
        step_s={m: statistics.median(v) for m, v in times.items()},
        save_s={m: statistics.median(v) for m, v in saves.items()},
        cpu_s={m: statistics.median(v) for m, v in cpus.items()},
        n={m: len(v) for m, v in times.items()}, gemini_error=gem_error,
        pushes=[rep.get("pushes_ok"), rep.get("pushes_superseded"), rep.get("pushes_failed")],
        pinned=bool(a.get("pin")), agents_pinned_at_start=list(pinned.values()),
        agent_cpus=list(affinities(agents).values()),
        rank_cpus=sorted({c for t in os.listdir("/proc/self/task")
                          for c in os.sched_getaffinity(int(t))}))
    dist.barrier()
    os._exit(0)  # no flush on the way out


def safepoint_tensors(obj, out=None):
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            safepoint_tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            safepoint_tensors(v, out)
    return out


if __name__ == "__main__":
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    {"save": run_save, "load": run_load, "train": run_train, "gemini": run_gemini,
     "gemini-load": run_gemini_load}[mode](args)
