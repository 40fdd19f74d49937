//! The configuration reference (docs/configuration.md) against the code: every
//! control-plane key (the fields of the config structs in agentenv-core/src/config.rs)
//! and every environment variable the daemons read must be documented; the JSON in the
//! docs and in deploy/ must load without unknown keys.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use agentenv_core::config::{Config, LoadOptions, Service};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// JSON key paths of the control-plane config, read from the struct definitions.
fn control_plane_keys() -> BTreeSet<String> {
    let src = read("agentenv-core/src/config.rs");
    // Where each config struct sits in the JSON document.
    let prefix = |name: &str| -> Option<&'static [&'static str]> {
        Some(match name {
            "Config" => &[""],
            "SchedulerConfig" => &["scheduler."],
            "GatewayConfig" => &["gateway."],
            "NodeConfig" => &["scheduler.nodes[]."],
            "DiscoveryConfig" => &["scheduler.discovery."],
            "KubernetesConfig" => &["scheduler.discovery.kubernetes."],
            // The TLS sections appear at several places.
            "TlsListen" => &["scheduler.tls.", "gateway.tls."],
            "TlsConnect" => &["gateway.node_tls.", "gateway.scheduler_tls."],
            "NodeResourceLimit" => &["scheduler.node_resource_limit."],
            "ConsoleConfig" => &["gateway.console."],
            _ => return None,
        })
    };
    let mut keys = BTreeSet::new();
    let mut current: Option<&[&str]> = None;
    let mut skip_next = false;
    for line in src.lines() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("pub struct ") {
            let name = rest.split([' ', '{', '(']).next().unwrap();
            // Only deserialized structs are part of the JSON document.
            let derive_ok = src
                .split(&format!("pub struct {name} "))
                .next()
                .and_then(|before| before.rsplit("#[derive(").next())
                .is_some_and(|d| d.contains("Deserialize"));
            if derive_ok {
                current = Some(prefix(name).unwrap_or_else(|| {
                    panic!(
                        "config struct {name} is new: map it to its JSON path in control_plane_keys()"
                    )
                }));
            } else {
                current = None;
            }
            continue;
        }
        if t == "}" {
            current = None;
            continue;
        }
        if t.starts_with("#[serde(skip") {
            skip_next = true;
            continue;
        }
        if let (Some(ps), Some(rest)) = (current, t.strip_prefix("pub ")) {
            if let Some((field, _)) = rest.split_once(':') {
                if !std::mem::take(&mut skip_next) {
                    for p in ps {
                        keys.insert(format!("{p}{field}"));
                    }
                }
            }
        }
    }
    keys
}

/// Quoted environment-variable names in `files`.
fn env_vars(files: &[&str]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for f in files {
        let src = read(f);
        for (i, _) in src.match_indices('"') {
            let rest = &src[i + 1..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            if rest[name.len()..].starts_with('"')
                && (name.starts_with("AENV_")
                    || name.starts_with("SCHEDULER_")
                    || name.starts_with("GATEWAY_")
                    || ["API_ADDR", "LOG_LEVEL", "LOG_FORMAT"].contains(&name.as_str()))
            {
                out.insert(name);
            }
        }
    }
    out
}

fn rust_files_under(dir: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![repo().join(dir)];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(
                    p.strip_prefix(repo())
                        .unwrap()
                        .to_string_lossy()
                        .into_owned(),
                );
            }
        }
    }
    out
}

#[test]
fn every_control_plane_key_in_the_code_is_in_the_configuration_reference() {
    let doc = read("docs/configuration.md");
    let keys = control_plane_keys();
    assert!(
        keys.len() > 30,
        "the struct scan found too few keys: {keys:?}"
    );
    for k in [
        "scheduler.nodes[].id",
        "gateway.scheduler_addr",
        "log_format",
    ] {
        assert!(keys.contains(k), "{k} missing from the scan: {keys:?}");
    }
    assert_documented(&doc, &keys, "control-plane keys");
}

