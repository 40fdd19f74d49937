//! Tests of the node's configuration: files, variables and the errors that name them.

use super::*;
use agentenv_core::storage::AddressingStyle;
use std::collections::HashMap;

pub(super) fn load(vars: &[(&str, &str)], file: Option<&str>) -> Result<NodeConfig, ConfigError> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = file.map(|text| {
        let p = dir.path().join("aenv.toml");
        std::fs::write(&p, text).unwrap();
        p
    });
    NodeConfig::load(path.as_deref(), &|k| map.get(k).cloned())
}

#[test]
fn env_overrides_file_and_defaults_apply() {
    let c = load(
        &[("API_ADDR", "127.0.0.1:9000"), ("AENV_NODE_ID", "n1")],
        Some("api_addr = \"0.0.0.0:1\"\n[node_identity]\nnode_id = \"f\"\n[orchestrator]\nauto_evict_interval_ms = 50\n"),
    )
    .unwrap();
    assert_eq!(c.api_addr.to_string(), "127.0.0.1:9000");
    assert_eq!(c.node_id, "n1");
    assert_eq!(c.auto_evict_interval, Duration::from_millis(50));
    assert_eq!(c.metrics_interval, Duration::from_secs(5));
    assert_eq!(c.metrics_history, crate::observe::ring::DEFAULT_HISTORY);
    assert_eq!(c.backend, BackendKind::Auto);
    assert_eq!(c.home, PathBuf::from("/var/lib/aenv"));
    assert!(!c.report_enabled);
}

#[test]
fn scheduler_endpoint_needs_a_scheme_and_reporting_needs_an_endpoint() {
    let e = load(
        &[("AENV_OBSERVABILITY_SCHEDULER_ENDPOINT", "10.0.0.5:9090")],
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("http://"), "{e}");
    let e = load(
        &[("AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED", "true")],
        None,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("AENV_OBSERVABILITY_SCHEDULER_ENDPOINT"),
        "{e}"
    );
    let c = load(
        &[
            ("AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED", "1"),
            ("AENV_OBSERVABILITY_SCHEDULER_ENDPOINT", "http://s:9090"),
            ("AENV_OBSERVABILITY_REPORT_INTERVAL_SECS", "2"),
        ],
        None,
    )
    .unwrap();
    assert!(c.report_enabled);
    assert_eq!(c.report_interval, Duration::from_secs(2));
}

#[test]
fn snapshot_repository_defaults_to_a_directory_under_home_and_takes_the_shared_store() {
    let c = load(&[("AENV_HOME_PATH", "/data/aenv")], None).unwrap();
    assert_eq!(
        c.snapshot_repository,
        StorageConfig::Fs {
            root: PathBuf::from("/data/aenv/snapshot-store/repository")
        }
    );
    assert_eq!(
        c.snapshot_local_cache,
        PathBuf::from("/data/aenv/snapshot-local-cache")
    );
    let c = load(
        &[("AENV_HOME_PATH", "/data/aenv")],
        Some("backend = \"jail\"\n[snapshot]\nlocal_cache_path = \"$AENV_HOME/cache\"\n"),
    )
    .unwrap();
    assert_eq!(c.backend, BackendKind::Jail);
    assert_eq!(c.snapshot_local_cache, PathBuf::from("/data/aenv/cache"));
    let c = load(
        &[("AENV_SNAPSHOT_STORE", "/mnt/shared")],
        Some("[backend.posix_fs]\nsnapshot_store = \"/mnt/other\"\n"),
    )
    .unwrap();
    assert_eq!(
        c.snapshot_repository,
        StorageConfig::Fs {
            root: PathBuf::from("/mnt/shared/repository")
        }
    );
    let c = load(
        &[],
        Some("[backend.posix_fs]\nsnapshot_store = \"/mnt/other\"\n"),
    )
    .unwrap();
    assert_eq!(
        c.snapshot_repository,
        StorageConfig::Fs {
            root: PathBuf::from("/mnt/other/repository")
        }
    );
}

#[test]
fn oss_repository_takes_file_keys_and_credentials_from_the_environment() {
    let file = "[snapshot]\nrepository_backend = \"oss\"\n[backend.oss]\nendpoint = \"https://oss-cn-beijing.aliyuncs.com\"\nbucket = \"snaps\"\nregion = \"cn-beijing\"\nprefix = \"c1/\"\n";
    let e = load(&[], Some(file)).unwrap_err();
    assert!(e.to_string().contains("AENV_OSS_ACCESS_KEY_ID"), "{e}");
    let c = load(
        &[
            ("AENV_OSS_ACCESS_KEY_ID", "ak"),
            ("AENV_OSS_ACCESS_KEY_SECRET", "sk"),
            ("AENV_OSS_ADDRESSING_STYLE", "path"),
        ],
        Some(file),
    )
    .unwrap();
    let StorageConfig::S3(s3) = c.snapshot_repository else {
        panic!("not oss: {:?}", c.snapshot_repository)
    };
    assert_eq!(s3.bucket, "snaps");
    assert_eq!(s3.prefix, "c1/");
    assert_eq!(s3.region, "cn-beijing");
    assert_eq!(
        (s3.access_key_id.as_str(), s3.secret_access_key.as_str()),
        ("ak", "sk")
    );
    assert_eq!(s3.addressing_style, Some(AddressingStyle::Path));
    let e = load(&[("AENV_SNAPSHOT_REPOSITORY_BACKEND", "nfs")], None).unwrap_err();
    assert!(e.to_string().contains("posix_fs"), "{e}");
    let e = load(&[], Some("[backend.disk]\nx = 1\n")).unwrap_err();
    assert!(e.to_string().contains("backend.posix_fs"), "{e}");
    let e = load(&[], Some("[backend.oss]\nbucket_name = \"x\"\n")).unwrap_err();
    assert!(e.to_string().contains("bucket_name"), "{e}");
}

