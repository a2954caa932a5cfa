"""The crash campaign's training process (tests/crash/crashtest.py drives it).

One process per rank, using the real ``safepoint.Checkpointer``: it resumes from the newest step it
can load (with several ranks, the step all ranks agree on, through torch.distributed / gloo, as a
real job would), checks what it loaded bit for bit, then saves ``--steps`` more steps, each a pure
function of (seed, step, rank) (``make_state``), with a barrier after each save (lockstep training).
Now and then it waits for its last persisted step to be committed (``wait()``) or asks the agent
for the newest committed step (``status()``), and says so. It prints one line per event, flushed:

    READY <pid>
    LOADED <step> <source> EXACT|MISMATCH <peers> <seconds> <uri>
                                              what load() returned (MISMATCH: a violation),
                                              the peers a rebuild came from ("-": none), the
                                              storage tier read ("-": not storage)
    DIFF <where>                              after MISMATCH: the first difference
    FRESH                                     nothing to load
    BEGIN <step> / SAVED <step>               around save(step); SKIPPED <step> if skipped
    COMMITTED <step>                          wait() returned: <step> is committed
    WAITFAIL <step> <error>                   wait() raised
    NEWEST <step>                             status()["newest_committed"]
    PROTECTED <step> / UNPROTECTED <step>     with redundancy, after wait(): the rank's newest
                                              snapshot reached its peers (or not)
    TIME <call> <seconds> <outcome>           with `timing` (the node campaign): how long each
                                              load, save, wait and status call took, and "ok" or
                                              the class of the error it raised
    SUPERSEDED <call> <step> <error>          a call raised SupersededError: this process's run
                                              was superseded (it waits for "stale" or its end)
    PARKED <call> <error class>               a stale process's call failed after "stale" came
                                              (its collective timed out): it waits for its end
    IDLE                                      done; then reads commands from stdin:
        exit   -> dies at once without closing (the agent flushes, as after a crash)
        close  -> close(); prints CLOSED or CLOSEFAIL <error>; exits
        more   -> one more lockstep save (the next step), wait() and the replication report
                  (a node that came back after a partition is protected again); then IDLE
    With `run_tag` (the node campaign) every saved state also holds "run": {"tag": run_tag,
    "stale": bool}, which LOADED reports as an 8th field (the tag) and the comparison leaves out;
    and stdin is read by a thread of its own from the start, which also takes
        stale <step> -> the process acts as a stale one whose run was superseded while it hung
                  (the driver stopped it in a collective and started the job's next run): saves
                  <step> with a poisoned state (every tensor negated, "stale": true: a load of it
                  is a MISMATCH), then wait(), then a new connection; prints STALE <call>
                  ok|<error class> <seconds> for each (each must fail, SupersededError), then exits

The driver normally runs ``child_main`` in a process forked from a zygote that has imported torch
once (tests/crash/crashtest.py); ``python workload.py --json '<args>'`` runs it directly.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python",
                                "workloads"))
from bitexact import first_difference  # noqa: E402

SMALL = 1 << 14        # int32 elements of "w<rank>" on most steps (64 KiB)
BIG = (5 << 20) // 2   # on big steps (10 MiB: two 8 MiB write pieces, and a larger slot)


def is_big_step(seed: int, step: int) -> bool:
    return (seed + step) % 11 == 0


def make_state(seed: int, step: int, rank: int) -> dict:
    """The state of (seed, step, rank); some steps are big. Like data-parallel training, "model"
    is the same on every rank (a function of seed and step: the ranks write each of its tensors
    to storage once, and a rank loading from storage reads some from the other's image), while
    "w<rank>" and "meta" are the rank's own (every byte depends on all three)."""
    import torch

    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 131)
    n = BIG if is_big_step(seed, step) else SMALL
    w = torch.arange(n, dtype=torch.int32) * (2 * rank + 1) + (step * 7919 + seed) % (1 << 30)
    return {
        f"w{rank}": w,
        "model": {"b": torch.randn(257, generator=g),
                  "h": torch.randn(3, 5, generator=g).to(torch.float64),
                  "e": torch.randn(4, 4, generator=g).to(torch.bfloat16),
                  "i": torch.randint(-1000, 1000, (7,), generator=g, dtype=torch.int64)},
        "step": step,
        "meta": {"seed": seed, "rank": rank, "tag": f"s{seed}-r{rank}-{step}",
                 "lr": 1.0 / (step + 1), "flags": [step % 2 == 0, None, b"\x00\xff"]},
    }




_say_lock = threading.Lock()


def say(*fields) -> None:
    with _say_lock:
        sys.stdout.write(" ".join(str(f) for f in fields) + "\n")
        sys.stdout.flush()


