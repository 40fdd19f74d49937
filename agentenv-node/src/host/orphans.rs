//! The last step of every backend's reconciliation: host resources that no
//! sandbox owns any more (address reservations of vanished owners, sandbox
//! cgroups without a reservation, host interfaces without one) are removed.

use std::time::Duration;

use super::cgroup::Hierarchy;
use super::ids::IdPool;
use super::net::{self, AddressPool};
use crate::backend::ReconcileReport;

/// Where a backend's sandboxes hold host resources.
pub(crate) struct HostResources<'a> {
    pub pool: &'a AddressPool,
    pub ids: &'a IdPool,
    pub netlink: &'a rtnetlink::Handle,
    pub hierarchy: &'a Hierarchy,
    pub cgroup_parent: &'a str,
    pub iface_prefix: &'a str,
    pub op_timeout: Duration,
}

impl HostResources<'_> {
    /// Removes what belongs to no sandbox; `live` are the ids the backend
    /// runs now. Each removal is added to `report`.
    pub(crate) async fn remove_orphans(&self, live: &[String], report: &mut ReconcileReport) {
        // Reservations of this pool whose owner directory is gone belong to nobody.
        for (slot, owner) in self.pool.reservations() {
            if self.pool.owns(slot) && !owner.as_os_str().is_empty() && !owner.exists() {
                for internet in [true, false] {
                    let name = slot.host_ifname(self.iface_prefix, internet);
                    if let Ok(true) = net::delete_link(self.netlink, &name).await {
                        report.removed_other.push(format!("link {name}"));
                    }
                }
                self.pool.release(slot);
                report
                    .removed_other
                    .push(format!("address {}", slot.sandbox_ip()));
            }
        }
        // Id ranges whose owner directory is gone belong to nobody.
        for range in self.ids.release_orphans() {
            report
                .removed_other
                .push(format!("id range {}", range.base));
        }
        // Sandbox cgroups without an address reservation belong to nobody: a sandbox
        // reserves its address before it creates its cgroup and releases it after (the
        // reservations are host-wide, so other node processes' sandboxes are safe). List
        // the cgroups before the reservations, so a create in flight is never mistaken
        // for a leftover.
        let cgroups = self.hierarchy.list(self.cgroup_parent);
        let owners: Vec<String> = self
            .pool
            .reservations()
            .into_iter()
            .filter_map(|(_, o)| o.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        for name in cgroups {
            if live.contains(&name) || owners.contains(&name) {
                continue;
            }
            let cg = self.hierarchy.sandbox(self.cgroup_parent, &name);
            if let Err(e) = cg.kill_all(self.op_timeout).await {
                tracing::warn!(cgroup = %name, error = %e, "killing a leftover cgroup");
            }
            match cg.remove(self.op_timeout).await {
                Ok(()) => report.removed_other.push(format!("cgroup {name}")),
                Err(e) => tracing::warn!(cgroup = %name, error = %e, "removing a leftover cgroup"),
            }
        }
        // Host interfaces whose address is not reserved belong to nobody.
        let links = net::list_links(self.netlink, self.iface_prefix)
            .await
            .unwrap_or_default();
        for name in links {
            if let Some(slot) = net::slot_of_ifname(self.iface_prefix, &name)
                && !self.pool.is_reserved(slot)
                && let Ok(true) = net::delete_link(self.netlink, &name).await
            {
                report.removed_other.push(format!("link {name}"));
            }
        }
    }
}
