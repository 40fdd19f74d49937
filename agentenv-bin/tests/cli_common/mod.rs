//! Helpers of the `aenv` tests: the CLI binary run with its own config directory, and
//! a tmux session as a real pseudo-terminal.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use agentenv_testkit::Wait;

/// The `aenv` binary under test.
pub fn aenv_bin() -> &'static str {
    env!("CARGO_BIN_EXE_aenv")
}

/// `aenv` with `XDG_CONFIG_HOME` set to `config` (an isolated credentials file).
pub struct Aenv {
    pub config: tempfile::TempDir,
}

impl Aenv {
    pub fn new() -> Aenv {
        Aenv {
            config: tempfile::tempdir().expect("config dir"),
        }
    }

    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(aenv_bin());
        c.args(args)
            .env("XDG_CONFIG_HOME", self.config.path())
            .env_remove("AENV_URL")
            .env_remove("AENV_API_KEY")
            .stdin(Stdio::null());
        c
    }

    /// Runs `aenv args…` (stdin empty) and returns its output.
    pub fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().expect("run aenv")
    }

    /// Runs `aenv args…` with `input` on stdin.
    pub fn run_with_input(&self, args: &[&str], input: &str) -> Output {
        use std::io::Write;
        let mut c = self.cmd(args);
        c.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().expect("spawn aenv");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().expect("wait aenv")
    }

    /// Runs and asserts success; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(
            o.status.success(),
            "aenv {args:?} failed ({:?}):\nstdout: {}\nstderr: {}",
            o.status.code(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// What the completion scripts run, `COMPLETE=bash aenv -- aenv <words>` (the last
    /// word is completed); returns the candidates, one a line.
    pub fn complete(&self, words: &[&str]) -> String {
        let mut c = self.cmd(&["--", "aenv"]);
        c.args(words)
            .env("COMPLETE", "bash")
            .env("_CLAP_COMPLETE_INDEX", words.len().to_string());
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    }

    pub fn credentials_path(&self) -> PathBuf {
        self.config.path().join("aenv/credentials")
    }

    /// Asserts that `aenv args…` failed (exit 1) for want of credentials, saying so.
    pub fn assert_not_authenticated(&self, args: &[&str]) -> Output {
        let o = self.run(args);
        assert_eq!(o.status.code(), Some(1));
        assert_eq!(
            stderr(&o).trim(),
            format!(
                "Error: not authenticated — run `aenv auth` first (expected credentials at {})",
                self.credentials_path().display()
            )
        );
        o
    }
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// SHA-256 of a file, streamed.
pub fn sha256_file(p: &Path) -> String {
    use sha2::Digest;
    use std::io::Read;
    let mut f = std::fs::File::open(p).expect("open for hashing");
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).expect("read for hashing");
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    format!("{:x}", h.finalize())
}

/// Writes `len` pseudo-random bytes (a fixed xorshift sequence seeded by `seed`).
pub fn write_random(p: &Path, len: usize, seed: u64) {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(p).expect("create"));
    let mut x = seed | 1;
    let mut left = len;
    let mut buf = vec![0u8; 1 << 16];
    while left > 0 {
        for chunk in buf.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let b = x.to_le_bytes();
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
        let n = left.min(buf.len());
        f.write_all(&buf[..n]).expect("write");
        left -= n;
    }
    f.flush().expect("flush");
}

/// A detached tmux session on its own server socket (a real pseudo-terminal).
pub struct Tmux {
    socket: PathBuf,
    pub name: String,
    _dir: tempfile::TempDir,
}

impl Tmux {
    /// Whether tmux is installed.
    pub fn available() -> bool {
        Command::new("tmux")
            .arg("-V")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    }

    /// Starts `shell_cmd` in a `cols`×`rows` window.
    pub fn start(shell_cmd: &str, cols: u16, rows: u16) -> Tmux {
        let dir = tempfile::tempdir().expect("tmux dir");
        let socket = dir.path().join("tmux.sock");
        let t = Tmux {
            socket,
            name: "aenv".into(),
            _dir: dir,
        };
        let st = t
            .tmux()
            .args(["new-session", "-d", "-s", "aenv", "-x"])
            .arg(cols.to_string())
            .arg("-y")
            .arg(rows.to_string())
            .arg(shell_cmd)
            .status()
            .expect("tmux new-session");
        assert!(st.success(), "tmux new-session failed");
        // Keep the window size fixed to what the test sets.
        let _ = t
            .tmux()
            .args(["set-option", "-t", "aenv", "window-size", "manual"])
            .status();
        t
    }

    fn tmux(&self) -> Command {
        let mut c = Command::new("tmux");
        c.arg("-S").arg(&self.socket).arg("-f").arg("/dev/null");
        c
    }

    /// Types keys (tmux key names, e.g. "Enter", "C-c", or literal text with `literal`).
    pub fn send(&self, keys: &[&str], literal: bool) {
        let mut c = self.tmux();
        c.args(["send-keys", "-t", "aenv"]);
        if literal {
            c.arg("-l");
        }
        c.args(keys);
        assert!(c.status().expect("send-keys").success());
    }

    /// Types a line and Enter.
    pub fn line(&self, text: &str) {
        self.send(&[text], true);
        self.send(&["Enter"], false);
    }

    /// The visible pane.
    pub fn capture(&self) -> String {
        let o = self
            .tmux()
            .args(["capture-pane", "-p", "-J", "-t", "aenv", "-S", "-200"])
            .output()
            .expect("capture-pane");
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// Polls the pane until `pred` holds (bounded).
    pub fn wait_for(&self, what: &str, limit: Duration, pred: impl Fn(&str) -> bool) -> String {
        Wait::new(format_args!("the terminal to show {what}"), limit)
            .every(Duration::from_millis(50))
            .until_blocking(|| {
                let s = self.capture();
                if pred(&s) {
                    Ok(s)
                } else {
                    Err(format!("pane:\n{s}"))
                }
            })
    }

    pub fn resize(&self, cols: u16, rows: u16) {
        let st = self
            .tmux()
            .args(["resize-window", "-t", "aenv", "-x"])
            .arg(cols.to_string())
            .arg("-y")
            .arg(rows.to_string())
            .status()
            .expect("resize-window");
        assert!(st.success());
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.tmux().arg("kill-server").status();
    }
}

/// Waits for `child` to exit within `limit`; fails with `what` otherwise.
pub fn wait_exit(
    child: &mut std::process::Child,
    limit: Duration,
    what: &str,
) -> std::process::ExitStatus {
    Wait::new(format_args!("the child to exit; else {what}"), limit)
        .every(Duration::from_millis(20))
        .until_blocking(|| child.try_wait().unwrap())
}

/// Polls a file until it exists with content (bounded).
pub fn wait_file(p: &Path, limit: Duration) -> String {
    Wait::new(format_args!("{} to be written", p.display()), limit)
        .every(Duration::from_millis(50))
        .until_blocking(|| {
            std::fs::read_to_string(p)
                .ok()
                .filter(|s| s.ends_with('\n'))
        })
}
