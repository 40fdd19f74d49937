//! The Rust Connect client (binary protobuf codec) against an in-process
//! agent on loopback.

mod common;

use std::time::Duration;

use agentenv_guest::client::{ClientError, GuestClient, collect_output};
use agentenv_guest::connect::Code;
use agentenv_guest::proto::process as pr;
use agentenv_guest::server::AgentOptions;
use agentenv_testkit::eventually;
use common::TestAgent;
use futures::StreamExt;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

fn pid_sel(pid: u32) -> pr::ProcessSelector {
    pr::ProcessSelector {
        selector: Some(pr::process_selector::Selector::Pid(pid)),
    }
}

fn start_req(cmd: &str, args: &[&str], stdin: bool) -> pr::StartRequest {
    pr::StartRequest {
        process: Some(pr::ProcessConfig {
            cmd: cmd.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }),
        stdin: Some(stdin),
        ..Default::default()
    }
}

async fn first_pid<T, F>(stream: &mut agentenv_guest::client::ResponseStream<T>, ev: F) -> u32
where
    T: agentenv_guest::connect::ConnectMessage,
    F: Fn(T) -> Option<pr::ProcessEvent>,
{
    let first = stream.next().await.unwrap().unwrap();
    match ev(first).and_then(|e| e.event) {
        Some(pr::process_event::Event::Start(s)) => s.pid,
        other => panic!("first event is not start: {other:?}"),
    }
}

#[tokio::test]
async fn binary_codec_runs_a_process_with_separate_stdout_and_stderr() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    let out = c
        .run("/bin/sh", &["-c", "echo out; echo err >&2; exit 7"])
        .await
        .unwrap();
    assert!(out.pid > 0);
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    let end = out.end.unwrap();
    assert_eq!(
        (end.exit_code, end.exited, end.status.as_str()),
        (7, true, "exit status 7")
    );
    agent.stop().await;
}

#[tokio::test]
async fn h2c_client_runs_processes_over_one_connection() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new_h2c(&agent.url()).unwrap();
    for i in 0..3 {
        let out = c.run("/bin/echo", &[&i.to_string()]).await.unwrap();
        assert_eq!(out.stdout, format!("{i}\n").into_bytes());
    }
    agent.stop().await;
}

#[tokio::test]
async fn stream_input_and_close_stdin_feed_a_process() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    let mut stream = c.start(&start_req("/bin/cat", &[], true)).await.unwrap();
    let pid = first_pid(&mut stream, |m: pr::StartResponse| m.event).await;
    let (tx, task) = c.stream_input(pid_sel(pid), false);
    assert!(tx.send(b"hello ".to_vec()).await);
    assert!(tx.keepalive().await);
    assert!(tx.send(b"world\n".to_vec()).await);
    drop(tx);
    task.await.unwrap().unwrap();
    c.send_input(pid_sel(pid), b"unary\n".to_vec(), false)
        .await
        .unwrap();
    c.close_stdin(pid_sel(pid)).await.unwrap();
    let out = collect_output(stream.map(|r| r.map(|m| m.event)))
        .await
        .unwrap();
    assert_eq!(out.stdout, b"hello world\nunary\n");
    assert_eq!(out.end.unwrap().exit_code, 0);
    agent.stop().await;
}

#[tokio::test]
async fn signals_end_a_process_and_report_it_like_envd() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    let mut stream = c
        .start(&start_req("/bin/sleep", &["60"], false))
        .await
        .unwrap();
    let pid = first_pid(&mut stream, |m: pr::StartResponse| m.event).await;
    let listed = c.list().await.unwrap();
    assert!(listed.iter().any(|p| p.pid == pid));
    c.send_signal(pid_sel(pid), pr::Signal::Sigterm)
        .await
        .unwrap();
    let out = collect_output(stream.map(|r| r.map(|m| m.event)))
        .await
        .unwrap();
    let end = out.end.unwrap();
    assert_eq!((end.exit_code, end.exited), (-1, false));
    assert_eq!(end.status, "signal: terminated");
    let err = c
        .send_signal(pid_sel(pid), pr::Signal::Sigkill)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound), "{err}");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "process was not reaped"
    );
    agent.stop().await;
}

