//! Bad input: every case gets a Connect error or a clean close, the agent
//! keeps serving, and no process or file descriptor is leaked.

mod common;

use std::time::Duration;

use agentenv_guest::client::GuestClient;
use agentenv_guest::connect::encode_envelope;
use agentenv_guest::proto::process as pr;
use agentenv_guest::server::AgentOptions;
use agentenv_testkit::eventually;
use common::{TestAgent, open_fds};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends raw bytes, returns everything the server sends until it closes.
async fn raw(addr: std::net::SocketAddr, request: &[u8]) -> String {
    raw_inner(addr, request, false).await
}

/// Like [`raw`], but half-closes after sending (a body cut off mid-way).
async fn raw_cut(addr: std::net::SocketAddr, request: &[u8]) -> String {
    raw_inner(addr, request, true).await
}

async fn raw_inner(addr: std::net::SocketAddr, request: &[u8], cut: bool) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    // The server may answer (and close) before reading everything.
    let _ = s.write_all(request).await;
    if cut {
        let _ = s.shutdown().await;
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

fn post(path: &str, ct: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: {ct}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

/// A bodiless `GET path` that closes the connection.
fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").into_bytes()
}

fn status_of(resp: &str) -> u16 {
    resp.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Waits until this process has no more open file descriptors than `baseline`.
async fn fds_return_to(baseline: usize) {
    eventually(
        "file descriptors to return to the baseline",
        Duration::from_secs(10),
        || async { (open_fds() <= baseline).then_some(()) },
    )
    .await;
}

async fn assert_still_serving(agent: &TestAgent) {
    let c = GuestClient::new(&agent.url()).unwrap();
    let out = c.run("/bin/echo", &["alive"]).await.unwrap();
    assert_eq!(out.stdout, b"alive\n");
}

#[tokio::test]
async fn malformed_requests_get_connect_errors_and_nothing_leaks() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    assert_still_serving(&agent).await;
    let fds_before = open_fds();
    let a = agent.addr;

    // Wrong content type on a unary and a streaming method: 415.
    let r = raw(a, &post("/process.Process/List", "text/plain", b"{}")).await;
    assert_eq!(status_of(&r), 415, "{r}");
    assert!(r.contains("application/json"), "{r}");
    let r = raw(
        a,
        &post("/process.Process/Start", "application/json", b"{}"),
    )
    .await;
    assert_eq!(status_of(&r), 415, "{r}");

    // Not JSON / not protobuf: invalid_argument, 400.
    let r = raw(
        a,
        &post("/process.Process/List", "application/json", b"{nope"),
    )
    .await;
    assert_eq!(status_of(&r), 400, "{r}");
    assert!(r.contains("\"code\":\"invalid_argument\""), "{r}");
    let r = raw(
        a,
        &post(
            "/filesystem.Filesystem/Stat",
            "application/proto",
            &[0xff, 0xff, 0xff],
        ),
    )
    .await;
    assert_eq!(status_of(&r), 400, "{r}");

    // Envelope whose length runs past the body (truncated): end-of-stream error.
    let mut env = encode_envelope(0, b"{\"process\":{\"cmd\":\"/bin/true\"}}").to_vec();
    env.truncate(env.len() - 5);
    let r = raw(
        a,
        &post("/process.Process/Start", "application/connect+json", &env),
    )
    .await;
    assert_eq!(status_of(&r), 200, "{r}");
    assert!(
        r.contains("invalid_argument") && r.contains("truncated"),
        "{r}"
    );

    // Envelope claiming 4 GiB: resource_exhausted, without reading it.
    let r = raw(
        a,
        &post(
            "/process.Process/Start",
            "application/connect+json",
            &[0, 0xff, 0xff, 0xff, 0xff, b'{'],
        ),
    )
    .await;
    assert!(r.contains("resource_exhausted"), "{r}");

    // Empty streaming body, and two messages for a server-streaming call.
    let r = raw(
        a,
        &post("/process.Process/Start", "application/connect+proto", b""),
    )
    .await;
    assert!(r.contains("invalid_argument"), "{r}");
    let mut two = encode_envelope(0, b"").to_vec();
    two.extend_from_slice(&encode_envelope(0, b""));
    let r = raw(
        a,
        &post("/process.Process/Start", "application/connect+proto", &two),
    )
    .await;
    assert!(r.contains("exactly one"), "{r}");

    // Unknown method, GET on an RPC path, unknown path, bad timeout header.
    let r = raw(a, &post("/process.Process/Nope", "application/json", b"{}")).await;
    assert!(r.contains("unimplemented"), "{r}");
    let r = raw(a, &get("/process.Process/List")).await;
    assert_eq!(status_of(&r), 405, "{r}");
    let r = raw(a, &get("/nothing")).await;
    assert_eq!(status_of(&r), 404, "{r}");
    let mut req = post("/process.Process/List", "application/json", b"{}");
    let pos = req.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    req.splice(pos..pos, b"\r\nConnect-Timeout-Ms: soon".iter().copied());
    let r = raw(a, &req).await;
    assert_eq!(status_of(&r), 400, "{r}");

    // Huge headers: 431, connection closed.
    let big = "a".repeat(2 << 20);
    let r = raw(
        a,
        format!("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(status_of(&r), 431, "{}", &r[..r.len().min(200)]);

    // Garbage instead of HTTP, and a chunked body cut off mid-chunk.
    let _ = raw_cut(a, b"\x00\x01\x02 not http at all\r\n\r\n").await;
    let dir = tempfile::tempdir().unwrap();
    let cut = dir.path().join("cut.bin");
    std::fs::write(&cut, b"previous content").unwrap();
    let _ = raw_cut(
        a,
        format!(
            "POST /files?path={} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Type: application/octet-stream\r\n\r\n100\r\nabc",
            cut.display()
        )
        .as_bytes(),
    )
    .await;
    eventually(
        "the cut-off upload to be cleaned up",
        Duration::from_secs(10),
        || async { (std::fs::read_dir(dir.path()).unwrap().count() == 1).then_some(()) },
    )
    .await;
    assert_eq!(
        std::fs::read(&cut).unwrap(),
        b"previous content",
        "a cut-off upload clobbered the file"
    );
    let _ = raw_cut(
        a,
        b"POST /process.Process/StreamInput HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Type: application/connect+proto\r\n\r\n3\r\n\x00\x00\x00\r\n",
    )
    .await;

    // Multipart without a `file` part; upload without a path.
    let mp = b"--XX\r\nContent-Disposition: form-data; name=\"other\"\r\n\r\nv\r\n--XX--\r\n";
    let r = raw(
        a,
        &post("/files?path=/tmp/x", "multipart/form-data; boundary=XX", mp),
    )
    .await;
    assert_eq!(status_of(&r), 400, "{r}");
    let r = raw(a, &post("/files", "application/octet-stream", b"abc")).await;
    assert_eq!(status_of(&r), 400, "{r}");
    // Downloads: a directory is 400, a missing file 404, an unknown user 401.
    let r = raw(a, &get("/files?path=/tmp")).await;
    assert_eq!(status_of(&r), 400, "{r}");
    let r = raw(a, &get("/files?path=/no/such/file")).await;
    assert_eq!(status_of(&r), 404, "{r}");
    let r = raw(a, &get("/files?path=/etc/hostname&username=no-such-user-x")).await;
    assert_eq!(status_of(&r), 401, "{r}");

    assert_still_serving(&agent).await;
    fds_return_to(fds_before).await;
    assert!(agent.state.processes.is_empty());
    agent.stop().await;
}

#[tokio::test]
async fn paths_with_dotdot_are_resolved_lexically() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f"), b"x").unwrap();
    let p = format!("{}/sub/../f", dir.path().display());
    let st = c.stat(&p).await.unwrap();
    assert_eq!(st.path, dir.path().join("f").display().to_string());
    // `..` never climbs above the root.
    let root = c.stat("/../../..").await.unwrap();
    assert_eq!(root.path, "/");
    let err = c.remove("/..").await.unwrap_err();
    assert_eq!(
        err.code(),
        Some(agentenv_guest::connect::Code::InvalidArgument)
    );
    // Uploads and downloads resolve the same way.
    let up = format!("{}/new/../up.txt", dir.path().display());
    c.upload(
        &up,
        futures::stream::iter([Ok(bytes::Bytes::from_static(b"hi"))]),
    )
    .await
    .unwrap();
    assert_eq!(std::fs::read(dir.path().join("up.txt")).unwrap(), b"hi");
    assert!(!dir.path().join("new").exists());
    agent.stop().await;
}

#[tokio::test]
async fn client_disconnecting_mid_stream_leaves_no_zombie_or_fd() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    assert_still_serving(&agent).await;
    let fds_before = open_fds();
    let c = GuestClient::new(&agent.url()).unwrap();
    // A process that writes a lot; the client reads a little and disconnects.
    let req = pr::StartRequest {
        process: Some(pr::ProcessConfig {
            cmd: "/bin/sh".into(),
            args: vec!["-c".into(), "yes output-line | head -c 50000000".into()],
            ..Default::default()
        }),
        stdin: Some(false),
        ..Default::default()
    };
    let mut stream = c.start(&req).await.unwrap();
    let mut pid = 0;
    use futures::StreamExt;
    for _ in 0..3 {
        if let Some(Ok(m)) = stream.next().await
            && let Some(pr::process_event::Event::Start(s)) = m.event.and_then(|e| e.event)
        {
            pid = s.pid;
        }
    }
    assert!(pid > 0);
    drop(stream);
    drop(c);
    // The process runs to its end without a reader and is reaped.
    eventually(
        "the process to finish and be reaped",
        Duration::from_secs(20),
        || async {
            (agent.state.processes.is_empty()
                && !std::path::Path::new(&format!("/proc/{pid}")).exists())
            .then_some(())
        },
    )
    .await;

    // A StreamInput whose client vanishes after the first message.
    let c = GuestClient::new(&agent.url()).unwrap();
    let mut cat = c
        .start(&pr::StartRequest {
            process: Some(pr::ProcessConfig {
                cmd: "/bin/cat".into(),
                ..Default::default()
            }),
            stdin: Some(true),
            ..Default::default()
        })
        .await
        .unwrap();
    let first = cat.next().await.unwrap().unwrap();
    let Some(pr::process_event::Event::Start(s)) = first.event.and_then(|e| e.event) else {
        panic!("no start event")
    };
    let sel = pr::ProcessSelector {
        selector: Some(pr::process_selector::Selector::Pid(s.pid)),
    };
    let (tx, task) = c.stream_input(sel.clone(), false);
    assert!(tx.send(b"x".to_vec()).await);
    task.abort();
    drop(tx);
    c.send_signal(sel, pr::Signal::Sigkill).await.unwrap();
    drop(cat);
    drop(c);
    eventually("cat to be reaped", Duration::from_secs(10), || async {
        (agent.state.processes.is_empty()
            && !std::path::Path::new(&format!("/proc/{}", s.pid)).exists())
        .then_some(())
    })
    .await;
    assert_still_serving(&agent).await;
    fds_return_to(fds_before).await;
    agent.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_client_that_never_finishes_its_headers_is_dropped() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let mut s = TcpStream::connect(agent.addr).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let mut out = Vec::new();
    // The (paused) clock runs ahead to the server's header deadline.
    tokio::time::timeout(Duration::from_secs(120), s.read_to_end(&mut out))
        .await
        .expect("the server kept a half-sent request open")
        .ok();
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(29) && waited < Duration::from_secs(120),
        "dropped after {waited:?}"
    );
    assert_still_serving(&agent).await;
    agent.stop().await;
}
