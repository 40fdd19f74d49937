//! What the node's tests share besides the host firewall chains: the template cache every
//! test run on this machine uses, a log subscriber, and the root check.

/// Templates shared by every test run on this machine (built once, under a lock).
pub const TEMPLATE_CACHE: &str = "/var/cache/agentenv-test/templates";

/// Installs a log subscriber writing to the test's output (`RUST_LOG`, else
/// `agentenv_node=info`); later calls keep the first.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "agentenv_node=info".into()),
        )
        .with_test_writer()
        .try_init();
}

/// `Some(why)` (a reason to skip) unless this process runs as root.
pub fn unless_root(why: &str) -> Option<String> {
    (!nix::unistd::Uid::effective().is_root()).then(|| why.to_string())
}
