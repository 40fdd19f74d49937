//! Templates from an OCI image (`from_image`) with the official E2B Python SDK through the
//! gateway and two nodes: a tiny image made here from Debian's `busybox-static` (a root
//! filesystem of `/bin/busybox`, its applet links, a `/bin/bash` that is busybox's sh,
//! `/etc/passwd`, `/etc/group`, `/tmp`, `/root`, the jail's mount points `/proc`, `/sys`
//! and `/dev`, and a marker file), pushed with `skopeo` to a real `docker-registry` with
//! htpasswd auth; a build from it with credentials, `ENV` and a `RUN` whose output is in
//! the build log; sandboxes from it (the jail runs the node's static guest agent in the
//! image, so the image needs no agent of its own); a wrong password and a closed port fail the
//! build with messages saying so, and publish nothing.
//!
//! Needs `docker-registry`, `skopeo`, `apache2-utils` and `busybox-static`, all listed in
//! scripts/apt-packages.txt.

use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::Path;
use std::process::Command;

use agentenv_testkit::registry::{ImageConfig, TestRegistry, need, push, write_image};
use agentenv_tests::{API_KEY, Cluster, e2b_python, free_port, node_templates, skip_reason};

/// The node indices of this test (address pools 10.15.12.0/24 and 10.15.13.0/24,
/// interface prefixes `cm` and `cn`): no other test uses them.
const FIRST_IDX: u8 = 19;

/// What `/etc/image-marker` holds in the image.
const MARKER: &str = "marker-of-the-tiny-image-4711\n";

const USER: &str = "puller";
const PASSWORD: &str = "s3cret-pull-password";

/// The busybox applets linked into `/bin`.
const APPLETS: &[&str] = &[
    "sh", "tar", "mkdir", "cat", "echo", "sleep", "id", "chown", "chmod", "cp", "rm", "mktemp",
    "dirname", "ls", "env",
];

