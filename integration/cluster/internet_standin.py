#!/usr/bin/python3
"""A stand-in for the internet the e2e *runner* is asked to reach.

The [sig-network] Networking specs of 1.20 begin with a pre-test assertion
in the test process itself (not in the cluster): `http.Get("http://google.com")`
must answer 200 ("not really a test of kubernetes in any way", says its
comment). This machine has no internet. e2e.sh points the runner's
HTTP_PROXY (plain http only: the API server is https and goes direct; the
cluster's own ranges are in NO_PROXY) at this server, which answers 200 to
a GET of http://google.com and 502 to anything else. Nothing the cluster's
pods do goes through it.

usage: internet_standin.py PORT-FILE   (binds 127.0.0.1 on a free port,
                                        writes the port to PORT-FILE)
"""
import http.server
import os
import sys


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        # Only the one check: anything else the runner fetched through the
        # proxy would get an answer the cluster did not give.
        host = (self.headers.get("Host") or "").split(":")[0]
        if host != "google.com":
            self.send_error(502, "the stand-in answers only http://google.com")
            return
        body = b"stand-in for the e2e runner's internet check\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def main():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))

    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    server.serve_forever()


if __name__ == "__main__":
    main()
