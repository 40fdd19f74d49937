//! Host-based routing: `<port>-<sandbox id>.<domain>` names a sandbox's
//! data-plane port when `<domain>` is one of `gateway.sandbox_proxy_domains`.

/// A domain in `sandbox_proxy_domains` that is not a DNS name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "gateway.sandbox_proxy_domains contains invalid domain {0:?}: use a DNS name such as \"sandbox.example.com\""
)]
pub struct InvalidDomain(pub String);

/// Why a Host under a proxy domain is not a usable sandbox route. The
/// message is what the client receives with a 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HostRouteError {
    #[error("invalid sandbox data-plane host: label too long")]
    LabelTooLong,
    #[error("invalid sandbox data-plane host: sandbox id is empty")]
    EmptySandboxId,
    #[error("invalid sandbox data-plane host: sandbox id is invalid")]
    InvalidSandboxId,
    #[error("invalid sandbox data-plane host: port is not numeric")]
    PortNotNumeric,
    #[error("invalid sandbox data-plane host: port out of range")]
    PortOutOfRange,
}

/// A sandbox and port named by the request's Host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRoute {
    pub sandbox_id: String,
    pub port: u16,
}

/// The normalised proxy domains, longest first.
#[derive(Debug, Clone, Default)]
pub struct HostRouter {
    domains: Vec<String>,
}

impl HostRouter {
    /// Normalises (trim, lowercase, strip a trailing dot, drop blanks),
    /// validates, deduplicates and sorts the domains longest first.
    pub fn new<S: AsRef<str>>(domains: &[S]) -> Result<Self, InvalidDomain> {
        let mut out: Vec<String> = Vec::new();
        for raw in domains {
            let d = raw.as_ref().trim().to_ascii_lowercase();
            let d = d.strip_suffix('.').unwrap_or(&d).to_string();
            if d.is_empty() {
                continue;
            }
            if !is_dns_name(&d) {
                return Err(InvalidDomain(raw.as_ref().to_string()));
            }
            if !out.contains(&d) {
                out.push(d);
            }
        }
        out.sort_by_key(|d| std::cmp::Reverse(d.len()));
        Ok(Self { domains: out })
    }

    /// The domains in matching order.
    pub fn domains(&self) -> &[String] {
        &self.domains
    }

    /// Whether any domain is configured.
    pub fn is_empty(&self) -> bool {
        self.domains.is_empty()
    }

    /// Parses a request Host (`name[:port]`, any case, optional trailing
    /// dot). `Ok(None)` when the host is not a sandbox route.
    pub fn route(&self, host: &str) -> Result<Option<HostRoute>, HostRouteError> {
        if self.domains.is_empty() {
            return Ok(None);
        }
        let host = normalize_host(host);
        for domain in &self.domains {
            if host == *domain {
                return Ok(None);
            }
            let Some(label) = host
                .strip_suffix(domain.as_str())
                .and_then(|rest| rest.strip_suffix('.'))
            else {
                continue;
            };
            if label.is_empty() || label.contains('.') || !label.contains('-') {
                continue;
            }
            return parse_label(label).map(Some);
        }
        Ok(None)
    }
}

fn normalize_host(host: &str) -> String {
    let h = host.trim();
    let h = if let Some(rest) = h.strip_prefix('[') {
        // IPv6 literal: never a sandbox route, keep it recognisable.
        rest.split(']').next().unwrap_or(rest)
    } else {
        match h.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => h,
        }
    };
    let h = h.to_ascii_lowercase();
    h.strip_suffix('.').map(str::to_string).unwrap_or(h)
}

fn parse_label(label: &str) -> Result<HostRoute, HostRouteError> {
    if label.len() > 63 {
        return Err(HostRouteError::LabelTooLong);
    }
    let (port, id) = label.split_once('-').expect("label contains '-'");
    if id.is_empty() {
        return Err(HostRouteError::EmptySandboxId);
    }
    if !is_dns_label(id) {
        return Err(HostRouteError::InvalidSandboxId);
    }
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return Err(HostRouteError::PortNotNumeric);
    }
    let port: u64 = port.parse().unwrap_or(u64::MAX);
    if !(1..=65535).contains(&port) {
        return Err(HostRouteError::PortOutOfRange);
    }
    Ok(HostRoute {
        sandbox_id: id.to_string(),
        port: port as u16,
    })
}

/// A lowercase DNS label: 1–63 of `[a-z0-9-]`, no leading or trailing `-`.
fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && !s.starts_with('-')
        && !s.ends_with('-')
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

