//! A real `redis-server` (Debian package `redis-server`) on a free loopback port, with no
//! persistence: it can be killed, stopped and started again on the same port, and is killed
//! when dropped.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{Wait, free_port};

/// A `redis-server` process on `127.0.0.1:<port>`.
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    password: Option<String>,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers PING.
    pub fn start() -> RedisServer {
        Self::start_inner(None)
    }

    /// [`RedisServer::start`] with `requirepass <password>`; [`RedisServer::command`]
    /// authenticates first.
    pub fn start_with_password(password: &str) -> RedisServer {
        Self::start_inner(Some(password.to_string()))
    }

    fn start_inner(password: Option<String>) -> RedisServer {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("agentenv-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("creating the redis-server directory");
        let mut server = RedisServer {
            port,
            dir,
            password,
            child: None,
        };
        server.restart();
        server
    }

    /// `127.0.0.1:<port>`, the form `scheduler.redis_addr` takes.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr())
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether the process runs (started and not killed or stopped).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Kills the server with SIGKILL and reaps it; its data is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Asks the server to shut down without saving and waits for it to exit.
    pub fn stop(&mut self) {
        if self.child.is_some() {
            let _ = self.command(&["SHUTDOWN", "NOSAVE"]);
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port (killing a running one first), empty, and
    /// waits until it answers PING.
    pub fn restart(&mut self) {
        self.kill();
        let mut cmd = Command::new("redis-server");
        if let Some(pw) = &self.password {
            cmd.args(["--requirepass", pw]);
        }
        let child = cmd
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--protected-mode", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("starting redis-server: {e} (install the Debian package redis-server: scripts/setup.sh)")
            });
        self.child = Some(child);
        Wait::new(
            format_args!("redis-server to answer PING on {}", self.addr()),
            Duration::from_secs(30),
        )
        .until_blocking(|| self.command(&["PING"]).ok().filter(|r| r == "PONG"));
    }

    /// Sends one command and returns the reply as text: a simple string, an integer, a
    /// bulk string (`(nil)` for none), an error as `ERR …`, or an array's elements one per
    /// line.
    pub fn command(&self, args: &[&str]) -> std::io::Result<String> {
        self.command_in_db(0, args)
    }

    /// [`RedisServer::command`] in database `db`.
    pub fn command_in_db(&self, db: u32, args: &[&str]) -> std::io::Result<String> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut req = String::new();
        let mut preludes = 0;
        if let Some(pw) = &self.password {
            encode(&mut req, &["AUTH", pw]);
            preludes += 1;
        }
        if db != 0 {
            encode(&mut req, &["SELECT", &db.to_string()]);
            preludes += 1;
        }
        encode(&mut req, args);
        stream.write_all(req.as_bytes())?;
        let mut reader = BufReader::new(stream);
        for _ in 0..preludes {
            read_reply(&mut reader)?;
        }
        read_reply(&mut reader)
    }
}

fn encode(out: &mut String, args: &[&str]) {
    out.push_str(&format!("*{}\r\n", args.len()));
    for a in args {
        out.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
}

fn read_reply(r: &mut impl BufRead) -> std::io::Result<String> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    let mut line = String::new();
    r.read_line(&mut line)?;
    let line = line.trim_end_matches("\r\n");
    let (kind, rest) = line.split_at_checked(1).ok_or_else(|| bad("empty reply"))?;
    match kind {
        "+" | ":" | "-" => Ok(rest.to_string()),
        "$" => {
            let len: i64 = rest.parse().map_err(|_| bad(line))?;
            if len < 0 {
                return Ok("(nil)".into());
            }
            let mut buf = vec![0; len as usize + 2];
            std::io::Read::read_exact(r, &mut buf)?;
            buf.truncate(len as usize);
            String::from_utf8(buf).map_err(|_| bad("bulk string is not UTF-8"))
        }
        "*" => {
            let n: i64 = rest.parse().map_err(|_| bad(line))?;
            let items = (0..n.max(0))
                .map(|_| read_reply(r))
                .collect::<std::io::Result<Vec<_>>>()?;
            Ok(items.join("\n"))
        }
        _ => Err(bad(line)),
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