#[tokio::test]
async fn connect_by_tag_reattaches_to_running_process() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    let mut req = start_req("/bin/cat", &[], true);
    req.tag = Some("my-cat".into());
    let mut first = c.start(&req).await.unwrap();
    let pid = first_pid(&mut first, |m: pr::StartResponse| m.event).await;
    drop(first); // the first client goes away; the process keeps running
    let sel = pr::ProcessSelector {
        selector: Some(pr::process_selector::Selector::Tag("my-cat".into())),
    };
    let mut again = c.connect(sel.clone()).await.unwrap();
    assert_eq!(
        first_pid(&mut again, |m: pr::ConnectResponse| m.event).await,
        pid
    );
    let listed = c.list().await.unwrap();
    assert_eq!(
        listed
            .iter()
            .find(|p| p.pid == pid)
            .and_then(|p| p.tag.clone())
            .as_deref(),
        Some("my-cat")
    );
    c.send_input(sel.clone(), b"after reconnect\n".to_vec(), false)
        .await
        .unwrap();
    c.close_stdin(sel).await.unwrap();
    let out = collect_output(again.map(|r| r.map(|m| m.event)))
        .await
        .unwrap();
    assert_eq!(out.stdout, b"after reconnect\n");
    agent.stop().await;
}

#[tokio::test]
async fn pty_process_gets_input_and_resize() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    let req = pr::StartRequest {
        process: Some(pr::ProcessConfig {
            cmd: "/bin/sh".into(),
            ..Default::default()
        }),
        pty: Some(pr::Pty {
            size: Some(pr::pty::Size { cols: 90, rows: 20 }),
        }),
        ..Default::default()
    };
    let mut stream = c.start(&req).await.unwrap();
    let pid = first_pid(&mut stream, |m: pr::StartResponse| m.event).await;
    c.send_input(pid_sel(pid), b"stty size; tty\n".to_vec(), true)
        .await
        .unwrap();
    let mut seen = Vec::new();
    let mut wait_for = async |needle: &str, seen: &mut Vec<u8>| {
        tokio::time::timeout(Duration::from_secs(10), async {
            while !String::from_utf8_lossy(seen).contains(needle) {
                if let Some(Ok(m)) = stream.next().await
                    && let Some(pr::process_event::Event::Data(d)) = m.event.and_then(|e| e.event)
                    && let Some(pr::process_event::data_event::Output::Pty(b)) = d.output
                {
                    seen.extend_from_slice(&b);
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no {needle:?} in {:?}", String::from_utf8_lossy(seen)));
    };
    wait_for("20 90", &mut seen).await;
    wait_for("/dev/pts/", &mut seen).await;
    c.resize_pty(pid_sel(pid), 120, 40).await.unwrap();
    c.send_input(pid_sel(pid), b"stty size\n".to_vec(), true)
        .await
        .unwrap();
    wait_for("40 120", &mut seen).await;
    let err = c.close_stdin(pid_sel(pid)).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::FailedPrecondition));
    c.send_input(pid_sel(pid), b"exit 5\n".to_vec(), true)
        .await
        .unwrap();
    let out = collect_output(stream.map(|r| r.map(|m| m.event)))
        .await
        .unwrap();
    assert_eq!(out.end.unwrap().exit_code, 5);
    agent.stop().await;
}

#[tokio::test]
async fn filesystem_calls_over_binary_codec() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("a/b");
    c.make_dir(d.to_str().unwrap()).await.unwrap();
    let err = c.make_dir(d.to_str().unwrap()).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::AlreadyExists));
    std::fs::write(d.join("f.txt"), b"12345").unwrap();
    std::os::unix::fs::symlink(d.join("f.txt"), d.join("link")).unwrap();
    let st = c.stat(d.join("f.txt").to_str().unwrap()).await.unwrap();
    assert_eq!((st.size, st.name.as_str()), (5, "f.txt"));
    let link = c.stat(d.join("link").to_str().unwrap()).await.unwrap();
    assert!(link.is_symlink);
    assert_eq!(
        link.r#type,
        agentenv_guest::proto::filesystem::FileType::File as i32
    );
    assert_eq!(link.symlink_target.as_deref(), d.join("f.txt").to_str());
    let top = c.list_dir(dir.path().to_str().unwrap(), 1).await.unwrap();
    assert_eq!(top.len(), 1);
    let all = c.list_dir(dir.path().to_str().unwrap(), 3).await.unwrap();
    assert_eq!(all.len(), 4, "{all:?}");
    c.remove(dir.path().join("a").to_str().unwrap())
        .await
        .unwrap();
    let err = c.stat(d.to_str().unwrap()).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound));
    agent.stop().await;
}