#[test]
fn every_environment_variable_the_daemons_read_is_in_the_configuration_reference() {
    let doc = read("docs/configuration.md");
    let mut files = rust_files_under("agentenv-node/src");
    files.extend(
        [
            "agentenv-core/src/config.rs",
            "agentenv-core/src/api_key.rs",
            "agentenv-bin/src/bin/agentenv-node.rs",
            "agentenv-bin/src/bin/agentenv-scheduler.rs",
            "agentenv-bin/src/bin/agentenv-gateway.rs",
        ]
        .map(String::from),
    );
    let files: Vec<&str> = files.iter().map(String::as_str).collect();
    let vars = env_vars(&files);
    for v in [
        "AENV_NODE_ID",
        "API_ADDR",
        "GATEWAY_SCHEDULER_ADDR",
        "SCHEDULER_STRATEGY",
    ] {
        assert!(vars.contains(v), "{v} missing from the scan: {vars:?}");
    }
    let missing: Vec<_> = vars
        .iter()
        .filter(|v| !doc.contains(&format!("`{v}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "environment variables not documented in docs/configuration.md: {missing:?}"
    );
}

/// The JSON blocks of a markdown file that look like a control-plane config.
fn json_blocks(md: &str) -> Vec<String> {
    md.split("```json")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .filter(|b| b.contains("\"scheduler\""))
        .map(String::from)
        .collect()
}

#[test]
fn the_guide_and_deploy_configs_load_for_both_services_without_unknown_keys() {
    let mut docs = json_blocks(&read("docs/static-multi-node.md"));
    assert_eq!(docs.len(), 1, "the guide shows one control-plane.json");
    docs.push(read("deploy/control-plane.json"));
    let dir = tempfile::tempdir().unwrap();
    for (i, text) in docs.iter().enumerate() {
        let path = dir.path().join(format!("c{i}.json"));
        std::fs::write(&path, text).unwrap();
        for service in [Service::Scheduler, Service::Gateway] {
            let loaded = Config::load_with_env(
                Some(&path),
                LoadOptions {
                    service,
                    query_only: false,
                },
                |_| None,
            )
            .unwrap_or_else(|e| panic!("config {i} for {service}: {e}"));
            assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
            let ids: Vec<_> = loaded
                .config
                .scheduler
                .nodes
                .iter()
                .map(|n| n.id.as_str())
                .collect();
            assert_eq!(ids, ["node-a", "node-b"]);
            assert_eq!(loaded.config.gateway.scheduler_addr, "10.0.0.10:9090");
            assert_eq!(
                loaded.config.scheduler.metrics_listen_addr,
                "127.0.0.1:9101"
            );
            assert_eq!(loaded.config.gateway.metrics_listen_addr, "127.0.0.1:9102");
        }
    }
}

/// `KEY="value"` lines of the guide's example of `/etc/default/aenv`.
fn guide_node_env() -> Vec<String> {
    let guide = read("docs/static-multi-node.md");
    let block = guide
        .split("```bash")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .find(|b| b.contains("AENV_NODE_ID="))
        .expect("the guide shows /etc/default/aenv")
        .to_string();
    block
        .lines()
        .filter(|l| l.contains("=\""))
        .map(String::from)
        .collect()
}

#[test]
fn the_node_example_environment_matches_the_guide() {
    let env = read("deploy/aenv.env");
    for line in [
        "API_ADDR=\"0.0.0.0:8000\"",
        "AENV_NODE_ID=\"node-a\"",
        "AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED=\"true\"",
        "AENV_OBSERVABILITY_SCHEDULER_ENDPOINT=\"https://10.0.0.10:9090\"",
    ] {
        assert!(
            env.lines().any(|l| l == line),
            "deploy/aenv.env lacks {line}"
        );
    }
    // Each line of the guide's example (but the secrets' placeholders) is the example
    // file's.
    let guide = guide_node_env();
    assert!(guide.len() > 10, "{guide:?}");
    for line in guide.iter().filter(|l| !l.contains("=\"<")) {
        assert!(
            env.lines().any(|l| l == line),
            "the guide shows {line}, deploy/aenv.env does not"
        );
    }
    // Every variable it sets is a documented one.
    let doc = read("docs/configuration.md");
    for l in env
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains('='))
    {
        let k = l.split('=').next().unwrap();
        assert!(doc.contains(&format!("`{k}`")), "{k} is not documented");
    }
}

/// The value of `key` in an environment file.
fn env_value(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| {
        l.strip_prefix(&format!("{key}="))
            .map(|v| v.trim_matches('"').to_string())
    })
}

