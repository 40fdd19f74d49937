//! Configuration of the jail backend: [`JailConfig`], its defaults, and the host layer's
//! configuration derived from it.

use std::ops::{Deref, DerefMut};
use std::path::PathBuf;

use crate::config::BackendKind;
use crate::host::{HostConfig, HostedConfig, devices};

/// Configuration of the jail backend.
///
/// Node configuration it corresponds to: `home_path` → `data_dir`, `runtime_path` →
/// `runtime_dir`, `tools.control_plane_port` → `agent_port`,
/// `network.egress.always_denied_cidrs` → `denied_networks`; `address_pool` plays the
/// part of `network.internal.veth_cidr` (one /30 per sandbox instead of a /31 plus a
/// host interaction address, since no tap or in-namespace NAT sits between node and
/// agent).
///
/// On cgroup v2 the parent must be a cgroup the node may enable controllers in: an
/// absolute `cgroup_parent` such as `/agentenv`, or a delegated subtree.
#[derive(Clone, Debug)]
pub struct JailConfig {
    /// The settings both backends have (`data_dir`, `address_pool`, …), reached through
    /// `Deref`: sandboxes live in `<data_dir>/jail`.
    pub hosted: HostedConfig,
    /// Arguments of the agent (after its path): init mode by default.
    pub agent_args: Vec<String>,
    /// Whether the jail makes the agent's listening socket (on `agent_port`) before the
    /// agent runs and hands it over ([`super::AGENT_LISTEN_FD_ENV`]): on by default; off
    /// for an agent that binds its own.
    pub agent_listener: bool,
    /// Most processes per sandbox unless the spec says otherwise.
    pub default_max_processes: u32,
    /// Network namespaces kept ready for creates (see [`netpool`](crate::host::netpool));
    /// 0 turns the pool off.
    pub net_pool_size: usize,
    /// Size of a sandbox's writable layer when its create names none, in MiB
    /// (`AENV_JAIL_DISK_SIZE_MB`): writes beyond it fail with ENOSPC inside.
    pub disk_size_mb: u64,
    /// Writable layers of the default size kept formatted and mounted for creates
    /// (`AENV_JAIL_LAYER_POOL_SIZE`); 0 turns the pool off.
    pub layer_pool_size: usize,
}

/// Network namespaces a jail backend keeps ready unless configured otherwise.
pub const DEFAULT_NET_POOL_SIZE: usize = 8;

/// A sandbox's writable layer unless configured otherwise, in MiB (sparse: it takes host
/// disk only as the sandbox writes).
pub const DEFAULT_DISK_SIZE_MB: u64 = 10240;

/// Writable layers a jail backend keeps ready unless configured otherwise.
pub const DEFAULT_LAYER_POOL_SIZE: usize = 8;

impl JailConfig {
    /// Defaults for a node with data under `data_dir`, running `agent_binary`.
    pub fn new(data_dir: impl Into<PathBuf>, agent_binary: impl Into<PathBuf>) -> Self {
        Self {
            hosted: HostedConfig::new(data_dir, agent_binary),
            agent_args: vec!["--init".into()],
            agent_listener: true,
            default_max_processes: 1024,
            net_pool_size: DEFAULT_NET_POOL_SIZE,
            disk_size_mb: DEFAULT_DISK_SIZE_MB,
            layer_pool_size: DEFAULT_LAYER_POOL_SIZE,
        }
    }

    pub(super) fn host(&self) -> HostConfig {
        self.hosted
            .host(BackendKind::Jail, self.net_pool_size, devices::STANDARD)
    }
}

impl Deref for JailConfig {
    type Target = HostedConfig;

    fn deref(&self) -> &HostedConfig {
        &self.hosted
    }
}

impl DerefMut for JailConfig {
    fn deref_mut(&mut self) -> &mut HostedConfig {
        &mut self.hosted
    }
}
