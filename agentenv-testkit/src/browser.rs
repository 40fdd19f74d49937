//! A real headless Chromium driven over WebDriver: Debian's `chromium` and
//! `chromium-driver` packages, `chromedriver` on a free loopback port and one session
//! opened with [`fantoccini`]. Dropping the [`Browser`] kills chromedriver and every
//! Chromium process it started (they share chromedriver's process group); the profile is a
//! fresh temporary directory.
//!
//! A test that needs the browser asks [`skip_reason`] first and prints `SKIPPED: ...` when
//! the packages are missing (`scripts/test.sh` fails on a skip, so CI runs it for real).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub use fantoccini::{Client, Locator};

use crate::{Wait, free_port};

/// The window size of [`Browser::start`]: a laptop screen.
pub const LAPTOP: (u32, u32) = (1280, 860);

/// Chromium's flags: headless, no sandbox (tests run as root), and nothing that reaches
/// out on its own (without the networking flags this machine's closed network refuses its
/// background connections and pages load slowly or not at all).
const CHROMIUM_ARGS: &[&str] = &[
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--disable-crash-reporter",
    "--disable-breakpad",
];

/// An executable named `name` on `PATH`.
fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The Chromium binary: `AGENTENV_CHROMIUM`, else `chromium` on `PATH`.
pub fn chromium() -> Option<PathBuf> {
    match std::env::var_os("AGENTENV_CHROMIUM") {
        Some(p) => Some(PathBuf::from(p)).filter(|p| is_executable(p)),
        None => on_path("chromium"),
    }
}

/// The WebDriver server: `AGENTENV_CHROMEDRIVER`, else `chromedriver` on `PATH`.
pub fn chromedriver() -> Option<PathBuf> {
    match std::env::var_os("AGENTENV_CHROMEDRIVER") {
        Some(p) => Some(PathBuf::from(p)).filter(|p| is_executable(p)),
        None => on_path("chromedriver"),
    }
}

/// Why a browser test cannot run here, if it cannot.
pub fn skip_reason() -> Option<String> {
    if chromium().is_none() {
        return Some(
            "chromium is not installed: `apt-get install chromium chromium-driver` \
             (scripts/setup.sh installs scripts/apt-packages.txt)"
                .into(),
        );
    }
    if chromedriver().is_none() {
        return Some(
            "chromedriver is not installed: `apt-get install chromium-driver` \
             (scripts/setup.sh installs scripts/apt-packages.txt)"
                .into(),
        );
    }
    None
}

/// A headless Chromium session; chromedriver and Chromium are killed when it is dropped.
pub struct Browser {
    client: Client,
    driver: Driver,
}

/// chromedriver's process (leader of its own process group) and Chromium's profile.
struct Driver {
    child: Option<Child>,
    profile: tempfile::TempDir,
}

impl Driver {
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pgid = child.id() as libc::pid_t;
            // SAFETY: kill(2) with a negative pid signals the process group created for
            // chromedriver (`process_group(0)`); it touches no memory.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
            let _ = child.wait();
        }
    }
}

