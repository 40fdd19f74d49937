//! Test support shared by the workspace's tests and examples.
//!
//! * [`eventually`] and [`eventually_blocking`] (and [`Wait`] for other intervals or a
//!   result instead of a panic): poll a check until it passes or a deadline passes;
//! * [`bins`]: the workspace's binaries, static builds included;
//! * `browser` (feature `browser`): headless Chromium driven over WebDriver;
//! * `moto` (feature `s3`): a real S3-compatible server on loopback;
//! * `internet` (feature `internet`): a fake internet in a network namespace, with web
//!   servers and a DNS server, for egress tests;
//! * `registry` (feature `registry`): a real OCI registry on loopback, OCI image layouts
//!   written from a directory, `skopeo` pushes;
//! * `redis` (feature `redis`): a real `redis-server` on loopback that can be killed and
//!   restarted on its port;
//! * `vmm` (feature `vmm`): guest programs for the VMM, as minimal ELF "kernels";
//! * `host_rules` and `node` (feature `node`): the host firewall chains a test's backends
//!   install, the shared template cache, a log subscriber, the root check.

pub mod bins;
#[cfg(feature = "browser")]
pub mod browser;
#[cfg(feature = "node")]
pub mod host_rules;
#[cfg(feature = "internet")]
pub mod internet;
#[cfg(feature = "s3")]
pub mod moto;
#[cfg(feature = "node")]
pub mod node;
mod poll;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "registry")]
pub mod registry;
#[cfg(feature = "vmm")]
pub mod vmm;

pub use poll::{Check, Wait, eventually, eventually_blocking};

use std::path::{Path, PathBuf};

/// The workspace's root directory.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

/// A free loopback port (bound and released; the OS does not hand it out again at once).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding a loopback port")
}

/// The workspace's target directory: `CARGO_TARGET_DIR`, else `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}
