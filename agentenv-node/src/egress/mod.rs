//! Per-sandbox egress rules (`network.allowOut`, `denyOut`, `dnsServers`, and
//! `allow_internet_access`), enforced inside each sandbox's own network namespace.
//!
//! * `policy`: the API's lists checked and normalized, and the [`EgressPolicy`] they make
//!   (pure).
//! * `rules`: the policy as `iptables-restore` input for the namespace, applied atomically
//!   from inside it. Addresses and CIDRs are enforced there, in the kernel.
//! * `proxy` (with `sniff` and `netns`): domain names, enforced for HTTP (`Host`) and TLS
//!   (SNI) on ports 80 and 443 by a proxy the node serves inside the namespace; other
//!   traffic to a denied address is refused whatever name it was meant for.
//!
//! The namespace belongs to the host's initial user namespace; the tenant is root only in
//! a user namespace of its own, so it can change neither the rules nor the proxy. The
//! node's floor (its denied networks, the host, other sandboxes: the host chains of
//! [`crate::host::net`]) applies underneath whatever a policy allows.
//!
//! [`SandboxEgress`] is what the host layer keeps per sandbox: it applies a policy before
//! the sandbox's first process starts and whenever `PUT /network` replaces it, and serves
//! the proxy until the sandbox goes.

pub mod netns;
pub mod policy;
mod proxy;
pub mod rules;
pub mod sniff;

pub use policy::{DomainPattern, EgressPolicy, EgressRules, PolicyError};
pub use proxy::{HANDSHAKE_TIMEOUT, IDLE_TIMEOUT, MAX_CONNECTIONS};

use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use self::netns::Netns;
use self::rules::Mode;

/// How long a sandbox's proxy may take to end its connections when the sandbox goes.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors applying a sandbox's egress policy.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    #[error("egress rules: {0}")]
    Rules(String),
    #[error("egress proxy: {0}")]
    Proxy(String),
}

/// The egress side of one sandbox's network namespace: its kernel rules and its proxy.
pub struct SandboxEgress {
    id: String,
    /// Taken when the sandbox goes: nothing of the node may keep the namespace alive then.
    netns: std::sync::Mutex<Option<Netns>>,
    nameservers: Vec<Ipv4Addr>,
    proxy_port: u16,
    /// Whether the jumps to the policy's chains are in place; held across an update.
    installed: tokio::sync::Mutex<bool>,
    policy: watch::Sender<Arc<EgressPolicy>>,
    cancel: watch::Sender<bool>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl SandboxEgress {
    /// Applies `policy` in the namespace `netns` of sandbox `id` and serves its proxy on
    /// `listener` (made in that namespace, on `proxy_port`). `nameservers` are the
    /// sandbox's own: the proxy resolves through them, and a policy allowing a domain
    /// without `dnsServers` lets the sandbox reach them.
    pub async fn start(
        id: &str,
        netns: OwnedFd,
        listener: Option<std::net::TcpListener>,
        proxy_port: u16,
        nameservers: Vec<Ipv4Addr>,
        policy: EgressPolicy,
    ) -> Result<Self, EgressError> {
        let netns = Netns::new(netns);
        let (policy_tx, policy_rx) = watch::channel(Arc::new(EgressPolicy::default()));
        let (cancel, cancel_rx) = watch::channel(false);
        let task = match listener {
            Some(l) => {
                let listener = tokio::net::TcpListener::from_std(l)
                    .map_err(|e| EgressError::Proxy(format!("serving the listener: {e}")))?;
                let shared = Arc::new(proxy::Shared::new(
                    id.to_string(),
                    netns.clone(),
                    nameservers.clone(),
                    policy_rx,
                ));
                Some(tokio::spawn(proxy::serve(listener, shared, cancel_rx)))
            }
            None => None,
        };
        let me = Self {
            id: id.to_string(),
            netns: std::sync::Mutex::new(Some(netns)),
            nameservers,
            proxy_port,
            installed: tokio::sync::Mutex::new(false),
            policy: policy_tx,
            cancel,
            task: std::sync::Mutex::new(task),
        };
        me.update(policy).await?;
        Ok(me)
    }

    /// The policy in force.
    pub fn policy(&self) -> Arc<EgressPolicy> {
        self.policy.borrow().clone()
    }

    /// Replaces the policy: the namespace's rules at once (one `iptables-restore`), then
    /// the proxy's (connections to names no longer allowed end). On failure the policy in
    /// force stays.
    pub async fn update(&self, policy: EgressPolicy) -> Result<(), EgressError> {
        let mut installed = self.installed.lock().await;
        if policy.has_domains()
            && self
                .task
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_none()
        {
            return Err(EgressError::Proxy(format!(
                "sandbox {} has no egress proxy, so allowOut cannot name domains",
                self.id
            )));
        }
        if policy.needs_rules() || *installed {
            let netns = self
                .netns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .ok_or_else(|| EgressError::Rules(format!("sandbox {} is gone", self.id)))?;
            let mode = if *installed {
                Mode::Replace
            } else {
                Mode::Install
            };
            let dns = policy.reachable_dns(&self.nameservers);
            let input = rules::render(&policy, &dns, self.proxy_port, mode);
            rules::apply(netns.fd(), &input).await?;
            *installed = true;
        }
        self.policy.send_replace(Arc::new(policy));
        Ok(())
    }

    /// Stops the proxy, ends its connections and lets go of the namespace.
    pub async fn shutdown(&self) {
        let _ = self.cancel.send(true);
        let task = self.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(mut task) = task
            && tokio::time::timeout(SHUTDOWN_TIMEOUT, &mut task)
                .await
                .is_err()
        {
            tracing::warn!(sandbox = %self.id, "the egress proxy did not end in time");
            task.abort();
        }
        self.netns.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

impl Drop for SandboxEgress {
    fn drop(&mut self) {
        if let Some(task) = self.task.lock().unwrap_or_else(|e| e.into_inner()).take() {
            task.abort();
        }
    }
}

impl std::fmt::Debug for SandboxEgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxEgress")
            .field("id", &self.id)
            .field("policy", &*self.policy.borrow())
            .finish_non_exhaustive()
    }
}