#[tokio::test]
async fn access_token_is_enforced_once_init_sets_it() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let open = GuestClient::new(&agent.url()).unwrap();
    open.init(&serde_json::json!({
        "envVars": {"FROM_INIT": "yes"},
        "accessToken": "s3cret",
        "timestamp": "2026-01-01T00:00:00Z"
    }))
    .await
    .unwrap();
    assert!(open.health().await.unwrap(), "/health must stay open");
    let err = open.list().await.unwrap_err();
    assert_eq!(err.code(), Some(Code::Unauthenticated), "{err}");
    let wrong = GuestClient::new(&agent.url())
        .unwrap()
        .with_access_token("s3creT");
    assert_eq!(
        wrong.list().await.unwrap_err().code(),
        Some(Code::Unauthenticated)
    );
    let err = open.download("/etc/hostname").await.err().unwrap();
    assert!(
        matches!(err, ClientError::Http { status, .. } if status == 401),
        "{err}"
    );
    let good = GuestClient::new(&agent.url())
        .unwrap()
        .with_access_token("s3cret");
    let out = good
        .run("/bin/sh", &["-c", "echo $FROM_INIT"])
        .await
        .unwrap();
    assert_eq!(out.stdout, b"yes\n");
    // A second /init needs the current token.
    assert!(
        open.init(&serde_json::json!({"accessToken": ""}))
            .await
            .is_err()
    );
    good.init(&serde_json::json!({"accessToken": ""}))
        .await
        .unwrap();
    open.list().await.unwrap();
    agent.stop().await;
}

#[tokio::test(start_paused = true)]
async fn start_stream_sends_keepalives_at_the_requested_interval() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url())
        .unwrap()
        .with_header("keepalive-ping-interval", "1")
        .unwrap();
    let t0 = tokio::time::Instant::now();
    let mut stream = c
        .start(&start_req("/bin/sleep", &["0.5"], false))
        .await
        .unwrap();
    let mut keepalives = 0;
    let mut ended = false;
    while let Some(m) = stream.next().await {
        match m.unwrap().event.and_then(|e| e.event) {
            Some(pr::process_event::Event::Keepalive(_)) => keepalives += 1,
            Some(pr::process_event::Event::End(_)) => ended = true,
            _ => {}
        }
    }
    assert!(ended);
    // The paused clock jumps ahead while the runtime waits for the process:
    // one keepalive per (virtual) second of the stream's life.
    let secs = t0.elapsed().as_secs_f64();
    assert!(keepalives >= 1, "no keepalive while the process ran");
    assert!(
        (keepalives as f64 - secs).abs() <= 1.5,
        "{keepalives} keepalives in {secs:.1} s at a 1 s interval"
    );
    agent.stop().await;
}

#[tokio::test]
async fn connect_timeout_ms_ends_a_start_stream_and_the_process() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let msg = prost::Message::encode_to_vec(&start_req("/bin/sleep", &["30"], false));
    let env = agentenv_guest::connect::encode_envelope(0, &msg);
    let req = http::Request::post(format!("{}/process.Process/Start", agent.url()))
        .header("content-type", "application/connect+proto")
        .header("connect-timeout-ms", "300")
        .body(http_body_util::Full::new(env))
        .unwrap();
    let resp = http.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("deadline_exceeded"), "{text}");
    eventually(
        "the timed-out process to end",
        Duration::from_secs(10),
        || async { agent.state.processes.is_empty().then_some(()) },
    )
    .await;
    agent.stop().await;
}

