#!/usr/bin/env bash
# Runs a command with a throwaway Ceph cluster (scripts/ceph-cluster.sh) for the RADOS and S3
# tier tests, and always stops the cluster afterwards:
#
#   scripts/with-ceph.sh CMD [ARGS...]
#
# The command sees the environment of `ceph-cluster.sh env` (CEPH_CONF, CEPH_ARGS, AWS_*) plus
#   SAFEPOINT_TEST_RADOS_URI=rados://safepoint/<unique>   base URI of the rados:// tests
#   SAFEPOINT_TEST_S3_URI=s3://safepoint-test/<unique>    base URI of the s3:// tests
#   SAFEPOINT_TEST_CEPH_DIR=<dir>                         the cluster's directory (run/*.pid for
#                                                         the tests that kill or stop a daemon)
# Where the cluster cannot run (not root, Ceph not installed) or does not start, CMD runs
# without it and this script says why on stderr: the tests that need Ceph then skip.
# Exits with CMD's status. SAFEPOINT_CEPH_DIR chooses the cluster's directory (default: a fresh
# one under /var/tmp; the path must stay short for Ceph's admin sockets).
set -uo pipefail

[ $# -ge 1 ] || { echo "usage: $0 CMD [ARGS...]" >&2; exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)

why=""
if [ "$(id -u)" -ne 0 ]; then
  why="not root (the Ceph daemons need root)"
else
  for t in ceph-mon ceph-mgr ceph-osd radosgw radosgw-admin ceph curl; do
    command -v "$t" >/dev/null || { why="$t is not installed (scripts/setup.sh installs Ceph)"; break; }
  done
fi
if [ -n "$why" ]; then
  echo "with-ceph: running without a Ceph cluster: $why; the RADOS and S3 tests will skip" >&2
  exec "$@"
fi

DIR=${SAFEPOINT_CEPH_DIR:-$(mktemp -d /var/tmp/sp-ceph-XXXXXX)}
cleanup() { "$HERE/ceph-cluster.sh" stop "$DIR" || true; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

t0=$SECONDS
if ! "$HERE/ceph-cluster.sh" start "$DIR"; then
  echo "with-ceph: the Ceph cluster did not start (see above); running without it: the RADOS and S3 tests will skip" >&2
  cleanup
  trap - EXIT
  exec "$@"
fi
eval "$("$HERE/ceph-cluster.sh" env "$DIR")"
run=$(date -u +%Y%m%dT%H%M%S)-$$
export SAFEPOINT_TEST_RADOS_URI="rados://safepoint/test-$run"
export SAFEPOINT_TEST_S3_URI="s3://safepoint-test/test-$run"
export SAFEPOINT_TEST_CEPH_DIR="$DIR"
echo "with-ceph: Ceph cluster in $DIR up in $((SECONDS - t0)) s; RADOS tests under $SAFEPOINT_TEST_RADOS_URI, S3 tests under $SAFEPOINT_TEST_S3_URI" >&2
"$@"
