#!/usr/bin/env bash
# A throwaway single-host Ceph cluster for tests, from Debian's packages (ceph-mon, ceph-mgr,
# ceph-osd, radosgw, ceph-common), with every file under one directory and no systemd.
#
#   scripts/ceph-cluster.sh start DIR   one mon, one mgr, one OSD, a pool `safepoint` (size 1) and a
#                                       RADOS Gateway with an S3 user; returns once all are healthy
#   scripts/ceph-cluster.sh env DIR     prints CEPH_CONF, CEPH_ARGS and AWS_* lines to `eval`
#   scripts/ceph-cluster.sh stop DIR    kills every daemon of DIR and removes DIR
#   scripts/ceph-cluster.sh restart-osd DIR
#                                       starts osd.0 again after a test killed it (its pid file is
#                                       DIR/run/osd.0.pid) and waits until every PG is active+clean
#   scripts/ceph-cluster.sh resume-osd DIR
#                                       SIGCONTs osd.0 after a test stopped it, and has it re-peer
#                                       (marked down, it rejoins at once): with one OSD, the PGs of a
#                                       paused OSD stay "laggy" (their read leases expired) and
#                                       queue every op until they re-peer
#   scripts/ceph-cluster.sh restart-rgw DIR
#                                       starts radosgw again after a test killed it (its pid file
#                                       is DIR/run/client.rgw.pid), on its port, and waits until it
#                                       answers
#   scripts/ceph-cluster.sh full DIR    sets the OSD's full ratio (and the nearfull and backfillfull
#                                       ratios below it) under what it holds, and waits until the
#                                       monitor flags it full: every pool refuses writes
#   scripts/ceph-cluster.sh unfull DIR  puts the ratios back (0.85, 0.90, 0.95) and waits for
#                                       HEALTH_OK
#
# `start` also creates the S3 bucket `safepoint-test` (the S3 tier's tests write under it).
#
# The daemons listen on 127.0.0.1 on ports picked free at start, so several clusters can run at
# once. Authentication is off (`auth ... = none`): the cluster exists only on loopback for the
# lifetime of a test run. The OSD is BlueStore on a plain file DIR/osd.0/block (no loop device and
# no real disk needed; the file is sparse), so its data survives an OSD restart, which the
# kill-an-OSD tests need; CEPH_OSD_STORE=memstore gives an in-memory OSD instead (faster to
# create, loses everything when the OSD dies). Memory is kept small (osd_memory_target, caches).
# Idempotent: `start` on a running cluster and `stop` on a missing one do nothing. Quiet on success.
set -euo pipefail

