//! The agent's listening socket, made by the jail inside the sandbox before the agent
//! runs and handed to it (`AGENTENV_GUEST_LISTEN_FD`): the node's readiness probe waits
//! in its backlog instead of polling; an agent that never serves still fails readiness
//! at the timeout; and no process of the sandbox holds the socket or can take the
//! agent's port, even while the agent is down.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use agentenv_guest::client::GuestClient;
use agentenv_node::backend::SandboxBackend;
use agentenv_node::backend::agent::{AgentError, wait_ready};

fn guest_binary() -> Option<PathBuf> {
    agentenv_testkit::bins::find_binary("AGENTENV_GUEST_BIN", "agentenv-guest")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_never_accepts_fails_readiness_at_the_timeout() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let mut spec = common::spec(&common::id("stall"));
    spec.env.insert("TEST_AGENT_STALL".into(), "1".into());
    let info = b.create(spec).await.expect("create");
    let addr = info.address.agent();
    // The listener exists as soon as the create returned, before the agent runs: a
    // connection is taken into its backlog, not refused.
    tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
        .await
        .expect("connect in time")
        .expect("the agent's port accepts a connection at once");
    let timeout = Duration::from_millis(1500);
    let started = std::time::Instant::now();
    let r = wait_ready(addr, timeout, Duration::from_millis(2)).await;
    let waited = started.elapsed();
    match r {
        Err(AgentError::NotReady { last, .. }) => {
            // Never "connection refused": the probe waited on the queued connection.
            assert_eq!(last, "timed out", "probe failed otherwise: {last}");
        }
        Ok(()) => panic!("a stalled agent was taken for ready"),
    }
    assert!(
        waited >= timeout && waited < timeout + Duration::from_secs(10),
        "readiness gave up after {waited:?} (timeout {timeout:?})"
    );
    b.destroy(&info.id).await.unwrap();
}

async fn sh(c: &GuestClient, script: &str) -> String {
    let out = c.run("/bin/sh", &["-c", script]).await.expect("command");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Binds the agent's port as hard as a tenant can (address reuse on) and prints `bound`
/// or the errno's name.
const BIND: &str = r#"
import errno, socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("0.0.0.0", 49983))
    s.listen()
    print("bound")
except OSError as e:
    print(errno.errorcode.get(e.errno, str(e.errno)))
"#;

/// Tries to take or open every descriptor of init and of the agent (`sys.argv[1]`):
/// `pidfd_getfd` and `/proc/<pid>/fd/<n>`; prints how many it got.
const STEAL: &str = r#"
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
got = 0
for pid in (1, int(sys.argv[1])):
    try:
        pfd = os.pidfd_open(pid)
    except OSError:
        pfd = None
    for fd in range(3, 256):
        if pfd is not None and libc.syscall(438, pfd, fd, 0) >= 0:
            got += 1
        try:
            os.close(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY))
            got += 1
        except OSError:
            pass
print(got)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_hold_the_agents_listener_or_take_its_port() {
    require_jail!();
    let Some(agent) = guest_binary() else {
        eprintln!(
            "SKIPPED: no agentenv-guest binary: build it with `cargo build -p agentenv-guest` or set AGENTENV_GUEST_BIN"
        );
        return;
    };
    let (b, _data) = common::backend_with(|c| c.agent_binary = agent.clone()).await;
    let info = common::create_ready(&b, common::spec(&common::id("listener"))).await;
    let c = GuestClient::new(&format!("http://{}", info.address.agent())).unwrap();

    // A process the agent starts holds no socket and does not see the variable.
    let fds = sh(&c, "ls -l /proc/$$/fd/ | grep -c 'socket:' || true").await;
    assert_eq!(fds, "0", "a started process holds a socket");
    let env = sh(&c, "env | grep -c LISTEN_FD || true").await;
    assert_eq!(env, "0", "the listener's variable reached a process");

    // Nor can root in the sandbox take the socket from init or the agent.
    sh(&c, &format!("cat > /tmp/steal.py <<'EOF'\n{STEAL}\nEOF")).await;
    let stolen = sh(&c, "python3 /tmp/steal.py $PPID 2>&1").await;
    assert_eq!(
        stolen, "0",
        "descriptors of init or the agent taken: {stolen}"
    );

    // Root in the sandbox kills the agent and at once tries to take its port, to serve
    // the next client (and read its access token) in the agent's place.
    sh(&c, &format!("cat > /tmp/bind.py <<'EOF'\n{BIND}\nEOF")).await;
    let agent_pid = sh(&c, "echo $PPID").await;
    sh(
        &c,
        "setsid sh -c 'sleep 0.3; kill -9 \"$1\"; python3 /tmp/bind.py > /tmp/bind.txt 2>&1' \
         sh $PPID </dev/null >/dev/null 2>&1 &",
    )
    .await;
    // Init restarts the agent (at most once a second) on the same socket: a call made
    // while it is down waits in the backlog and is served by the new agent.
    let new_agent =
        agentenv_testkit::eventually("a restarted agent", Duration::from_secs(10), || async {
            let out = c.run("/bin/sh", &["-c", "echo $PPID"]).await.ok()?;
            let pid = String::from_utf8_lossy(&out.stdout).trim().to_string();
            (pid != agent_pid).then_some(pid)
        })
        .await;
    assert!(!new_agent.is_empty());
    let bind = sh(&c, "cat /tmp/bind.txt").await;
    assert_eq!(
        bind, "EADDRINUSE",
        "the tenant's bind of the agent's port: {bind}"
    );
    b.destroy(&info.id).await.unwrap();
}
