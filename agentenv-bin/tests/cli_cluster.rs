//! `aenv` against a real local cluster: scheduler, gateway and two nodes (jail backend,
//! `base` template, static guest agent) as separate processes on loopback. The CLI is
//! pointed at the gateway, so every call (REST, Connect, `/files`) crosses gateway and
//! node. One cluster serves every step; each step says what it pins.

mod cli_common;

use std::time::Duration;

use agentenv_testkit::{Wait, eventually_blocking};
use agentenv_tests::{API_KEY, Cluster, api, skip_reason};
use cli_common::{Aenv, Tmux, sha256_file, stderr, stdout, wait_exit, wait_file, write_random};

fn wait_two_nodes(cluster: &Cluster) {
    Wait::new("the gateway to list two nodes", Duration::from_secs(30))
        .every(Duration::from_millis(100))
        .until_blocking(|| {
            let (st, v) = api(cluster.gateway, "GET", "/nodes", "");
            if st == 200 && v.as_array().map(|a| a.len()) == Some(2) {
                Ok(())
            } else {
                Err(format!("{st} {v}"))
            }
        });
}

fn listed(a: &Aenv, args: &[&str]) -> Vec<serde_json::Value> {
    let out = a.ok(args);
    let v: serde_json::Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("`aenv {args:?}` printed invalid JSON ({e}):\n{out}"));
    v.as_array().expect("a JSON array").clone()
}