fn is_dns_name(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOMAIN: &str = "sandbox-proxy.example.invalid";
    const ALT: &str = "sandbox-proxy-alt.example.invalid";
    const ID: &str = "018ff4b7-8c0d-7f7c-9a99-123456789abc";

    fn router() -> HostRouter {
        HostRouter::new(&[DOMAIN, ALT]).unwrap()
    }

    fn ok(host: &str) -> Option<HostRoute> {
        router().route(host).unwrap()
    }

    fn err(host: &str) -> String {
        router().route(host).unwrap_err().to_string()
    }

    #[test]
    fn a_port_and_id_label_under_either_domain_is_a_route() {
        let want = Some(HostRoute {
            sandbox_id: ID.into(),
            port: 40988,
        });
        assert_eq!(ok(&format!("40988-{ID}.{DOMAIN}")), want);
        assert_eq!(ok(&format!("40988-{ID}.{ALT}")), want);
        assert_eq!(ok(&format!("40988-{ID}.{DOMAIN}.:443")), want);
        assert_eq!(
            ok(&format!("40988-{ID}.SANDBOX-proxy.Example.invalid")),
            want
        );
    }

    #[test]
    fn each_bad_label_has_its_own_message() {
        assert_eq!(
            err(&format!("abc-{ID}.{DOMAIN}")),
            "invalid sandbox data-plane host: port is not numeric"
        );
        assert_eq!(
            err(&format!("0-{ID}.{DOMAIN}")),
            "invalid sandbox data-plane host: port out of range"
        );
        assert_eq!(
            err(&format!("70000-{ID}.{DOMAIN}")),
            "invalid sandbox data-plane host: port out of range"
        );
        assert_eq!(
            err(&format!("99999999999999999999999-{ID}.{DOMAIN}")),
            "invalid sandbox data-plane host: port out of range"
        );
        assert_eq!(
            err(&format!("40988-.{DOMAIN}")),
            "invalid sandbox data-plane host: sandbox id is empty"
        );
        assert_eq!(
            err(&format!("40988-sbx_bad.{DOMAIN}")),
            "invalid sandbox data-plane host: sandbox id is invalid"
        );
        assert_eq!(
            err(&format!("40988-{}.{DOMAIN}", "a".repeat(58))),
            "invalid sandbox data-plane host: label too long"
        );
    }

    #[test]
    fn hosts_outside_the_routing_shape_give_no_route() {
        assert_eq!(ok(&format!("40988-{ID}.evil.test")), None);
        assert_eq!(ok(DOMAIN), None);
        assert_eq!(ok(&format!("{DOMAIN}:8080")), None);
        assert_eq!(ok(&format!("asdfasdfasdfasdf.{DOMAIN}")), None);
        assert_eq!(ok(&format!("a.40988-{ID}.{DOMAIN}")), None);
        assert_eq!(ok("[::1]:8080"), None);
        assert_eq!(
            HostRouter::new::<&str>(&[])
                .unwrap()
                .route("1-a.x")
                .unwrap(),
            None
        );
    }

    #[test]
    fn domains_are_normalised_deduplicated_and_sorted_longest_first() {
        let r = HostRouter::new(&[
            " Sandbox-Proxy.Example.Invalid. ",
            "sandbox-proxy.example.invalid",
            "localHost",
            "",
        ])
        .unwrap();
        assert_eq!(r.domains(), ["sandbox-proxy.example.invalid", "localhost"]);
        let r = HostRouter::new(&["example.invalid", "sandbox-proxy.example.invalid"]).unwrap();
        assert_eq!(r.domains()[0], "sandbox-proxy.example.invalid");
    }

    #[test]
    fn the_longest_overlapping_domain_matches() {
        let r = HostRouter::new(&["example.invalid", "sandbox-proxy.example.invalid"]).unwrap();
        assert_eq!(
            r.route("40988-sbx123.sandbox-proxy.example.invalid")
                .unwrap(),
            Some(HostRoute {
                sandbox_id: "sbx123".into(),
                port: 40988
            })
        );
        assert_eq!(r.route("sandbox-proxy.example.invalid").unwrap(), None);
    }

    #[test]
    fn an_invalid_domain_is_rejected_naming_the_key() {
        let e = HostRouter::new(&["not a domain!"]).unwrap_err();
        assert!(
            e.to_string().starts_with(
                "gateway.sandbox_proxy_domains contains invalid domain \"not a domain!\""
            ),
            "{e}"
        );
        assert!(HostRouter::new(&["-bad.example"]).is_err());
        assert!(HostRouter::new(&[format!("{}.com", "a".repeat(64))]).is_err());
    }
}
