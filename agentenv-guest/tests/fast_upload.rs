//! The zero-copy upload path on real sockets: a raw `POST /files` as a
//! connection's first request has its body spliced into the file, with the
//! same checks and answers as hyper's handler; the connection stays usable
//! afterwards; every other upload still goes through hyper.

mod common;

use std::path::Path;
use std::time::Duration;

use agentenv_guest::client::GuestClient;
use agentenv_guest::server::AgentOptions;
use agentenv_testkit::eventually;
use base64::Engine as _;
use common::{TestAgent, open_fds};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One HTTP/1.1 response.
#[derive(Debug)]
struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A client connection that reads responses one by one; bytes read past a
/// response stay for the next.
struct Conn {
    s: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    async fn open(agent: &TestAgent) -> Conn {
        let s = TcpStream::connect(agent.addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        Conn { s, buf: Vec::new() }
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).await.unwrap();
    }

    async fn fill(&mut self) -> usize {
        let mut chunk = vec![0u8; 64 * 1024];
        let n = tokio::time::timeout(Duration::from_secs(20), self.s.read(&mut chunk))
            .await
            .expect("no answer within 20 s")
            .unwrap_or(0);
        self.buf.extend_from_slice(&chunk[..n]);
        n
    }

    /// The next response; its body must have a `Content-Length` (1xx, 204:
    /// none).
    async fn response(&mut self) -> Resp {
        loop {
            let mut h = [httparse::EMPTY_HEADER; 32];
            let mut r = httparse::Response::new(&mut h);
            if let httparse::Status::Complete(n) = r.parse(&self.buf).unwrap() {
                let status = r.code.unwrap();
                let headers: Vec<(String, String)> = r
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_ascii_lowercase(),
                            String::from_utf8_lossy(h.value).into_owned(),
                        )
                    })
                    .collect();
                let len = if status < 200 || status == 204 {
                    0
                } else {
                    headers
                        .iter()
                        .find(|(k, _)| k == "content-length")
                        .map(|(_, v)| v.parse::<usize>().unwrap())
                        .expect("a response with Content-Length")
                };
                while self.buf.len() < n + len {
                    assert!(self.fill().await > 0, "connection closed mid-body");
                }
                let body = self.buf[n..n + len].to_vec();
                self.buf.drain(..n + len);
                return Resp {
                    status,
                    headers,
                    body,
                };
            }
            assert!(
                self.fill().await > 0,
                "connection closed before a response: {:?}",
                String::from_utf8_lossy(&self.buf)
            );
        }
    }

    /// Whether the server closed the connection (with nothing more sent).
    async fn closed(&mut self) -> bool {
        self.buf.is_empty() && self.fill().await == 0
    }
}

fn upload_head(path: &Path, len: usize, extra: &str) -> Vec<u8> {
    format!(
        "POST /files?path={} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\nContent-Length: {len}\r\n{extra}\r\n",
        path.display()
    )
    .into_bytes()
}

fn get_file(path: &Path) -> Vec<u8> {
    format!(
        "GET /files?path={} HTTP/1.1\r\nHost: x\r\n\r\n",
        path.display()
    )
    .into_bytes()
}

fn pseudo_random(len: usize, mut seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; len];
    for chunk in out.chunks_mut(8) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        chunk.copy_from_slice(&seed.to_le_bytes()[..chunk.len()]);
    }
    out
}

fn sha256(b: &[u8]) -> Vec<u8> {
    Sha256::digest(b).to_vec()
}

/// Names in `dir`, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Asserts a successful upload answer for `path`.
fn assert_uploaded(r: &Resp, path: &Path) {
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/json"));
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(
        v,
        serde_json::json!([{
            "path": path.display().to_string(),
            "name": path.file_name().unwrap().to_string_lossy(),
            "type": "file",
        }])
    );
}