def strip_run(state):
    """The state without the node campaign's "run" entry (what make_state compares with)."""
    if isinstance(state, dict) and "run" in state:
        state = {k: v for k, v in state.items() if k != "run"}
    return state


def poisoned(state: dict) -> dict:
    """`state` with every tensor negated (bit-different from any state make_state gives)."""
    import torch

    def walk(v):
        if isinstance(v, torch.Tensor):
            return -v if v.dtype != torch.bool else ~v
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return v
    return walk(state)


def child_main(a: dict) -> int:
    """Runs one rank. `a`: path, job, shm_dir, seed, rank, world_size, persist_every, keep,
    steps, p_wait, p_status, rng (a string seeding this process's choices), rdzv (a file for
    torch.distributed's FileStore when world_size > 1), env (variables to set first); optional:
    tiers (a list of safepoint.Tier arguments as dicts), redundancy and its settings, run_tag
    and timing (the node campaign's: see the module's docstring)."""
    os.environ.update(a.get("env", {}))  # before the first kill point reads SAFEPOINT_KILL_AT
    import queue
    import threading
    import time

    import torch

    import safepoint

    if a.get("run_tag") is not None:
        import faulthandler
        import signal
        # The node campaign asks a stale process that does not answer for its stacks (not with
        # SIGUSR1: the Checkpointer takes that as a preemption notice).
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    rank, world = a["rank"], a["world_size"]
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="file://" + a["rdzv"], rank=rank,
                                world_size=world,
                                timeout=timedelta(seconds=a.get("pg_timeout", 600)))
    extra = {}
    if a.get("redundancy"):
        extra = {"redundancy": a["redundancy"], "peer_timeout": a.get("peer_timeout", 10.0),
                 "replication_bandwidth": a.get("bandwidth")}
    if a.get("tiers"):
        extra["tiers"] = [safepoint.Tier(**t) for t in a["tiers"]]
    extra.update(a.get("layout") or {})  # compression, incremental of path
    run_tag = a.get("run_tag")
    timing = bool(a.get("timing"))
    wait_timeout = float(a.get("wait_timeout", 600))
    seed = a["seed"]
    # Commands from stdin: read by a thread of their own in the node campaign (a "stale" command
    # arrives while the main thread is blocked in a collective), else by the main thread at IDLE.
    commands: "queue.Queue[str]" = queue.Queue()
    in_client = threading.Lock()  # held by the main thread around each call into the checkpointer
    told_stale = threading.Event()  # the control thread acts as the stale process

    def park(kind: str, e: BaseException) -> None:
        """A call of a stale process's main thread failed after it was woken (its collective
        timed out: its peers died while its link was cut): the control thread acts and exits."""
        say("PARKED", kind, type(e).__name__)
        threading.Event().wait()

    def timed(kind: str, call):
        """call(), timed (TIME line with `timing`); a SupersededError is said and parks the main
        thread (its run was superseded: the driver ends it)."""
        t0 = time.monotonic()
        outcome = "ok"
        try:
            with in_client:
                return call()
        except BaseException as e:
            outcome = (type(e).__name__ if isinstance(e, safepoint.Error)
                       else "raised:" + type(e).__name__)
            if isinstance(e, getattr(safepoint, "SupersededError", ())):
                say("SUPERSEDED", kind, str(e).replace("\n", " "))
                threading.Event().wait()  # the control thread acts and exits
            if told_stale.is_set():
                park(kind, e)
            raise
        finally:
            if timing:
                say("TIME", kind, f"{time.monotonic() - t0:.3f}", outcome)

    def state_of(step: int, stale: bool = False) -> dict:
        state = make_state(seed, step, rank)
        if stale:
            state = poisoned(state)
        if run_tag is not None:
            state["run"] = {"tag": run_tag, "stale": stale}
        return state

    ckpt = timed("open", lambda: safepoint.Checkpointer(
        a["path"], job=a["job"], shm_dir=a["shm_dir"], rank=rank, world_size=world,
        persist_every=a["persist_every"], keep=a["keep"], **extra))

    def act_stale(step: int) -> None:
        """The stale process's acts (command "stale"): each must fail."""
        def attempt(kind: str, call) -> None:
            t0 = time.monotonic()
            try:
                call()
                outcome = "ok"
            except safepoint.Error as e:
                outcome = type(e).__name__
            except BaseException as e:  # noqa: BLE001 (reported, the driver judges)
                outcome = "raised:" + type(e).__name__
            say("STALE", kind, outcome, f"{time.monotonic() - t0:.3f}")
        with in_client:  # after a call of the main thread that was stopped midway
            attempt("save", lambda: ckpt.save(step, state_of(step, stale=True)))
            attempt("wait", lambda: ckpt.wait(timeout=60))
            # A new connection of this process (a Checkpointer's, without its collectives).
            from safepoint import _checkpointer
            attempt("hello", lambda: safepoint._core.Client(
                ckpt.path, ckpt.job, ckpt.shm_dir, rank, world, ckpt.keep, True,
                _checkpointer._agent_binary(), ckpt.attempt, [], 0, "", "", "none", False))
        os._exit(0)

    if run_tag is not None:
        def control() -> None:
            for line in sys.stdin:
                cmd = line.split()
                if cmd and cmd[0] == "stale":
                    told_stale.set()
                    act_stale(int(cmd[1]))
                commands.put(line)
            commands.put("")
        threading.Thread(target=control, daemon=True).start()

    say("READY", os.getpid())
    loaded = timed("load", ckpt.load)
    if loaded is None:
        say("FRESH")
        step = 1
    else:
        got, state = loaded
        run = state.get("run") if isinstance(state, dict) else None
        diff = first_difference(strip_run(state), make_state(seed, got, rank))
        info = ckpt.last_restore
        say("LOADED", got, ckpt.last_load_source, "EXACT" if diff is None else "MISMATCH",
            (info.peers if info is not None else "") or "-",
            f"{info.seconds:.3f}" if info is not None else "-",
            (info.uri if info is not None else None) or "-",
            (("stale:" if run.get("stale") else "") + str(run.get("tag"))) if run else "-")
        if diff is not None:
            say("DIFF", diff)
        step = got + 1
    rng = random.Random(a["rng"])
    last_persisted = None

    def report_replication() -> None:
        """With redundancy: where this rank's newest snapshot stands (after wait(): reached
        its peers, or the push failed)."""
        if "redundancy" not in extra:
            return
        try:
            repl = timed("status", ckpt.status)["replication"] or {}
        except safepoint.Error as e:
            say("STATUSFAIL", str(e).replace("\n", " "))
            return
        for r in repl.get("ranks", []):
            if r.get("rank") == rank and r.get("step") is not None:
                say("PROTECTED" if r.get("protected") else "UNPROTECTED", r["step"])

    def save_step(step: int) -> None:
        say("BEGIN", step)
        if timed("save", lambda: ckpt.save(step, state_of(step))):
            say("SAVED", step)
        else:
            say("SKIPPED", step)
        if world > 1:
            try:
                torch.distributed.barrier()
            except RuntimeError as e:
                if run_tag is None:
                    raise
                # The other ranks are gone (a stale process, woken after the job restarted
                # without it): the control thread acts on "stale"; the driver ends the process.
                say("PEERSGONE", str(e).replace("\n", " ")[:200])
                threading.Event().wait()

    def wait_and_report(step: int) -> None:
        # wait() returns once every step persisted so far is committed: the newest persist step
        # up to `step` (a step between persist steps is only in memory and on the peers; its
        # commit, if the process dies with it, is the emergency flush's, later).
        persisted = step - step % a["persist_every"]
        try:
            timed("wait", lambda: ckpt.wait(timeout=wait_timeout))
            if persisted > 0:
                say("COMMITTED", persisted)
            report_replication()
        except safepoint.Error as e:
            say("WAITFAIL", step, str(e).replace("\n", " "))

    for _ in range(a["steps"]):
        save_step(step)
        if step % a["persist_every"] == 0:
            last_persisted = step
        if last_persisted == step and rng.random() < a["p_wait"]:
            wait_and_report(step)
        if rng.random() < a["p_status"]:
            try:
                newest = timed("status", ckpt.status)["newest_committed"]
                if newest is not None:
                    say("NEWEST", newest)
            except safepoint.Error as e:
                say("STATUSFAIL", str(e).replace("\n", " "))
        step += 1
    if a.get("p_final_wait") and rng.random() < a["p_final_wait"]:
        # Everything saved reaches storage and the peers: the state a node loss is checked on.
        try:
            timed("wait", lambda: ckpt.wait(timeout=wait_timeout))
            report_replication()
        except safepoint.Error as e:
            say("WAITFAIL", step - 1, str(e).replace("\n", " "))
    say("IDLE")
    lines = iter(commands.get, "") if run_tag is not None else sys.stdin
    for line in lines:
        cmd = line.strip()
        if cmd == "exit":
            os._exit(0)
        if cmd == "close":
            try:
                timed("close", ckpt.close)
                say("CLOSED")
            except safepoint.Error as e:
                say("CLOSEFAIL", str(e).replace("\n", " "))
            os._exit(0)
        if cmd == "more":
            save_step(step)
            wait_and_report(step)
            step += 1
            say("IDLE")
    os._exit(0)  # stdin closed: like a crash


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--json":
        sys.exit("usage: workload.py --json '<arguments as a JSON object>'")
    sys.exit(child_main(json.loads(sys.argv[2])))
