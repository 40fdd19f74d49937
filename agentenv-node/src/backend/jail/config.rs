//! Configuration of the jail backend: [`JailConfig`], its defaults, and the host layer's
//! configuration derived from it.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use crate::backend::AGENT_PORT;
use crate::host::ids::IdPoolRange;
use crate::host::net::Ipv4Net;
use crate::host::{HostConfig, devices};
use crate::template::TemplateStoreConfig;

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
    /// The node's data directory (`home_path`); sandboxes live in `<data_dir>/jail`.
    pub data_dir: PathBuf,
    /// Host-wide runtime state (address and id reservations, locks), shared by every
    /// node process on the host (`runtime_path`).
    pub runtime_dir: PathBuf,
    /// The template store.
    pub templates: TemplateStoreConfig,
    /// The agent binary on the host (a static `agentenv-guest`).
    pub agent_binary: PathBuf,
    /// Arguments of the agent (after its path): init mode by default.
    pub agent_args: Vec<String>,
    /// The agent's port inside the sandbox.
    pub agent_port: u16,
    /// Sandbox addresses: carved into /30 networks.
    pub address_pool: Ipv4Net,
    /// Host interface names start with this (at most 6 characters).
    pub iface_prefix: String,
    /// Networks sandboxes never reach (the host's private ranges by default).
    pub denied_networks: Vec<Ipv4Net>,
    /// Nameservers for the sandboxes' resolv.conf; `None` takes the host's.
    pub dns_servers: Option<Vec<Ipv4Addr>>,
    /// Parent of the sandbox cgroups, relative to the node's own cgroup (absolute from
    /// the hierarchy root when it starts with `/`).
    pub cgroup_parent: String,
    /// Most processes per sandbox unless the spec says otherwise.
    pub default_max_processes: u32,
    /// How long pause, resume and kill may take before they fail.
    pub op_timeout: Duration,
    /// Network namespaces kept ready for creates (see [`netpool`](crate::host::netpool));
    /// 0 turns the pool off.
    pub net_pool_size: usize,
    /// Host ids sandboxes are given, 65,536 each (`AENV_JAIL_ID_POOL`).
    pub id_pool: IdPoolRange,
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
        let data_dir = data_dir.into();
        Self {
            templates: TemplateStoreConfig::new(data_dir.join("templates")),
            data_dir,
            runtime_dir: PathBuf::from("/run/agentenv"),
            agent_binary: agent_binary.into(),
            agent_args: vec!["--init".into()],
            agent_port: AGENT_PORT,
            address_pool: Ipv4Net::new(Ipv4Addr::new(10, 12, 0, 0), 16)
                .expect("10.12.0.0/16 is a valid network"),
            iface_prefix: "ae".into(),
            denied_networks: Ipv4Net::default_denied(),
            dns_servers: None,
            cgroup_parent: "agentenv".into(),
            default_max_processes: 1024,
            op_timeout: Duration::from_secs(5),
            net_pool_size: DEFAULT_NET_POOL_SIZE,
            id_pool: IdPoolRange::default(),
            disk_size_mb: DEFAULT_DISK_SIZE_MB,
            layer_pool_size: DEFAULT_LAYER_POOL_SIZE,
        }
    }

    pub(super) fn host(&self) -> HostConfig {
        HostConfig {
            kind: "jail",
            data_dir: self.data_dir.clone(),
            runtime_dir: self.runtime_dir.clone(),
            address_pool: self.address_pool,
            iface_prefix: self.iface_prefix.clone(),
            denied_networks: self.denied_networks.clone(),
            dns_servers: self.dns_servers.clone(),
            cgroup_parent: self.cgroup_parent.clone(),
            op_timeout: self.op_timeout,
            net_pool_size: self.net_pool_size,
            id_pool: self.id_pool,
            devices: devices::STANDARD,
        }
    }
}