#[tokio::test]
async fn fast_path_upload_of_an_odd_size_keeps_every_byte() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/odd.bin");
    let data = pseudo_random((3 << 20) + 12_345, 0xDEAD_BEEF_1234_5678);
    let mut c = Conn::open(&agent).await;
    c.send(&upload_head(&path, data.len(), "")).await;
    c.send(&data).await;
    let r = c.response().await;
    assert_uploaded(&r, &path);
    assert!(r.header("date").is_some_and(|d| d.ends_with(" GMT")));
    let got = std::fs::read(&path).unwrap();
    assert_eq!(got.len(), data.len());
    assert_eq!(sha256(&got), sha256(&data), "uploaded bytes differ");
    assert_eq!(entries(&dir.path().join("sub")), ["odd.bin"]);
    assert_eq!(agent.state.fast_path_uploads(), 1);
    agent.stop().await;
}

#[tokio::test]
async fn fast_path_upload_of_zero_bytes_replaces_a_file_with_an_empty_one() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty");
    std::fs::write(&path, b"previous content").unwrap();
    let mut c = Conn::open(&agent).await;
    c.send(&upload_head(&path, 0, "")).await;
    assert_uploaded(&c.response().await, &path);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
    assert_eq!(entries(dir.path()), ["empty"]);
    assert_eq!(agent.state.fast_path_uploads(), 1);
    agent.stop().await;
}

#[tokio::test]
async fn fast_path_upload_writes_body_bytes_that_came_with_the_head_then_the_rest() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("with-head.bin");
    let data = pseudo_random((200 << 10) + 7, 42);
    // Head and body in one write: the agent's first read takes part of the
    // body with the head.
    let mut req = upload_head(&path, data.len(), "");
    req.extend_from_slice(&data);
    let mut c = Conn::open(&agent).await;
    c.send(&req).await;
    assert_uploaded(&c.response().await, &path);
    assert_eq!(sha256(&std::fs::read(&path).unwrap()), sha256(&data));
    assert_eq!(agent.state.fast_path_uploads(), 1);
    agent.stop().await;
}

#[tokio::test]
async fn a_connection_stays_usable_after_a_fast_path_upload() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kept.bin");
    let data = pseudo_random(1 << 20, 7);
    let mut c = Conn::open(&agent).await;
    c.send(&upload_head(&path, data.len(), "")).await;
    c.send(&data).await;
    let r = c.response().await;
    assert_uploaded(&r, &path);
    assert_eq!(
        r.header("connection"),
        None,
        "the upload closed the connection"
    );

    // A download of the same file on the same connection.
    c.send(&get_file(&path)).await;
    let r = c.response().await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.body == data, "downloaded bytes differ");

    // A Connect call.
    let stat = serde_json::json!({"path": path.display().to_string()}).to_string();
    c.send(
        format!(
            "POST /filesystem.Filesystem/Stat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{stat}",
            stat.len()
        )
        .as_bytes(),
    )
    .await;
    let r = c.response().await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["entry"]["name"], "kept.bin", "{v}");
    assert_eq!(v["entry"]["size"], (1 << 20).to_string(), "{v}");

    // A second upload on the connection is hyper's, and works as well.
    let second = dir.path().join("second");
    c.send(&upload_head(&second, 5, "")).await;
    c.send(b"again").await;
    assert_uploaded(&c.response().await, &second);
    assert_eq!(std::fs::read(&second).unwrap(), b"again");
    assert_eq!(agent.state.fast_path_uploads(), 1);
    agent.stop().await;
}

#[tokio::test]
async fn requests_pipelined_right_behind_an_upload_body_are_answered() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    // A small body: the next request arrives in the same read as the head.
    // A large one: the next request follows the spliced body.
    for (name, len) in [("small", 100), ("large", 3 << 20)] {
        let path = dir.path().join(name);
        let data = pseudo_random(len, len as u64);
        let mut req = upload_head(&path, len, "");
        req.extend_from_slice(&data);
        req.extend_from_slice(&get_file(&path));
        req.extend_from_slice(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
        let mut c = Conn::open(&agent).await;
        c.send(&req).await;
        assert_uploaded(&c.response().await, &path);
        let r = c.response().await;
        assert_eq!(r.status, 200, "{name}: {}", r.text());
        assert!(r.body == data, "{name}: downloaded bytes differ");
        assert_eq!(c.response().await.status, 204, "{name}");
    }
    assert_eq!(agent.state.fast_path_uploads(), 2);
    agent.stop().await;
}