/// The pids of process group `pgid` that are not zombies, from `/proc/<pid>/stat`.
fn running_in_group(pgid: i32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            // "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
            let Some((_, rest)) = stat.rsplit_once(')') else {
                return false;
            };
            let mut fields = rest.split_whitespace();
            let state = fields.next();
            let pgrp = fields.nth(1).and_then(|f| f.parse::<i32>().ok());
            state != Some("Z") && state != Some("X") && pgrp == Some(pgid)
        })
        .collect()
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Browser {
    /// Starts chromedriver and opens a session with a 1280x860 window ([`LAPTOP`]).
    pub async fn start() -> Result<Browser, String> {
        Self::start_with_size(LAPTOP.0, LAPTOP.1).await
    }

    /// Starts chromedriver and opens a session with a `width` x `height` window.
    pub async fn start_with_size(width: u32, height: u32) -> Result<Browser, String> {
        if let Some(r) = skip_reason() {
            return Err(r);
        }
        let chromium = chromium().expect("checked by skip_reason");
        let driver_bin = chromedriver().expect("checked by skip_reason");
        let profile = tempfile::Builder::new()
            .prefix("agentenv-chromium-")
            .tempdir()
            .map_err(|e| format!("creating a Chromium profile directory: {e}"))?;
        let port = free_port();
        let mut cmd = Command::new(&driver_bin);
        cmd.arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            // Its own process group: dropping the browser kills chromedriver and the
            // Chromium processes it started in one signal.
            .process_group(0);
        let child = cmd
            .spawn()
            .map_err(|e| format!("starting {}: {e}", driver_bin.display()))?;
        // From here on, dropping `driver` kills the process group.
        let driver = Driver {
            child: Some(child),
            profile,
        };
        let url = format!("http://127.0.0.1:{port}");
        Wait::new(
            format_args!("chromedriver to listen on 127.0.0.1:{port}"),
            Duration::from_secs(30),
        )
        .every(Duration::from_millis(20))
        .try_until(|| async { tokio::net::TcpStream::connect(("127.0.0.1", port)).await })
        .await?;

        let mut args: Vec<String> = CHROMIUM_ARGS.iter().map(|s| s.to_string()).collect();
        args.push(format!(
            "--user-data-dir={}",
            driver.profile.path().display()
        ));
        args.push(format!("--window-size={width},{height}"));
        let mut caps = serde_json::Map::new();
        caps.insert("browserName".into(), "chrome".into());
        caps.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": chromium.display().to_string(),
                "args": args,
            }),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = fantoccini::ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&url)
            .await
            .map_err(|e| format!("opening a Chromium session through chromedriver: {e}"))?;
        let browser = Browser { client, driver };
        browser.set_viewport_size(width, height).await?;
        Ok(browser)
    }

    /// Resizes the window so that the page's viewport (`innerWidth` x `innerHeight`, what a
    /// screenshot shows) is `width` x `height`.
    pub async fn set_viewport_size(&self, width: u32, height: u32) -> Result<(), String> {
        let inner = |v: serde_json::Value| -> Option<(i64, i64)> {
            Some((v.get(0)?.as_i64()?, v.get(1)?.as_i64()?))
        };
        let viewport = || async {
            self.client
                .execute("return [window.innerWidth, window.innerHeight];", vec![])
                .await
                .ok()
                .and_then(inner)
        };
        let mut target = (i64::from(width), i64::from(height));
        // Two rounds: the first learns the window's frame, the second corrects a window
        // the screen clamped.
        for _ in 0..2 {
            let Some((w, h)) = viewport().await else {
                return Err("reading the viewport size".into());
            };
            if (w, h) == (i64::from(width), i64::from(height)) {
                return Ok(());
            }
            let (ow, oh) = self
                .client
                .get_window_size()
                .await
                .map_err(|e| format!("reading the window size: {e}"))?;
            target = (
                ow as i64 + i64::from(width) - w,
                oh as i64 + i64::from(height) - h,
            );
            self.client
                .set_window_size(target.0.max(1) as u32, target.1.max(1) as u32)
                .await
                .map_err(|e| format!("resizing the window to {target:?}: {e}"))?;
        }
        match viewport().await {
            Some(v) if v == (i64::from(width), i64::from(height)) => Ok(()),
            v => Err(format!(
                "the viewport is {v:?}, not {width}x{height}, with a {target:?} window"
            )),
        }
    }

    /// The WebDriver client of the session.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The process group of chromedriver and the Chromium processes it started (gone once
    /// the browser is closed or dropped).
    pub fn process_group(&self) -> Option<i32> {
        self.driver.child.as_ref().map(|c| c.id() as i32)
    }

    /// The processes of [`Browser::process_group`] that still run (zombies left to an
    /// init that does not reap them are not counted).
    pub fn running_in_group(pgid: i32) -> Vec<i32> {
        running_in_group(pgid)
    }

    /// A PNG of the viewport, written to `path` (parent directories made).
    pub async fn save_screenshot(&self, path: &Path) -> Result<(), String> {
        let png = self
            .client
            .screenshot()
            .await
            .map_err(|e| format!("taking a screenshot: {e}"))?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        }
        std::fs::write(path, png).map_err(|e| format!("writing {}: {e}", path.display()))
    }

    /// Ends the session, then stops chromedriver and Chromium.
    pub async fn close(mut self) {
        let _ = self.client.clone().close().await;
        self.driver.kill();
    }
}

impl std::ops::Deref for Browser {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.client
    }
}
