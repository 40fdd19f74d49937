"""The official E2B Python SDK against an AgentENV cluster, for `node_bench`: warm
`commands.run("true")` through the gateway (`E2B_SANDBOX_URL`) and straight to the node
that holds the sandbox, Python's own `subprocess.run` in the same process as
references, and create -> first command at concurrency 1 and 8. `NODE_URLS` lists the
nodes (comma-separated); the one that answers for the sandbox is used.

Arguments: `EXECS CREATES TEMPLATE_ROOT`. TEMPLATE_ROOT is the template's root file
system on this host: the command the SDK sends (`/bin/bash -l -c true`) is also run
there with `chroot`, and started by a shell inside that root, so the shell's own
start-up has a reference too. Prints one JSON
object: lists of milliseconds per series.
"""

import json
import os
import subprocess
import sys
import threading
import time

from e2b import Sandbox

EXECS = int(sys.argv[1])
CREATES = int(sys.argv[2])
TEMPLATE_ROOT = sys.argv[3]
WARMUP = 20


def ms(t0):
    return (time.perf_counter() - t0) * 1000.0


def timed(n, f):
    for _ in range(min(WARMUP, n)):
        f()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        out.append(ms(t0))
    return out


def run_true(sbx):
    r = sbx.commands.run("true")
    assert r.exit_code == 0, r


def create_and_run():
    t0 = time.perf_counter()
    sbx = Sandbox.create("base", timeout=120)
    run_true(sbx)
    took = ms(t0)
    sbx.kill()
    return took


def creates(n, concurrency):
    out = []
    lock = threading.Lock()
    left = [n]

    def worker():
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            took = create_and_run()
            with lock:
                out.append(took)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, ms(t0)


result = {}
sbx = Sandbox.create("base", timeout=600)
result["exec_gateway"] = timed(EXECS, lambda: run_true(sbx))
direct = None
for url in os.environ["NODE_URLS"].split(","):
    candidate = Sandbox.connect(sbx.sandbox_id, sandbox_url=url)
    try:
        run_true(candidate)
    except Exception:
        continue
    direct = candidate
    break
assert direct is not None, "no node answered for the sandbox"
result["exec_node"] = timed(EXECS, lambda: run_true(direct))
result["subprocess_true"] = timed(EXECS, lambda: subprocess.run(["true"], check=True))
result["subprocess_bash_l"] = timed(
    EXECS,
    lambda: subprocess.run(
        ["chroot", TEMPLATE_ROOT, "/bin/bash", "-l", "-c", "true"], check=True
    ),
)
# The same shell started by a shell inside the root (fork + exec + wait, as the agent
# does), without `chroot`'s own exec in every sample: each line is one start's
# EPOCHREALTIME before and after.
loop = subprocess.run(
    [
        "chroot",
        TEMPLATE_ROOT,
        "/usr/bin/env",
        "-i",
        "PATH=/usr/bin:/bin",
        "HOME=/root",
        "/bin/bash",
        "-c",
        "for i in $(seq %d); do s=$EPOCHREALTIME; /bin/bash -l -c true; "
        "echo $s $EPOCHREALTIME; done" % (EXECS + WARMUP),
    ],
    check=True,
    capture_output=True,
    text=True,
)
result["root_bash_l"] = [
    (float(b) - float(a)) * 1000.0
    for a, b in (line.split() for line in loop.stdout.split("\n")[WARMUP:] if line)
]
sbx.kill()

create_and_run()  # warm-up
result["create_c1"], _ = creates(CREATES, 1)
result["create_c8"], result["create_c8_wall"] = creates(CREATES, 8)
print(json.dumps(result))
