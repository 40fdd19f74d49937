//! A sandbox's egress rules: the API's lists (`allowOut`, `denyOut`, `dnsServers`) checked
//! and normalized ([`EgressRules::checked`]), and the policy the node enforces from them
//! ([`EgressPolicy`]).
//!
//! Entries of `allowOut` are IPv4 addresses, IPv4 CIDRs or domain names (`example.com`,
//! or `*.example.com` for every name below it at any depth, not the apex); `denyOut` takes
//! addresses and CIDRs only. Allowed entries win over denied ones. Names are lowercase and
//! without a trailing dot once normalized. Sandboxes have IPv4 only, so IPv6 entries are
//! refused with a message saying why.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use crate::host::net::Ipv4Net;

/// Most entries `allowOut` or `denyOut` may hold.
pub const MAX_ENTRIES: usize = 512;
/// Most entries `dnsServers` may hold.
pub const MAX_DNS_SERVERS: usize = 16;
/// Longest entry, in bytes (a name of 253 bytes plus a wildcard and a trailing dot).
const MAX_ENTRY_LEN: usize = 260;

/// Why an egress rule is refused; the message names the field, the entry and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("network.{field}[{index}] {entry:?}: {reason}")]
    Entry {
        field: &'static str,
        index: usize,
        entry: String,
        reason: String,
    },
    #[error(
        "network.{field} has {count} entries; at most {max} are allowed (cover addresses with CIDRs, names with *. wildcards)"
    )]
    TooMany {
        field: &'static str,
        count: usize,
        max: usize,
    },
}

/// A sandbox's egress rules as the API names them: `allowOut`, `denyOut`, `dnsServers`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EgressRules {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_out: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny_out: Vec<String>,
    /// `None`: the sandbox's own nameservers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_servers: Option<Vec<String>>,
}

impl EgressRules {
    pub fn is_empty(&self) -> bool {
        self.allow_out.is_empty() && self.deny_out.is_empty() && self.dns_servers.is_none()
    }

    /// The rules checked, with every entry in its normal form (bare addresses stay bare,
    /// CIDRs lose their host bits, names are lowercase without a trailing dot).
    pub fn checked(&self) -> Result<EgressRules, PolicyError> {
        let allow = parse_list("allowOut", &self.allow_out, true)?;
        let deny = parse_list("denyOut", &self.deny_out, false)?;
        let dns = self.dns_servers.as_deref().map(parse_dns).transpose()?;
        Ok(EgressRules {
            allow_out: allow.into_iter().map(|(_, s)| s).collect(),
            deny_out: deny.into_iter().map(|(_, s)| s).collect(),
            dns_servers: dns.map(|d| d.iter().map(Ipv4Addr::to_string).collect()),
        })
    }
}

/// A domain pattern of `allowOut`: a name, or every name below it (`*.name`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DomainPattern {
    /// The name (for a wildcard: what follows `*.`), normalized.
    name: String,
    wildcard: bool,
}

impl DomainPattern {
    /// Whether `host` (normalized, see [`normalize_name`]) is this name, or for a wildcard
    /// a name below it at any depth (never the name itself).
    pub fn matches(&self, host: &str) -> bool {
        if !self.wildcard {
            return host == self.name;
        }
        host.len() > self.name.len() + 1
            && host.ends_with(&self.name)
            && host.as_bytes()[host.len() - self.name.len() - 1] == b'.'
    }

    /// The pattern as `allowOut` writes it.
    pub fn as_entry(&self) -> String {
        if self.wildcard {
            format!("*.{}", self.name)
        } else {
            self.name.clone()
        }
    }
}

/// What the node enforces for a sandbox: which IPv4 networks it may reach directly,
/// which it may not, which names it may reach through the egress proxy on ports 80 and
/// 443 of denied addresses, and which nameservers it may reach for those names.
///
/// The default (nothing denied) lets every address through; the node's own floor (its
/// denied networks, the host, other sandboxes) applies whatever the policy says.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "EgressRules", try_from = "EgressRules")]
pub struct EgressPolicy {
    pub allow_nets: Vec<Ipv4Net>,
    pub deny_nets: Vec<Ipv4Net>,
    pub domains: Vec<DomainPattern>,
    /// `None`: the sandbox's own nameservers (what its resolv.conf names).
    pub dns_servers: Option<Vec<Ipv4Addr>>,
}

