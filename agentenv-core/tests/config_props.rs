//! Property test of config loading: any file content and any environment
//! value gives a config or an error naming what is wrong, never a panic.

use agentenv_core::config::{Config, LoadOptions, Service};
use proptest::prelude::*;

fn json_like() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("null".to_string()),
        Just("true".to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        "\"[ -~&&[^\"\\\\]]{0,12}\"".prop_map(|s| s),
        Just("\"-5s\"".to_string()),
        Just("\"99999999999999999999h\"".to_string()),
    ];
    let key = prop_oneof![
        Just("scheduler"),
        Just("gateway"),
        Just("nodes"),
        Just("request_timeout"),
        Just("report_ttl"),
        Just("strategy"),
        Just("endpoint"),
        Just("id"),
        Just("max_connections"),
        Just("tls"),
        Just("cert_file"),
        Just("x")
    ];
    leaf.prop_recursive(4, 40, 6, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4)
                .prop_map(|v| format!("[{}]", v.join(","))),
            proptest::collection::vec((key.clone(), inner), 0..5).prop_map(|kv| {
                let body: Vec<String> = kv
                    .into_iter()
                    .map(|(k, v)| format!("\"{k}\":{v}"))
                    .collect();
                format!("{{{}}}", body.join(","))
            }),
        ]
    })
}

proptest! {
    #[test]
    fn loading_any_file_never_panics(text in prop_oneof![json_like(), "[ -~\n]{0,200}"], gateway: bool, env in "[ -~]{0,20}") {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.json");
        std::fs::write(&path, &text).unwrap();
        let service = if gateway { Service::Gateway } else { Service::Scheduler };
        let opts = LoadOptions { service, query_only: false };
        let _ = Config::load_with_env(Some(&path), opts, |k| {
            (k.ends_with("TIMEOUT") || k.ends_with("CAPACITY")).then(|| env.clone())
        });
    }
}
