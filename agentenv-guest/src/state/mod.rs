//! The agent's shared state: start-up options, what `/init` set (access
//! token, environment, default user and directory), and what hangs off it:
//! the running processes ([`processes`]), the polling watchers
//! ([`watchers`]) and the metrics sampler. Every handler gets an
//! `Arc<AgentState>`; this module imports none of them.

mod auth;
pub mod processes;
pub mod watchers;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use http::{HeaderMap, Method, Response, StatusCode, Uri};
use parking_lot::RwLock;

use crate::connect::{Code, ConnectError, RespBody};
use crate::metrics::{Metrics, MetricsSampler};
use crate::responses::json_error;
use crate::users::{AccountFiles, User};

pub use processes::ProcessTable;
pub use watchers::Watchers;

/// Start-up options of the agent.
#[derive(Debug, Clone, Default)]
pub struct AgentOptions {
    /// User for calls that name none (until `/init` sets one). `None`: the
    /// account the agent runs as.
    pub default_user: Option<String>,
    /// Working directory for processes that name none. `None`: the user's home.
    pub default_workdir: Option<String>,
    /// Access token enforced from the start (otherwise only after `/init`).
    pub access_token: Option<String>,
    /// Let `/init` set the system clock from its `timestamp` (only inside a
    /// sandbox).
    pub set_clock: bool,
    /// Where users and groups are read from.
    pub accounts: AccountFiles,
}

/// What `/init` may change.
#[derive(Debug, Clone, Default)]
struct InitState {
    envs: BTreeMap<String, String>,
    access_token: Option<String>,
    default_user: Option<String>,
    default_workdir: Option<String>,
}

/// What one `/init` call sets; `None` leaves a setting as it is.
#[derive(Debug, Default)]
pub(crate) struct InitUpdate {
    /// Added to the environment set so far.
    pub env_vars: Option<BTreeMap<String, String>>,
    /// Empty: no token any more.
    pub access_token: Option<String>,
    /// Ignored when empty.
    pub default_user: Option<String>,
    /// Ignored when empty.
    pub default_workdir: Option<String>,
}

/// The agent's shared state.
#[derive(Debug)]
pub struct AgentState {
    opts: AgentOptions,
    init: RwLock<InitState>,
    /// Running processes.
    pub processes: ProcessTable,
    /// Polling watchers (CreateWatcher).
    pub watchers: Watchers,
    metrics: MetricsSampler,
    fast_uploads: AtomicU64,
}

impl AgentState {
    pub fn new(opts: AgentOptions) -> Arc<Self> {
        let init = InitState {
            envs: BTreeMap::new(),
            access_token: opts.access_token.clone().filter(|t| !t.is_empty()),
            default_user: opts.default_user.clone(),
            default_workdir: opts.default_workdir.clone(),
        };
        Arc::new(AgentState {
            opts,
            init: RwLock::new(init),
            processes: ProcessTable::default(),
            watchers: Watchers::default(),
            metrics: Default::default(),
            fast_uploads: Default::default(),
        })
    }

    /// Account files in use.
    pub fn accounts(&self) -> &AccountFiles {
        &self.opts.accounts
    }

    /// The default user's name.
    pub fn default_user_name(&self) -> String {
        if let Some(u) = self.init.read().default_user.clone() {
            return u;
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        let uid = unsafe { libc::geteuid() };
        self.opts
            .accounts
            .name_of_uid(uid)
            .unwrap_or_else(|| uid.to_string())
    }

    /// Resolves a user by name, or the default user for `None`/empty.
    pub fn user(&self, name: Option<&str>) -> Result<User, ConnectError> {
        let name = match name {
            Some(n) if !n.is_empty() => n.to_string(),
            _ => self.default_user_name(),
        };
        match self.opts.accounts.lookup(&name) {
            Ok(u) => Ok(u),
            // A root filesystem without an entry for the agent's own account
            // (or without /etc/passwd): the agent's identity still works.
            Err(e) => self
                .own_account(&name)
                .ok_or_else(|| ConnectError::new(Code::Unauthenticated, e.to_string())),
        }
    }

    /// The account the agent runs as, when `name` names it (by the name
    /// `root` for uid 0, or by number).
    fn own_account(&self, name: &str) -> Option<User> {
        // SAFETY: geteuid/getegid have no preconditions.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let matches = name == uid.to_string() || (uid == 0 && name == "root");
        matches.then(|| User {
            name: name.to_string(),
            uid,
            gid,
            home: std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(if uid == 0 { "/root" } else { "/" })),
            shell: "/bin/sh".into(),
            groups: vec![gid],
        })
    }