/// The tiny image's root filesystem at `root`.
fn make_rootfs(root: &Path) {
    let busybox = need("busybox", "busybox-static");
    let mode = |p: &Path, m: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
    };
    // proc, sys and dev: the jail mounts there and does not create them.
    for d in ["bin", "etc", "tmp", "root", "proc", "sys", "dev"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    mode(root, 0o755);
    mode(&root.join("tmp"), 0o1777);
    mode(&root.join("root"), 0o700);
    std::fs::copy(&busybox, root.join("bin/busybox")).unwrap();
    mode(&root.join("bin/busybox"), 0o755);
    for applet in APPLETS {
        symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    // The E2B SDK runs every command as `/bin/bash -l -c <cmd>`; busybox has no bash
    // applet, its ash takes the same flags.
    std::fs::write(
        root.join("bin/bash"),
        "#!/bin/sh\nexec /bin/busybox sh \"$@\"\n",
    )
    .unwrap();
    mode(&root.join("bin/bash"), 0o755);
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    std::fs::write(root.join("etc/group"), "root:x:0:\n").unwrap();
    std::fs::write(root.join("etc/image-marker"), MARKER).unwrap();
}

#[test]
fn sdk_builds_a_template_from_a_registry_image_and_sandboxes_start_from_it() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let py = e2b_python().expect("E2B SDK virtual environment");

    // The image, pushed to a registry that wants a password.
    let reg = TestRegistry::start(Some((USER, PASSWORD)));
    let work = tempfile::tempdir().unwrap();
    let rootfs = work.path().join("rootfs");
    make_rootfs(&rootfs);
    let config = ImageConfig {
        env: vec!["PATH=/bin".into(), "IMAGE_VAR=from-the-image-config".into()],
        working_dir: Some("/root".into()),
        cmd: vec!["/bin/sh".into()],
        ..ImageConfig::default()
    };
    let layout = write_image(&rootfs, &work.path().join("layout"), "1", &config);
    let image = reg.reference("tiny/busybox:1");
    let creds = format!("{USER}:{PASSWORD}");
    push(layout.dir(), "1", &image, &["--dest-creds", &creds]);
    let closed = format!("127.0.0.1:{}/tiny/busybox:1", free_port());

    let dirs = tempfile::tempdir().unwrap();
    let tpl: Vec<String> = (0..2)
        .map(|i| node_templates(&dirs.path().join(format!("node-{i}"))))
        .collect();
    let insecure = reg.addr().to_string();
    let cluster = Cluster::start_with(2, FIRST_IDX, &|i| {
        vec![
            ("AENV_TEMPLATE_PATH".to_string(), tpl[i as usize].clone()),
            ("AENV_OCI_INSECURE_REGISTRIES".to_string(), insecure.clone()),
        ]
    });
    cluster.wait_nodes_listed(2);

    let gw = format!("http://{}", cluster.gateway);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/e2b_template_image.py"
    );
    let out = Command::new(&py)
        .arg(script)
        .args([image.as_str(), USER, PASSWORD, closed.as_str()])
        .env("E2B_API_URL", &gw)
        .env("E2B_SANDBOX_URL", &gw)
        .env("E2B_API_KEY", API_KEY)
        .output()
        .expect("run the SDK script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "SDK script failed:\n{stderr}\n{stdout}"
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("JSON from the script");
    eprintln!("SDK script saw: {v:#}");

    // A wrong password: the build fails saying so (and not with the password), and there
    // is no template of that name.
    let bad = &v["bad_auth"];
    assert_eq!(bad["ok"], false, "{bad:#}");
    let msg = bad["error"].as_str().unwrap();
    assert!(
        msg.contains("refused authentication") && msg.contains("check the username and password"),
        "the build error says authentication failed: {msg}"
    );
    assert!(msg.contains(&insecure), "it names the registry: {msg}");
    assert!(
        !msg.contains("-wrong"),
        "it does not show the password: {msg}"
    );
    assert_eq!(v["bad_auth_exists"], false);

    // A registry on a closed port: the build fails naming it.
    let closed_err = &v["closed"];
    assert_eq!(closed_err["ok"], false, "{closed_err:#}");
    let msg = closed_err["error"].as_str().unwrap();
    let registry = closed.split('/').next().unwrap();
    assert!(
        msg.contains(&format!("registry {registry}")),
        "the build error names the registry: {msg}"
    );
    assert_eq!(v["closed_exists"], false);

    // The build: the RUN step read the image's marker.
    let b = &v["build"];
    assert_eq!(b["ok"], true, "the build from the image: {b:#}");
    let logs: Vec<&str> = b["logs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    assert!(
        logs.iter().any(|l| *l == MARKER.trim_end()),
        "the RUN step's output (the image's marker) is in the build log: {logs:?}"
    );
    assert_eq!(v["exists"], true);

    // Sandboxes from it, on both nodes.
    let sandboxes = v["sandboxes"].as_array().unwrap();
    assert_eq!(sandboxes.len(), 2, "{v:#}");
    for s in sandboxes {
        assert!(s.get("create_error").is_none(), "creating a sandbox: {s:#}");
        assert!(s.get("error").is_none(), "in the sandbox: {s:#}");
        assert_eq!(s["marker"], MARKER, "the image's file");
        assert_eq!(s["built"], "from-image\n", "the RUN step's file");
        assert_eq!(
            s["run"]["stdout"], "from-the-image-config\nfrom-set-envs\n0\n",
            "the image's Env, the template's ENV, root: {s:#}"
        );
        assert_eq!(s["run"]["exit_code"], 0);
    }

    // `aenv pull` of the same image (credentials from the environment), followed to the
    // end; a sandbox from it has the image's files.
    let cfg = tempfile::tempdir().unwrap();
    let aenv = |args: &[&str], password: &str| {
        Command::new(agentenv_tests::binary("aenv").expect("aenv binary"))
            .args(args)
            .env("XDG_CONFIG_HOME", cfg.path())
            .env("AENV_REGISTRY_PASSWORD", password)
            .output()
            .expect("run aenv")
    };
    let o = aenv(&["auth", "--url", &gw, "--api-key", API_KEY], "");
    assert!(
        o.status.success(),
        "aenv auth: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = aenv(
        &[
            "pull",
            &image,
            "--name",
            "tiny-pulled",
            "--registry-user",
            USER,
        ],
        PASSWORD,
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "aenv pull: {out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("ready"), "{out}");
    let o = aenv(
        &[
            "pull",
            &image,
            "--name",
            "tiny-denied",
            "--registry-user",
            USER,
        ],
        "wrong",
    );
    assert_eq!(o.status.code(), Some(1), "a wrong password fails the pull");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("refused authentication"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let (st, created) = agentenv_tests::api(
        cluster.gateway,
        "POST",
        "/v2/sandboxes",
        r#"{"templateID":"tiny-pulled","timeout":60}"#,
    );
    assert_eq!(st, 201, "{created}");
    assert_eq!(created["alias"], "tiny-pulled");
}