#[test]
fn the_deploy_examples_use_tls_and_the_cluster_token_on_every_link() {
    // (deploy_install.rs checks that install.sh installs every file they name.)
    let cp: serde_json::Value = serde_json::from_str(&read("deploy/control-plane.json")).unwrap();
    let (s, g) = (&cp["scheduler"], &cp["gateway"]);
    let path = |v: &serde_json::Value, what: &str| -> String {
        let p = v.as_str().unwrap_or_default().to_string();
        assert!(
            p.starts_with("/etc/agentenv/"),
            "{what} = {p:?}: a file the install puts under /etc/agentenv"
        );
        p
    };
    // The scheduler: TLS, client certificates required, the token.
    let token = path(&s["cluster_token_file"], "scheduler.cluster_token_file");
    path(&s["tls"]["cert_file"], "scheduler.tls.cert_file");
    path(&s["tls"]["key_file"], "scheduler.tls.key_file");
    let ca = path(&s["tls"]["client_ca_file"], "scheduler.tls.client_ca_file");
    // The gateway: TLS toward clients, mutual TLS toward nodes and scheduler with its
    // own certificate, the same token.
    assert_eq!(
        path(&g["cluster_token_file"], "gateway.cluster_token_file"),
        token,
        "one token file for scheduler and gateway"
    );
    path(&g["tls"]["cert_file"], "gateway.tls.cert_file");
    path(&g["tls"]["key_file"], "gateway.tls.key_file");
    for link in ["node_tls", "scheduler_tls"] {
        assert_eq!(
            path(&g[link]["ca_file"], link),
            ca,
            "gateway.{link}.ca_file"
        );
        assert_eq!(g[link]["cert_file"], g["tls"]["cert_file"], "{link}");
        assert_eq!(g[link]["key_file"], g["tls"]["key_file"], "{link}");
    }
    for n in s["nodes"].as_array().unwrap() {
        assert!(
            n["endpoint"].as_str().unwrap().starts_with("https://"),
            "{n}: nodes serve TLS"
        );
    }
    for (section, v) in [("scheduler", s), ("gateway", g)] {
        for k in ["allow_plain_http", "insecure_no_auth", "open_lookups"] {
            assert!(v.get(k).is_none(), "{section}.{k} in the secure example");
        }
    }

    // The node: TLS on its API with client certificates required, mutual TLS to the
    // scheduler, the token.
    let env = read("deploy/aenv.env");
    for k in [
        "AENV_TLS_CERT_FILE",
        "AENV_TLS_KEY_FILE",
        "AENV_TLS_CLIENT_CA_FILE",
        "AENV_SCHEDULER_CA_FILE",
        "AENV_SCHEDULER_CLIENT_CERT_FILE",
        "AENV_SCHEDULER_CLIENT_KEY_FILE",
        "AENV_CLUSTER_TOKEN_FILE",
    ] {
        let v = env_value(&env, k).unwrap_or_else(|| panic!("deploy/aenv.env lacks {k}"));
        assert!(
            v.starts_with("/etc/aenv/"),
            "{k}={v}: a file the install puts under /etc/aenv"
        );
    }
    assert!(env_value(&env, "AENV_ALLOW_PLAIN_HTTP").is_none());
    assert!(
        env_value(&env, "AENV_OBSERVABILITY_SCHEDULER_ENDPOINT")
            .is_some_and(|e| e.starts_with("https://"))
    );
}

/// TOML key paths of the node config file, read from the `File*` structs of
/// agentenv-node/src/config/file.rs.
fn node_toml_keys() -> BTreeSet<String> {
    let src = read("agentenv-node/src/config/file.rs");
    let section = |name: &str| -> &'static str {
        match name {
            "FileConfig" => "",
            "FileIdentity" => "node_identity.",
            "FileCluster" => "cluster.",
            "FileObservability" => "observability.",
            "FileReport" => "observability.scheduler_report.",
            "FileSandbox" => "sandbox.",
            "FileProxy" => "sandbox_proxy.",
            "FileOrchestrator" => "orchestrator.",
            "FileMachine" => "machine.",
            "FileJail" => "jail.",
            "FileTemplate" => "template.",
            "FileSnapshot" => "snapshot.",
            "FilePool" => "pool.",
            "FilePosixFs" => "backend.posix_fs.",
            "FileOss" => "backend.oss.",
            other => panic!(
                "node config struct {other} is new: map it to its TOML section in node_toml_keys()"
            ),
        }
    };
    let mut keys = BTreeSet::new();
    let mut current: Option<&str> = None;
    for line in src.lines() {
        let t = line.trim();
        let t = t.strip_prefix("pub(super) ").unwrap_or(t);
        if let Some(rest) = t.strip_prefix("struct File") {
            let name = format!("File{}", rest.split([' ', '{']).next().unwrap());
            current = Some(section(&name));
            continue;
        }
        if t == "}" {
            current = None;
            continue;
        }
        if let Some(p) = current
            && !t.starts_with('#')
            && !t.starts_with("//")
            && let Some((field, ty)) = t.split_once(':')
        {
            // Sub-tables are listed through their own fields.
            if !ty.trim().starts_with("File") {
                keys.insert(format!("{p}{}", field.trim()));
            }
        }
    }
    keys
}

/// Asserts that every key of `keys` stands in `doc` as `` `key` ``.
fn assert_documented<'a>(doc: &str, keys: impl IntoIterator<Item = &'a String>, what: &str) {
    let missing: Vec<_> = keys
        .into_iter()
        .filter(|k| !doc.contains(&format!("`{k}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "{what} not documented in docs/configuration.md: {missing:?}"
    );
}

#[test]
fn every_node_toml_key_in_the_code_is_in_the_configuration_reference() {
    let doc = read("docs/configuration.md");
    let keys = node_toml_keys();
    for k in [
        "api_addr",
        "jail.address_pool",
        "observability.scheduler_report.enabled",
    ] {
        assert!(keys.contains(k), "{k} missing from the scan: {keys:?}");
    }
    assert_documented(&doc, &keys, "node TOML keys");
}
