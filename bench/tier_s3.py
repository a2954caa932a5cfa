"""safepoint benchmark: the s3:// tier against plain parallel curl and DCP over fsspec/s3fs.

    python bench/tier_s3.py [--size 1G] [--runs 3] [--no-doc]

Rewrites the "Object storage tiers: S3" section of docs/benchmarks.md. It needs an S3 gateway:
with AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY set it uses that one (bucket
--bucket, created when missing); otherwise (root) it starts a throwaway Ceph cluster with
scripts/ceph-cluster.sh (one OSD, radosgw) and stops it at the end. In one run, contenders
alternated, median of --runs:

1. **safepoint**: ``safepoint.save(s3://BUCKET/P, ...)`` of a --size state (fp32 tensors of 64
   MiB each), durable when it returns (CompleteMultipartUpload, then the COMMIT object), and
   ``safepoint.load`` of it (16 MiB ranged GETs, one per part, 8 at a time, into the image
   buffer, checksums verified).
2. **curl**: the same bytes as 16 MiB objects (safepoint's part size) from tmpfs, PUT by one
   ``curl --parallel --parallel-max 8`` (safepoint's 8 connections), and GET back into tmpfs the
   same way: what the gateway gives plain HTTP with the same request size and parallelism.
3. **DCP**: ``torch.distributed.checkpoint.save/load`` with FsspecWriter/FsspecReader on s3fs
   (installed into build/bench/s3fs-deps when missing), 8 threads; load into preallocated
   tensors (allocated outside the timing).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
S3FS_DEPS = os.path.join(REPO, "build", "bench", "s3fs-deps")

import torch  # noqa: E402

import safepoint  # noqa: E402
from run import GiB, MiB, machine, parse_size, publish  # noqa: E402

PART = 16 * MiB
PARALLEL = 8
GB = 1e9
med = statistics.median


def curl_base() -> list[str]:
    region = os.environ.get("AWS_REGION", "us-east-1")
    return ["curl", "-sS", "--fail", "--aws-sigv4", f"aws:amz:{region}:s3",
            "--user", f"{os.environ['AWS_ACCESS_KEY_ID']}:{os.environ['AWS_SECRET_ACCESS_KEY']}",
            # libcurl 7.88 does not add the payload hash header that RGW requires for SigV4.
            "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD"]


def endpoint() -> str:
    return os.environ["AWS_ENDPOINT_URL"].rstrip("/")


def s3_keys(bucket: str, prefix: str) -> list[str]:
    keys, token = [], None
    while True:
        # libcurl 7.88 signs the query as written: it must be encoded and sorted already.
        q = {"list-type": "2", "prefix": prefix}
        if token:
            q["continuation-token"] = token
        url = f"{endpoint()}/{bucket}?" + "&".join(
            f"{k}={urllib.parse.quote(v, safe='')}" for k, v in sorted(q.items()))
        out = subprocess.run(curl_base() + [url], capture_output=True, check=True).stdout
        root = ET.fromstring(out)
        ns = {"s": root.tag.split("}")[0].strip("{")} if root.tag.startswith("{") else {}
        find = (lambda e, t: e.findall(f"s:{t}", ns)) if ns else (lambda e, t: e.findall(t))
        for c in find(root, "Contents"):
            keys.append(find(c, "Key")[0].text)
        trunc = find(root, "IsTruncated")
        if not trunc or trunc[0].text != "true":
            return keys
        token = find(root, "NextContinuationToken")[0].text


def s3_delete_prefix(bucket: str, prefix: str) -> None:
    keys = s3_keys(bucket, prefix)
    if keys:
        subprocess.run(curl_base() + ["--parallel", "-X", "DELETE"] +
                       [f"{endpoint()}/{bucket}/{k}" for k in keys], capture_output=True)
    # radosgw frees a deleted object's data only in its garbage collection, 2 hours later by
    # default: a few runs of 1 GiB fill the test cluster's OSD (and radosgw then blocks every
    # write). Where the cluster is at hand (CEPH_CONF), collect now.
    if os.environ.get("CEPH_CONF") and shutil.which("radosgw-admin"):
        subprocess.run(["timeout", "300", "radosgw-admin", "gc", "process", "--include-all"],
                       capture_output=True)


def start_cluster() -> str:
    d = tempfile.mkdtemp(prefix="sp-bench-s3-", dir="/var/tmp")
    subprocess.run(["bash", os.path.join(REPO, "scripts", "ceph-cluster.sh"), "start", d],
                   check=True)
    env = subprocess.run(["bash", os.path.join(REPO, "scripts", "ceph-cluster.sh"), "env", d],
                         check=True, capture_output=True, text=True).stdout
    for line in env.splitlines():
        k, _, v = line.removeprefix("export ").partition("=")
        os.environ[k] = v.strip("'")
    return d


def make_state(nbytes: int) -> dict:
    g = torch.Generator().manual_seed(1)
    n = max(1, nbytes // (64 * MiB))
    return {f"layer{i}.weight": torch.randn(16 * MiB, generator=g) for i in range(n)}


def bench_safepoint(bucket: str, state: dict) -> tuple[float, float]:
    uri = f"s3://{bucket}/sp-{uuid.uuid4().hex[:10]}"
    t0 = time.perf_counter()
    r = safepoint.save(uri, 1, state)
    save_s = time.perf_counter() - t0
    assert r["committed"]
    t0 = time.perf_counter()
    step, back = safepoint.load(uri, 1)
    load_s = time.perf_counter() - t0
    assert step == 1 and all(torch.equal(back[k], v) for k, v in state.items())
    del back
    s3_delete_prefix(bucket, uri.split("/", 3)[3] + "/")
    return save_s, load_s


def bench_curl(bucket: str, parts_dir: str, nparts: int) -> tuple[float, float]:
    prefix = f"curl-{uuid.uuid4().hex[:10]}"
    put, get = [], []
    for i in range(nparts):
        put += ["-T", os.path.join(parts_dir, f"p{i}"), f"{endpoint()}/{bucket}/{prefix}/p{i}"]
        get += ["-o", os.path.join(parts_dir, f"g{i}"), f"{endpoint()}/{bucket}/{prefix}/p{i}"]
    par = ["--parallel", "--parallel-max", str(PARALLEL)]
    t0 = time.perf_counter()
    subprocess.run(curl_base() + par + put, check=True, capture_output=True)
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run(curl_base() + par + get, check=True, capture_output=True)
    get_s = time.perf_counter() - t0
    for i in range(nparts):
        os.unlink(os.path.join(parts_dir, f"g{i}"))
    s3_delete_prefix(bucket, prefix + "/")
    return put_s, get_s


def dcp_available() -> str | None:
    if not os.path.isdir(S3FS_DEPS):
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", S3FS_DEPS,
                            "s3fs"], capture_output=True, text=True)
        if r.returncode != 0:
            return "pip install s3fs failed: " + r.stderr.strip().splitlines()[-1][:200]
    if S3FS_DEPS not in sys.path:
        sys.path.append(S3FS_DEPS)
    try:
        import s3fs  # noqa: F401
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # noqa: F401
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"{type(e).__name__}: {e}"
    return None


def bench_dcp(bucket: str, state: dict) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    opts = dict(endpoint_url=endpoint(), key=os.environ["AWS_ACCESS_KEY_ID"],
                secret=os.environ["AWS_SECRET_ACCESS_KEY"])
    prefix = f"dcp-{uuid.uuid4().hex[:10]}"
    path = f"s3://{bucket}/{prefix}"
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=FsspecWriter(path, thread_count=PARALLEL, **opts), no_dist=True)
    save_s = time.perf_counter() - t0
    target = {k: torch.empty_like(v) for k, v in state.items()}
    t0 = time.perf_counter()
    dcp.load(target, storage_reader=FsspecReader(path, **opts), no_dist=True)
    load_s = time.perf_counter() - t0
    assert all(torch.equal(target[k], v) for k, v in state.items())
    s3_delete_prefix(bucket, prefix + "/")
    return save_s, load_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1G")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bucket", default="safepoint-bench")
    ap.add_argument("--dir", default=os.path.join(REPO, "build", "bench"))
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--render", metavar="JSON",
                    help="only render the section from a results file of an earlier run")
    args = ap.parse_args()
    if args.render:
        import json

        with open(args.render) as f:
            saved = json.load(f)
        results, nbytes = saved["results"], saved["nbytes"]
        args.runs = len(results["safepoint"])
        section = render(results, nbytes, args, saved.get("dcp_error"), saved.get("own_cluster"))
        publish(args, "tier-s3", "Object storage tiers: S3", section, saved)
        return
    os.makedirs(args.dir, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)
    cluster = None
    if not all(os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                           "AWS_SECRET_ACCESS_KEY")):
        cluster = start_cluster()
    try:
        subprocess.run(curl_base()[:2] + curl_base()[3:] + ["-X", "PUT",
                       f"{endpoint()}/{args.bucket}"], capture_output=True)  # exists: fine
        state = make_state(parse_size(args.size))
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        parts_dir = tempfile.mkdtemp(prefix="sp-s3-parts-", dir="/dev/shm")
        raw = b"".join(t.numpy().tobytes() for t in state.values())
        nparts = (len(raw) + PART - 1) // PART
        for i in range(nparts):
            with open(os.path.join(parts_dir, f"p{i}"), "wb") as f:
                f.write(raw[i * PART:(i + 1) * PART])
        del raw
        dcp_error = dcp_available()
        results = {"safepoint": [], "curl": [], "dcp": []}
        try:
            # Warm-up round (connections, the gateway's caches), not counted.
            bench_curl(args.bucket, parts_dir, nparts)
            bench_safepoint(args.bucket, state)
            for run in range(args.runs):
                order = ["safepoint", "curl", "dcp"]
                if run % 2:
                    order.reverse()
                for name in order:
                    if name == "safepoint":
                        results[name].append(bench_safepoint(args.bucket, state))
                    elif name == "curl":
                        results[name].append(bench_curl(args.bucket, parts_dir, nparts))
                    elif dcp_error is None:
                        try:
                            results[name].append(bench_dcp(args.bucket, state))
                        except Exception as e:  # noqa: BLE001 - reported in the table
                            dcp_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                print(name, results[name][-1:] if results[name] else dcp_error, flush=True)
        finally:
            shutil.rmtree(parts_dir, ignore_errors=True)
        section = render(results, nbytes, args, dcp_error, cluster is not None)
        publish(args, "tier-s3", "Object storage tiers: S3", section,
                {"results": results, "nbytes": nbytes, "dcp_error": dcp_error,
                 "own_cluster": cluster is not None})
    finally:
        if cluster:
            subprocess.run(["bash", os.path.join(REPO, "scripts", "ceph-cluster.sh"), "stop",
                            cluster], check=False)


def render(results: dict, nbytes: int, args, dcp_error, own_cluster: bool) -> str:
    import datetime

    curl_put = med(r[0] for r in results["curl"])
    curl_get = med(r[1] for r in results["curl"])
    lines = [f"Measured {datetime.date.today().isoformat()} on {machine()}.",
             f"Command: `python bench/tier_s3.py --size {args.size}`; median of {args.runs} runs "
             "after a warm-up round, contenders alternated. Gateway: Ceph 16.2 radosgw (beast) "
             "on 127.0.0.1 over one BlueStore OSD on a file of the same virtual disk, pool size 1"
             + (" (a cluster started for the run by scripts/ceph-cluster.sh)" if own_cluster
                else "") +
             ", on the same 2 cores as the client: the gateway, the OSD and the client compete "
             "for them, so these figures measure this VM's CPU more than the protocol.",
             f"State: {nbytes / GiB:.2f} GiB in {nbytes // (64 * MiB)} fp32 tensors of 64 MiB. "
             f"safepoint: default s3:// options (16 MiB parts, 8 connections); persist = "
             "`safepoint.save` until durable (CompleteMultipartUpload and COMMIT done); load = "
             "`safepoint.load` (16 MiB ranged GETs, 8 in flight, checksums verified, tensors built). curl: one "
             f"`curl --parallel --parallel-max {PARALLEL}` PUTting {nbytes // PART} objects of "
             "16 MiB from tmpfs, and GETting them back into tmpfs (no checksums, no tensors).",
             "",
             "Seconds are the median (min-max) of the runs; GB/s and ratios use the median.",
             "",
             "| contender | persist s | persist GB/s | vs curl PUT | load s | load GB/s | vs curl GET |",
             "|---|---:|---:|---:|---:|---:|---:|"]

    def row(name: str, rs: list) -> None:
        s, l = med(r[0] for r in rs), med(r[1] for r in rs)
        lines.append(f"| {name} | {s:.2f} ({min(r[0] for r in rs):.2f}-{max(r[0] for r in rs):.2f}) | "
                     f"{nbytes / s / GB:.2f} | {curl_put / s:.0%} | "
                     f"{l:.2f} ({min(r[1] for r in rs):.2f}-{max(r[1] for r in rs):.2f}) | "
                     f"{nbytes / l / GB:.2f} | {curl_get / l:.0%} |")

    row("safepoint s3://", results["safepoint"])
    row(f"curl, {PARALLEL} parallel (reference)", results["curl"])
    if results["dcp"]:
        row(f"DCP FsspecWriter/Reader (s3fs, {PARALLEL} threads)", results["dcp"])
    if dcp_error:
        lines.append("")
        lines.append(f"DCP over s3fs did not run: {dcp_error}")
    lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