usage() { echo "usage: $0 start|stop|env|restart-osd|resume-osd|restart-rgw|full|unfull DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
cmd=$1
DIR=$2
MARK="# made by safepoint scripts/ceph-cluster.sh"
START_TIMEOUT=${CEPH_START_TIMEOUT:-120}
OSD_STORE=${CEPH_OSD_STORE:-bluestore}

die() {
  # The daemons go first: a reader that closes stderr early must not leave them running.
  [ "$cmd" = start ] && kill_daemons
  echo "ceph-cluster: $*" >&2
  if [ -d "$DIR/log" ]; then
    for f in "$DIR"/log/*.log; do
      [ -f "$f" ] || continue
      echo "---- tail of $f" >&2
      tail -n 25 "$f" >&2
    done
  fi
  exit 1
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Runs a ceph CLI command against this cluster with a bounded time.
cephc() { timeout 30 ceph -c "$DIR/ceph.conf" --connect-timeout 15 "$@"; }

# True when at least ${1:-4} daemons have pid files under DIR/run and all of them are alive.
all_running() {
  local n=0 f
  for f in "$DIR"/run/*.pid; do
    [ -f "$f" ] || continue
    n=$((n + 1))
    kill -0 "$(cat "$f")" 2>/dev/null || return 1
  done
  [ "$n" -ge "${1:-4}" ]
}

kill_daemons() {
  local f pid pids=()
  for f in "$DIR"/run/*.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  local i
  for i in $(seq 1 50); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" -eq 0 ] && break
    sleep 0.2
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  return 0
}

# DIR is ours to remove when it is empty or holds a cluster this script made (never rm -rf a
# directory someone passed by mistake).
check_ours() {
  [ -d "$DIR" ] || return 0
  [ -z "$(ls -A "$DIR")" ] && return 0
  grep -qx "$MARK" "$DIR/ceph.conf" 2>/dev/null && return 0
  echo "ceph-cluster: $DIR is not empty and holds no cluster of this script; not touching it" >&2
  exit 1
}

do_stop() {
  [ -d "$DIR" ] || return 0
  check_ours
  kill_daemons
  rm -rf "$DIR"
}

do_env() {
  [ -f "$DIR/ceph.conf" ] && [ -f "$DIR/s3.env" ] || { echo "ceph-cluster: no cluster in $DIR" >&2; exit 1; }
  echo "export CEPH_CONF=$DIR/ceph.conf"
  echo "export CEPH_ARGS='--id admin'"
  cat "$DIR/s3.env"
}

# Waits up to START_TIMEOUT for `$@` to succeed; dies naming WHAT otherwise.
wait_for() {
  local what=$1; shift
  local deadline=$((SECONDS + START_TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    all_running 1 || die "a daemon exited while waiting for $what"
    [ $SECONDS -lt $deadline ] || die "timed out after ${START_TIMEOUT}s waiting for $what"
    sleep 0.5
  done
}

pgs_active() {
  local out
  out=$(cephc pg stat 2>/dev/null) || return 1
  # e.g. "41 pgs: 41 active+clean; ..." ; every PG active+clean
  echo "$out" | grep -Eq '^([0-9]+) pgs: \1 active\+clean;'
}

osd_active() {
  timeout 10 ceph --admin-daemon "$DIR/run/osd.0.asok" status 2>/dev/null | grep -q '"state": "active"'
}

health_ok() { [ "$(cephc health 2>/dev/null)" = HEALTH_OK ]; }

rgw_up() { curl -sf -o /dev/null "http://127.0.0.1:$(cat "$DIR/rgw.port")/"; }

do_start() {
  if [ -f "$DIR/started" ] && all_running; then return 0; fi
  # A half-started or dead cluster in DIR: clear it and start over.
  do_stop
  command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null && command -v ceph-mgr >/dev/null \
    && command -v radosgw >/dev/null && command -v ceph >/dev/null \
    || { echo "ceph-cluster: Ceph is not installed (apt-get install ceph-mon ceph-osd ceph-mgr radosgw ceph-common)" >&2; exit 1; }
  mkdir -p "$DIR"
  DIR=$(cd "$DIR" && pwd)
  # Unix socket paths (the admin sockets) are limited to 107 bytes.
  [ ${#DIR} -le 80 ] || { echo "ceph-cluster: $DIR is too long for Ceph's admin sockets (80 characters at most)" >&2; exit 1; }
  mkdir -p "$DIR/run" "$DIR/log" "$DIR/mon.a" "$DIR/mgr.x" "$DIR/osd.0" "$DIR/rgw"
  local fsid mon_port rgw_port
  fsid=$(python3 -c 'import uuid; print(uuid.uuid4())')
  mon_port=$(free_port)
  rgw_port=$(free_port)
  echo "$rgw_port" > "$DIR/rgw.port"

  cat > "$DIR/ceph.conf" <<EOF
$MARK
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:$mon_port]
public network = 127.0.0.0/8
ms bind msgr1 = false
ms bind ipv6 = false
ms mon client mode = crc
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = false
run dir = $DIR/run
pid file = $DIR/run/\$name.pid
admin socket = $DIR/run/\$name.asok
log file = $DIR/log/\$name.log
mon data = $DIR/mon.\$id
mgr data = $DIR/mgr.\$id
osd data = $DIR/osd.\$id
keyring = $DIR/keyring
log to stderr = false
err to stderr = false
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon max pg per osd = 1000
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
mgr initial modules =

[mon]
mon cluster log file = $DIR/log/cluster.log

[osd]
osd objectstore = $OSD_STORE
osd memory target = 939524096
osd memory cache min = 67108864
bluestore cache autotune = false
bluestore cache size = 134217728
bluestore block size = 21474836480
bluestore block create = true
bluestore block db create = false
bluestore block wal create = false
bluestore fsck on mkfs = false
memstore device bytes = 4294967296
osd op num shards = 1
osd op num threads per shard = 2
# A test that stops the OSD marks it down to have it re-peer (resume-osd); an OSD marked down
# more than osd_max_markdown_count (5) times in 10 minutes shuts itself down for good.
osd max markdown count = 100000

[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:$rgw_port
rgw data = $DIR/rgw
rgw dns name = localhost
rgw thread pool size = 64
EOF
  touch "$DIR/keyring"

  monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$mon_port]" "$DIR/monmap" >/dev/null \
    || die "monmaptool failed"
  ceph-mon -c "$DIR/ceph.conf" -i a --mkfs --monmap "$DIR/monmap" >"$DIR/log/mkfs-mon.out" 2>&1 \
    || die "ceph-mon --mkfs failed: $(cat "$DIR/log/mkfs-mon.out")"
  ceph-mon -c "$DIR/ceph.conf" -i a || die "ceph-mon did not start"
  wait_for "the monitor" cephc mon stat

  ceph-mgr -c "$DIR/ceph.conf" -i x || die "ceph-mgr did not start"

  local osd_uuid
  osd_uuid=$(python3 -c 'import uuid; print(uuid.uuid4())')
  local id
  id=$(cephc osd new "$osd_uuid") || die "ceph osd new failed"
  [ "$id" = 0 ] || die "expected OSD id 0, got $id"
  ceph-osd -c "$DIR/ceph.conf" -i 0 --mkfs --osd-uuid "$osd_uuid" >"$DIR/log/mkfs-osd.out" 2>&1 \
    || die "ceph-osd --mkfs failed: $(tail -n 20 "$DIR/log/mkfs-osd.out")"
  ceph-osd -c "$DIR/ceph.conf" -i 0 || die "ceph-osd did not start"

  cephc osd pool create safepoint 8 8 >/dev/null 2>&1 || die "creating pool safepoint failed"
  cephc osd pool set safepoint size 1 --yes-i-really-mean-it >/dev/null 2>&1 || die "setting pool size failed"
  cephc osd pool application enable safepoint rados >/dev/null 2>&1 || true

  radosgw -c "$DIR/ceph.conf" -n client.rgw || die "radosgw did not start"
  wait_for "radosgw on port $rgw_port" rgw_up

  local access secret
  access=$(python3 -c 'import secrets; print("SP" + secrets.token_hex(9).upper())')
  secret=$(python3 -c 'import secrets; print(secrets.token_hex(20))')
  timeout 60 radosgw-admin -c "$DIR/ceph.conf" user create --uid=safepoint --display-name=safepoint \
    --access-key="$access" --secret-key="$secret" >"$DIR/log/user.out" 2>&1 \
    || die "radosgw-admin user create failed: $(tail -n 20 "$DIR/log/user.out")"
  cat > "$DIR/s3.env" <<EOF
export AWS_ENDPOINT_URL=http://127.0.0.1:$rgw_port
export AWS_ACCESS_KEY_ID=$access
export AWS_SECRET_ACCESS_KEY=$secret
export AWS_REGION=us-east-1
EOF
  chmod 600 "$DIR/s3.env"
  # The bucket of the S3 tier's tests, through the S3 API as any client would (SigV4 by curl;
  # curl 7.88 does not add the payload hash header that RGW requires).
  curl -sS --fail-with-body -o "$DIR/log/bucket.out" --max-time 30 -X PUT \
    --aws-sigv4 "aws:amz:us-east-1:s3" --user "$access:$secret" \
    -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" "http://127.0.0.1:$rgw_port/safepoint-test" \
    2>>"$DIR/log/bucket.out" || die "creating bucket safepoint-test failed: $(cat "$DIR/log/bucket.out")"

  wait_for "every PG active+clean" pgs_active
  wait_for "HEALTH_OK" health_ok
  touch "$DIR/started"
}

# Waits (bounded) until the daemon whose pid file is DIR/run/$1.pid is gone, then removes the
# pid file; exits naming $2 if it still runs. A test killed it: a killed daemon may linger as a
# zombie where nothing reaps orphans, and that one is gone too.
wait_gone() {
  local pid i
  pid=$(cat "$DIR/run/$1.pid" 2>/dev/null || true)
  for i in $(seq 1 100); do
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null \
      && [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ] || break
    sleep 0.2
  done
  [ "$i" -lt 100 ] || { echo "ceph-cluster: $2 (pid $pid) is still running" >&2; exit 1; }
  rm -f "$DIR/run/$1.pid"
}

do_restart_osd() {
  [ -f "$DIR/started" ] || { echo "ceph-cluster: no cluster in $DIR" >&2; exit 1; }
  wait_gone osd.0 osd.0
  ceph-osd -c "$DIR/ceph.conf" -i 0 || die "ceph-osd did not start again"
  # Booted (the monitor has it up at its new address) before the PGs' state means anything.
  wait_for "osd.0 to boot" osd_active
  wait_for "every PG active+clean after the OSD restart" pgs_active
}

do_resume_osd() {
  [ -f "$DIR/started" ] || { echo "ceph-cluster: no cluster in $DIR" >&2; exit 1; }
  local pid
  pid=$(cat "$DIR/run/osd.0.pid")
  kill -CONT "$pid" || die "osd.0 (pid $pid) is not running"
  cephc osd down 0 >/dev/null 2>&1 || die "ceph osd down 0 failed"
  wait_for "osd.0 to boot again" osd_active
  wait_for "every PG active+clean after osd.0 re-peered" pgs_active
}

do_restart_rgw() {
  [ -f "$DIR/started" ] || { echo "ceph-cluster: no cluster in $DIR" >&2; exit 1; }
  wait_gone client.rgw radosgw
  radosgw -c "$DIR/ceph.conf" -n client.rgw || die "radosgw did not start again"
  wait_for "radosgw on port $(cat "$DIR/rgw.port") again" rgw_up
}

osd_full() { cephc health 2>/dev/null | grep -Eq '(^|[^a-z])[0-9]+ full osd'; }

# Sets the OSDs' $1 ratio (nearfull, backfillfull or full) to $2.
set_ratio() { cephc osd "set-$1-ratio" "$2" >/dev/null 2>&1 || die "ceph osd set-$1-ratio failed"; }

# The ratios keep their order (nearfull < backfillfull < full) at every moment, as the monitor
# wants: lowered from the bottom, raised from the top.
do_full() {
  [ -f "$DIR/started" ] || { echo "ceph-cluster: no cluster in $DIR" >&2; exit 1; }
  set_ratio nearfull 0.0001
  set_ratio backfillfull 0.0002
  set_ratio full 0.0003
  wait_for "osd.0 to be flagged full" osd_full
}

do_unfull() {
  [ -f "$DIR/started" ] || { echo "ceph-cluster: no cluster in $DIR" >&2; exit 1; }
  set_ratio full 0.95
  set_ratio backfillfull 0.90
  set_ratio nearfull 0.85
  wait_for "HEALTH_OK after the full ratio was put back" health_ok
}

case "$cmd" in
  start) do_start ;;
  restart-osd) do_restart_osd ;;
  resume-osd) do_resume_osd ;;
  restart-rgw) do_restart_rgw ;;
  full) do_full ;;
  unfull) do_unfull ;;
  stop) do_stop ;;
  env) do_env ;;
  *) usage ;;
esac
