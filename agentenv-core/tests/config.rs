//! Loading the control-plane config: defaults, file, environment, validation.

use std::collections::HashMap;
use std::io::Write;
use std::time::Duration;

use agentenv_core::config::{Config, ConfigError, LoadOptions, Loaded, Service};

const SCHED: LoadOptions = LoadOptions {
    service: Service::Scheduler,
    query_only: false,
};
const QUERY_ONLY: LoadOptions = LoadOptions {
    service: Service::Scheduler,
    query_only: true,
};
const GATEWAY: LoadOptions = LoadOptions {
    service: Service::Gateway,
    query_only: false,
};

fn load(json: &str, opts: LoadOptions, env: &[(&str, &str)]) -> Result<Loaded, ConfigError> {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(json.as_bytes()).unwrap();
    let env: HashMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Config::load_with_env(Some(f.path()), opts, |k| env.get(k).cloned())
}

fn err(json: &str, opts: LoadOptions, env: &[(&str, &str)]) -> String {
    match load(json, opts, env) {
        Ok(l) => panic!("expected an error, got {:?}", l.config),
        Err(e) => e.to_string(),
    }
}

/// The reference's defaults, except the listen addresses: they bind loopback, so a
/// cluster without TLS is never reachable from other hosts by default.
#[test]
fn defaults_match_the_reference_but_listen_on_loopback() {
    let c = load("{}", SCHED, &[]).unwrap().config;
    assert_eq!(c.log_format, "auto");
    assert_eq!(c.log_level, "info");
    let s = &c.scheduler;
    assert_eq!(s.discovery.mode, "static");
    assert_eq!(s.discovery.kubernetes.scheme, "http");
    assert_eq!(s.report_ttl, Duration::from_secs(30));
    assert_eq!(s.binding_ttl, Duration::from_secs(30));
    assert_eq!(s.grpc_listen_addr, "127.0.0.1:9090");
    assert_eq!(s.metrics_listen_addr, "127.0.0.1:9101");
    assert_eq!(s.artifact_store_capacity, 1_000_000);
    assert_eq!(s.artifact_lookup_node_limit, 0);
    assert_eq!(s.strategy, "round_robin");
    assert_eq!(s.nodes.len(), 1);
    assert_eq!(s.nodes[0].id, "local-node");
    assert_eq!(s.nodes[0].endpoint, "http://127.0.0.1:8000");
    let g = load("{}", GATEWAY, &[]).unwrap().config.gateway;
    assert_eq!(g.http_listen_addr, "127.0.0.1:8080");
    assert_eq!(g.metrics_listen_addr, "127.0.0.1:9102");
    assert_eq!(g.scheduler_addr, "127.0.0.1:9090");
    assert_eq!(g.request_timeout, Duration::from_secs(30));
    assert_eq!(g.forward_response_size, 4 * 1024 * 1024);
    assert!(!g.debug_mode);
}

#[test]
fn no_file_means_defaults() {
    let l = Config::load_with_env(None, SCHED, |_| None).unwrap();
    assert_eq!(l.config.scheduler.nodes[0].id, "local-node");
    assert_eq!(l.config.service, Some(Service::Scheduler));
}

#[test]
fn query_only_needs_redis_and_ignores_nodes() {
    let c = load(
        r#"{"scheduler":{"redis_addr":"127.0.0.1:6379","nodes":[]}}"#,
        QUERY_ONLY,
        &[],
    )
    .unwrap()
    .config;
    assert_eq!(c.scheduler.redis_addr, "127.0.0.1:6379");
    let e = err("{}", QUERY_ONLY, &[]);
    assert!(e.contains("scheduler.redis_addr"), "{e}");
}