    /// The user a request acts as: `Authorization: Basic base64("<user>:")`
    /// or the default user.
    pub fn caller(&self, headers: &HeaderMap) -> Result<User, ConnectError> {
        let name = auth::basic_auth_user(headers)?;
        self.user(name.as_deref())
    }

    /// Environment variables set by `/init`.
    pub fn init_envs(&self) -> BTreeMap<String, String> {
        self.init.read().envs.clone()
    }

    /// Default working directory (from `/init` or options).
    pub fn default_workdir(&self) -> Option<PathBuf> {
        self.init
            .read()
            .default_workdir
            .clone()
            .filter(|w| !w.is_empty())
            .map(PathBuf::from)
    }

    /// Applies what an `/init` call sets.
    pub(crate) fn apply_init(&self, update: InitUpdate) {
        let mut init = self.init.write();
        if let Some(envs) = update.env_vars {
            init.envs.extend(envs);
        }
        if let Some(token) = update.access_token {
            init.access_token = if token.is_empty() { None } else { Some(token) };
        }
        if let Some(u) = update.default_user.filter(|u| !u.is_empty()) {
            init.default_user = Some(u);
        }
        if let Some(w) = update.default_workdir.filter(|w| !w.is_empty()) {
            init.default_workdir = Some(w);
        }
    }

    /// Whether `/init` may set the system clock.
    pub(crate) fn may_set_clock(&self) -> bool {
        self.opts.set_clock
    }

    /// The answer to a request without valid credentials (`X-Access-Token`,
    /// or a signed URL for `/files`), or `None` when it may pass.
    pub(crate) fn denied(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
    ) -> Option<Response<RespBody>> {
        let path = uri.path();
        let signed_files_url = path == "/files" && {
            let token = self.init.read().access_token.clone();
            auth::signed_url_ok(token.as_deref(), method, uri.query())
        };
        if signed_files_url || auth::token_ok(self.init.read().access_token.as_deref(), headers) {
            return None;
        }
        let msg = "missing or wrong X-Access-Token: send the sandbox's envd access token";
        Some(
            if path.starts_with("/process.") || path.starts_with("/filesystem.") {
                ConnectError::new(Code::Unauthenticated, msg).into_unary_response()
            } else {
                json_error(StatusCode::UNAUTHORIZED, msg)
            },
        )
    }

    /// CPU, memory and disk use now (`GET /metrics`).
    pub fn sample_metrics(&self) -> Metrics {
        self.metrics.sample()
    }

    /// Uploads taken by the zero-copy path so far (a raw `POST /files` as
    /// a connection's first request, its body spliced into the file).
    pub fn fast_path_uploads(&self) -> u64 {
        self.fast_uploads.load(Ordering::Relaxed)
    }

    pub(crate) fn count_fast_upload(&self) {
        self.fast_uploads.fetch_add(1, Ordering::Relaxed);
    }
}

/// The agent's own environment without its configuration variables
/// (`AGENTENV_GUEST_*`, which may carry the access token): the base of every
/// process's environment.
pub fn base_env() -> BTreeMap<String, String> {
    std::env::vars()
        .filter(|(k, _)| !k.starts_with("AGENTENV_GUEST_"))
        .collect()
}
