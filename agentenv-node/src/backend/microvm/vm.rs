//! What a sandbox's VM gets: its spec's limits checked against the host (CPUs, memory,
//! and the cgroup limits of its VMM), and the VM configuration the VMM is started with
//! (kernel command line, drives, network, balloon), with the paths the VMM sees in its
//! jail.

use std::path::PathBuf;

use super::{MicrovmBackend, jail, net};
use crate::backend::{BackendError, SandboxSpec};
use crate::host::cgroup::Limits;
use crate::host::setup;
use crate::template::image;

impl MicrovmBackend {
    pub(super) fn check_limits(&self, spec: &SandboxSpec) -> Result<Limits, BackendError> {
        if spec.cpu_count == 0 || spec.cpu_count > u32::from(agentenv_vmm::config::MAX_VCPUS) {
            return Err(BackendError::InvalidLimits(format!(
                "cpuCount must be between 1 and {}",
                agentenv_vmm::config::MAX_VCPUS
            )));
        }
        self.host.check_cpus_and_memory(spec)?;
        Ok(Limits {
            cpus: spec.cpu_count,
            memory_bytes: (spec.memory_mb + self.cfg().vmm_overhead_mib).saturating_mul(1 << 20),
            max_processes: self.cfg().vmm_max_threads,
        })
    }

    /// The VM configuration of a sandbox, with the paths the VMM sees in its jail.
    pub(super) fn vm_config(
        &self,
        spec: &SandboxSpec,
    ) -> Result<agentenv_vmm::VmConfig, BackendError> {
        let dns = self
            .host
            .dns()
            .first()
            .map(|d| d.to_string())
            .unwrap_or_default();
        let mut cmdline = format!(
            "{} ip={}::{}:255.255.255.252:{}:eth0:off:{dns}",
            self.cfg().boot_args,
            net::GUEST_IP,
            net::TAP_IP,
            // The kernel sets its host name from here (ids are valid host names).
            spec.id,
        );
        if self.cfg().attach_devices {
            cmdline.push_str(" root=/dev/vda rw rootwait");
        }
        // The kernel hands unknown `KEY=VALUE` arguments to init as its environment; a
        // value the command line cannot carry is left to /init, which sets env again.
        for (k, v) in &spec.env {
            let plain = |s: &str| {
                !s.is_empty()
                    && s.bytes()
                        .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\'' && b != b'=')
            };
            if plain(k) && !k.contains('.') && (v.is_empty() || plain(v)) {
                cmdline.push_str(&format!(" {k}={v}"));
            }
        }
        cmdline.push(' ');
        cmdline.push_str(&image::init_cmdline());
        let mut drives = Vec::new();
        let mut nets = Vec::new();
        if self.cfg().attach_devices {
            drives.push(agentenv_vmm::config::DriveConfig {
                id: "rootfs".into(),
                path: PathBuf::from(jail::DISK),
                read_only: false,
                is_root: true,
            });
            nets.push(agentenv_vmm::config::NetConfig {
                id: "eth0".into(),
                tap: net::TAP_IF.into(),
                guest_mac: net::GUEST_MAC.into(),
            });
        }
        let cfg: agentenv_vmm::VmConfig = serde_json::from_value(serde_json::json!({
            "vcpus": spec.cpu_count,
            "memory_mib": spec.memory_mb,
            "kernel": self.cfg().kernel,
            "cmdline": cmdline,
            "drives": drives,
            "net": nets,
            "serial_output": jail::SERIAL_LOG,
            // A balloon the node can inflate to take memory back (empty at start; the
            // guest gets pages back when it runs short), and entropy for the guest.
            "balloon": if self.cfg().attach_devices {
                serde_json::json!({
                    "amount_mib": 0,
                    "deflate_on_oom": true,
                    "stats_polling_interval_s": 5,
                })
            } else {
                serde_json::Value::Null
            },
            "rng": self.cfg().attach_devices,
        }))
        .map_err(|e| setup(format!("building the VM configuration: {e}")))?;
        // Checked with the host's view of the files; the VMM sees them in its jail.
        let mut host_view = cfg.clone();
        host_view.drives.clear();
        host_view.serial_output = None;
        host_view
            .validate()
            .map_err(|e| BackendError::InvalidLimits(e.to_string()))?;
        let mut cfg = cfg;
        cfg.kernel = PathBuf::from(jail::KERNEL);
        Ok(cfg)
    }
}
