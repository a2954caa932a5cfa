"""A fault-injecting HTTP/1.1 proxy in front of a real S3 gateway (the tests' radosgw), for the
S3 fault tests (tests/python/test_s3_faults.py).

It is no mock of S3: every request it does not fault is forwarded, byte for byte, to the real
gateway on a connection of its own (one upstream connection per client connection), and the
gateway's answer is relayed back. What it adds (a `match` is a dict of criteria, see `matches`):

- `slow_down(count, match)`: the next `count` matching requests are answered, without being
  forwarded, `503 Slow Down` with S3's XML error body (`<Code>SlowDown</Code>`), as S3 and
  radosgw's rate limits answer; count=None answers every matching request so until `clear()`.
- `stall(match, count, after_bytes)`: the next `count` matching requests make no progress: with
  after_bytes=None the request is read and neither forwarded nor answered; otherwise it is
  forwarded and only the first `after_bytes` bytes of the answer's body are relayed. The
  connection is then held, silent, until the client closes it (or `clear()` / `close()`).
- `on_answer(match, pid, sig)`: sends `sig` to `pid` (SIGSTOP to the gateway) when the gateway's
  answer to the next matching request arrives, before it is relayed: a stop at a known point of
  an upload (after its n-th part) or a download.
- a record of every request (`requests`): its connection, method, key, query, Range, and what
  the proxy did (forwarded with the gateway's status, answered 503, stalled), and whether the
  client closed a stalled connection: what the tests count (UploadPart requests per part number,
  the connection a retry came on).

It runs in a process of its own (`FaultProxy` starts it and talks to it over a control socket):
the tests' process calls into safepoint's core, which may hold Python's GIL while its requests
wait, so a proxy thread in that process could not answer them. It speaks what the s3:// backend
sends: requests with a Content-Length body (no chunked request bodies, no 100-continue), answers
with a Content-Length, chunked, or to-EOF body.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import Counter
from typing import Callable, Optional

SLOW_DOWN_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    "<Message>Please reduce your request rate.</Message>"
    "<Resource>{resource}</Resource><RequestId>sp-proxy-{n}</RequestId></Error>"
)

# Criteria of a match (all given must hold): "method"; "part": a part number, or True for any
# UploadPart; "path_contains" / "path_endswith" (the decoded "/bucket/key"); "ranged": a Range
# header or none; "range": that Range header.
UPLOAD_PART = {"part": True}
IMAGE_GET = {"method": "GET", "ranged": True, "path_endswith": ".img"}


@dataclasses.dataclass
class Request:
    id: int  # 0, 1, ... in the order the requests came
    conn: int  # the client connection it came on (1, 2, ... in the order they were accepted)
    method: str
    path: str  # "/bucket/key" (decoded)
    query: dict
    range: str = ""  # its Range header
    action: str = ""  # "forwarded", "slowdown", "stalled"; "" while in flight
    status: int = 0  # the status the client got (0: none, stalled)
    client_closed: bool = False  # a stalled request: the client closed its connection
    t: float = 0.0  # when it came (time.monotonic() of the proxy), for diagnostics

    @property
    def part(self) -> Optional[int]:
        """The part number of an UploadPart, else None."""
        if self.method == "PUT" and "uploadId" in self.query and "partNumber" in self.query:
            return int(self.query["partNumber"])
        return None


def matches(match: dict, r: Request) -> bool:
    if "method" in match and r.method != match["method"]:
        return False
    if "part" in match:
        if r.part is None or (match["part"] is not True and r.part != match["part"]):
            return False
    if "path_contains" in match and match["path_contains"] not in r.path:
        return False
    if "path_endswith" in match and not r.path.endswith(match["path_endswith"]):
        return False
    if "ranged" in match and bool(r.range) != match["ranged"]:
        return False
    if "range" in match and r.range != match["range"]:
        return False
    return True


# --- the tests' side -----------------------------------------------------------------------------

class FaultProxy:
    """Starts the proxy process in front of the gateway on `upstream_port` and controls it."""

    def __init__(self, upstream_port: int):
        self._proc = subprocess.Popen([sys.executable, __file__, str(upstream_port)],
                                      stdout=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline().split()
        if len(line) != 2:
            self._proc.kill()
            raise RuntimeError("the S3 fault proxy did not start")
        self.port, self._control = int(line[0]), int(line[1])

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _call(self, command: str, **args):
        with socket.create_connection(("127.0.0.1", self._control), timeout=60) as s:
            s.sendall((json.dumps({"command": command, **args}) + "\n").encode())
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(1 << 20)
                if not chunk:
                    raise RuntimeError("the S3 fault proxy closed its control connection")
                data += chunk
        return json.loads(data)

    def slow_down(self, count: Optional[int], match: Optional[dict] = None) -> None:
        self._call("rule", kind="slowdown", match=match or {}, count=count)

    def stall(self, match: dict, count: Optional[int] = 1,
              after_bytes: Optional[int] = None) -> None:
        self._call("rule", kind="stall", match=match, count=count, after_bytes=after_bytes)

    def on_answer(self, match: dict, pid: int, sig: int) -> None:
        self._call("rule", kind="signal", match=match, count=1, pid=pid, sig=int(sig))

    def clear(self) -> None:
        """No more faults; connections held by stalls are closed."""
        self._call("clear")

    @property
    def requests(self) -> list[Request]:
        return [Request(**r) for r in self._call("requests")]

    def signalled(self) -> list[list[int]]:
        """For each signal sent (on_answer), the ids of the requests answered 200 by then (the
        one whose answer triggered it included)."""
        return self._call("signalled")

    def count(self, action: str, match: Optional[dict] = None) -> int:
        return sum(1 for r in self.requests if r.action == action and matches(match or {}, r))

    def part_uploads(self, key: str) -> Counter:
        """UploadPart requests per part number to `key` ("/bucket/key") that reached the proxy,
        whatever became of them."""
        return Counter(r.part for r in self.requests if r.part is not None and r.path == key)

    def close(self) -> None:
        try:
            self._call("close")
        except (OSError, RuntimeError):
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


# --- the proxy process ---------------------------------------------------------------------------

@dataclasses.dataclass
class _Rule:
    kind: str  # "slowdown", "stall" or "signal"
    match: dict
    left: Optional[int]  # None: unlimited
    after_bytes: Optional[int] = None
    pid: int = 0
    sig: int = 0


class _Closed(Exception):
    pass


class _Server:
    def __init__(self, upstream_port: int):
        self.upstream = ("127.0.0.1", upstream_port)
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._requests: list[Request] = []
        self._signalled: list[list[int]] = []
        self._generation = 0  # bumped by clear(): ends the stalls of earlier rules
        self.closing = threading.Event()
        self._conns = itertools.count(1)
        self._sock = _listen()
        self._control = _listen()

    def serve(self) -> None:
        print(self._sock.getsockname()[1], self._control.getsockname()[1], flush=True)
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._accept_control, daemon=True).start()
        parent = os.getppid()
        while not self.closing.wait(0.5):
            if os.getppid() != parent:  # the tests' process is gone
                break

    # --- control --------------------------------------------------------------------------------

    def _accept_control(self) -> None:
        while True:
            try:
                c, _ = self._control.accept()
            except OSError:
                return
            threading.Thread(target=self._command, args=(c,), daemon=True).start()

    def _command(self, c: socket.socket) -> None:
        with c:
            data = b""
            while not data.endswith(b"\n"):
                chunk = c.recv(65536)
                if not chunk:
                    return
                data += chunk
            m = json.loads(data)
            out = None
            with self._lock:
                if m["command"] == "rule":
                    self._rules.append(_Rule(m["kind"], m["match"], m["count"],
                                             m.get("after_bytes"), m.get("pid", 0),
                                             m.get("sig", 0)))
                elif m["command"] in ("clear", "close"):
                    self._rules.clear()
                    self._generation += 1
                elif m["command"] == "requests":
                    out = [dataclasses.asdict(r) for r in self._requests]
                elif m["command"] == "signalled":
                    out = self._signalled
            c.sendall((json.dumps(out) + "\n").encode())
            if m["command"] == "close":
                self.closing.set()

    # --- serving --------------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c, next(self._conns)), daemon=True).start()

    def _fault(self, r: Request) -> tuple[Optional[_Rule], Optional[_Rule]]:
        """Records `r`; the fault rule that takes it (None: forward it) and the signal rule to
        run on its answer."""
        fault, hook = None, None
        with self._lock:
            r.id = len(self._requests)
            r.t = time.monotonic()
            self._requests.append(r)
            for rule in self._rules:
                if rule.left is not None and rule.left <= 0 or not matches(rule.match, r):
                    continue
                if rule.kind == "signal" and hook is None:
                    rule.left -= 1
                    hook = rule
                elif rule.kind != "signal" and fault is None:
                    if rule.left is not None:
                        rule.left -= 1
                    fault = rule
        return fault, hook

    def _fire(self, hook: _Rule, r: Request) -> None:
        os.kill(hook.pid, hook.sig)
        with self._lock:
            self._signalled.append([q.id for q in self._requests if q.status == 200] + [r.id])

    def _serve(self, c: socket.socket, conn: int) -> None:
        up: Optional[socket.socket] = None
        buf = bytearray()
        try:
            while True:
                head = _read_head(c, buf)
                if head is None:
                    return
                line, headers = _parse_head(head)
                method, target, _ = line.split(" ", 2)
                body = _read_exact(c, buf, int(headers.get("content-length", "0")))
                url = urllib.parse.urlsplit(target)
                r = Request(0, conn, method, urllib.parse.unquote(url.path),
                            dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True)),
                            headers.get("range", ""))
                with self._lock:
                    generation = self._generation
                rule, hook = self._fault(r)
                if rule is not None and rule.kind == "slowdown":
                    xml = SLOW_DOWN_BODY.format(resource=r.path, n=r.id).encode()
                    c.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                              b"Content-Length: %d\r\n\r\n" % len(xml) + xml)
                    r.action, r.status = "slowdown", 503
                    continue
                if rule is not None and rule.after_bytes is None:
                    r.action = "stalled"
                    r.client_closed = self._hold(c, generation)
                    return
                if up is None:
                    up = socket.create_connection(self.upstream)
                up.sendall(head + body)
                limit = rule.after_bytes if rule is not None else None
                status, keep = _relay_answer(
                    up, c, method, limit, functools.partial(self._fire, hook, r) if hook else None)
                if limit is not None:
                    r.action = "stalled"
                    r.client_closed = self._hold(c, generation)
                    return
                r.action, r.status = "forwarded", status
                if not keep or headers.get("connection", "").lower() == "close":
                    return
        except (_Closed, OSError):
            return
        finally:
            c.close()
            if up is not None:
                up.close()

    def _hold(self, c: socket.socket, generation: int) -> bool:
        """Holds a stalled connection until the client closes it (True) or the stall is
        cleared (False)."""
        while not self.closing.is_set():
            with self._lock:
                if self._generation != generation:
                    return False
            readable, _, _ = select.select([c], [], [], 0.05)
            if readable:
                try:
                    if not c.recv(65536):
                        return True
                except OSError:
                    return True
        return False


def _listen() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s


def _read_head(c: socket.socket, buf: bytearray) -> Optional[bytes]:
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = bytes(buf[:end + 4])
            del buf[:end + 4]
            return head
        chunk = c.recv(65536)
        if not chunk:
            if buf:
                raise _Closed()
            return None
        buf += chunk


def _read_exact(c: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        chunk = c.recv(max(65536, n - len(buf)))
        if not chunk:
            raise _Closed()
        buf += chunk
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _parse_head(head: bytes) -> tuple[str, dict]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for ln in lines[1:]:
        if ":" in ln:
            k, v = ln.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return lines[0], headers


def _relay_answer(up: socket.socket, c: socket.socket, method: str, limit: Optional[int],
                  hook: Optional[Callable[[], None]] = None) -> tuple[int, bool]:
    """Relays one answer from the gateway to the client (at most `limit` bytes of its body when
    given), calling `hook` once its head arrived. Returns its status and whether the connection
    may carry another request."""
    buf = bytearray()
    head = _read_head(up, buf)
    if head is None:
        raise _Closed()
    if hook is not None:
        hook()
    line, headers = _parse_head(head)
    status = int(line.split(" ", 2)[1])
    c.sendall(head)
    keep = headers.get("connection", "").lower() != "close"
    budget = [limit]

    def send(data: bytes) -> None:
        if budget[0] is not None:
            data = data[:budget[0]]
            budget[0] -= len(data)
        if data:
            c.sendall(data)

    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return status, keep
    if "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            if not buf:
                chunk = up.recv(min(left, 1 << 20))
                if not chunk:
                    raise _Closed()
                buf += chunk
            piece = bytes(buf[:left])
            del buf[:len(piece)]
            left -= len(piece)
            send(piece)
            if budget[0] == 0:
                break
        return status, keep
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            while b"\r\n" not in buf:
                chunk = up.recv(65536)
                if not chunk:
                    raise _Closed()
                buf += chunk
            size_line = bytes(buf[:buf.find(b"\r\n") + 2])
            size = int(size_line.split(b";")[0], 16)
            # The chunk, its CRLF (and the empty trailer after the last one).
            want = len(size_line) + size + 2
            while len(buf) < want:
                chunk = up.recv(65536)
                if not chunk:
                    raise _Closed()
                buf += chunk
            send(bytes(buf[:want]))
            del buf[:want]
            if size == 0 or budget[0] == 0:
                return status, keep
    # Neither: the body ends when the gateway closes.
    send(bytes(buf))
    while budget[0] != 0:
        chunk = up.recv(65536)
        if not chunk:
            break
        send(chunk)
    return status, False


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C of the tests is theirs to handle
    server = _Server(int(sys.argv[1]))
    server.serve()
    time.sleep(0.1)  # the answer to "close" is on its way
