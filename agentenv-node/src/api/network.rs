//! `PUT /sandboxes/{id}/network`: a sandbox's egress rules, replaced at once; the
//! `network` of `SandboxDetail`; and the network fields this node refuses rather than
//! ignores.

use http::{Request, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;

use super::ApiState;
use super::body::read_json;
use super::error::{Reply, bad_request};
use crate::dataplane::status_only;
use crate::egress::EgressRules;
use crate::ids::parse_sandbox_id;
use crate::lifecycle::SandboxRecord;

/// The body of `PUT /sandboxes/{id}/network`: a full replace, an omitted field is cleared.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkUpdate {
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub dns_servers: Option<Vec<String>>,
    /// Not served here: refused rather than ignored.
    pub egress_proxy: Option<serde_json::Value>,
    /// Not served here: refused rather than ignored.
    pub rules: Option<serde_json::Value>,
    /// Not served here: refused rather than ignored.
    pub mask_request_host: Option<String>,
    /// Not served here: refused rather than ignored.
    pub https_ports: Option<Vec<u16>>,
    /// Snake case on the wire, as on create.
    #[serde(rename = "allow_internet_access", alias = "allowInternetAccess")]
    pub allow_internet_access: Option<bool>,
}

/// `PUT /sandboxes/{id}/network`: 204 once the rules are in force.
pub(super) async fn update(state: &ApiState, id: &str, req: Request<Incoming>) -> Reply {
    let id = parse_sandbox_id(id)?;
    let body: NetworkUpdate = read_json(req).await?;
    refuse_unsupported(
        body.egress_proxy.as_ref(),
        body.rules.as_ref(),
        body.mask_request_host.as_deref(),
        body.https_ports.as_deref(),
    )
    .map_err(bad_request)?;
    let rules = EgressRules {
        allow_out: body.allow_out.unwrap_or_default(),
        deny_out: body.deny_out.unwrap_or_default(),
        dns_servers: body.dns_servers,
    }
    .checked()
    .map_err(|e| bad_request(e.to_string()))?;
    state
        .orch
        .update_network(&id, rules, body.allow_internet_access)
        .await?;
    Ok(status_only(StatusCode::NO_CONTENT))
}

/// Refuses, with what to do instead, the network features this node does not serve:
/// a SOCKS5 `egressProxy`, header-transform `rules`, `maskRequestHost`, `httpsPorts`.
/// Empty values (null, `{}`, `""`, `[]`) ask for nothing and pass.
pub(crate) fn refuse_unsupported(
    egress_proxy: Option<&serde_json::Value>,
    rules: Option<&serde_json::Value>,
    mask_request_host: Option<&str>,
    https_ports: Option<&[u16]>,
) -> Result<(), String> {
    let given = |v: Option<&serde_json::Value>| match v {
        None | Some(serde_json::Value::Null) => false,
        Some(serde_json::Value::Object(m)) => !m.is_empty(),
        Some(_) => true,
    };
    if given(egress_proxy) {
        return Err(
            "network.egressProxy is not supported by this node: sandbox traffic cannot be tunneled through a SOCKS5 proxy here; remove the field".into(),
        );
    }
    if given(rules) {
        return Err(
            "network.rules (header transforms of outbound requests) are not supported by this node; remove the field".into(),
        );
    }
    if mask_request_host.is_some_and(|m| !m.is_empty()) {
        return Err(
            "network.maskRequestHost is not supported by this node: the data plane forwards the Host a client sends; remove the field".into(),
        );
    }
    if https_ports.is_some_and(|p| !p.is_empty()) {
        return Err(
            "network.httpsPorts is not supported by this node: the data plane speaks plain HTTP to every sandbox port; remove the field".into(),
        );
    }
    Ok(())
}

/// `network` of `SandboxDetail`: shown when public traffic is restricted or egress rules
/// exist.
pub(super) fn detail_json(rec: &SandboxRecord) -> Option<serde_json::Value> {
    let o = &rec.options;
    if o.allow_public_traffic && o.network.is_empty() {
        return None;
    }
    let mut m = serde_json::Map::new();
    m.insert("allowPublicTraffic".into(), o.allow_public_traffic.into());
    if !o.network.allow_out.is_empty() {
        m.insert("allowOut".into(), o.network.allow_out.clone().into());
    }
    if !o.network.deny_out.is_empty() {
        m.insert("denyOut".into(), o.network.deny_out.clone().into());
    }
    if let Some(d) = &o.network.dns_servers {
        m.insert("dnsServers".into(), d.clone().into());
    }
    Some(m.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_features_are_refused_and_empty_ones_pass() {
        let v = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
        let proxy = v(r#"{"address":"p:1080"}"#);
        assert!(
            refuse_unsupported(Some(&proxy), None, None, None)
                .unwrap_err()
                .contains("egressProxy")
        );
        let rules = v(r#"{"a.com":[{}]}"#);
        assert!(
            refuse_unsupported(None, Some(&rules), None, None)
                .unwrap_err()
                .contains("network.rules")
        );
        assert!(
            refuse_unsupported(None, None, Some("${PORT}-m.x"), None)
                .unwrap_err()
                .contains("maskRequestHost")
        );
        assert!(
            refuse_unsupported(None, None, None, Some(&[3000]))
                .unwrap_err()
                .contains("httpsPorts")
        );
        let (null, empty) = (v("null"), v("{}"));
        assert!(refuse_unsupported(Some(&null), Some(&empty), Some(""), Some(&[])).is_ok());
    }

    #[test]
    fn the_update_body_takes_internet_access_in_either_case() {
        let b: NetworkUpdate =
            serde_json::from_str(r#"{"allowOut":["1.2.3.4"],"allow_internet_access":false}"#)
                .unwrap();
        assert_eq!(b.allow_internet_access, Some(false));
        let b: NetworkUpdate = serde_json::from_str(r#"{"allowInternetAccess":true}"#).unwrap();
        assert_eq!(b.allow_internet_access, Some(true));
        let b: NetworkUpdate = serde_json::from_str("{}").unwrap();
        assert!(b.allow_out.is_none() && b.allow_internet_access.is_none());
    }
}
