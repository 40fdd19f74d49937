//! Property tests of what the node parses from every request before any
//! credential is checked: data-plane classification (host labels, routing
//! headers, the `/proxy` prefix) and query strings. No input may panic, and a
//! well-formed host route is always read back exactly.

use agentenv_node::api::query_pairs;
use agentenv_node::dataplane::{Classified, classify};
use http::Request;
use proptest::prelude::*;

const DOMAINS: [&str; 1] = ["sb.example.com"];

fn domains() -> Vec<String> {
    DOMAINS.iter().map(|d| d.to_string()).collect()
}

fn header_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("01936f8e-72f5-7000-8000-000000000001".to_string()),
        Just("49983".to_string()),
        Just("0".to_string()),
        Just("99999".to_string()),
        "[ -~]{0,40}",
    ]
}

proptest! {
    #[test]
    fn classification_never_panics(
        host in "[ -~]{0,80}",
        path in "/[ -~&&[^ ]]{0,60}",
        id in proptest::option::of(header_value()),
        port in proptest::option::of(header_value()),
        matched: bool,
    ) {
        let mut b = Request::get("/");
        if let Ok(uri) = path.parse::<http::Uri>() {
            b = Request::get(uri);
        }
        if let Ok(v) = http::HeaderValue::from_str(&host) {
            b = b.header("host", v);
        }
        if let Some(id) = id.as_deref().and_then(|v| http::HeaderValue::from_str(v).ok()) {
            b = b.header("e2b-sandbox-id", id);
        }
        if let Some(p) = port.as_deref().and_then(|v| http::HeaderValue::from_str(v).ok()) {
            b = b.header("e2b-sandbox-port", p);
        }
        let req = b.body(()).unwrap();
        let _ = classify(&req, &domains(), matched);
    }

    #[test]
    fn a_valid_sandbox_host_is_read_back_exactly(port in 1u16.., id in "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", upper: bool) {
        let mut host = format!("{port}-{id}.{}", DOMAINS[0]);
        if upper {
            host = host.to_ascii_uppercase();
        }
        let req = Request::get("/files?path=/a").header("host", host).body(()).unwrap();
        match classify(&req, &domains(), false) {
            Classified::Proxy(t) => {
                prop_assert_eq!(t.port, port);
                prop_assert_eq!(t.sandbox_id, id);
                prop_assert_eq!(t.path_and_query, "/files?path=/a");
            }
            other => prop_assert!(false, "{other:?}"),
        }
    }

    #[test]
    fn query_parsing_never_panics(q in "[ -~]{0,120}") {
        let _ = query_pairs(&q);
    }
}