#[tokio::test]
async fn expect_100_continue_is_answered_before_the_body_is_sent() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("continued");
    let data = pseudo_random(300_001, 3);
    let mut c = Conn::open(&agent).await;
    c.send(&upload_head(
        &path,
        data.len(),
        "Expect: 100-continue\r\nConnection: close\r\n",
    ))
    .await;
    let r = c.response().await;
    assert_eq!(r.status, 100, "{r:?}");
    c.send(&data).await;
    let r = c.response().await;
    assert_uploaded(&r, &path);
    assert_eq!(r.header("connection"), Some("close"));
    assert!(c.closed().await, "Connection: close was not honoured");
    assert_eq!(sha256(&std::fs::read(&path).unwrap()), sha256(&data));
    assert_eq!(agent.state.fast_path_uploads(), 1);
    agent.stop().await;
}

fn signature(path: &Path, token: &str, expiration: Option<u64>) -> String {
    let mut raw = format!("{}:write::{token}", path.display());
    if let Some(e) = expiration {
        raw.push_str(&format!(":{e}"));
    }
    let sig = base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(raw));
    // `+` and `/` percent-encoded for the query.
    format!("v1_{sig}").replace('+', "%2B").replace('/', "%2F")
}

#[tokio::test]
async fn fast_path_upload_without_token_after_init_is_401() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    GuestClient::new(&agent.url())
        .unwrap()
        .init(&serde_json::json!({"accessToken": "s3cret"}))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("guarded");
    let data = pseudo_random(1 << 20, 9);

    // Without the token: 401, then the connection closes; nothing written.
    // The whole body is sent: the agent reads it away before closing, so
    // the answer is not lost to a reset.
    for extra in ["", "X-Access-Token: s3creT\r\n"] {
        let mut c = Conn::open(&agent).await;
        let mut req = upload_head(&path, data.len(), extra);
        req.extend_from_slice(&data);
        c.send(&req).await;
        let r = c.response().await;
        assert_eq!(r.status, 401, "{}", r.text());
        assert!(r.text().contains("X-Access-Token"), "{}", r.text());
        assert_eq!(r.header("connection"), Some("close"));
        assert!(c.closed().await);
    }
    // Asking first: the refusal comes instead of 100 Continue.
    let mut c = Conn::open(&agent).await;
    c.send(&upload_head(&path, data.len(), "Expect: 100-continue\r\n"))
        .await;
    assert_eq!(c.response().await.status, 401);
    assert!(c.closed().await);
    assert!(entries(dir.path()).is_empty(), "{:?}", entries(dir.path()));

    // With the token, or with a signed URL (valid / expired).
    let mut c = Conn::open(&agent).await;
    c.send(&upload_head(&path, 5, "X-Access-Token: s3cret\r\n"))
        .await;
    c.send(b"token").await;
    assert_uploaded(&c.response().await, &path);
    let later = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 60;
    for (exp, status) in [(later, 200), (1_000, 401)] {
        let mut c = Conn::open(&agent).await;
        c.send(
            format!(
                "POST /files?path={}&signature={}&signature_expiration={exp} HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nsigned",
                path.display(),
                signature(&path, "s3cret", Some(exp)),
            )
            .as_bytes(),
        )
        .await;
        let r = c.response().await;
        assert_eq!(r.status, status, "{}", r.text());
    }
    assert_eq!(std::fs::read(&path).unwrap(), b"signed");
    assert_eq!(agent.state.fast_path_uploads(), 2);
    agent.stop().await;
}

/// Sends `req` on a fresh connection and returns the answer.
async fn exchange(agent: &TestAgent, req: &[u8]) -> Resp {
    let mut c = Conn::open(agent).await;
    c.send(req).await;
    c.response().await
}

