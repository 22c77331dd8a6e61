#!/usr/bin/env python3
"""Traffic probe for the istio-redirect tests (stdlib only).

listen RECORD PORT...   TCP listeners on 0.0.0.0 and :: for each PORT, UDP
                        ones for each udp:PORT (and a UDP one on 15053);
                        every connection is recorded in RECORD as
                        "tcp <port> <original dst>", every datagram as
                        "udp <port>".
connect HOST PORT [SRC] One TCP connection (from address SRC); exit 0 if it
                        was accepted.
udp HOST PORT [SPORT]   One UDP datagram (from source port SPORT: one flow
                        as conntrack sees it).
echo PORT [push]        A TCP echo server on 0.0.0.0 and :: that keeps every
                        connection open (and with push, also sends "tick"
                        on each every 100 ms); prints "ready".
PROBE_MARK=0x539 (env) connect and udp send with that SO_MARK, as ztunnel's
                        own sockets do.
hold HOST PORT          One TCP connection kept open: for each line on stdin
                        it drops what came meanwhile, sends the line and
                        prints "echoed" when anything comes back within a
                        second, "lost" when not.
"""
import os
import socket
import struct
import sys
import threading

SO_ORIGINAL_DST = 80
# Envoy's listeners are transparent: TPROXY only hands connections to those.
IP_TRANSPARENT = 19
IPV6_TRANSPARENT = 75


def marked(s):
    """The socket with PROBE_MARK as its SO_MARK, when set."""
    mark = os.environ.get("PROBE_MARK")
    if mark:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, int(mark, 0))
    return s


def original_dst(conn, family):
    if family == socket.AF_INET:
        raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port, = struct.unpack_from("!H", raw, 2)
        return "%s:%d" % (socket.inet_ntop(socket.AF_INET, raw[4:8]), port)
    raw = conn.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)
    port, = struct.unpack_from("!H", raw, 2)
    return "[%s]:%d" % (socket.inet_ntop(socket.AF_INET6, raw[8:24]), port)


def record(path, line):
    with open(path, "a") as f:
        f.write(line + "\n")


def bind_tcp(family, port):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.setsockopt(socket.IPPROTO_IPV6, IPV6_TRANSPARENT, 1)
    else:
        s.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
    s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    s.listen(16)
    return s


def serve_tcp(path, s, family, port):
    while True:
        conn, _ = s.accept()
        try:
            dst = original_dst(conn, family)
        except OSError:
            # No conntrack in this namespace: nothing was translated.
            local = conn.getsockname()
            dst = ("%s:%d" if family == socket.AF_INET else "[%s]:%d") % local[:2]
        record(path, "tcp %d %s" % (port, dst))
        conn.close()


def echo_back(conn):
    while True:
        data = conn.recv(512)
        if not data:
            break
        conn.sendall(data)


def push_ticks(conn):
    try:
        while True:
            conn.sendall(b"tick\n")
            threading.Event().wait(0.1)
    except OSError:
        pass


def serve_echo(s, push):
    while True:
        conn, _ = s.accept()
        threading.Thread(target=echo_back, args=(conn,), daemon=True).start()
        if push:
            threading.Thread(target=push_ticks, args=(conn,), daemon=True).start()


def drain(s):
    s.setblocking(False)
    try:
        while s.recv(4096):
            pass
    except OSError:
        pass
    s.settimeout(1)


def serve_udp(path, s, port):
    while True:
        s.recvfrom(512)
        record(path, "udp %d" % port)


def main():
    mode = sys.argv[1]
    if mode == "listen":
        path = sys.argv[2]
        ports = [int(p) for p in sys.argv[3:] if not p.startswith("udp:")]
        for port in [int(p[4:]) for p in sys.argv[3:] if p.startswith("udp:")]:
            for family, any_address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
                u = socket.socket(family, socket.SOCK_DGRAM)
                if family == socket.AF_INET6:
                    u.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                u.bind((any_address, port))
                threading.Thread(target=serve_udp, args=(path, u, port), daemon=True).start()
        for port in ports:
            for family in (socket.AF_INET, socket.AF_INET6):
                s = bind_tcp(family, port)
                threading.Thread(target=serve_tcp, args=(path, s, family, port), daemon=True).start()
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.bind(("0.0.0.0", 15053))
        threading.Thread(target=serve_udp, args=(path, u, 15053), daemon=True).start()
        record(path, "ready")
        threading.Event().wait()
    elif mode == "connect":
        host, port = sys.argv[2], int(sys.argv[3])
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = marked(socket.socket(family, socket.SOCK_STREAM))
        s.settimeout(2)
        try:
            if len(sys.argv) > 4:
                s.bind((sys.argv[4], 0))
            # getaddrinfo reads a zone ("fe80::1%eth0") into the scope id.
            s.connect(socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4])
        except OSError as e:
            print("connect failed: %s" % e)
            sys.exit(1)
        s.close()
    elif mode == "echo":
        port = int(sys.argv[2])
        push = len(sys.argv) > 3 and sys.argv[3] == "push"
        for family in (socket.AF_INET, socket.AF_INET6):
            s = bind_tcp(family, port)
            threading.Thread(target=serve_echo, args=(s, push), daemon=True).start()
        print("ready", flush=True)
        threading.Event().wait()
    elif mode == "hold":
        host, port = sys.argv[2], int(sys.argv[3])
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect((host, port))
        except OSError as e:
            print("connect failed: %s" % e, flush=True)
            sys.exit(1)
        print("connected", flush=True)
        s.settimeout(1)
        for line in sys.stdin:
            try:
                drain(s)
                s.sendall(line.encode())
                got = s.recv(512)
                print("echoed" if got else "lost", flush=True)
            except OSError:
                print("lost", flush=True)
    elif mode == "udp":
        host, port = sys.argv[2], int(sys.argv[3])
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = marked(socket.socket(family, socket.SOCK_DGRAM))
        if len(sys.argv) > 4:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", int(sys.argv[4])))
        s.sendto(b"probe", (host, port))


if __name__ == "__main__":
    main()
