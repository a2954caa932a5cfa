"""The interval advisor, the goodput simulator and the terminal views (issue 13, parts 4-6):
`safepoint advise`, `safepoint simulate`, persist_every="auto", the measurement history,
`status --watch` and the progress bars."""

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch

import safepoint
from conftest import cli_path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "common"))
from processes import wait_until  # noqa: E402

HISTORY = "safepoint-history.jsonl"


def state(n=64):
    return {"w": torch.arange(n, dtype=torch.float32)}


def run_job(ckpt, shm, saves=12, crash=False, pause=0.0, **kw):
    """A short job: `saves` saves (one a step, `pause` seconds of "training" between them), a
    restore, then a clean close or a crash (abandon)."""
    c = safepoint.Checkpointer(ckpt, shm_dir=shm, job="adv", **kw)
    for step in range(saves):
        c.save(step, state())
        time.sleep(pause)
    c.wait()
    c.load()
    if crash:
        c.abandon()
    else:
        c.close()


def history_events(ckpt):
    return [json.loads(line)["ev"] for line in open(ckpt / HISTORY)]


def test_history_records_saves_persists_restores_and_a_clean_end(ckpt, shm):
    run_job(ckpt, shm)
    ev = history_events(ckpt)
    assert ev[0] == "start" and ev[-1] == "close"
    assert "save" in ev and "persist" in ev and "restore" in ev
    h = safepoint._core.read_history(str(ckpt / HISTORY))
    assert h.runs == 1 and h.interruptions == 0 and h.save.samples == 12
    assert h.persist["path"].samples >= 1 and "memory" in h.restore
    # The history is no checkpoint: ls and verify see only the steps.
    assert safepoint.steps(ckpt)


def test_advise_explains_with_a_learned_mtbf(ckpt, shm, cli):
    run_job(ckpt, shm, crash=True)  # an interruption...
    run_job(ckpt, shm)              # ...and the restart after it
    out = json.loads(cli("advise", ckpt, "--json", check=0).stdout)
    levels = {lv["level"]: lv for lv in out["levels"]}
    assert set(levels) >= {"memory", "path"}
    mem = levels["memory"]
    assert "learned from 1 interruption" in mem["mtbf_source"]
    assert mem["interval_seconds"] > 0 and mem["save_seconds"] > 0
    assert "median of" in mem["measured"]["save"]
    p = levels["path"]
    assert p["persist_seconds"] is not None and p["interval_seconds"] >= p["persist_seconds"]
    text = cli("advise", ckpt, "--mtbf", "2h", check=0).stdout
    assert "memory: save every" in text and "path: persist every" in text
    assert "configured (--mtbf)" in text and "Young" not in text  # one model: no other formula


def test_advise_without_history_says_what_is_missing(tmp_path, cli):
    r = cli("advise", tmp_path / "nothing", check=1)
    assert "no measurement history" in r.stderr and "--save-seconds" in r.stderr
    r = cli("advise", tmp_path / "nothing", "--save-seconds", "2", "--restore-seconds", "30",
            "--mtbf", "1h", "--json", check=0)
    lv = json.loads(r.stdout)["levels"][0]
    # The goodput model's optimum: the same as `simulate` finds for the same costs.
    sim = json.loads(cli("simulate", "--mtbf", "1h", "--snapshot-seconds", "2",
                         "--restore-memory-seconds", "30", "--restore-storage-seconds", "30",
                         "--json", check=0).stdout)
    assert lv["level"] == "memory"
    assert lv["interval_seconds"] == sim["strategies"][0]["interval_seconds"]
    assert lv["restore_estimated"] is False
    r = cli("advise", tmp_path / "nothing", "--mtbf", "soon", check=2)
    assert "duration" in r.stderr


def test_advise_names_a_simulate_command_that_runs(tmp_path, cli):
    """advise ends with the `safepoint simulate` line that models the same job; without a
    history that is no `--from` (which fails there) but advise's own flags in simulate's words,
    and it finds advise's interval."""
    r = cli("advise", tmp_path / "nothing", "--save-seconds", "2", "--restore-seconds", "30",
            "--restart-seconds", "60", "--mtbf", "3h", check=0)
    line = r.stdout.strip().splitlines()[-1]
    cmd = line.split(": ", 1)[1].split()
    assert cmd[:2] == ["safepoint", "simulate"] and "--from" not in cmd, line
    adv = json.loads(cli("advise", tmp_path / "nothing", "--save-seconds", "2",
                         "--restore-seconds", "30", "--restart-seconds", "60", "--mtbf", "3h",
                         "--json", check=0).stdout)
    sim = json.loads(cli(*cmd[1:], "--json", check=0).stdout)
    assert adv["levels"][0]["interval_seconds"] == sim["strategies"][0]["interval_seconds"]