#[tokio::test]
async fn fast_path_upload_onto_a_directory_is_the_same_400_as_through_hyper() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut req = upload_head(dir.path(), 5, "");
    req.extend_from_slice(b"hello");
    let fast = exchange(&agent, &req).await;
    assert_eq!(
        agent.state.fast_path_uploads(),
        0,
        "refused before counting"
    );
    // The same through hyper (chunked).
    let chunked = format!(
        "POST /files?path={} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        dir.path().display()
    );
    let slow = exchange(&agent, chunked.as_bytes()).await;
    assert_eq!(fast.status, 400, "{}", fast.text());
    assert_eq!((fast.status, fast.text()), (slow.status, slow.text()));
    assert!(fast.text().contains("is a directory"), "{}", fast.text());
    assert_eq!(fast.header("content-type"), slow.header("content-type"));
    // Other refusals match too: no path, an unknown user.
    let no_path = b"POST /files HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx";
    let r = exchange(&agent, no_path).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("`path` is required"), "{}", r.text());
    let p = dir.path().join("u");
    let bad_user = format!(
        "POST /files?path={}&username=no-such-user-x HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx",
        p.display()
    );
    let r = exchange(&agent, bad_user.as_bytes()).await;
    assert_eq!(r.status, 401, "{}", r.text());
    assert!(entries(dir.path()).is_empty(), "{:?}", entries(dir.path()));
    agent.stop().await;
}

#[tokio::test]
async fn a_client_disconnecting_mid_body_leaves_no_temp_file_and_no_fd() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let fds_before = open_fds();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.bin");
    std::fs::write(&path, b"previous content").unwrap();
    let mut c = Conn::open(&agent).await;
    c.send(&upload_head(&path, 8 << 20, "")).await;
    c.send(&pseudo_random(1 << 20, 5)).await;
    // The upload is under way: its temporary file exists.
    eventually(
        "the temporary file to appear",
        Duration::from_secs(10),
        || async { (entries(dir.path()).len() == 2).then_some(()) },
    )
    .await;
    assert_eq!(agent.state.fast_path_uploads(), 1);
    drop(c);
    eventually(
        "the temporary file to be removed",
        Duration::from_secs(10),
        || async { (entries(dir.path()) == ["cut.bin"]).then_some(()) },
    )
    .await;
    assert_eq!(
        std::fs::read(&path).unwrap(),
        b"previous content",
        "a cut-off upload clobbered the file"
    );
    eventually(
        "file descriptors to return to the baseline",
        Duration::from_secs(10),
        || async { (open_fds() <= fds_before).then_some(()) },
    )
    .await;
    // The agent still serves.
    let c = GuestClient::new(&agent.url()).unwrap();
    assert!(c.health().await.unwrap());
    agent.stop().await;
}

#[tokio::test]
async fn gzip_multipart_and_chunked_uploads_still_go_through_hyper() {
    use async_compression::tokio::bufread::GzipEncoder;
    let agent = TestAgent::start(AgentOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let data = pseudo_random(100_003, 11);

    let gz_path = dir.path().join("gz.bin");
    let mut gz = Vec::new();
    GzipEncoder::new(&data[..])
        .read_to_end(&mut gz)
        .await
        .unwrap();
    let mut req = upload_head(&gz_path, gz.len(), "Content-Encoding: gzip\r\n");
    req.extend_from_slice(&gz);
    assert_uploaded(&exchange(&agent, &req).await, &gz_path);
    assert!(std::fs::read(&gz_path).unwrap() == data, "gzip upload");

    let mp_path = dir.path().join("mp.bin");
    let mut body = b"--XX\r\nContent-Disposition: form-data; name=\"file\"; filename=\"mp.bin\"\r\nContent-Type: application/octet-stream\r\n\r\n".to_vec();
    body.extend_from_slice(&data);
    body.extend_from_slice(b"\r\n--XX--\r\n");
    let mut req = format!(
        "POST /files?path={} HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=XX\r\nContent-Length: {}\r\n\r\n",
        mp_path.display(),
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(&body);
    assert_uploaded(&exchange(&agent, &req).await, &mp_path);
    assert!(std::fs::read(&mp_path).unwrap() == data, "multipart upload");

    let ch_path = dir.path().join("chunked.bin");
    let mut req = format!(
        "POST /files?path={} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        ch_path.display()
    )
    .into_bytes();
    for piece in data.chunks(30_000) {
        req.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        req.extend_from_slice(piece);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"0\r\n\r\n");
    assert_uploaded(&exchange(&agent, &req).await, &ch_path);
    assert!(std::fs::read(&ch_path).unwrap() == data, "chunked upload");

    assert_eq!(agent.state.fast_path_uploads(), 0);
    agent.stop().await;
}
