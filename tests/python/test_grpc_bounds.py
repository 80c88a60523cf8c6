"""What one connection can make dosd buffer before any handler runs, and so
before any identity check or per-uid bound (a hostile review grew dosd by
gigabytes with partial gRPC messages held open on many HTTP/2 streams):
at most 16 streams a connection, each with gRPC's initial 64 KiB window,
which dosd does not grow (no BDP probing)."""
import socket
import struct
import time

from conftest import running_dosd

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, DATA, HEADERS = 4, 0, 1
MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE = 3, 4


def frame(typ, flags, sid, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([typ, flags]) + struct.pack(">I", sid) + \
        payload


def literal(name, value):  # HPACK: a literal header field, not indexed
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


REQUEST = b"".join(literal(k, v) for k, v in [
    (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/dos.v1.Dos/RegisterShard"),
    (b":authority", b"localhost"), (b"content-type", b"application/grpc"), (b"te", b"trailers")])


def server_settings(sock):
    """The server's first SETTINGS frame, as {identifier: value}."""
    buf = b""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
            n = int.from_bytes(buf[:3], "big")
            typ, flags, payload = buf[3], buf[4], buf[9:9 + n]
            buf = buf[9 + n:]
            if typ == SETTINGS and not flags & 1:
                return dict(struct.unpack(">HI", payload[i:i + 6])
                            for i in range(0, len(payload), 6))
        buf += sock.recv(1 << 16)
    raise AssertionError("no SETTINGS frame from dosd")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_partial_messages_on_many_streams_grow_dosd_by_little():
    with running_dosd() as (path, proc):
        before = rss_kib(proc.pid)
        conns = []
        for _ in range(8):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(path)
            s.sendall(PREFACE + frame(SETTINGS, 0, 0))
            settings = server_settings(s)
            assert settings.get(MAX_CONCURRENT_STREAMS) == 16, settings
            assert settings.get(INITIAL_WINDOW_SIZE, 65535) <= 65536, settings
            s.sendall(frame(SETTINGS, 1, 0))
            for k in range(60):  # 60 calls each announcing a 4 MiB message, 60 KB of it sent
                body = b"\x00" + struct.pack(">I", 4 << 20) + b"A" * 60000
                try:
                    s.sendall(frame(HEADERS, 4, 2 * k + 1, REQUEST) + frame(DATA, 0, 2 * k + 1, body))
                except OSError:
                    break  # dosd closed the connection (flow control): nothing more to send
            conns.append(s)
        time.sleep(1)
        grown = rss_kib(proc.pid) - before
        for s in conns:
            s.close()
        assert grown < 64 * 1024, f"dosd grew by {grown} KiB holding partial messages"