impl EgressPolicy {
    /// The policy of `rules` (checked), with `allow_internet_access: false` meaning a
    /// deny of `0.0.0.0/0`.
    pub fn new(
        rules: &EgressRules,
        allow_internet_access: Option<bool>,
    ) -> Result<Self, PolicyError> {
        let mut policy = Self::default();
        for (entry, _) in parse_list("allowOut", &rules.allow_out, true)? {
            match entry {
                Entry::Net(n) => policy.allow_nets.push(n),
                Entry::Domain(d) => policy.domains.push(d),
            }
        }
        for (entry, _) in parse_list("denyOut", &rules.deny_out, false)? {
            if let Entry::Net(n) = entry {
                policy.deny_nets.push(n);
            }
        }
        if allow_internet_access == Some(false) {
            policy
                .deny_nets
                .push(Ipv4Net::new(Ipv4Addr::UNSPECIFIED, 0).expect("/0 is valid"));
        }
        policy.dns_servers = rules.dns_servers.as_deref().map(parse_dns).transpose()?;
        Ok(policy)
    }

    /// Whether anything is denied: without, the sandbox needs no rules at all.
    pub fn needs_rules(&self) -> bool {
        !self.deny_nets.is_empty()
    }

    /// Whether `allowOut` names a domain.
    pub fn has_domains(&self) -> bool {
        !self.domains.is_empty()
    }

    /// Whether the normalized name `host` is allowed by a domain entry.
    pub fn allows_name(&self, host: &str) -> bool {
        self.domains.iter().any(|d| d.matches(host))
    }

    /// Whether the sandbox may reach `ip` directly (allowed, or not denied).
    pub fn allows_ip(&self, ip: Ipv4Addr) -> bool {
        self.allow_nets.iter().any(|n| n.contains(ip))
            || !self.deny_nets.iter().any(|n| n.contains(ip))
    }

    /// The nameservers the sandbox may reach: with a domain allowed, `dnsServers`, else the
    /// sandbox's own (`own`); without a domain, none.
    pub fn reachable_dns(&self, own: &[Ipv4Addr]) -> Vec<Ipv4Addr> {
        if !self.has_domains() {
            return Vec::new();
        }
        self.dns_servers.clone().unwrap_or_else(|| own.to_vec())
    }
}

impl From<EgressPolicy> for EgressRules {
    fn from(p: EgressPolicy) -> Self {
        EgressRules {
            allow_out: p
                .allow_nets
                .iter()
                .map(ToString::to_string)
                .chain(p.domains.iter().map(DomainPattern::as_entry))
                .collect(),
            deny_out: p.deny_nets.iter().map(ToString::to_string).collect(),
            dns_servers: p
                .dns_servers
                .map(|d| d.iter().map(Ipv4Addr::to_string).collect()),
        }
    }
}

impl TryFrom<EgressRules> for EgressPolicy {
    type Error = PolicyError;

    fn try_from(r: EgressRules) -> Result<Self, Self::Error> {
        EgressPolicy::new(&r, None)
    }
}

/// One parsed entry.
enum Entry {
    Net(Ipv4Net),
    Domain(DomainPattern),
}

fn parse_list(
    field: &'static str,
    items: &[String],
    domains: bool,
) -> Result<Vec<(Entry, String)>, PolicyError> {
    if items.len() > MAX_ENTRIES {
        return Err(PolicyError::TooMany {
            field,
            count: items.len(),
            max: MAX_ENTRIES,
        });
    }
    items
        .iter()
        .enumerate()
        .map(|(index, s)| {
            let bad = |reason: String| PolicyError::Entry {
                field,
                index,
                entry: s.chars().take(MAX_ENTRY_LEN).collect(),
                reason,
            };
            let (entry, normal) = parse_entry(s).map_err(bad)?;
            if !domains && matches!(entry, Entry::Domain(_)) {
                return Err(bad(
                    "denyOut takes IPv4 addresses and CIDRs only; to keep a sandbox to some names, deny 0.0.0.0/0 and list the names in allowOut".into(),
                ));
            }
            Ok((entry, normal))
        })
        .collect()
}