fn fill_pseudo_random(buf: &mut [u8], seed: &mut u64) {
    for chunk in buf.chunks_mut(8) {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        let b = seed.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

#[tokio::test]
async fn upload_and_download_100_mib_round_trip_with_checksum() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    let mut want = Sha256::new();
    {
        let mut f = tokio::fs::File::create(&src).await.unwrap();
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut buf = vec![0u8; 1 << 20];
        for _ in 0..100 {
            fill_pseudo_random(&mut buf, &mut seed);
            want.update(&buf);
            f.write_all(&buf).await.unwrap();
        }
        f.flush().await.unwrap();
    }
    let want = want.finalize();
    let remote = dir.path().join("remote/dir/uploaded.bin");
    c.upload_file(&src, remote.to_str().unwrap()).await.unwrap();
    assert_eq!(std::fs::metadata(&remote).unwrap().len(), 100 << 20);
    let mut got = Sha256::new();
    let mut n = 0usize;
    let mut stream = c.download(remote.to_str().unwrap()).await.unwrap();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        n += chunk.len();
        got.update(&chunk);
    }
    assert_eq!(n, 100 << 20);
    assert_eq!(
        got.finalize(),
        want,
        "downloaded bytes differ from uploaded ones"
    );
    agent.stop().await;
}

#[tokio::test]
async fn gzip_upload_and_download_round_trip() {
    use async_compression::tokio::bufread::{GzipDecoder, GzipEncoder};
    use tokio::io::AsyncReadExt;
    let agent = TestAgent::start(AgentOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..200_000u32)
        .flat_map(|i| (i % 251).to_le_bytes())
        .collect();
    let mut gz = Vec::new();
    GzipEncoder::new(&data[..])
        .read_to_end(&mut gz)
        .await
        .unwrap();
    let path = dir.path().join("g.bin");
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let req = http::Request::post(format!("{}/files?path={}", agent.url(), path.display()))
        .header("content-type", "application/octet-stream")
        .header("content-encoding", "gzip")
        .body(http_body_util::Full::new(bytes::Bytes::from(gz)))
        .unwrap();
    let resp = http.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(std::fs::read(&path).unwrap(), data);
    let req = http::Request::get(format!("{}/files?path={}", agent.url(), path.display()))
        .header("accept-encoding", "gzip")
        .body(http_body_util::Full::default())
        .unwrap();
    let resp = http.request(req).await.unwrap();
    assert_eq!(resp.headers()["content-encoding"], "gzip");
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert!(body.len() < data.len());
    let mut plain = Vec::new();
    GzipDecoder::new(&body[..])
        .read_to_end(&mut plain)
        .await
        .unwrap();
    assert_eq!(plain, data);
    agent.stop().await;
}

#[tokio::test]
async fn processes_and_files_run_as_the_requested_user() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!(
            "SKIPPED processes_and_files_run_as_the_requested_user: needs root to switch users"
        );
        return;
    }
    let agent = TestAgent::start(AgentOptions::default()).await;
    let root = GuestClient::new(&agent.url()).unwrap();
    assert_eq!(
        root.run("/bin/sh", &["-c", "id -u"]).await.unwrap().stdout,
        b"0\n"
    );
    // Basic authorization names the user.
    let nobody = GuestClient::new(&agent.url()).unwrap().with_user("nobody");
    let out = nobody
        .run("/bin/sh", &["-c", "id -u; id -g; pwd; echo $USER $HOME"])
        .await
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "65534\n65534\n/\nnobody /nonexistent\n"
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let f = dir.path().join("sub/owned.txt");
    nobody
        .upload(
            f.to_str().unwrap(),
            futures::stream::iter([Ok(bytes::Bytes::from_static(b"x"))]),
        )
        .await
        .unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(&f).unwrap().uid(), 65534);
    assert_eq!(std::fs::metadata(f.parent().unwrap()).unwrap().uid(), 65534);
    let unknown = GuestClient::new(&agent.url())
        .unwrap()
        .with_user("no-such-user-x");
    let err = unknown.run("/bin/true", &[]).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::Unauthenticated), "{err}");
    // /init changes the default user and the default working directory.
    root.init(&serde_json::json!({"defaultUser": "nobody", "defaultWorkdir": "/tmp"}))
        .await
        .unwrap();
    let out = root.run("/bin/sh", &["-c", "id -u; pwd"]).await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "65534\n/tmp\n");
    let err = root
        .init(&serde_json::json!({"defaultUser": "no-such-user-x"}))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no-such-user-x"), "{err}");
    agent.stop().await;
}

