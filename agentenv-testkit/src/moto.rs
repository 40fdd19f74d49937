//! A real S3-compatible server for tests: moto's server (PyPI `moto[server]`, installed
//! once into `target/moto-venv` under an inter-process lock) on a free loopback port.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use agentenv_core::storage::S3Config;

use crate::{eventually_blocking, target_dir};

/// `moto_server` in a virtual environment (`target/moto-venv`, created once under an
/// inter-process lock).
fn moto_server_binary() -> PathBuf {
    let venv = target_dir().join("moto-venv");
    let bin = venv.join("bin/moto_server");
    let works = |b: &Path| {
        b.is_file()
            && Command::new(venv.join("bin/python"))
                .args(["-c", "import moto.server"])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
    };
    if works(&bin) {
        return bin;
    }
    std::fs::create_dir_all(target_dir()).unwrap();
    let lock = target_dir().join("moto-venv.lock");
    let f = std::fs::File::create(&lock).unwrap();
    let _guard = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
        .unwrap_or_else(|(_, e)| panic!("locking {}: {e}", lock.display()));
    if works(&bin) {
        return bin;
    }
    let st = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .expect("python3 runs");
    assert!(
        st.success(),
        "`python3 -m venv` failed (install python3-venv)"
    );
    let st = Command::new(venv.join("bin/pip"))
        .args(["install", "-q", "moto[server]"])
        .status()
        .expect("pip runs");
    assert!(
        st.success() && works(&bin),
        "`pip install moto[server]` failed (is PyPI reachable?)"
    );
    bin
}

/// A moto S3 server on a free loopback port, killed when dropped.
pub struct Moto {
    addr: SocketAddr,
    child: Child,
}

impl Moto {
    /// Starts a server; with `enforce_auth` every request is checked against moto's
    /// (empty) IAM, so any key is refused.
    pub fn start(enforce_auth: bool) -> Moto {
        let bin = moto_server_binary();
        let port = crate::free_port();
        let mut cmd = Command::new(bin);
        cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if enforce_auth {
            // Every request is authenticated against moto's (empty) IAM: any key is refused.
            cmd.env("INITIAL_NO_AUTH_ACTION_COUNT", "0");
        }
        let child = cmd.spawn().expect("starting moto_server");
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        eventually_blocking(
            format_args!("moto_server to listen on {addr}"),
            Duration::from_secs(60),
            || TcpStream::connect(addr),
        );
        Moto { addr, child }
    }

    /// The server's URL.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Creates a bucket (moto takes unsigned requests unless auth is enforced).
    pub fn create_bucket(&self, name: &str) {
        let mut s = TcpStream::connect(self.addr).unwrap();
        s.set_nodelay(true).unwrap();
        write!(
            s,
            "PUT /{name} HTTP/1.1\r\nHost: {}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.addr
        )
        .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        assert!(resp.starts_with("HTTP/1.1 200"), "create bucket: {resp}");
    }

    /// A store configuration for `bucket` under `prefix` on this server (static test
    /// keys, path-style requests).
    pub fn config(&self, bucket: &str, prefix: &str) -> S3Config {
        S3Config {
            endpoint: self.endpoint(),
            bucket: bucket.into(),
            prefix: prefix.into(),
            region: "us-east-1".into(),
            access_key_id: "test-access-key".into(),
            secret_access_key: "test-secret-key".into(),
            security_token: None,
            addressing_style: None,
        }
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