fn parse_dns(items: &[String]) -> Result<Vec<Ipv4Addr>, PolicyError> {
    if items.len() > MAX_DNS_SERVERS {
        return Err(PolicyError::TooMany {
            field: "dnsServers",
            count: items.len(),
            max: MAX_DNS_SERVERS,
        });
    }
    items
        .iter()
        .enumerate()
        .map(|(index, s)| {
            s.trim()
                .parse::<Ipv4Addr>()
                .map_err(|_| PolicyError::Entry {
                    field: "dnsServers",
                    index,
                    entry: s.chars().take(MAX_ENTRY_LEN).collect(),
                    reason: "dnsServers takes IPv4 addresses, e.g. 8.8.8.8".into(),
                })
        })
        .collect()
}

/// An entry and its normal form, or why it is refused.
fn parse_entry(raw: &str) -> Result<(Entry, String), String> {
    let s = raw.trim();
    if s.is_empty() {
        return Err("an empty entry: remove it".into());
    }
    if s.len() > MAX_ENTRY_LEN {
        return Err(format!("longer than {MAX_ENTRY_LEN} bytes"));
    }
    if s.contains(':') {
        return Err(
            "IPv6 is not supported: sandboxes have IPv4 only (no IPv6 address or route), so every IPv6 destination is unreachable already; remove the entry".into(),
        );
    }
    if let Ok(ip) = s.parse::<Ipv4Addr>() {
        let net = Ipv4Net::new(ip, 32).expect("/32 is valid");
        return Ok((Entry::Net(net), ip.to_string()));
    }
    if let Some((addr, len)) = s.split_once('/') {
        let addr: Ipv4Addr = addr
            .parse()
            .map_err(|_| format!("{addr:?} is not an IPv4 address; write a CIDR as a.b.c.d/len"))?;
        let len: u8 = len
            .parse()
            .ok()
            .filter(|l| *l <= 32)
            .ok_or_else(|| format!("the prefix length {len:?} must be 0 to 32"))?;
        let net = Ipv4Net::new(addr, len).expect("checked above");
        return Ok((Entry::Net(net), net.to_string()));
    }
    if s == "*" {
        return Err(
            "a bare * is invalid: write 0.0.0.0/0 for every address, or *.example.com for the names below a domain".into(),
        );
    }
    let (wildcard, name) = match s.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    if name.contains('*') {
        return Err("a wildcard may only be the first label, as in *.example.com".into());
    }
    let name = normalize_name(name).ok_or_else(|| {
        "neither an IPv4 address, an IPv4 CIDR (a.b.c.d/len) nor a domain name (labels of letters, digits and hyphens, the last one not all digits; punycode for other scripts)".to_string()
    })?;
    let pattern = DomainPattern { name, wildcard };
    let normal = pattern.as_entry();
    Ok((Entry::Domain(pattern), normal))
}