#[tokio::test]
async fn metrics_and_envs_report_the_sandbox() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    c.init(&serde_json::json!({"envVars": {"FROM_INIT": "1"}}))
        .await
        .unwrap();
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let get = |path: &str| {
        http.request(
            http::Request::get(format!("{}{path}", agent.url()))
                .body(http_body_util::Full::default())
                .unwrap(),
        )
    };
    let body = http_body_util::BodyExt::collect(get("/metrics").await.unwrap().into_body())
        .await
        .unwrap()
        .to_bytes();
    let m: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let num = |k: &str| {
        m[k].as_f64()
            .unwrap_or_else(|| panic!("{k} missing in {m}"))
    };
    assert!(num("cpu_count") >= 1.0);
    assert!((0.0..=100.0).contains(&num("cpu_used_pct")));
    assert!(num("mem_total") > num("mem_used") && num("mem_used") > 0.0);
    assert_eq!(num("mem_total_mib"), (num("mem_total") / 1048576.0).floor());
    assert!(num("disk_total") >= num("disk_used") && num("disk_total") > 0.0);
    assert!(num("ts") > 1.7e9);
    let body = http_body_util::BodyExt::collect(get("/envs").await.unwrap().into_body())
        .await
        .unwrap()
        .to_bytes();
    let envs: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(envs["FROM_INIT"], "1");
    agent.stop().await;
}