def test_advise_on_a_fresh_job_estimates_restores_and_shows_typical_mtbfs(tmp_path, shm, cli):
    """A job that saved and persisted but was never interrupted nor restored still gets advice:
    the restore time estimated from the state's size and the measured bandwidths, and the
    intervals for typical MTBFs (1 h, 3 h, 12 h), with exit 0."""
    ckpt = tmp_path / "fresh"
    c = safepoint.Checkpointer(ckpt, shm_dir=shm, job="fresh")
    for step in range(20):  # the advisor asks the agent for persist times every 10 saves
        c.save(step, state(4096))
        if step == 9:
            c.wait()
    c.wait()
    c.close()
    assert "restore" not in history_events(ckpt)
    r = cli("advise", ckpt, check=0)
    assert "no interruption" in r.stdout and "--mtbf" in r.stdout
    for m in ("60 min", "3 h", "12 h"):  # FormatDuration: minutes below 2 h
        assert f"if failures came every {m}: save every" in r.stdout, r.stdout
        assert f"if failures came every {m}: persist every" in r.stdout, r.stdout
    assert "estimated" in r.stdout and "no advice" not in r.stdout
    out = json.loads(cli("advise", ckpt, "--json", check=0).stdout)
    levels = {lv["level"]: lv for lv in out["levels"]}
    for name in ("memory", "path"):
        lv = levels[name]
        assert lv["mtbf_seconds"] is None and "not known yet" in lv["mtbf_source"]
        assert lv["restore_estimated"] and lv["restore_seconds"] > 0
        assert lv["measured"]["restore"].startswith("estimated")
        assert [t["mtbf_seconds"] for t in lv["typical_mtbf"]] == [3600, 3 * 3600, 12 * 3600]
        ivs = [t["interval_seconds"] for t in lv["typical_mtbf"]]
        assert all(i > 0 for i in ivs) and ivs == sorted(ivs)  # rarer failures: longer intervals
    assert "bandwidth" in levels["path"]["measured"]["restore"]
    # With --mtbf the same fresh job gets one recommendation per level, restore still estimated.
    out = json.loads(cli("advise", ckpt, "--mtbf", "3h", "--json", check=0).stdout)
    p = {lv["level"]: lv for lv in out["levels"]}["path"]
    assert p["interval_seconds"] > 0 and p["restore_estimated"]
    assert p["mtbf_source"] == "configured (--mtbf)"


SIM = ["simulate", "--mtbf", "3h", "--node-loss-fraction", "0.2", "--snapshot-seconds", "0.5",
       "--persist-seconds", "60", "--restart-seconds", "120", "--restore-memory-seconds", "2",
       "--restore-peer-seconds", "10", "--restore-storage-seconds", "60"]


def test_simulate_orders_strategies_and_monte_carlo_agrees(cli):
    out = json.loads(cli(*SIM, "--monte-carlo", "--seed", "7", "--json", check=0).stdout)
    assert out["reported"] == "analytic"
    g = {s["strategy"]: s for s in out["strategies"]}
    assert g["safepoint"]["goodput"] > g["dcp-async"]["goodput"] > g["sync"]["goodput"]
    for s in g.values():
        mc = s["monte_carlo"]
        assert mc["failures"] > 1000
        # The Monte-Carlo run of the same model: within 4 standard errors of the analytic value.
        assert abs(mc["goodput"] - s["goodput"]) <= 4 * mc["standard_error"], s
    text = cli(*SIM, "--interval", "10m", check=0).stdout
    assert "safepoint:" in text and "at an interval of 10 min" in text