/// `name` as a domain name in normal form (lowercase, no trailing dot), or `None` when it
/// is not one: labels of 1 to 63 letters, digits, hyphens or underscores (no hyphen at
/// either end), at most 253 bytes, the last label not all digits (that is an address).
pub fn normalize_name(name: &str) -> Option<String> {
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() || name.len() > 253 || !name.is_ascii() {
        return None;
    }
    let name = name.to_ascii_lowercase();
    let mut last = "";
    for label in name.split('.') {
        let ok = !label.is_empty()
            && label.len() <= 63
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !ok {
            return None;
        }
        last = label;
    }
    if last.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rules(allow: &[&str], deny: &[&str]) -> EgressRules {
        EgressRules {
            allow_out: allow.iter().map(|s| s.to_string()).collect(),
            deny_out: deny.iter().map(|s| s.to_string()).collect(),
            dns_servers: None,
        }
    }

    fn reason(allow: &[&str], deny: &[&str]) -> String {
        EgressPolicy::new(&rules(allow, deny), None)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn cidrs_bare_addresses_and_names_parse_into_their_parts() {
        let p = EgressPolicy::new(
            &rules(
                &["8.8.8.8", "10.1.2.3/8", "Example.COM.", "*.api.example.com"],
                &["0.0.0.0/0"],
            ),
            None,
        )
        .unwrap();
        assert_eq!(
            p.allow_nets,
            vec!["8.8.8.8/32".parse().unwrap(), "10.0.0.0/8".parse().unwrap()]
        );
        assert_eq!(p.deny_nets, vec!["0.0.0.0/0".parse().unwrap()]);
        assert!(p.allows_name("example.com") && p.allows_name("a.b.api.example.com"));
        assert!(!p.allows_name("api.example.com") && !p.allows_name("x.example.com"));
        let normal = rules(
            &["8.8.8.8", "10.1.2.3/8", "Example.COM.", "*.API.example.com"],
            &[],
        )
        .checked()
        .unwrap();
        assert_eq!(
            normal.allow_out,
            ["8.8.8.8", "10.0.0.0/8", "example.com", "*.api.example.com"]
        );
    }

    #[test]
    fn malformed_entries_are_refused_with_the_field_index_and_fix() {
        let r = reason(&["10.0.0.0/33"], &[]);
        assert!(
            r.contains("network.allowOut[0] \"10.0.0.0/33\"") && r.contains("0 to 32"),
            "{r}"
        );
        let r = reason(&["8.8.8.8", "1.2.3"], &[]);
        assert!(
            r.starts_with("network.allowOut[1] \"1.2.3\": neither an IPv4 address"),
            "{r}"
        );
        assert!(reason(&["300.1.1.1/8"], &[]).contains("not an IPv4 address"));
        assert!(reason(&["*"], &[]).contains("bare * is invalid"));
        assert!(reason(&["a.*.com"], &[]).contains("first label"));
        assert!(reason(&["*a.com"], &[]).contains("first label"));
        assert!(reason(&["-a.com"], &[]).contains("neither"));
        assert!(reason(&["a..com"], &[]).contains("neither"));
        assert!(reason(&["exämple.com"], &[]).contains("punycode"));
        assert!(reason(&[""], &[]).contains("empty"));
        assert!(reason(&["::/0"], &[]).contains("IPv6 is not supported"));
        assert!(reason(&[], &["2001:db8::1"]).contains("network.denyOut[0]"));
        let long = format!("{}.com", "a".repeat(64));
        assert!(reason(&[&long], &[]).contains("neither"));
        let r = reason(&[], &["10.0.0.0/8", "example.com"]);
        assert!(
            r.starts_with("network.denyOut[1] \"example.com\": denyOut takes IPv4"),
            "{r}"
        );
        let many: Vec<String> = (0..=MAX_ENTRIES)
            .map(|i| format!("10.0.{}.{}", i / 256, i % 256))
            .collect();
        let e = EgressPolicy::new(
            &EgressRules {
                allow_out: many,
                ..Default::default()
            },
            None,
        )
        .unwrap_err();
        assert!(matches!(
            e,
            PolicyError::TooMany {
                field: "allowOut",
                ..
            }
        ));
        let e = EgressRules {
            dns_servers: Some(vec!["dns.google".into()]),
            ..Default::default()
        }
        .checked()
        .unwrap_err();
        assert!(e.to_string().starts_with("network.dnsServers[0]"), "{e}");
    }

    #[test]
    fn internet_off_denies_everything_and_allowed_entries_still_win() {
        let p = EgressPolicy::new(&rules(&["198.18.0.0/15"], &[]), Some(false)).unwrap();
        assert!(p.needs_rules());
        assert!(p.allows_ip("198.19.1.1".parse().unwrap()));
        assert!(!p.allows_ip("1.1.1.1".parse().unwrap()));
        let open = EgressPolicy::new(&rules(&["example.com"], &[]), Some(true)).unwrap();
        assert!(!open.needs_rules(), "nothing denied: no rules");
        assert!(open.allows_ip("1.1.1.1".parse().unwrap()));
    }

    #[test]
    fn nameservers_are_reachable_only_with_a_domain_allowed() {
        let own = ["10.0.0.2".parse().unwrap()];
        let no_names = EgressPolicy::new(&rules(&["1.2.3.4"], &["0.0.0.0/0"]), None).unwrap();
        assert!(no_names.reachable_dns(&own).is_empty());
        let names = EgressPolicy::new(&rules(&["a.com"], &["0.0.0.0/0"]), None).unwrap();
        assert_eq!(names.reachable_dns(&own), own);
        let mut r = rules(&["a.com"], &["0.0.0.0/0"]);
        r.dns_servers = Some(vec![]);
        assert!(
            EgressPolicy::new(&r, None)
                .unwrap()
                .reachable_dns(&own)
                .is_empty()
        );
        r.dns_servers = Some(vec!["1.1.1.1".into()]);
        assert_eq!(
            EgressPolicy::new(&r, None).unwrap().reachable_dns(&own),
            vec!["1.1.1.1".parse::<Ipv4Addr>().unwrap()]
        );
    }

    #[test]
    fn a_policy_serializes_as_its_api_rules() {
        let p = EgressPolicy::new(&rules(&["1.2.3.4", "*.a.com"], &["0.0.0.0/0"]), None).unwrap();
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"allowOut": ["1.2.3.4/32", "*.a.com"], "denyOut": ["0.0.0.0/0"]})
        );
        assert_eq!(serde_json::from_value::<EgressPolicy>(json).unwrap(), p);
        assert!(
            serde_json::from_value::<EgressPolicy>(serde_json::json!({"denyOut": ["x.com"]}))
                .is_err()
        );
    }

    fn label() -> impl Strategy<Value = String> {
        "[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?"
    }

    fn name() -> impl Strategy<Value = String> {
        (prop::collection::vec(label(), 0..3), "[a-z]{1,6}").prop_map(|(mut labels, tld)| {
            labels.push(tld);
            labels.join(".")
        })
    }

    proptest! {
        #[test]
        fn a_wildcard_matches_names_below_at_any_depth_but_never_the_apex(
            base in name(),
            below in prop::collection::vec(label(), 1..4),
        ) {
            let p = EgressPolicy::new(&rules(&[&format!("*.{base}")], &[]), None).unwrap();
            let host = format!("{}.{base}", below.join("."));
            prop_assert!(p.allows_name(&host));
            prop_assert!(!p.allows_name(&base));
        }

        #[test]
        fn an_exact_name_matches_itself_only(base in name(), sub in label()) {
            let p = EgressPolicy::new(&rules(&[&base.to_ascii_uppercase()], &[]), None).unwrap();
            prop_assert!(p.allows_name(&base));
            let below = format!("{sub}.{base}");
            prop_assert!(!p.allows_name(&below));
        }

        #[test]
        fn a_match_is_on_whole_labels(base in name(), glued in "[a-z0-9]{1,5}") {
            // "*.example.com" never matches "badexample.com" nor "x.badexample.com".
            let p = EgressPolicy::new(&rules(&[&format!("*.{base}")], &[]), None).unwrap();
            let glued_host = format!("{glued}{base}");
            let below_glued = format!("x.{glued}{base}");
            prop_assert!(!p.allows_name(&glued_host));
            prop_assert!(!p.allows_name(&below_glued));
        }

        #[test]
        fn normal_forms_are_stable(base in name(), upper in any::<bool>(), dot in any::<bool>()) {
            let mut s = if upper { base.to_ascii_uppercase() } else { base.clone() };
            if dot { s.push('.'); }
            prop_assert_eq!(normalize_name(&s), Some(base.clone()));
            let once = rules(&[&s], &[]).checked().unwrap();
            prop_assert_eq!(once.checked().unwrap(), once.clone());
            prop_assert_eq!(once.allow_out, vec![base]);
        }
    }
}