#[tokio::test]
async fn recursive_watch_follows_new_subdirectories_and_polling_watchers_drain() {
    use agentenv_guest::proto::filesystem as fs;
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap().to_string();
    let req = fs::WatchDirRequest {
        path: root.clone(),
        recursive: true,
        include_entry: true,
        allow_network_mounts: false,
    };
    let mut stream = c
        .server_stream::<_, fs::WatchDirResponse>("/filesystem.Filesystem/WatchDir", &req)
        .await
        .unwrap();
    let first = stream.next().await.unwrap().unwrap();
    assert!(matches!(
        first.event,
        Some(fs::watch_dir_response::Event::Start(_))
    ));
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    // The new directory is watched once its create event was handled.
    let mut names = Vec::new();
    let mut wait_for = async |want: &str, ty: fs::EventType, names: &mut Vec<String>| {
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let m = stream.next().await.unwrap().unwrap();
                if let Some(fs::watch_dir_response::Event::Filesystem(e)) = m.event {
                    names.push(e.name.clone());
                    if e.name == want && e.r#type == ty as i32 {
                        return e;
                    }
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no {ty:?} event for {want}; saw {names:?}"))
    };
    let e = wait_for("sub", fs::EventType::Create, &mut names).await;
    assert_eq!(e.entry.unwrap().r#type, fs::FileType::Directory as i32);
    std::fs::write(dir.path().join("sub/f.txt"), b"1").unwrap();
    wait_for("sub/f.txt", fs::EventType::Create, &mut names).await;
    std::fs::rename(dir.path().join("sub/f.txt"), dir.path().join("g.txt")).unwrap();
    wait_for("sub/f.txt", fs::EventType::Rename, &mut names).await;
    wait_for("g.txt", fs::EventType::Create, &mut names).await;
    drop(stream);

    // Polling watcher: events accumulate, GetWatcherEvents drains them.
    let created: fs::CreateWatcherResponse = c
        .unary(
            "/filesystem.Filesystem/CreateWatcher",
            &fs::CreateWatcherRequest {
                path: root.clone(),
                recursive: false,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    std::fs::write(dir.path().join("sub/deep.txt"), b"x").unwrap(); // not reported: not recursive
    std::fs::write(dir.path().join("top.txt"), b"x").unwrap();
    let get = fs::GetWatcherEventsRequest {
        watcher_id: created.watcher_id.clone(),
    };
    let events = eventually("polled events", Duration::from_secs(10), || async {
        let r: fs::GetWatcherEventsResponse = c
            .unary("/filesystem.Filesystem/GetWatcherEvents", &get)
            .await
            .unwrap();
        (!r.events.is_empty()).then_some(r.events)
    })
    .await;
    assert!(events.iter().any(|e| e.name == "top.txt"), "{events:?}");
    assert!(
        events
            .iter()
            .all(|e| e.name != "sub/deep.txt" && e.name != "deep.txt"),
        "{events:?}"
    );
    let _: fs::RemoveWatcherResponse = c
        .unary(
            "/filesystem.Filesystem/RemoveWatcher",
            &fs::RemoveWatcherRequest {
                watcher_id: created.watcher_id.clone(),
            },
        )
        .await
        .unwrap();
    let err = c
        .unary::<_, fs::GetWatcherEventsResponse>("/filesystem.Filesystem/GetWatcherEvents", &get)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound));
    let err = c
        .unary::<_, fs::CreateWatcherResponse>(
            "/filesystem.Filesystem/CreateWatcher",
            &fs::CreateWatcherRequest {
                path: dir.path().join("top.txt").display().to_string(),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(Code::InvalidArgument), "{err}");
    assert!(agent.state.watchers.is_empty());
    agent.stop().await;
}

#[tokio::test]
async fn killing_a_shell_also_kills_its_children() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    let mut stream = c
        .start(&start_req(
            "/bin/sh",
            &["-c", "sleep 60 & echo $!; wait"],
            false,
        ))
        .await
        .unwrap();
    let pid = first_pid(&mut stream, |m: pr::StartResponse| m.event).await;
    let mut child = String::new();
    while !child.ends_with('\n') {
        let m = stream.next().await.unwrap().unwrap();
        if let Some(pr::process_event::Event::Data(d)) = m.event.and_then(|e| e.event)
            && let Some(pr::process_event::data_event::Output::Stdout(b)) = d.output
        {
            child.push_str(&String::from_utf8_lossy(&b));
        }
    }
    let child: u32 = child.trim().parse().unwrap();
    c.send_signal(pid_sel(pid), pr::Signal::Sigkill)
        .await
        .unwrap();
    let out = collect_output(stream.map(|r| r.map(|m| m.event)))
        .await
        .unwrap();
    assert_eq!(out.end.unwrap().status, "signal: killed");
    // The background child is gone too (or at most a zombie awaiting its new parent).
    eventually(
        "the shell's child to die",
        Duration::from_secs(10),
        || async {
            let stat = std::fs::read_to_string(format!("/proc/{child}/stat")).unwrap_or_default();
            let state = stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .chars()
                .next();
            matches!(state, None | Some('Z') | Some('X')).then_some(())
        },
    )
    .await;
    agent.stop().await;
}

#[tokio::test]
async fn files_compose_concatenates_in_order_and_removes_sources() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let parts: Vec<_> = (0..3)
        .map(|i| {
            let p = dir.path().join(format!("part{i}"));
            std::fs::write(&p, format!("<{i}>").repeat(1000)).unwrap();
            p
        })
        .collect();
    let dest = dir.path().join("out/all.bin");
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let post = |body: serde_json::Value| {
        http.request(
            http::Request::post(format!("{}/files/compose", agent.url()))
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(
                    body.to_string(),
                )))
                .unwrap(),
        )
    };
    let resp = post(serde_json::json!({
        "source_paths": parts.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "destination": dest.display().to_string(),
    }))
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    let info: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(info["path"], dest.display().to_string());
    assert_eq!(info["type"], "file");
    let want: String = (0..3).map(|i| format!("<{i}>").repeat(1000)).collect();
    assert_eq!(std::fs::read_to_string(&dest).unwrap(), want);
    assert!(parts.iter().all(|p| !p.exists()), "sources must be deleted");
    let resp = post(serde_json::json!({
        "source_paths": [dir.path().join("missing").display().to_string()],
        "destination": dest.display().to_string(),
    }))
    .await
    .unwrap();
    assert_eq!(resp.status(), 404);
    assert_eq!(
        std::fs::read_to_string(&dest).unwrap(),
        want,
        "a failed compose changed the destination"
    );
    agent.stop().await;
}

#[tokio::test]
async fn pseudo_files_with_size_zero_download_their_content() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    let mut body = Vec::new();
    let mut s = c.download("/proc/self/status").await.unwrap();
    while let Some(chunk) = s.next().await {
        body.extend_from_slice(&chunk.unwrap());
    }
    assert!(String::from_utf8_lossy(&body).contains("Pid:"), "{body:?}");
    agent.stop().await;
}

