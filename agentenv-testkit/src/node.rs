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

/// Makes sure the `base` template is in [`TEMPLATE_CACHE`] (built there once).
pub async fn ensure_base() {
    let store = agentenv_node::template::TemplateStore::new(
        agentenv_node::template::TemplateStoreConfig::new(TEMPLATE_CACHE),
    );
    store
        .ensure(
            agentenv_node::template::BASE_TEMPLATE,
            std::sync::Arc::new(|l: &str| eprintln!("[template base] {l}")),
        )
        .await
        .expect("the base template");
}

/// A template directory `dir` holding only `base`, as hard links into
/// [`TEMPLATE_CACHE`] (call [`ensure_base`] first): a node given it
/// (`AENV_TEMPLATE_PATH`) makes every other template itself, and what it makes goes
/// with `dir`.
pub fn templates_with_base(dir: &std::path::Path) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).expect("creating the template directory");
    let st = std::process::Command::new("cp")
        .arg("-al")
        .arg(std::path::Path::new(TEMPLATE_CACHE).join("base"))
        .arg(dir.join("base"))
        .status()
        .expect("running cp");
    assert!(
        st.success(),
        "cp -al of the base template into {}",
        dir.display()
    );
    dir.to_path_buf()
}

/// Whether process `pid` can run again: it exists, is neither exiting nor a zombie, and
/// no SIGKILL is pending for it (a killed process may take a while to be gone).
pub fn runs_on(pid: i32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    let sigkill = 1u64 << (libc::SIGKILL - 1);
    let dying = field("State:").starts_with(['Z', 'X'])
        || ["SigPnd:", "ShdPnd:"]
            .iter()
            .any(|f| u64::from_str_radix(&field(f), 16).is_ok_and(|m| m & sigkill != 0));
    !dying
}
