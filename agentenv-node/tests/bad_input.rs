//! Bad input to the jail backend: clear errors, and nothing left behind.

mod common;

use agentenv_node::backend::jail::JailBackend;
use agentenv_node::backend::{BackendError, SandboxBackend, SandboxSpec};
use agentenv_node::template::TemplateError;

type SpecChange = Box<dyn Fn(&mut SandboxSpec)>;

/// Nothing of sandbox `id` exists: no directory, no cgroup, not listed.
async fn assert_no_trace(b: &JailBackend, id: &str) {
    assert!(!b.sandbox_dir(id).exists(), "{id}: directory left behind");
    for d in b.cgroup_dirs(id) {
        assert!(!d.exists(), "{id}: cgroup {} left behind", d.display());
    }
    assert!(b.list().await.iter().all(|i| i.id != id));
    assert!(matches!(b.get(id).await, Err(BackendError::NotFound(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_template_is_a_clear_error_and_leaves_nothing() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let id = common::id("notpl");
    let mut spec = common::spec(&id);
    spec.template = "no-such-template".into();
    let err = b.create(spec).await.unwrap_err();
    assert!(
        matches!(err, BackendError::UnknownTemplate(ref t) if t == "no-such-template"),
        "{err}"
    );
    assert_eq!(err.to_string(), "template \"no-such-template\" not found");
    let mut spec = common::spec(&id);
    spec.template = "../etc".into();
    assert!(matches!(
        b.create(spec).await.unwrap_err(),
        BackendError::UnknownTemplate(_)
    ));
    assert_no_trace(&b, &id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn impossible_limits_are_refused_with_the_reason() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let id = common::id("limits");
    let cases: Vec<(SpecChange, &str)> = vec![
        (Box::new(|s| s.cpu_count = 0), "cpuCount must be at least 1"),
        (Box::new(|s| s.cpu_count = 100_000), "more than this node's"),
        (Box::new(|s| s.memory_mb = 0), "memoryMB must be at least"),
        (Box::new(|s| s.memory_mb = 1 << 40), "more than this node's"),
        (
            Box::new(|s| s.max_processes = Some(0)),
            "process limit must be at least 1",
        ),
    ];
    for (change, want) in cases {
        let mut spec = common::spec(&id);
        change(&mut spec);
        let err = b.create(spec.clone()).await.unwrap_err();
        assert!(
            matches!(err, BackendError::InvalidLimits(_)),
            "{spec:?}: {err}"
        );
        assert!(err.to_string().contains(want), "{err} should say {want}");
        assert_no_trace(&b, &id).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_and_duplicate_ids_are_refused() {
    require_jail!();
    let (b, _data) = common::backend().await;
    for bad in ["", "../x", "a b", "x/y"] {
        let err = b.create(common::spec(bad)).await.unwrap_err();
        assert!(matches!(err, BackendError::InvalidId(_)), "{bad:?}: {err}");
    }
    let id = common::id("dup");
    let info = b.create(common::spec(&id)).await.unwrap();
    let err = b.create(common::spec(&id)).await.unwrap_err();
    assert!(matches!(err, BackendError::AlreadyExists(_)), "{err}");
    // The duplicate did not disturb the original.
    assert_eq!(b.get(&id).await.unwrap(), info);
    b.destroy(&id).await.unwrap();
    for op in ["pause", "resume", "destroy", "usage"] {
        let err = match op {
            "pause" => b.pause(&id).await.err(),
            "resume" => b.resume(&id).await.err(),
            "destroy" => b.destroy(&id).await.err(),
            _ => b.usage(&id).await.err(),
        };
        assert!(
            matches!(err, Some(BackendError::NotFound(_))),
            "{op}: {err:?}"
        );
    }
    assert_no_trace(&b, &id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_address_pool_is_a_clear_error_and_leaves_nothing() {
    require_jail!();
    // Two /30 slots, in a range no other test uses.
    let (b, _data) =
        common::backend_with(|c| c.address_pool = "10.13.0.0/29".parse().unwrap()).await;
    let first = b.create(common::spec(&common::id("pool1"))).await.unwrap();
    let second = b.create(common::spec(&common::id("pool2"))).await.unwrap();
    let id = common::id("pool3");
    let err = b.create(common::spec(&id)).await.unwrap_err();
    assert!(
        matches!(err, BackendError::AddressPoolExhausted { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("10.13.0.0/29"), "{err}");
    assert_no_trace(&b, &id).await;
    // A destroyed sandbox's address is free again.
    b.destroy(&first.id).await.unwrap();
    let third = b.create(common::spec(&id)).await.unwrap();
    assert_eq!(third.address, first.address);
    b.destroy(&second.id).await.unwrap();
    b.destroy(&third.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_debootstrap_is_a_clear_error_and_leaves_nothing() {
    require_jail!();
    common::init_tracing();
    let data = tempfile::tempdir().unwrap();
    let mut cfg = common::config(data.path());
    // A store without `base`, and no debootstrap.
    cfg.templates.root = data.path().join("templates");
    cfg.templates.debootstrap = data.path().join("bin/debootstrap");
    let b = JailBackend::new(cfg).await.unwrap();
    let id = common::id("nodebootstrap");
    let err = b.create(common::spec(&id)).await.unwrap_err();
    assert!(
        matches!(
            err,
            BackendError::Template(TemplateError::DebootstrapMissing(_))
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("apt-get install debootstrap"),
        "{err}"
    );
    assert_no_trace(&b, &id).await;
    let templates: Vec<_> = std::fs::read_dir(data.path().join("templates"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".lock"))
        .collect();
    assert!(templates.is_empty(), "{templates:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_agent_binary_is_refused_at_startup() {
    require_jail!();
    let data = tempfile::tempdir().unwrap();
    let mut cfg = common::config(data.path());
    cfg.agent_binary = data.path().join("nope");
    let err = JailBackend::new(cfg).await.err().expect("refused");
    assert!(err.to_string().contains("agent binary"), "{err}");
}