#[test]
fn the_nat_mode_is_snat_unless_the_environment_or_the_file_says_masquerade() {
    use crate::host::net::NatMode;
    assert_eq!(load(&[], None).unwrap().net_nat, NatMode::Snat);
    let file = Some("[jail]\nnat = \"masquerade\"\n");
    assert_eq!(load(&[], file).unwrap().net_nat, NatMode::Masquerade);
    let c = load(&[("AENV_NET_NAT", "snat")], file).unwrap();
    assert_eq!(c.net_nat, NatMode::Snat);
    let e = load(&[("AENV_NET_NAT", "masq")], None).unwrap_err();
    assert!(e.to_string().contains("jail.nat"), "{e}");
}

#[test]
fn sandbox_nameservers_come_from_the_environment_or_the_file_and_are_checked() {
    assert_eq!(load(&[], None).unwrap().jail_dns_servers, None);
    let c = load(
        &[("AENV_JAIL_DNS_SERVERS", "198.18.0.53, 1.1.1.1")],
        Some("[jail]\ndns_servers = [\"9.9.9.9\"]\n"),
    )
    .unwrap();
    let want: Vec<std::net::Ipv4Addr> =
        vec!["198.18.0.53".parse().unwrap(), "1.1.1.1".parse().unwrap()];
    assert_eq!(c.jail_dns_servers, Some(want));
    let c = load(&[], Some("[jail]\ndns_servers = [\"9.9.9.9\"]\n")).unwrap();
    assert_eq!(c.jail_dns_servers, Some(vec!["9.9.9.9".parse().unwrap()]));
    for bad in ["127.0.0.53", "dns.google", "::1"] {
        let e = load(&[("AENV_JAIL_DNS_SERVERS", bad)], None).unwrap_err();
        assert!(e.to_string().contains("jail.dns_servers"), "{e}");
    }
    let e = load(&[], Some("[jail]\ndns_servers = []\n")).unwrap_err();
    assert!(e.to_string().contains("jail.dns_servers"), "{e}");
}

#[test]
fn jail_net_pool_size_comes_from_the_environment_or_the_file() {
    let c = load(&[], None).unwrap();
    assert_eq!(
        c.jail_net_pool_size,
        crate::backend::jail::DEFAULT_NET_POOL_SIZE
    );
    let c = load(&[], Some("[jail]\nnet_pool_size = 0\n")).unwrap();
    assert_eq!(c.jail_net_pool_size, 0);
    let c = load(
        &[("AENV_JAIL_NET_POOL_SIZE", "8")],
        Some("[jail]\nnet_pool_size = 2\n"),
    )
    .unwrap();
    assert_eq!(c.jail_net_pool_size, 8);
    let e = load(&[("AENV_JAIL_NET_POOL_SIZE", "many")], None).unwrap_err();
    assert!(e.to_string().contains("AENV_JAIL_NET_POOL_SIZE"), "{e}");
    let e = load(&[], Some("[jail]\nnet_pool_size = 5000\n")).unwrap_err();
    assert!(e.to_string().contains("jail.net_pool_size"), "{e}");
}

#[test]
fn bad_values_and_unknown_file_keys_are_named() {
    let e = load(&[("AENV_BACKEND", "qemu")], None).unwrap_err();
    assert!(e.to_string().contains("AENV_BACKEND"), "{e}");
    let e = load(&[("API_ADDR", "nope")], None).unwrap_err();
    assert!(e.to_string().contains("API_ADDR"), "{e}");
    let e = load(&[], Some("[orchestrator]\nbogus = 1\n")).unwrap_err();
    assert!(e.to_string().contains("bogus"), "{e}");
}

#[test]
fn metrics_and_log_settings_are_checked() {
    let c = load(
        &[
            ("AENV_METRICS_INTERVAL_MS", "250"),
            ("AENV_METRICS_HISTORY", "10"),
            ("AENV_SANDBOX_LOG_FILE_BYTES", "100000"),
        ],
        None,
    )
    .unwrap();
    assert_eq!(c.metrics_interval, Duration::from_millis(250));
    assert_eq!((c.metrics_history, c.sandbox_log_file_bytes), (10, 100_000));
    for (k, v) in [
        ("AENV_METRICS_INTERVAL_MS", "10"),
        ("AENV_METRICS_HISTORY", "0"),
        ("AENV_SANDBOX_LOG_FILE_BYTES", "10"),
    ] {
        let e = load(&[(k, v)], None).unwrap_err();
        assert!(e.to_string().contains(k), "{e}");
    }
}

#[test]
fn the_api_listens_on_loopback_by_default_and_elsewhere_only_with_tls_or_a_choice() {
    assert!(load(&[], None).unwrap().api_addr.ip().is_loopback());
    let e = load(&[("API_ADDR", "0.0.0.0:8000")], None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("API_ADDR")
            && e.contains("AENV_TLS_CERT_FILE")
            && e.contains("AENV_ALLOW_PLAIN_HTTP"),
        "{e}"
    );
    let c = load(
        &[
            ("API_ADDR", "0.0.0.0:8000"),
            ("AENV_TLS_CERT_FILE", "/etc/aenv/node.pem"),
            ("AENV_TLS_KEY_FILE", "/etc/aenv/node-key.pem"),
        ],
        None,
    )
    .unwrap();
    assert!(c.tls.enabled());
    load(
        &[
            ("API_ADDR", "10.0.0.21:8000"),
            ("AENV_ALLOW_PLAIN_HTTP", "true"),
        ],
        None,
    )
    .unwrap();
}