fn ids(v: &[serde_json::Value]) -> Vec<String> {
    v.iter()
        .map(|s| s["sandboxID"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn aenv_commands_against_gateway_and_two_nodes() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let mut cluster = Cluster::start(2, 6);
    wait_two_nodes(&cluster);
    let gw = format!("http://{}", cluster.gateway);
    let a = Aenv::new();

    // -- auth: not authenticated, bad key, unreachable, then a good key.
    a.assert_not_authenticated(&["ls"]);
    let o = a.run_with_input(&["auth", "--url", &gw, "--api-key-stdin"], "wrong-key\n");
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "authentication failed (HTTP 401 Unauthorized); run `aenv auth` to update your API key"
        ),
        "{}",
        stderr(&o)
    );
    assert!(
        !a.credentials_path().exists(),
        "a rejected key is not saved"
    );
    let dead = format!("http://127.0.0.1:{}", agentenv_tests::free_port());
    let o = a.run_with_input(&["auth", "--url", &dead, "--api-key-stdin"], "k\n");
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains(&format!("cannot reach the server at {dead}/v2/sandboxes")),
        "{}",
        stderr(&o)
    );
    // Interactive prompts (URL line, then the key; stdin is not a terminal here).
    let o = a.run_with_input(&["auth"], &format!("{gw}\n{API_KEY}\n"));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("AENV server URL [http://localhost:8000]: "));
    let text = std::fs::read_to_string(a.credentials_path()).unwrap();
    assert!(text.contains(&format!("url = \"{gw}\"")) && text.contains(API_KEY));
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(a.credentials_path())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);

    // A stale key on a saved file: the 401 message on an ordinary command.
    let stale = Aenv::new();
    stale.ok(&["auth", "--url", &gw, "--api-key", "stale", "--no-verify"]);
    let o = stale.run(&["ls"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr(&o).trim(),
        "Error: authentication failed (HTTP 401 Unauthorized); run `aenv auth` to update your API key"
    );

    // -- start -d prints only the id; ls lists both, as JSON when piped.
    let id1 = a.ok(&[
        "start",
        "base",
        "-d",
        "--metadata",
        "suite=cli",
        "--metadata",
        "n=1",
    ]);
    let id1 = id1.trim().to_string();
    assert_eq!(id1.len(), 36, "only the id: {id1:?}");
    let id2 = a
        .ok(&["start", "base", "--detach", "--metadata", "suite=cli"])
        .trim()
        .to_string();
    let all = listed(&a, &["ls"]);
    let mut got = ids(&all);
    got.sort();
    let mut want = vec![id1.clone(), id2.clone()];
    want.sort();
    assert_eq!(got, want);
    // The server pages at limit=1 (so the next call really follows a token)...
    let (st, hdrs, body) = agentenv_tests::http(
        cluster.gateway,
        "GET",
        "/v2/sandboxes?limit=1",
        &[("x-api-key", API_KEY)],
        "",
    );
    assert_eq!(st, 200);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body)
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert!(
        hdrs.iter()
            .any(|(k, v)| k == "x-next-token" && !v.is_empty()),
        "{hdrs:?}"
    );
    // ...and `ls` fetches every page (one sandbox per request here), in the server's order.
    assert_eq!(ids(&listed(&a, &["ls", "--page-size", "1"])), ids(&all));
    assert_eq!(all[0]["state"], "running");
    assert_eq!(all[0]["templateID"], "base");
    assert_eq!(
        ids(&listed(&a, &["list", "--metadata", "n=1"])),
        vec![id1.clone()]
    );
    assert_eq!(
        ids(&listed(
            &a,
            &["ls", "--metadata", "suite=cli", "-o", "json"]
        ))
        .len(),
        2
    );
    let table = a.ok(&["ls", "--output", "table"]);
    assert!(
        table.contains("SANDBOX ID") && table.contains(&id1) && table.contains('┌'),
        "{table}"
    );

    if Tmux::available() {
        // On a terminal, `ls` prints a table without being asked.
        let cmd = format!(
            "XDG_CONFIG_HOME={} {} ls; sleep 60",
            a.config.path().display(),
            cli_common::aenv_bin()
        );
        let t = Tmux::start(&cmd, 200, 20);
        t.wait_for("a table", Duration::from_secs(10), |s| {
            s.contains("SANDBOX ID") && s.contains(&id2) && s.contains('└')
        });
    }

    // -- the CLI pointed at a node directly: its own sandboxes, exec on them.
    let direct = Aenv::new();
    let node_url = format!("http://{}", cluster.nodes[0].addr);
    direct.ok(&["auth", "--url", &node_url, "--api-key", API_KEY]);
    let own = ids(&listed(&direct, &["ls"]));
    assert_eq!(
        own.len(),
        1,
        "round robin put one sandbox on each node: {own:?}"
    );
    assert_eq!(
        direct.ok(&["exec", &own[0], "hostname"]).trim(),
        own[0],
        "the jail's hostname is its sandbox id"
    );

    // -- exec: stdout and stderr apart, exit code propagated, no shell in between.
    let o = a.run(&["exec", &id1, "sh", "-c", "echo out; echo err >&2; exit 7"]);
    assert_eq!(o.status.code(), Some(7));
    assert_eq!(stdout(&o), "out\n");
    assert_eq!(stderr(&o), "err\n");
    let o = a.run(&["exec", &id1, "echo", "$HOME", "-n"]);
    assert_eq!(stdout(&o), "$HOME -n\n", "arguments are passed verbatim");
    assert_eq!(
        a.ok(&[
            "exec",
            "-e",
            "A=1",
            "--cwd",
            "/tmp",
            &id1,
            "sh",
            "-c",
            "echo $A $PWD"
        ]),
        "1 /tmp\n"
    );
    assert_eq!(a.run(&["exec", &id1, "true"]).status.code(), Some(0));
    let o = a.run(&["exec", &id1, "sh", "-c", "kill -KILL $$"]);
    assert_eq!(o.status.code(), Some(137), "a signal death is 128+signal");
    let o = a.run_with_input(&["exec", "-i", &id1, "wc", "-c"], "abcde");
    assert_eq!(stdout(&o).trim(), "5", "stdin streamed and closed at EOF");
    exec_ctrl_c(&a, &id1);
    exec_closed_stdout(&a, &id1);

    // -- upload/download: a file, a tree, 200 MB, checksums compared.
    let work = tempfile::tempdir().unwrap();
    let small = work.path().join("small.bin");
    write_random(&small, 300_000, 1);
    let msg = a.ok(&["upload", &id1, small.to_str().unwrap(), "/tmp/"]);
    assert_eq!(
        msg.trim(),
        format!("Uploaded {} to {id1}:/tmp/small.bin", small.display())
    );
    let back = work.path().join("back.bin");
    a.ok(&["download", &id1, "/tmp/small.bin", back.to_str().unwrap()]);
    assert_eq!(sha256_file(&back), sha256_file(&small));
    let o = a.run(&["download", &id1, "/tmp/small.bin", back.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("already exists") && stderr(&o).contains("--force"),
        "{}",
        stderr(&o)
    );
    a.ok(&["upload", &id1, back.to_str().unwrap(), "/tmp/small.bin"]);
    a.ok(&[
        "download",
        &id1,
        "/tmp/small.bin",
        back.to_str().unwrap(),
        "--force",
    ]);
    let o = a.run(&["download", &id1, "/tmp/nope", work.path().to_str().unwrap()]);
    assert!(
        stderr(&o).contains("remote path does not exist: /tmp/nope"),
        "{}",
        stderr(&o)
    );

    let tree = work.path().join("tree");
    std::fs::create_dir_all(tree.join("a/b/c")).unwrap();
    std::fs::create_dir_all(tree.join("empty")).unwrap();
    std::fs::write(tree.join(".hidden"), "h").unwrap();
    std::fs::write(tree.join("a/one.txt"), "one").unwrap();
    write_random(&tree.join("a/b/c/deep.bin"), 70_000, 2);
    let msg = a.ok(&["upload", &id1, tree.to_str().unwrap(), "/tmp/"]);
    assert!(msg.contains(&format!("{id1}:/tmp/tree")), "{msg}");
    assert_eq!(
        a.ok(&["exec", &id1, "sh", "-c", "cd /tmp/tree && find . | sort"]),
        ".\n./.hidden\n./a\n./a/b\n./a/b/c\n./a/b/c/deep.bin\n./a/one.txt\n./empty\n"
    );
    let down = work.path().join("down");
    std::fs::create_dir(&down).unwrap();
    a.ok(&["download", &id1, "/tmp/tree", down.to_str().unwrap()]);
    for f in [".hidden", "a/one.txt", "a/b/c/deep.bin"] {
        assert_eq!(
            sha256_file(&down.join("tree").join(f)),
            sha256_file(&tree.join(f)),
            "{f}"
        );
    }
    assert!(down.join("tree/empty").is_dir());
    let o = a.run(&["download", &id1, "/tmp/tree", down.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "conflicting files need --force");
    a.ok(&[
        "download",
        &id1,
        "/tmp/tree",
        down.to_str().unwrap(),
        "--force",
    ]);

    let big = work.path().join("big.bin");
    write_random(&big, 200 * 1024 * 1024, 3);
    let want = sha256_file(&big);
    a.ok(&["upload", &id1, big.to_str().unwrap(), "/tmp/big.bin"]);
    let remote_sum = a.ok(&["exec", &id1, "sha256sum", "/tmp/big.bin"]);
    assert!(remote_sum.starts_with(&want), "{remote_sum} vs {want}");
    let big_back = work.path().join("big.back");
    a.ok(&["download", &id1, "/tmp/big.bin", big_back.to_str().unwrap()]);
    assert_eq!(sha256_file(&big_back), want);
    std::fs::remove_file(&big).ok();
    std::fs::remove_file(&big_back).ok();
    a.ok(&["exec", &id1, "rm", "/tmp/big.bin"]);

    // -- interactive shell through a real pseudo-terminal.
    if Tmux::available() {
        interactive_shell(&a, &id1, work.path());
    } else {
        eprintln!("SKIPPED interactive shell: tmux is not installed (scripts/apt-packages.txt)");
    }

    // -- pause, paused errors, resume, timeout.
    assert_eq!(a.ok(&["pause", &id2]).trim(), format!("Paused {id2}"));
    assert_eq!(
        ids(&listed(&a, &["ls", "--state", "paused"])),
        vec![id2.clone()]
    );
    assert_eq!(
        ids(&listed(&a, &["ls", "--state", "running"])),
        vec![id1.clone()]
    );
    // Completion offers running sandboxes for exec and paused ones for resume.
    let complete = |words: &[&str]| {
        a.complete(words)
            .lines()
            .filter(|w| !w.starts_with('-'))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(complete(&["exec", ""]), vec![id1.clone()]);
    assert_eq!(complete(&["resume", ""]), vec![id2.clone()]);
    let mut both = vec![id1.clone(), id2.clone()];
    both.sort();
    assert_eq!(complete(&["rm", ""]), both);
    let o = a.run(&["exec", &id2, "true"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr(&o).trim(),
        format!("Error: sandbox {id2} is paused; run `aenv resume {id2}` first")
    );
    assert_eq!(a.ok(&["resume", &id2]).trim(), format!("Resumed {id2}"));
    assert_eq!(a.ok(&["exec", &id2, "echo", "back"]), "back\n");
    let end_at = || {
        let (_, d) = api(cluster.gateway, "GET", &format!("/sandboxes/{id2}"), "");
        d["endAt"].as_str().expect("endAt").to_string()
    };
    let before = end_at();
    assert_eq!(
        a.ok(&["timeout", &id2, "1200"]).trim(),
        format!("Timeout for {id2} set to 1200s")
    );
    let longer = end_at();
    assert!(
        longer > before,
        "1200 s from now is later than 300 s: {before} -> {longer}"
    );
    a.ok(&["timeout", &id2, "100"]);
    let shorter = end_at();
    assert!(
        shorter < longer,
        "the TTL was set, not only extended: {longer} -> {shorter}"
    );
    a.ok(&["timeout", &id2, "1200"]);

    // -- snapshots: create one with a name, list it (all, and by source sandbox), delete
    // it by name.
    let created = a.ok(&["snapshot", "create", &id2, "--name", "cli-snap"]);
    let snap_id = created
        .trim()
        .strip_prefix("Created snapshot ")
        .unwrap_or_else(|| panic!("{created:?}"))
        .to_string();
    let snap_ids = |args: &[&str]| -> Vec<String> {
        listed(&a, args)
            .iter()
            .map(|v| v["snapshotID"].as_str().unwrap_or_default().to_string())
            .collect()
    };
    let all = listed(&a, &["snapshot", "ls"]);
    let mine = all
        .iter()
        .find(|v| v["snapshotID"] == snap_id.as_str())
        .unwrap_or_else(|| panic!("{snap_id} listed: {all:?}"));
    assert_eq!(mine["names"], serde_json::json!(["cli-snap"]), "{mine}");
    assert!(snap_ids(&["snapshot", "ls", "--sandbox-id", &id2]).contains(&snap_id));
    assert!(!snap_ids(&["snapshot", "ls", "--sandbox-id", &id1]).contains(&snap_id));
    assert_eq!(
        a.ok(&["template", "delete", "cli-snap"]).trim(),
        format!("Deleted snapshot cli-snap ({snap_id})")
    );
    assert!(!snap_ids(&["snapshot", "ls"]).contains(&snap_id));

    // -- templates through the gateway: the list answers (none built here).
    let o = a.run(&["template", "ls", "-o", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap(),
        serde_json::json!([])
    );

    // -- rm, then not found.
    assert_eq!(
        a.ok(&["rm", &id1, &id2]),
        format!("Deleted sandbox {id1}\nDeleted sandbox {id2}\n")
    );
    let o = a.run(&["exec", &id1, "true"]);
    assert_eq!(
        stderr(&o).trim(),
        format!("Error: sandbox {id1} not found; list sandboxes with `aenv ls`")
    );
    assert_eq!(listed(&a, &["ls"]).len(), 0);

    // -- last: the gateway goes away under an open session, which ends as "lost" (130).
    if Tmux::available() {
        let id = a.ok(&["start", "base", "-d"]).trim().to_string();
        let status = work.path().join("lost.txt");
        let cmd = format!(
            "XDG_CONFIG_HOME={} {} cn {id}; echo EXIT=$? > {st}.tmp; stty -a >> {st}.tmp; mv {st}.tmp {st}; sleep 60",
            a.config.path().display(),
            cli_common::aenv_bin(),
            st = status.display()
        );
        let t = Tmux::start(&cmd, 100, 30);
        t.line("echo alive-$((5*5))");
        t.wait_for("the session", Duration::from_secs(20), |s| {
            s.contains("alive-25")
        });
        cluster.gateway_proc.stop();
        let out = wait_file(&status, Duration::from_secs(60));
        assert!(out.starts_with("EXIT=130\n"), "{out}");
        assert_cooked(&out);
        let pane = t.capture();
        assert!(
            pane.contains(&format!("Terminal session lost contact with sandbox {id}")),
            "{pane}"
        );
    }
}

type StdoutLines = std::io::Lines<std::io::BufReader<std::process::ChildStdout>>;

/// `aenv exec <id> <command…>` started with stdout piped, once it printed `first` as its
/// first line; and the rest of its stdout.
fn exec_printing(
    a: &Aenv,
    id: &str,
    command: &[&str],
    first: &str,
) -> (std::process::Child, StdoutLines) {
    use std::io::BufRead;
    let mut child = a
        .cmd(&[&["exec", id][..], command].concat())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn aenv exec");
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), first);
    (child, lines)
}

/// A local Ctrl-C (SIGINT to `aenv exec`) stops the remote command; exit code 130.
fn exec_ctrl_c(a: &Aenv, id: &str) {
    let cmd = ["sh", "-c", "echo started; exec sleep 300"];
    let (mut child, _lines) = exec_printing(a, id, &cmd, "started");
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let status = wait_exit(
        &mut child,
        Duration::from_secs(20),
        "aenv exec ignored Ctrl-C",
    );
    assert_eq!(status.code(), Some(130));
    let ps = a.ok(&["exec", id, "ps", "-eo", "args"]);
    assert!(
        !ps.contains("sleep 300"),
        "the remote command was stopped:\n{ps}"
    );
}

/// A reader that goes away (`aenv exec … yes | head -1`) stops the remote command and
/// exits 141 like SIGPIPE would.
fn exec_closed_stdout(a: &Aenv, id: &str) {
    let cmd = ["yes", "closed-pipe"];
    let (mut child, lines) = exec_printing(a, id, &cmd, "closed-pipe");
    drop(lines);
    let status = wait_exit(
        &mut child,
        Duration::from_secs(20),
        "aenv exec kept writing to a closed pipe",
    );
    assert_eq!(status.code(), Some(141));
    eventually_blocking("the remote command to end", Duration::from_secs(10), || {
        !a.ok(&["exec", id, "ps", "-eo", "args"])
            .contains("yes closed-pipe")
    });
}

/// The blocked-signal mask of a process the agent starts, when it blocks SIGINT.
fn blocked_sigint(a: &Aenv, id: &str) -> Option<String> {
    let status = a.ok(&["exec", id, "cat", "/proc/self/status"]);
    let mask = status
        .lines()
        .find_map(|l| l.strip_prefix("SigBlk:"))
        .map(str::trim)?
        .to_string();
    let bits = u64::from_str_radix(&mask, 16).ok()?;
    (bits & (1 << (2 - 1)) != 0).then_some(mask)
}

/// The local terminal is back in cooked mode (canonical input, echo).
fn assert_cooked(stty: &str) {
    let words: Vec<&str> = stty.split_whitespace().collect();
    assert!(
        words.contains(&"icanon") && words.contains(&"echo"),
        "terminal left in raw mode:\n{stty}"
    );
}

fn interactive_shell(a: &Aenv, id: &str, dir: &std::path::Path) {
    let status = dir.join("exit.txt");
    let cmd = format!(
        "XDG_CONFIG_HOME={} TERM=xterm-256color {} cn {id}; echo EXIT=$? > {st}.tmp; stty -a >> {st}.tmp; mv {st}.tmp {st}; sleep 60",
        a.config.path().display(),
        cli_common::aenv_bin(),
        st = status.display()
    );
    let t = Tmux::start(&cmd, 100, 30);
    // A prompt from the remote shell, then a command and its output.
    t.line("echo hello-$((6*7))");
    t.wait_for("the command's output", Duration::from_secs(20), |s| {
        s.contains("hello-42")
    });
    t.line("stty size");
    t.wait_for("the initial size", Duration::from_secs(10), |s| {
        s.contains("30 100")
    });
    t.resize(120, 40);
    // The resize reaches the remote PTY (retyped until it shows: SIGWINCH is async).
    Wait::new("the resize to reach the sandbox", Duration::from_secs(10))
        .every(Duration::ZERO)
        .until_blocking(|| {
            t.line("clear; stty size");
            std::thread::sleep(Duration::from_millis(200));
            let pane = t.capture();
            if pane.contains("40 120") {
                Ok(())
            } else {
                Err(format!("pane:\n{pane}"))
            }
        });
    // Ctrl-C interrupts the remote foreground process, not the session.
    if let Some(mask) = blocked_sigint(a, id) {
        eprintln!(
            "SKIPPED the interactive Ctrl-C check: processes in the sandbox start with SIGINT \
             blocked (SigBlk {mask}), inherited from the agent, so no terminal can interrupt them"
        );
    } else {
        t.line("sleep 300");
        eventually_blocking("sleep to start", Duration::from_secs(10), || {
            a.ok(&["exec", id, "ps", "-eo", "args"])
                .contains("sleep 300")
        });
        t.send(&["C-c"], false);
        t.line("echo after-$((1+1))");
        t.wait_for("output after Ctrl-C", Duration::from_secs(10), |s| {
            s.contains("after-2")
        });
        assert!(
            !a.ok(&["exec", id, "ps", "-eo", "args"])
                .contains("sleep 300")
        );
    }
    t.line("exit 3");
    let out = wait_file(&status, Duration::from_secs(20));
    assert!(out.starts_with("EXIT=3\n"), "{out}");
    assert_cooked(&out);
    drop(t);

    // A paused sandbox ends the session with 130 and says how to resume.
    std::fs::remove_file(&status).ok();
    let t = Tmux::start(&cmd, 100, 30);
    t.line("echo ready-$((2*4))");
    t.wait_for("the second session", Duration::from_secs(20), |s| {
        s.contains("ready-8")
    });
    a.ok(&["pause", id]);
    let out = wait_file(&status, Duration::from_secs(30));
    assert!(out.starts_with("EXIT=130\n"), "{out}");
    assert_cooked(&out);
    let pane = t.capture();
    assert!(
        pane.contains(&format!("Sandbox {id} has been paused")),
        "{pane}"
    );
    drop(t);
    a.ok(&["resume", id]);

    // `start` creates a sandbox and attaches; deleting it ends the session with 130.
    std::fs::remove_file(&status).ok();
    let cmd = format!(
        "XDG_CONFIG_HOME={} {} start base --metadata shell=1; echo EXIT=$? > {st}.tmp; stty -a >> {st}.tmp; mv {st}.tmp {st}; sleep 60",
        a.config.path().display(),
        cli_common::aenv_bin(),
        st = status.display()
    );
    let t = Tmux::start(&cmd, 90, 25);
    t.line("echo started-$((3*3))");
    let pane = t.wait_for("the started shell", Duration::from_secs(30), |s| {
        s.contains("started-9")
    });
    assert!(pane.contains("Started sandbox "), "{pane}");
    let v: serde_json::Value =
        serde_json::from_str(&a.ok(&["ls", "--metadata", "shell=1"])).unwrap();
    let new_id = v[0]["sandboxID"]
        .as_str()
        .expect("the started sandbox")
        .to_string();
    a.ok(&["rm", &new_id]);
    let out = wait_file(&status, Duration::from_secs(30));
    assert!(out.starts_with("EXIT=130\n"), "{out}");
    assert_cooked(&out);
    let pane = t.capture();
    assert!(
        pane.contains(&format!("Sandbox {new_id} no longer exists.")),
        "{pane}"
    );
}
