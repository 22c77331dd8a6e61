#!/usr/bin/python3
"""The cluster's API server on this machine's loopback: listens on
LISTEN-HOST:LISTEN-PORT in the network namespace it starts in, then moves
into NETNS (a file under /run/netns) and relays each connection to
TARGET-HOST:TARGET-PORT there. The listening socket stays in the namespace
it was made in, so nothing of the machine's own network is configured.

usage: forward.py LISTEN-HOST LISTEN-PORT NETNS TARGET-HOST TARGET-PORT
"""
import ctypes
import os
import socket
import sys
import threading

CLONE_NEWNET = 0x40000000


def enter(netns):
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(netns, os.O_RDONLY)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        sys.exit("forward.py: setns %s: %s" % (netns, os.strerror(err)))
    os.close(fd)


def pump(source, sink):
    try:
        while True:
            data = source.recv(65536)
            if not data:
                break
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def relay(client, target):
    try:
        upstream = socket.create_connection(target, timeout=10)
        upstream.settimeout(None)
    except OSError:
        client.close()
        return
    back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    back.start()
    pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def main():
    listen_host, listen_port, netns, target_host, target_port = sys.argv[1:6]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((listen_host, int(listen_port)))
    listener.listen(128)
    # One thread so far: setns moves the whole process.
    enter(netns)
    target = (target_host, int(target_port))
    while True:
        client, _ = listener.accept()
        threading.Thread(target=relay, args=(client, target), daemon=True).start()


if __name__ == "__main__":
    main()
