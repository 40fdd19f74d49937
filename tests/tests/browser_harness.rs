//! The headless-browser fixture itself (agentenv-testkit feature `browser`): Chromium
//! loads a page from a loopback HTTP server, runs its script, takes keyboard input and
//! clicks, and every process it started is gone once the session is closed.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use agentenv_testkit::browser::{Browser, Locator, skip_reason};
use agentenv_testkit::eventually;

const PAGE: &str = r#"<!doctype html>
<html><head><title>harness</title></head>
<body>
<input id="name" autofocus>
<button id="greet">greet</button>
<p id="out">waiting</p>
<script>
document.getElementById('out').textContent = 'script ran';
document.getElementById('greet').addEventListener('click', () => {
  document.getElementById('out').textContent = 'hello ' + document.getElementById('name').value;
});
</script>
</body></html>"#;

/// Serves [`PAGE`] on a loopback port from a thread, for every request, until the test
/// ends.
fn serve_page() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binding a loopback port");
    let addr = listener.local_addr().expect("local address");
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
            let mut line = String::new();
            // The request line and headers, up to the blank line.
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
                if line == "\r\n" || line == "\n" {
                    break;
                }
                line.clear();
            }
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{PAGE}",
                PAGE.len()
            );
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chromium_runs_a_loopback_page_takes_input_and_is_gone_after_close() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let addr = serve_page();
    let browser = Browser::start().await.expect("starting the browser");
    let pgid = browser
        .process_group()
        .expect("chromedriver's process group");
    browser
        .goto(&format!("http://{addr}/"))
        .await
        .expect("loading the page");
    assert_eq!(browser.title().await.expect("title"), "harness");

    let out = browser
        .find(Locator::Id("out"))
        .await
        .expect("the output paragraph");
    eventually("the page's script to run", Duration::from_secs(10), || {
        let out = out.clone();
        async move { out.text().await.map(|t| t == "script ran").unwrap_or(false) }
    })
    .await;

    browser
        .find(Locator::Id("name"))
        .await
        .expect("the input")
        .send_keys("chromium")
        .await
        .expect("typing");
    browser
        .find(Locator::Id("greet"))
        .await
        .expect("the button")
        .click()
        .await
        .expect("clicking");
    eventually("the click handler's text", Duration::from_secs(10), || {
        let out = out.clone();
        async move {
            match out.text().await {
                Ok(t) if t == "hello chromium" => Ok(()),
                Ok(t) => Err(t),
                Err(e) => Err(e.to_string()),
            }
        }
    })
    .await;

    let size = browser
        .execute("return [window.innerWidth, window.innerHeight]", vec![])
        .await
        .expect("running a script");
    assert_eq!(
        size,
        serde_json::json!([1280, 860]),
        "the laptop-sized viewport"
    );

    let shot = tempfile::tempdir().expect("temp dir");
    let png = shot.path().join("harness.png");
    browser.save_screenshot(&png).await.expect("screenshot");
    let bytes = std::fs::read(&png).expect("reading the screenshot");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG file");

    assert!(
        !Browser::running_in_group(pgid).is_empty(),
        "chromedriver runs while the session is open"
    );
    browser.close().await;
    eventually(
        "chromedriver and Chromium to be gone once the browser is closed",
        Duration::from_secs(10),
        || async move {
            let left = Browser::running_in_group(pgid);
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("still running: {left:?}"))
            }
        },
    )
    .await;
}