#[test]
fn log_format_accepts_auto_console_json_and_rejects_pretty() {
    for f in ["auto", "console", "json", "JSON"] {
        load(&format!(r#"{{"log_format":"{f}"}}"#), SCHED, &[]).unwrap();
    }
    let e = err(r#"{"log_format":"pretty"}"#, SCHED, &[]);
    assert!(e.starts_with("log_format:") && e.contains("pretty"), "{e}");
    let e = err(r#"{"log_format":""}"#, SCHED, &[]);
    assert!(e.contains("log_format: is required"), "{e}");
}

#[test]
fn unknown_log_level_is_rejected() {
    let e = err(r#"{"log_level":"chatty"}"#, SCHED, &[]);
    assert!(e.starts_with("log_level:") && e.contains("chatty"), "{e}");
}

#[test]
fn gateway_timeout_and_domains_parse_in_order() {
    let g = load(
        r#"{"gateway":{"request_timeout":"45s","sandbox_proxy_domains":["b.example","a.example"]}}"#,
        GATEWAY,
        &[],
    )
    .unwrap()
    .config
    .gateway;
    assert_eq!(g.request_timeout, Duration::from_secs(45));
    assert_eq!(g.sandbox_proxy_domains, vec!["b.example", "a.example"]);
}

#[test]
fn numeric_durations_are_rejected_naming_the_key() {
    let e = err(r#"{"gateway":{"request_timeout":30}}"#, GATEWAY, &[]);
    assert!(e.contains("gateway.request_timeout"), "{e}");
    assert!(
        e.contains("must be a duration string like \"30s\", got numeric value 30"),
        "{e}"
    );
    for key in ["report_ttl", "binding_ttl"] {
        let e = err(&format!(r#"{{"scheduler":{{"{key}":30}}}}"#), SCHED, &[]);
        assert!(e.contains(&format!("scheduler.{key}")), "{e}");
        assert!(e.contains("got numeric value 30"), "{e}");
    }
}

#[test]
fn unparsable_and_non_positive_durations_are_rejected() {
    let e = err(r#"{"scheduler":{"report_ttl":"45"}}"#, SCHED, &[]);
    assert!(
        e.contains("scheduler.report_ttl") && e.contains("missing unit"),
        "{e}"
    );
    let e = err(r#"{"scheduler":{"report_ttl":"0s"}}"#, SCHED, &[]);
    assert!(
        e.contains("scheduler.report_ttl") && e.contains("greater than zero"),
        "{e}"
    );
    let e = err(r#"{"scheduler":{"binding_ttl":"-5s"}}"#, SCHED, &[]);
    assert!(
        e.contains("scheduler.binding_ttl") && e.contains("greater than zero"),
        "{e}"
    );
    let e = err(r#"{"gateway":{"request_timeout":"0s"}}"#, GATEWAY, &[]);
    assert!(
        e.contains("gateway.request_timeout") && e.contains("greater than zero"),
        "{e}"
    );
    let e = err(r#"{"gateway":{"request_timeout":true}}"#, GATEWAY, &[]);
    assert!(e.contains("gateway.request_timeout"), "{e}");
}

#[test]
fn env_overrides_apply_with_go_duration_syntax() {
    let g = load("{}", GATEWAY, &[("GATEWAY_REQUEST_TIMEOUT", "1m30s")])
        .unwrap()
        .config
        .gateway;
    assert_eq!(g.request_timeout, Duration::from_secs(90));
    let g = load(
        "{}",
        GATEWAY,
        &[("GATEWAY_SANDBOX_PROXY_DOMAINS", " a,b ,,")],
    )
    .unwrap()
    .config
    .gateway;
    assert_eq!(g.sandbox_proxy_domains, vec!["a", "b"]);
    let e = err("{}", GATEWAY, &[("GATEWAY_REQUEST_TIMEOUT", "1m30")]);
    assert!(
        e.starts_with("invalid GATEWAY_REQUEST_TIMEOUT \"1m30\""),
        "{e}"
    );
    let g = load("{}", GATEWAY, &[("GATEWAY_DEBUG_MODE", "T")])
        .unwrap()
        .config
        .gateway;
    assert!(g.debug_mode);
    let e = err("{}", GATEWAY, &[("GATEWAY_DEBUG_MODE", "yes")]);
    assert!(e.starts_with("invalid GATEWAY_DEBUG_MODE"), "{e}");
}

#[test]
fn scheduler_env_overrides_apply_and_validate() {
    let s = load("{}", SCHED, &[("SCHEDULER_BINDING_TTL", "45s")])
        .unwrap()
        .config
        .scheduler;
    assert_eq!(s.binding_ttl, Duration::from_secs(45));
    let e = err("{}", SCHED, &[("SCHEDULER_BINDING_TTL", "45")]);
    assert!(e.starts_with("invalid SCHEDULER_BINDING_TTL"), "{e}");
    let s = load("{}", SCHED, &[("SCHEDULER_ARTIFACT_STORE_CAPACITY", "123")])
        .unwrap()
        .config
        .scheduler;
    assert_eq!(s.artifact_store_capacity, 123);
    let e = err(
        "{}",
        SCHED,
        &[("SCHEDULER_ARTIFACT_STORE_CAPACITY", "many")],
    );
    assert!(
        e.starts_with("invalid SCHEDULER_ARTIFACT_STORE_CAPACITY"),
        "{e}"
    );
    let e = err("{}", SCHED, &[("SCHEDULER_ARTIFACT_STORE_CAPACITY", "0")]);
    assert!(e.contains("scheduler.artifact_store_capacity"), "{e}");
    let s = load(
        "{}",
        SCHED,
        &[("SCHEDULER_ARTIFACT_LOOKUP_NODE_LIMIT", "9")],
    )
    .unwrap()
    .config
    .scheduler;
    assert_eq!(s.artifact_lookup_node_limit, 9);
    let s = load(
        "{}",
        SCHED,
        &[("SCHEDULER_ARTIFACT_LOOKUP_NODE_LIMIT", "-1")],
    )
    .unwrap()
    .config
    .scheduler;
    assert_eq!(s.artifact_lookup_node_limit, -1);
    let e = err(
        "{}",
        SCHED,
        &[("SCHEDULER_ARTIFACT_LOOKUP_NODE_LIMIT", "many")],
    );
    assert!(
        e.starts_with("invalid SCHEDULER_ARTIFACT_LOOKUP_NODE_LIMIT"),
        "{e}"
    );
    let s = load("{}", SCHED, &[("SCHEDULER_METRICS_LISTEN_ADDR", ":19101")])
        .unwrap()
        .config
        .scheduler;
    assert_eq!(s.metrics_listen_addr, ":19101");
    let s = load("{}", SCHED, &[("SCHEDULER_STRATEGY", " least_loaded ")])
        .unwrap()
        .config
        .scheduler;
    assert_eq!(s.strategy, "least_loaded");
}

#[test]
fn env_of_the_other_service_does_not_break_loading() {
    load("{}", SCHED, &[("GATEWAY_REQUEST_TIMEOUT", "bogus")]).unwrap();
    load("{}", GATEWAY, &[("SCHEDULER_BINDING_TTL", "bogus")]).unwrap();
}

#[test]
fn nodes_without_discovery_default_to_static() {
    let s = load(
        r#"{"scheduler":{"nodes":[{"id":"node-a","endpoint":"http://10.0.0.21:8000"}]}}"#,
        SCHED,
        &[],
    )
    .unwrap()
    .config
    .scheduler;
    assert_eq!(s.discovery.mode, "static");
    assert_eq!(s.nodes[0].id, "node-a");
}

#[test]
fn kubernetes_discovery_parses_verbatim_and_requires_its_keys() {
    let s = load(
        r#"{"scheduler":{"discovery":{"mode":" Kubernetes ","kubernetes":{"namespace":"agentenv-system","service_name":"agentenv-nodes","port":8000,"ignore_pod_selector":"a=b","no_schedule_pod_selector":"c in (d)"}}}}"#,
        SCHED,
        &[],
    )
    .unwrap()
    .config
    .scheduler;
    assert_eq!(s.discovery.mode, "kubernetes");
    assert_eq!(s.discovery.kubernetes.namespace, "agentenv-system");
    assert_eq!(s.discovery.kubernetes.scheme, "http");
    assert_eq!(s.discovery.kubernetes.ignore_pod_selector, "a=b");
    assert_eq!(s.discovery.kubernetes.no_schedule_pod_selector, "c in (d)");
    let e = err(
        r#"{"scheduler":{"discovery":{"mode":"kubernetes","kubernetes":{"namespace":"ns","service_name":"","port":0}}}}"#,
        SCHED,
        &[],
    );
    assert!(
        e.contains("scheduler.discovery.kubernetes.service_name"),
        "{e}"
    );
    let e = err(
        r#"{"scheduler":{"discovery":{"mode":"consul"}}}"#,
        SCHED,
        &[],
    );
    assert!(
        e.contains("scheduler.discovery.mode") && e.contains("consul"),
        "{e}"
    );
}

#[test]
fn ttls_parse_and_default() {
    let s = load(
        r#"{"scheduler":{"report_ttl":"45s","binding_ttl":"75s"}}"#,
        SCHED,
        &[],
    )
    .unwrap()
    .config
    .scheduler;
    assert_eq!(s.report_ttl, Duration::from_secs(45));
    assert_eq!(s.binding_ttl, Duration::from_secs(75));
}

#[test]
fn artifact_settings_parse_and_bad_values_fail() {
    let s = load(
        r#"{"scheduler":{"artifact_store_capacity":42,"artifact_lookup_node_limit":7}}"#,
        SCHED,
        &[],
    )
    .unwrap()
    .config
    .scheduler;
    assert_eq!(
        (s.artifact_store_capacity, s.artifact_lookup_node_limit),
        (42, 7)
    );
    for limit in [0, -1] {
        let s = load(
            &format!(r#"{{"scheduler":{{"artifact_lookup_node_limit":{limit}}}}}"#),
            SCHED,
            &[],
        )
        .unwrap()
        .config
        .scheduler;
        assert_eq!(s.artifact_lookup_node_limit, limit);
    }
    let e = err(
        r#"{"scheduler":{"artifact_lookup_node_limit":"many"}}"#,
        SCHED,
        &[],
    );
    assert!(e.contains("scheduler.artifact_lookup_node_limit"), "{e}");
    let e = err(
        r#"{"scheduler":{"artifact_store_capacity":"many"}}"#,
        SCHED,
        &[],
    );
    assert!(e.contains("scheduler.artifact_store_capacity"), "{e}");
    let e = err(r#"{"scheduler":{"artifact_store_capacity":0}}"#, SCHED, &[]);
    assert!(
        e.contains("scheduler.artifact_store_capacity: must be greater than zero"),
        "{e}"
    );
}

#[test]
fn unknown_strategy_is_an_error_naming_the_choices() {
    let e = err(r#"{"scheduler":{"strategy":"round-robin"}}"#, SCHED, &[]);
    assert!(e.starts_with("scheduler.strategy:"), "{e}");
    assert!(
        e.contains("round_robin, random, least_loaded, power_of_two"),
        "{e}"
    );
    for s in ["round_robin", "random", "least_loaded", "power_of_two"] {
        load(
            &format!(r#"{{"scheduler":{{"strategy":"{s}"}}}}"#),
            SCHED,
            &[],
        )
        .unwrap();
    }
}

#[test]
fn node_list_is_strict() {
    let e = err(r#"{"scheduler":{"nodes":[]}}"#, SCHED, &[]);
    assert!(e.starts_with("scheduler.nodes: must not be empty"), "{e}");
    let e = err(r#"{"scheduler":{"nodes":[{"id":"a"}]}}"#, SCHED, &[]);
    assert!(
        e.starts_with("scheduler.nodes[0].endpoint: is required"),
        "{e}"
    );
    let e = err(
        r#"{"scheduler":{"nodes":[{"endpoint":"http://x:1"}]}}"#,
        SCHED,
        &[],
    );
    assert!(e.starts_with("scheduler.nodes[0].id: is required"), "{e}");
    let e = err(
        r#"{"scheduler":{"nodes":[{"id":"a","endpoint":"http://x:1"},{"id":"a","endpoint":"http://y:1"}]}}"#,
        SCHED,
        &[],
    );
    assert!(
        e.starts_with("scheduler.nodes[1].id: duplicate node id \"a\""),
        "{e}"
    );
    let e = err(
        r#"{"scheduler":{"nodes":[{"id":"a","endpoint":"10.0.0.21:8000"}]}}"#,
        SCHED,
        &[],
    );
    assert!(e.starts_with("scheduler.nodes[0].endpoint:"), "{e}");
    assert!(e.contains("must start with http:// or https://"), "{e}");
    assert!(e.contains("http://10.0.0.21:8000"), "{e}");
    load(
        r#"{"scheduler":{"nodes":[{"id":"a","endpoint":"https://x:1/base"}]}}"#,
        SCHED,
        &[],
    )
    .unwrap();
}

#[test]
fn scheduler_addr_with_a_scheme_is_rejected_with_the_fix() {
    let e = err(
        r#"{"gateway":{"scheduler_addr":"http://10.0.0.10:9090"}}"#,
        GATEWAY,
        &[],
    );
    assert!(e.starts_with("gateway.scheduler_addr:"), "{e}");
    assert!(e.contains("write \"10.0.0.10:9090\""), "{e}");
    let e = err(r#"{"gateway":{"scheduler_addr":""}}"#, GATEWAY, &[]);
    assert!(e.starts_with("gateway.scheduler_addr: is required"), "{e}");
    let e = err(
        r#"{"gateway":{"query_only_scheduler_addr":"grpc://a:1"}}"#,
        GATEWAY,
        &[],
    );
    assert!(e.starts_with("gateway.query_only_scheduler_addr:"), "{e}");
}

#[test]
fn only_the_running_services_section_is_validated() {
    load(r#"{"gateway":{"scheduler_addr":"http://x:1"}}"#, SCHED, &[]).unwrap();
    load(r#"{"scheduler":{"nodes":[]}}"#, GATEWAY, &[]).unwrap();
}

#[test]
fn blank_metrics_addresses_get_defaults() {
    let c = load(r#"{"scheduler":{"metrics_listen_addr":""}}"#, SCHED, &[])
        .unwrap()
        .config;
    assert_eq!(c.scheduler.metrics_listen_addr, "127.0.0.1:9101");
    let c = load(r#"{"gateway":{"metrics_listen_addr":" "}}"#, GATEWAY, &[])
        .unwrap()
        .config;
    assert_eq!(c.gateway.metrics_listen_addr, "127.0.0.1:9102");
}

#[test]
fn bad_listen_addresses_are_rejected() {
    let e = err(r#"{"scheduler":{"grpc_listen_addr":"9090"}}"#, SCHED, &[]);
    assert!(e.starts_with("scheduler.grpc_listen_addr:"), "{e}");
    let e = err(r#"{"gateway":{"http_listen_addr":":http"}}"#, GATEWAY, &[]);
    assert!(e.starts_with("gateway.http_listen_addr:"), "{e}");
}

#[test]
fn unknown_keys_are_warnings_not_errors() {
    let l = load(
        r#"{"schedular":{},"scheduler":{"stratgy":"random"}}"#,
        SCHED,
        &[],
    )
    .unwrap();
    assert_eq!(l.warnings.len(), 2, "{:?}", l.warnings);
    assert!(
        l.warnings
            .iter()
            .any(|w| w.contains("unknown key schedular"))
    );
    assert!(
        l.warnings
            .iter()
            .any(|w| w.contains("unknown key scheduler.stratgy"))
    );
}

#[test]
fn malformed_json_and_missing_files_are_clear_errors() {
    let e = err(r#"{"scheduler": "#, SCHED, &[]);
    assert!(e.contains("is not valid JSON"), "{e}");
    let e = err(r#"{"scheduler": {}} trailing"#, SCHED, &[]);
    assert!(e.contains("is not valid JSON"), "{e}");
    let e = Config::load_with_env(Some("/nonexistent/cp.json".as_ref()), SCHED, |_| None)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("cannot read config file /nonexistent/cp.json"),
        "{e}"
    );
}

#[test]
fn node_resource_limit_parses_optional_fields() {
    let s = load(
        r#"{"scheduler":{"node_resource_limit":{"max_sandbox_count":10,"max_allocated_memory_bytes_including_paused":17179869184}}}"#,
        SCHED,
        &[],
    )
    .unwrap()
    .config
    .scheduler;
    let l = s.node_resource_limit.unwrap();
    assert_eq!(l.max_sandbox_count, Some(10));
    assert_eq!(
        l.max_allocated_memory_bytes_including_paused,
        Some(17_179_869_184)
    );
    assert_eq!(l.max_cpu_used_percent, None);
    let s = load(r#"{"scheduler":{"node_resource_limit":null}}"#, SCHED, &[])
        .unwrap()
        .config
        .scheduler;
    assert!(s.node_resource_limit.is_none());
}

#[test]
fn listeners_other_hosts_reach_need_tls_or_an_explicit_choice() {
    // The gateway: plain HTTP on every interface is refused, naming both fixes.
    let e = err(r#"{"gateway":{"http_listen_addr":":8080"}}"#, GATEWAY, &[]);
    assert!(
        e.starts_with("gateway.http_listen_addr:")
            && e.contains("gateway.tls.cert_file")
            && e.contains("gateway.allow_plain_http"),
        "{e}"
    );
    load(
        r#"{"gateway":{"http_listen_addr":":8080","tls":{"cert_file":"c.pem","key_file":"k.pem"}}}"#,
        GATEWAY,
        &[],
    )
    .unwrap();
    load(
        r#"{"gateway":{"http_listen_addr":":8080","allow_plain_http":true}}"#,
        GATEWAY,
        &[],
    )
    .unwrap();
    load(
        r#"{"gateway":{"http_listen_addr":":8080"}}"#,
        GATEWAY,
        &[("GATEWAY_ALLOW_PLAIN_HTTP", "true")],
    )
    .unwrap();
    let e = err(
        r#"{"gateway":{"http_listen_addr":":8080"}}"#,
        GATEWAY,
        &[("GATEWAY_ALLOW_PLAIN_HTTP", "yes")],
    );
    assert!(e.contains("GATEWAY_ALLOW_PLAIN_HTTP"), "{e}");

    // The scheduler: TLS, and a cluster credential, when other hosts reach it.
    let exposed = r#"{"scheduler":{"grpc_listen_addr":"0.0.0.0:9090"}}"#;
    let e = err(exposed, SCHED, &[]);
    assert!(
        e.starts_with("scheduler.grpc_listen_addr:") && e.contains("scheduler.allow_plain_http"),
        "{e}"
    );
    let tls_only = r#"{"scheduler":{"grpc_listen_addr":"0.0.0.0:9090","tls":{"cert_file":"c","key_file":"k"}}}"#;
    let e = err(tls_only, SCHED, &[]);
    assert!(
        e.starts_with("scheduler.cluster_token_file:") && e.contains("insecure_no_auth"),
        "{e}"
    );
    load(
        r#"{"scheduler":{"grpc_listen_addr":"0.0.0.0:9090","tls":{"cert_file":"c","key_file":"k"},"cluster_token_file":"/etc/agentenv/cluster-token"}}"#,
        SCHED,
        &[],
    )
    .unwrap();
    load(
        r#"{"scheduler":{"grpc_listen_addr":"0.0.0.0:9090","allow_plain_http":true,"insecure_no_auth":true}}"#,
        SCHED,
        &[],
    )
    .unwrap();
    // Query-only replicas answer lookups only: TLS is still wanted, the credential not.
    load(
        r#"{"scheduler":{"grpc_listen_addr":"0.0.0.0:9090","allow_plain_http":true,"redis_addr":"127.0.0.1:6379"}}"#,
        QUERY_ONLY,
        &[],
    )
    .unwrap();
}

#[test]
fn the_console_is_on_with_a_twelve_hour_session_and_can_be_turned_off() {
    let g = load("{}", GATEWAY, &[]).unwrap().config.gateway;
    assert!(g.console.enabled);
    assert_eq!(g.console.session_ttl, Duration::from_secs(12 * 3600));
    let g = load(
        r#"{"gateway":{"console":{"enabled":false,"session_ttl":"30m"}}}"#,
        GATEWAY,
        &[],
    )
    .unwrap()
    .config
    .gateway;
    assert!(!g.console.enabled);
    assert_eq!(g.console.session_ttl, Duration::from_secs(1800));
    let g = load(
        "{}",
        GATEWAY,
        &[
            ("GATEWAY_CONSOLE_ENABLED", "false"),
            ("GATEWAY_CONSOLE_SESSION_TTL", "2h"),
        ],
    )
    .unwrap()
    .config
    .gateway;
    assert!(!g.console.enabled);
    assert_eq!(g.console.session_ttl, Duration::from_secs(7200));
    for ttl in ["0s", "169h"] {
        let e = err(
            &format!(r#"{{"gateway":{{"console":{{"session_ttl":"{ttl}"}}}}}}"#),
            GATEWAY,
            &[],
        );
        assert!(e.contains("gateway.console.session_ttl"), "{e}");
    }
}

#[test]
fn routes_are_kept_one_second_by_default_zero_asks_every_time_and_over_a_minute_is_refused() {
    let g = load("{}", GATEWAY, &[]).unwrap().config.gateway;
    assert_eq!(g.route_cache_ttl, Duration::from_secs(1));
    let g = load(r#"{"gateway":{"route_cache_ttl":"0s"}}"#, GATEWAY, &[])
        .unwrap()
        .config
        .gateway;
    assert_eq!(g.route_cache_ttl, Duration::ZERO);
    let g = load("{}", GATEWAY, &[("GATEWAY_ROUTE_CACHE_TTL", "250ms")])
        .unwrap()
        .config
        .gateway;
    assert_eq!(g.route_cache_ttl, Duration::from_millis(250));
    let e = err(r#"{"gateway":{"route_cache_ttl":"61s"}}"#, GATEWAY, &[]);
    assert!(e.contains("gateway.route_cache_ttl"), "{e}");
}
