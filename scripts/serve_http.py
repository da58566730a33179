"""What the end-to-end bench scripts share: start `wavefront serve` on one model with HTTP on
loopback, and send it one OpenAI completions request."""

import json
import re
import subprocess
import time
import urllib.request


def start(binary, model, flags):
    """`wavefront serve --model MODEL FLAGS...` on free ports; returns the process and the HTTP
    address it reports."""
    p = subprocess.Popen(
        [binary, "serve", "--model", model, "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
         "--log-filter", "warn", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in p.stdout:
        m = re.match(r"wavefront router http listening on (\S+)", line)
        if m:
            return p, m.group(1)
    raise RuntimeError("serve did not report its HTTP address")


def ask(addr, body):
    """POSTs `body` to /v1/completions; returns the wall time in seconds and the response."""
    req = urllib.request.Request(f"http://{addr}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    return time.perf_counter() - t, out