#[tokio::test]
async fn file_transfers_to_and_from_local_files_keep_every_byte() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    // Not a multiple of the transfer step, so the last piece is partial.
    let mut data = vec![0u8; (3 << 20) + 12_345];
    let mut seed = 0xDEAD_BEEF_1234_5678u64;
    fill_pseudo_random(&mut data, &mut seed);
    std::fs::write(&src, &data).unwrap();
    let remote = dir.path().join("remote/sub/up.bin");
    c.upload_file(&src, remote.to_str().unwrap()).await.unwrap();
    assert!(
        std::fs::read(&remote).unwrap() == data,
        "uploaded bytes differ"
    );
    let back = dir.path().join("back.bin");
    let n = c
        .download_to_file(remote.to_str().unwrap(), &back)
        .await
        .unwrap();
    assert_eq!(n, data.len() as u64);
    assert!(
        std::fs::read(&back).unwrap() == data,
        "downloaded bytes differ"
    );
    // An empty file both ways.
    let empty = dir.path().join("empty");
    std::fs::write(&empty, b"").unwrap();
    let remote_empty = dir.path().join("remote/empty");
    c.upload_file(&empty, remote_empty.to_str().unwrap())
        .await
        .unwrap();
    let back_empty = dir.path().join("back-empty");
    assert_eq!(
        c.download_to_file(remote_empty.to_str().unwrap(), &back_empty)
            .await
            .unwrap(),
        0
    );
    assert_eq!(std::fs::metadata(&back_empty).unwrap().len(), 0);
    // A pseudo file answers chunked: its content still arrives.
    let status = dir.path().join("status");
    let n = c
        .download_to_file("/proc/self/status", &status)
        .await
        .unwrap();
    let text = std::fs::read_to_string(&status).unwrap();
    assert_eq!(n, text.len() as u64);
    assert!(text.contains("Pid:"), "{text}");
    agent.stop().await;
}

#[tokio::test]
async fn file_transfer_errors_name_the_cause_and_leave_no_local_file() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("never.bin");
    let err = c
        .download_to_file(dir.path().join("missing").to_str().unwrap(), &local)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound), "{err}");
    assert!(!local.exists(), "a failed download created {local:?}");
    // Uploading onto a directory is refused by the agent, with its reason.
    let src = dir.path().join("small");
    std::fs::write(&src, b"hello").unwrap();
    let err = c
        .upload_file(&src, dir.path().to_str().unwrap())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ClientError::Http { status, body, .. }
            if *status == 400 && body.contains("is a directory")),
        "{err}"
    );
    // A missing local file is the client's error, naming the file.
    let err = c
        .upload_file(&dir.path().join("absent"), "/tmp/x")
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ClientError::Io { path, .. } if path.ends_with("absent")),
        "{err}"
    );
    // Once a token is set, transfers without it are refused as unauthenticated.
    c.init(&serde_json::json!({"accessToken": "tok"}))
        .await
        .unwrap();
    let err = c
        .upload_file(&src, dir.path().join("up").to_str().unwrap())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(Code::Unauthenticated), "{err}");
    let err = c
        .download_to_file(src.to_str().unwrap(), &local)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(Code::Unauthenticated), "{err}");
    let authed = GuestClient::new(&agent.url())
        .unwrap()
        .with_access_token("tok");
    authed
        .upload_file(&src, dir.path().join("up").to_str().unwrap())
        .await
        .unwrap();
    agent.stop().await;
}

#[tokio::test]
async fn dropping_a_download_midway_aborts_the_transfer() {
    // A server that sends a head promising 1 GiB, a little of it, then stalls.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (closed_tx, closed_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; 4096];
        let _ = s.read(&mut b).unwrap();
        s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n")
            .unwrap();
        s.write_all(&[7u8; 4096]).unwrap();
        // Blocks until the client goes away.
        let eof = matches!(s.read(&mut b), Ok(0) | Err(_));
        closed_tx.send(eof).unwrap();
    });
    let c = GuestClient::new(&format!("http://{addr}")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("partial");
    let r = tokio::time::timeout(
        Duration::from_millis(300),
        c.download_to_file("/big", &local),
    )
    .await;
    assert!(r.is_err(), "the stalled download cannot have finished");
    let closed =
        tokio::task::spawn_blocking(move || closed_rx.recv_timeout(Duration::from_secs(10)))
            .await
            .unwrap();
    assert_eq!(
        closed,
        Ok(true),
        "the client did not close its connection when the download was dropped"
    );
}