def test_simulate_plot_and_csv(tmp_path, cli):
    pytest.importorskip("matplotlib")
    png, csv = tmp_path / "g.png", tmp_path / "g.csv"
    cli(*SIM, "--plot", png, "--csv", csv, check=0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = csv.read_text().splitlines()
    assert rows[0] == "interval_seconds,safepoint,sync,dcp-async" and len(rows) > 100


def test_simulate_reads_costs_from_a_jobs_history(ckpt, shm, cli):
    run_job(ckpt, shm, crash=True)
    run_job(ckpt, shm)
    out = json.loads(cli("simulate", "--from", ckpt, "--json", check=0).stdout)
    inp = out["inputs"]
    assert inp["history"].endswith(HISTORY)
    assert inp["snapshot_seconds"] > 0 and inp["persist_seconds"] > 0
    assert inp["restore_memory_seconds"] > 0 and inp["mtbf_seconds"] > 0
    r = cli("simulate", "--snapshot-seconds", "1", check=1)
    assert "MTBF" in r.stderr


def test_persist_every_auto_persists_as_often_as_the_storage_takes_steps(ckpt, shm):
    """persist_every="auto" is the goodput model's schedule (the one `advise` prints for `path`):
    a persist costs training nothing, so every m-th save, m = ceil(persist time / save
    interval); the MTBF gives the goodput and the optimal save interval in the status."""
    c = safepoint.Checkpointer(ckpt, shm_dir=shm, job="auto", persist_every="auto", mtbf=1e7)
    try:
        st = c.status()["persist_interval"]
        assert st["mode"] == "auto" and st["every_steps"] == 1
        assert "no measurements yet" in st["reason"]
        # The schedule reads the persist times from the snapshot slots, where the agent records
        # them: it never asks the agent (one message per save).
        c.status = lambda: pytest.fail("the schedule asked the agent for its status")
        step = 0
        for _ in range(20):  # two evaluations
            if step in (9, 19):
                c.wait()  # a persist is recorded before each evaluation (in saves 9 and 19)
            c.save(step, state())
            step += 1
        adv = c._advisor
        assert adv._persist, "no persist time reached the schedule"
        c.wait()
        del c.status
        fast = c.status()["persist_interval"]
        period = statistics.median(adv._periods)
        expected = safepoint._core.persist_every_saves(statistics.median(adv._persist), period)
        assert fast["every_steps"] == expected, (fast, expected)
        assert "as often as the storage takes steps" in fast["reason"]
        # This job does little but save (a save each step of no work): the model says so, and
        # that saving less often would do better.
        assert "MTBF configured" in fast["reason"] and 0 < fast["expected_goodput"] < 1
        best = fast["save_interval"]
        assert best["recommended_seconds"] > period
        assert best["expected_goodput"] > fast["expected_goodput"]
        # The storage slows down: a persist takes 10 save intervals. Every 10th save, then.
        adv._persist.clear()
        adv._persist.extend([10 * period] * 8)
        for _ in range(20):
            c.save(step, state())
            step += 1
        slow = c.status()["persist_interval"]
        assert slow["every_steps"] >= 5 and slow["every_steps"] > fast["every_steps"], slow
        assert slow["changes"] > fast["changes"] and slow["reason"] != fast["reason"]
        assert f"{slow['every_steps']} steps" in slow["reason"]
    finally:
        c.close()


def test_the_agent_records_each_persist_time_in_the_slot(ckpt, shm):
    with safepoint.Checkpointer(ckpt, shm_dir=shm, job="recorded") as c:
        live = c._live
        c.save(1, state(), persist=False)
        assert live.last_persisted() is None  # in memory only: nothing written
        c.save(2, state())
        c.wait()
        step, seconds = live.last_persisted()
        assert step == 2 and seconds > 0
        for step in (3, 4):  # both slots overwritten: the record stays
            c.save(step, state(), persist=False)
        assert live.last_persisted() == (2, seconds)


def test_persist_every_auto_without_a_failure_rate_still_follows_the_persist_time(ckpt, shm):
    with safepoint.Checkpointer(ckpt, shm_dir=shm, job="auto2", persist_every="auto") as c:
        for step in range(10):
            if step == 9:
                c.wait()  # a persist time for the evaluation in save 10
            c.save(step, state())
        st = c.status()["persist_interval"]
        assert st["every_steps"] >= 1 and "as often as the storage takes steps" in st["reason"]
        assert st["expected_goodput"] is None and st["save_interval"] is None  # no MTBF


def test_bad_persist_every_and_mtbf_are_refused(ckpt, shm):
    with pytest.raises(safepoint.errors.InvalidArgumentError, match="persist_every"):
        safepoint.Checkpointer(ckpt, shm_dir=shm, persist_every="sometimes")
    with pytest.raises(safepoint.errors.InvalidArgumentError, match="mtbf"):
        safepoint.Checkpointer(ckpt, shm_dir=shm, mtbf=-5)
    with pytest.raises(safepoint.errors.InvalidArgumentError, match="mtbf"):
        safepoint.Checkpointer(ckpt, shm_dir=shm, mtbf="often")


def test_status_watch_refreshes_and_exits_zero_on_ctrl_c(ckpt, shm):
    with safepoint.Checkpointer(ckpt, shm_dir=shm, job="watched") as c:
        c.save(1, state())
        c.wait()
        p = subprocess.Popen([cli_path(), "status", "--watch", "--interval", "0.2",
                              "--shm-dir", shm], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        blocks, lines = 0, []
        while blocks < 3:
            line = p.stdout.readline()
            assert line, (lines, p.stderr.read())
            lines.append(line)
            blocks += line.startswith("--- ")
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate()
        assert p.returncode == 0, err
    text = "".join(lines)
    assert "\033[" not in text  # not a terminal: plain blocks, no redraw
    assert "job watched" in text and "newest committed step 1 (" in text and "ago)" in text


def test_verify_progress_bar_on_stderr_never_in_json(ckpt, cli):
    safepoint.save(ckpt, 3, state(1 << 16))
    r = cli("verify", ckpt, "--progress", check=0)
    assert "verify [" in r.stderr and "100%" in r.stderr and "OK" in r.stdout
    r = cli("verify", ckpt, "--progress", "--json", check=0)
    assert "verify [" not in r.stderr and json.loads(r.stdout)["ok"]
    r = cli("verify", ckpt, check=0)  # not a terminal, no --progress: no bar
    assert "verify [" not in r.stderr


def test_cp_progress_bar_has_rate_and_eta(tmp_path, ckpt, cli):
    safepoint.save(ckpt, 3, state(1 << 16))
    r = cli("cp", ckpt, tmp_path / "copy", "--progress", check=0)
    assert "step 3 [" in r.stderr and "100%" in r.stderr and "/s" in r.stderr and "ETA" in r.stderr


def test_each_save_is_one_message_and_the_agent_keeps_the_history(ckpt, shm, cli, monkeypatch):
    """Issue 21: a save's report travels with its snapshot note (one message per save), and
    the agent keeps the job's history itself: no $SAFEPOINT_HISTORY_DIR, no status poll."""
    monkeypatch.delenv("SAFEPOINT_HISTORY_DIR", raising=False)
    with safepoint.Checkpointer(ckpt, shm_dir=shm, job="one-msg") as c:
        before = c.status()["agent"]["messages_received"]
        for step in range(25):  # persists every step, past the old poll's 10-save cadence
            c.save(step, state())
        assert c.status()["agent"]["messages_received"] - before == 25
        assert c.status()["agent"]["history"]["where"] == str(ckpt / HISTORY)
        c.wait()
    h = safepoint._core.read_job_history(str(ckpt))
    assert h.runs == 1 and h.interruptions == 0 and h.save.samples == 25
    assert h.persist["path"].samples >= 1
    out = json.loads(cli("advise", ckpt, "--json", check=0).stdout)
    assert out["history"] == str(ckpt / HISTORY)
    assert "median of 25 samples" in {lv["level"]: lv for lv in out["levels"]}[
        "memory"]["measured"]["save"]


@pytest.mark.skipif(not os.environ.get("SAFEPOINT_TEST_S3_URI"),
                    reason="$SAFEPOINT_TEST_S3_URI is not set (make test sets it with a test "
                    "Ceph cluster)")
def test_advise_on_an_object_store_job_reads_the_history_the_agent_keeps_there(shm, cli,
                                                                                monkeypatch):
    import uuid
    monkeypatch.delenv("SAFEPOINT_HISTORY_DIR", raising=False)
    uri = os.environ["SAFEPOINT_TEST_S3_URI"].rstrip("/") + "/adv-" + uuid.uuid4().hex[:12]
    with safepoint.Checkpointer(uri, shm_dir=shm, job="adv-s3") as c:
        for step in range(3):
            c.save(step, state())
        c.wait()
    # The agent published its segment when rank 0 closed.
    h = safepoint._core.read_job_history(uri)
    assert h.runs == 1 and h.interruptions == 0 and h.save.samples == 3
    out = json.loads(cli("advise", uri, "--json", check=0).stdout)
    assert "safepoint-history/" in out["history"]
    assert {"memory", "path"} <= {lv["level"] for lv in out["levels"]}


def test_history_dir_for_non_local_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("SAFEPOINT_HISTORY_DIR", str(tmp_path))
    assert safepoint._core.history_path("s3://b/run", "j") == os.path.join(tmp_path,
                                                                            "j.history.jsonl")


def test_tier_every_auto_takes_steps_as_fast_as_it_copies_and_says_why(tmp_path, ckpt, shm):
    tier = tmp_path / "tier"
    with safepoint.Checkpointer(ckpt, shm_dir=shm, job="tauto",
                                tiers=[safepoint.Tier(str(tier), every="auto")]) as c:
        for step in range(3):
            c.save(step, state())
        c.wait()
        why = c.status()["persist_interval"]["tiers"]["tier 1"]
        assert why.startswith("auto:") and "as fast as" in why
        # The agent copies to the tier after the commit, on its own thread: wait() covers only
        # the job's storage, and close() does not wait for the agent's tier copies.
        assert wait_until(lambda: c.status()["tiers"][0]["newest_step"] is not None)
    assert safepoint.steps(tier)  # the tier received steps
    with pytest.raises(safepoint.errors.InvalidArgumentError, match="every"):
        safepoint.Checkpointer(ckpt, shm_dir=shm, tiers=[safepoint.Tier(str(tier),
                                                                         every="sometimes")])


def test_simulate_what_if_from_sizes_and_speeds(cli):
    base = ["simulate", "--mtbf", "3h", "--restart-seconds", "30", "--state-per-gpu", "10G",
            "--memory-bandwidth", "20G", "--storage-bandwidth", "8G", "--network-bandwidth",
            "40G", "--gpus-per-node", "8", "--interval", "10m", "--json"]
    small = json.loads(cli(*base, "--gpus", "16", check=0).stdout)
    assert small["inputs"]["snapshot_seconds"] == pytest.approx(0.5)
    assert small["inputs"]["persist_seconds"] == pytest.approx(20)
    assert small["inputs"]["restore_peer_seconds"] == pytest.approx(2)
    big = json.loads(cli(*base, "--gpus", "64", check=0).stdout)
    assert big["inputs"]["persist_seconds"] == pytest.approx(80)  # one storage, 4x the state

    def goodput(out, name):
        return next(s["goodput"] for s in out["strategies"] if s["strategy"] == name)

    # Synchronous saves suffer from the larger job; memory snapshots do not.
    assert goodput(big, "sync") < goodput(small, "sync")
    assert goodput(big, "safepoint") == pytest.approx(goodput(small, "safepoint"))
    r = cli("simulate", "--mtbf", "3h", "--state-per-gpu", "lots", check=2)
    assert "not a size" in r.stderr


def test_status_watch_redraws_in_place_on_a_terminal(shm):
    import pty

    master, slave = pty.openpty()
    p = subprocess.Popen([cli_path(), "status", "--watch", "--interval", "0.2", "--shm-dir", shm],
                         stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    out = b""
    while out.count(b"\033[H\033[2J") < 2:  # two redraws from the top of a cleared screen
        chunk = os.read(master, 4096)
        assert chunk, out
        out += chunk
    p.send_signal(signal.SIGINT)
    assert p.wait() == 0
    os.close(master)
    assert b"safepoint status, every 0.2 s (Ctrl-C to quit)" in out
    assert b"no safepoint jobs in" in out and b"--- " not in out


def test_simulate_monte_carlo_is_bounded_for_short_intervals_and_rare_failures(cli):
    # 20000 MTBFs of 30 days in periods of 10 ms would be 5 * 10^12 periods: capped at 10^7.
    out = json.loads(cli("simulate", "--mtbf", "30d", "--snapshot-seconds", "0.001",
                         "--restore-memory-seconds", "1", "--interval", "0.01", "--monte-carlo",
                         "--json", check=0).stdout)
    for s in out["strategies"]:
        assert s["monte_carlo"]["wall_seconds"] <= 1e7 * 0.01 * 1.001


def test_simulate_text_plot_and_advise_give_one_answer_for_one_history(ckpt, shm, cli, tmp_path):
    """Issue 36: for the same history `simulate` printed optima of 0.131 s / 0.516 s, its plot
    labelled 0.116 s / 0.497 s (the highest of a coarse CSV written with 4 digits), and `advise`
    recommended 0.156 s (another formula). One model now: the text, the CSV the plot draws (and
    the plot's labels) and advise give the same intervals."""
    gp = pytest.importorskip("safepoint.goodput_plot")
    run_job(ckpt, shm, crash=True, pause=0.01)
    run_job(ckpt, shm, pause=0.01)
    sim = {s["strategy"]: s for s in
           json.loads(cli("simulate", "--from", ckpt, "--json", check=0).stdout)["strategies"]}
    text = cli("simulate", "--from", ckpt, check=0).stdout
    csv = tmp_path / "g.csv"
    cli("simulate", "--from", ckpt, "--csv", csv, check=0)
    xs, curves = gp.read_curves(str(csv))
    for name, ys in curves.items():
        best = gp.optimum(xs, ys)
        assert xs[best] == pytest.approx(sim[name]["interval_seconds"], rel=1e-12), name
        label = gp.format_duration(xs[best])  # what the plot writes beside its mark
        assert f"{name}: " in text and f"at an interval of {label}" in text, (label, text)
        assert f"{100 * ys[best]:.2f}%" in text
    advice = json.loads(cli("advise", ckpt, "--json", check=0).stdout)
    levels = {lv["level"]: lv for lv in advice["levels"]}
    assert levels["memory"]["interval_seconds"] == sim["safepoint"]["interval_seconds"]
    assert levels["memory"]["expected_goodput"] == sim["safepoint"]["goodput"]
    assert levels["path"]["interval_seconds"] == pytest.approx(
        sim["safepoint"]["interval_seconds"] * sim["safepoint"]["persist_every_saves"])
    adv_text = cli("advise", ckpt, check=0).stdout
    assert f"memory: save every {gp.format_duration(xs[gp.optimum(xs, curves['safepoint'])])}" \
        in adv_text


def test_a_one_process_job_is_modelled_as_one_process_without_peers(ckpt, shm, cli):
    """Issue 36: `simulate --from` took any job for 8 GPUs whose lost node restores, for free,
    from a peer's copy. A one-process job: 1 GPU, no peers; a node loss restores from storage
    and loses the steps since the newest persisted one; no restore is free."""
    run_job(ckpt, shm, crash=True, pause=0.01)
    run_job(ckpt, shm, pause=0.01)
    out = json.loads(cli("simulate", "--from", ckpt, "--json", check=0).stdout)
    inp = out["inputs"]
    assert inp["gpus"] == 1 and inp["nodes"] == 1 and inp["peer_copies"] is False
    assert "recorded: 1 rank" in out["sources"]["shape"]
    assert inp["restore_storage_seconds"] > 0
    sp = out["strategies"][0]
    node_loss = next(m for m in sp["failure_modes"] if m["mode"] == "node loss")
    assert node_loss["recovery_seconds"] > inp["restart_seconds"] + inp["restore_storage_seconds"]
    # Peers need nodes to hold the copies: refused for one node, taken when given.
    r = cli("simulate", "--from", ckpt, "--peers", check=1)
    assert "peer copies need at least two nodes" in r.stderr
    two = json.loads(cli("simulate", "--from", ckpt, "--gpus", "16", "--gpus-per-node", "8",
                         "--peers", "--json", check=0).stdout)
    assert two["inputs"]["nodes"] == 2 and two["inputs"]["peer_copies"] is True


def test_advise_gives_intervals_in_steps_for_persist_every(ckpt, shm, cli):
    """persist_every takes steps: advise says how many, from the step time it measured (the
    history's save lines record their steps), and in seconds."""
    run_job(ckpt, shm, crash=True, pause=0.02)
    run_job(ckpt, shm, pause=0.02)
    out = json.loads(cli("advise", ckpt, "--json", check=0).stdout)
    assert out["shape"]["step_seconds"] > 0.01
    levels = {lv["level"]: lv for lv in out["levels"]}
    mem, path = levels["memory"], levels["path"]
    assert mem["interval_steps"] >= 1 and path["interval_steps"] == mem["interval_steps"] * \
        path["every"]
    assert f"persist_every={path['interval_steps']}" in path["explanation"]
    text = cli("advise", ckpt, check=0).stdout
    assert f"({mem['interval_steps']} step" in text and "A step: " in text
    # Given on the command line instead: the same conversion.
    out = json.loads(cli("advise", ckpt, "--step-seconds", "1", "--json", check=0).stdout)
    mem = {lv["level"]: lv for lv in out["levels"]}["memory"]
    assert mem["interval_steps"] == max(1, round(mem["interval_seconds"] - mem["save_seconds"]))
