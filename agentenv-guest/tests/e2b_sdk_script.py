"""Drives a running agent on localhost:49983 with the official E2B Python SDK
in debug mode (E2B_DEBUG=true). Each check prints one line; any failure raises
and exits non-zero. Run by tests/e2b_sdk.rs."""

import asyncio
import os
import sys
import threading
import time

from e2b import AsyncSandbox, CommandExitException, PtySize, Sandbox, TimeoutException
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

BASE = sys.argv[1]
CHECKS = 0


def check(name, cond, detail=""):
    global CHECKS
    if not cond:
        raise AssertionError(f"{name} failed: {detail}")
    CHECKS += 1
    print(f"ok {name}", flush=True)


def poll(what, fn, timeout=10.0):
    """Polls fn until it returns a truthy value (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def sync_part():
    sbx = Sandbox.create()

    # commands.run: stdout, stderr, exit code
    r = sbx.commands.run("echo hi; echo err >&2")
    check("run stdout", r.stdout == "hi\n", repr(r.stdout))
    check("run stderr kept apart", r.stderr == "err\n", repr(r.stderr))
    check("run exit code 0", r.exit_code == 0, r.exit_code)
    try:
        sbx.commands.run("echo out; exit 3")
        raise AssertionError("exit 3 did not raise")
    except CommandExitException as e:
        check("run exit code 3", e.exit_code == 3, e.exit_code)
        check("run stdout on failure", e.stdout == "out\n", repr(e.stdout))

    # envs, cwd
    r = sbx.commands.run("echo $FOO-$BAR", envs={"FOO": "foo", "BAR": "bar"})
    check("run envs", r.stdout == "foo-bar\n", repr(r.stdout))
    os.makedirs(f"{BASE}/cwd", exist_ok=True)
    r = sbx.commands.run("pwd", cwd=f"{BASE}/cwd")
    check("run cwd", r.stdout.strip() == f"{BASE}/cwd", repr(r.stdout))

    # timeout
    t0 = time.monotonic()
    try:
        sbx.commands.run("sleep 30", timeout=1)
        raise AssertionError("timeout did not raise")
    except TimeoutException:
        check("run timeout raises", time.monotonic() - t0 < 15, time.monotonic() - t0)

    # background + list + kill
    h = sbx.commands.run("sleep 60", background=True)
    pids = [p.pid for p in sbx.commands.list()]
    check("list shows background process", h.pid in pids, pids)
    listed = [p for p in sbx.commands.list() if p.pid == h.pid][0]
    check("list shows cmd", listed.cmd == "/bin/bash", listed.cmd)
    check("kill background", h.kill() is True)
    try:
        h.wait()
        raise AssertionError("killed command reported success")
    except CommandExitException as e:
        check("killed exit code", e.exit_code == -1, e.exit_code)
    poll("killed process to leave the list", lambda: h.pid not in [p.pid for p in sbx.commands.list()])
    check("kill unknown pid is False", sbx.commands.kill(h.pid) is False)

    # stdin
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "from stdin\n")
    sbx.commands.close_stdin(h.pid)
    r = h.wait()
    check("stdin round trip", r.stdout == "from stdin\n", repr(r.stdout))

    # files
    info = sbx.files.write(f"{BASE}/f/a.txt", "abc")
    check("write returns info", info.path == f"{BASE}/f/a.txt" and info.name == "a.txt", info)
    check("read text", sbx.files.read(f"{BASE}/f/a.txt") == "abc")
    blob = bytes(range(256)) * 1000
    sbx.files.write(f"{BASE}/f/blob.bin", blob)
    check("read bytes", sbx.files.read(f"{BASE}/f/blob.bin", format="bytes") == blob)
    entries = sbx.files.list(f"{BASE}/f")
    names = sorted(e.name for e in entries)
    check("list entries", names == ["a.txt", "blob.bin"], names)
    a = [e for e in entries if e.name == "a.txt"][0]
    check("entry size", a.size == 3, a.size)
    check("entry permissions", a.permissions.startswith("-rw"), a.permissions)
    check("entry owner", a.owner == "root", a.owner)
    check("entry modified time", a.modified_time is not None and a.modified_time.year >= 2024, a.modified_time)
    check("make_dir new", sbx.files.make_dir(f"{BASE}/f/d") is True)
    check("make_dir existing", sbx.files.make_dir(f"{BASE}/f/d") is False)
    d = [e for e in sbx.files.list(f"{BASE}/f") if e.name == "d"][0]
    check("dir type", d.type.value == "dir", d.type)
    deep = sbx.files.list(f"{BASE}", depth=3)
    check("list depth", f"{BASE}/f/d" in [e.path for e in deep], [e.path for e in deep])
    moved = sbx.files.rename(f"{BASE}/f/a.txt", f"{BASE}/f/b.txt")
    check("rename", moved.path == f"{BASE}/f/b.txt", moved)
    check("exists after rename", sbx.files.exists(f"{BASE}/f/b.txt") and not sbx.files.exists(f"{BASE}/f/a.txt"))
    sbx.files.remove(f"{BASE}/f/b.txt")
    check("remove", not sbx.files.exists(f"{BASE}/f/b.txt"))
    check("get_info", sbx.files.get_info(f"{BASE}/f/blob.bin").size == len(blob))
    sbx.files.write(f"{BASE}/f/meta.txt", "m", metadata={"owner": "team-a"})
    meta = sbx.files.get_info(f"{BASE}/f/meta.txt").metadata
    check("upload metadata kept as xattrs", meta == {"owner": "team-a"}, meta)
    infos = sbx.files.write_files(
        [{"path": f"{BASE}/multi/one.txt", "data": "1"}, {"path": f"{BASE}/multi/two.txt", "data": b"22"}]
    )
    check("write_files multipart", sorted(i.name for i in infos) == ["one.txt", "two.txt"], infos)
    check("write_files content", sbx.files.read(f"{BASE}/multi/two.txt") == "22")
    sbx.files.write(f"{BASE}/f/gz.txt", "zipped" * 1000, gzip=True)
    check("gzip upload", sbx.files.read(f"{BASE}/f/gz.txt") == "zipped" * 1000)

    # watch_dir (sync SDK: CreateWatcher / GetWatcherEvents / RemoveWatcher)
    os.makedirs(f"{BASE}/w", exist_ok=True)
    wh = sbx.files.watch_dir(f"{BASE}/w")
    sbx.files.write(f"{BASE}/w/new.txt", "x")
    events = []

    def got():
        events.extend(wh.get_new_events())
        return any(e.name == "new.txt" and e.type == FilesystemEventType.CREATE for e in events)

    poll("watch create event", got)
    check("watch_dir create event", True)
    sbx.files.remove(f"{BASE}/w/new.txt")

    def got_remove():
        events.extend(wh.get_new_events())
        return any(e.name == "new.txt" and e.type == FilesystemEventType.REMOVE for e in events)

    poll("watch remove event", got_remove)
    check("watch_dir remove event", True)
    wh.stop()

    # PTY: create, send input, resize, read output
    out = bytearray()
    lock = threading.Lock()
    pty = sbx.pty.create(PtySize(rows=24, cols=80))

    def reader():
        try:
            for _, _, chunk in pty:
                if chunk is not None:
                    with lock:
                        out.extend(chunk)
        except Exception:
            pass

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    sbx.pty.send_stdin(pty.pid, b"stty size; echo marker-$((40+2))\n")
    poll("pty output", lambda: b"marker-42" in bytes(out))
    check("pty initial size", b"24 80" in bytes(out), bytes(out)[-300:])
    sbx.pty.resize(pty.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(pty.pid, b"stty size\n")
    poll("pty resized output", lambda: b"30 100" in bytes(out))
    check("pty resize", True)
    sbx.pty.send_stdin(pty.pid, b"exit\n")
    th.join(timeout=10)
    check("pty exit ends stream", not th.is_alive())


async def async_part():
    sbx = await AsyncSandbox.create()
    r = await sbx.commands.run("echo async")
    check("async run", r.stdout == "async\n", repr(r.stdout))

    # WatchDir streaming
    os.makedirs(f"{BASE}/aw", exist_ok=True)
    seen = []
    done = asyncio.Event()

    def on_event(e):
        seen.append(e)
        if e.name == "s.txt" and e.type == FilesystemEventType.CREATE:
            done.set()

    wh = await sbx.files.watch_dir(f"{BASE}/aw", on_event=on_event, recursive=True, include_entry=True)
    await sbx.files.write(f"{BASE}/aw/s.txt", "1")
    await asyncio.wait_for(done.wait(), 10)
    check("async watch_dir stream event", True)
    ev = [e for e in seen if e.name == "s.txt"][0]
    check("watch event carries entry", ev.entry is not None and ev.entry.path == f"{BASE}/aw/s.txt", ev)
    await wh.stop()

    # StreamInput (client streaming) via the async SDK
    h = await sbx.commands.run("cat", background=True, stdin=True)

    ih = sbx.commands.stream_input(h.pid)
    for part in [b"a", b"b", b"c\n"]:
        await ih.send(part)
    await ih.close()
    await sbx.commands.close_stdin(h.pid)
    r = await h.wait()
    check("async stream_input", r.stdout == "abc\n", repr(r.stdout))


def signed_urls():
    """Once /init sets a token, a URL signed the SDK's way works without the
    X-Access-Token header, and an unsigned one does not."""
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    from e2b.sandbox.signature import get_signature

    token = "tok-" + str(os.getpid())
    req = urllib.request.Request(
        "http://localhost:49983/init",
        data=json.dumps({"accessToken": token}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    urllib.request.urlopen(req).read()
    path = f"{BASE}/signed.txt"
    with open(path, "w") as f:
        f.write("signed content")
    sig = get_signature(path, "read", None, token, 60)
    q = urllib.parse.urlencode(
        {"path": path, "signature": sig["signature"], "signature_expiration": sig["expiration"]},
        quote_via=urllib.parse.quote,
    )
    body = urllib.request.urlopen(f"http://localhost:49983/files?{q}").read()
    check("signed download URL", body == b"signed content", body)
    try:
        urllib.request.urlopen(f"http://localhost:49983/files?path={urllib.parse.quote(path)}")
        raise AssertionError("unsigned download succeeded")
    except urllib.error.HTTPError as e:
        check("unsigned download rejected", e.code == 401, e.code)


sync_part()
asyncio.run(async_part())
signed_urls()
print(f"{CHECKS} checks passed", flush=True)
