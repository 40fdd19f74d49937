//! `aenv build`, `aenv template ls|watch|rm` against a real node (jail backend, its own
//! template directory holding only `base`, its own snapshot store): a Dockerfile with
//! ARG, ENV, WORKDIR, COPY of a file and of a directory with a symlink, RUN and CMD is
//! built and followed; a sandbox from the template has the files and the environment;
//! a failing RUN, an unsupported instruction and a COPY out of the context fail with
//! messages that name them.

mod cli_common;

use std::net::SocketAddr;

use agentenv_tests::{API_KEY, free_port, node_templates, skip_reason, start_node_with_env};
use cli_common::{Aenv, stderr, stdout};

fn listed_names(a: &Aenv) -> Vec<(String, String)> {
    let out = a.ok(&["template", "ls", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|t| {
            let st = t["buildStatus"].as_str().unwrap_or("").to_string();
            t["names"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(move |n| (n.as_str().unwrap_or("").to_string(), st.clone()))
        })
        .collect()
}

#[test]
fn aenv_builds_a_dockerfile_template_and_manages_it() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let tpl = node_templates(&work.path().join("templates"));
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let store = work.path().join("store");
    let _node = start_node_with_env(
        22,
        "node-cli-tpl",
        addr,
        tempfile::tempdir().unwrap(),
        None,
        &[
            ("AENV_TEMPLATE_PATH".into(), tpl),
            ("AENV_SNAPSHOT_STORE".into(), store.display().to_string()),
        ],
    );
    let a = Aenv::new();
    a.ok(&[
        "auth",
        "--url",
        &format!("http://{addr}"),
        "--api-key",
        API_KEY,
    ]);

    // The build context: a file, a directory with a nested file and a symlink.
    let ctx = work.path().join("ctx");
    std::fs::create_dir_all(ctx.join("data/sub")).unwrap();
    std::fs::write(ctx.join("hello.txt"), "hello from the context\n").unwrap();
    std::fs::write(ctx.join("data/a.txt"), "a\n").unwrap();
    std::fs::write(ctx.join("data/sub/b.txt"), "nested b\n").unwrap();
    std::os::unix::fs::symlink("a.txt", ctx.join("data/link")).unwrap();
    let df = ctx.join("Dockerfile");
    std::fs::write(
        &df,
        "FROM base\n\
         ARG GREETING=hi-there\n\
         ENV APP_MODE=\"cli test\"\n\
         WORKDIR /opt/app\n\
         COPY hello.txt ./\n\
         COPY --chmod=0640 data /opt/data\n\
         RUN echo \"run says $GREETING\" && cat /opt/app/hello.txt\n\
         EXPOSE 8080\n\
         CMD [\"sleep\", \"3600\"]\n",
    )
    .unwrap();
    let name = format!("cli-tpl-{}", std::process::id());
    let o = a.run(&["build", "-f", df.to_str().unwrap(), "--name", &name]);
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(o.status.success(), "build failed:\n{out}\n{err}");
    assert!(out.contains("run says hi-there"), "the RUN output: {out}");
    assert!(out.contains("hello from the context"), "{out}");
    assert!(out.contains("Build succeeded"), "{out}");
    assert!(err.contains("Uploaded 'data'"), "{err}");
    assert!(err.contains("EXPOSE instruction is not supported"), "{err}");

    // A sandbox from the template by name: files, symlink, mode, env.
    let id = a.ok(&["start", &name, "-d"]).trim().to_string();
    let sh = |script: &str| a.ok(&["exec", &id, "sh", "-c", script]);
    assert_eq!(sh("cat /opt/app/hello.txt"), "hello from the context\n");
    assert_eq!(sh("cat /opt/data/sub/b.txt"), "nested b\n");
    assert_eq!(sh("readlink /opt/data/link"), "a.txt\n");
    assert_eq!(sh("stat -c %a /opt/data/a.txt"), "640\n");
    assert_eq!(sh("echo \"$APP_MODE|$GREETING\""), "cli test|hi-there\n");
    a.ok(&["rm", &id]);

    // Listed as ready; its finished build watched again.
    assert!(
        listed_names(&a).contains(&(name.clone(), "ready".into())),
        "{:?}",
        listed_names(&a)
    );
    let table = a.ok(&["template", "ls", "-o", "table"]);
    assert!(
        table.contains("NAME") && table.contains("CREATED") && table.contains(&name),
        "{table}"
    );
    let o = a.run(&["template", "watch", &name]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("run says hi-there"), "{}", stdout(&o));

    // A failing RUN: non-zero exit, the reason names the step.
    let bad = ctx.join("Dockerfile.bad");
    std::fs::write(&bad, "FROM base\nRUN echo about-to-fail && exit 3\n").unwrap();
    let bad_name = format!("{name}-bad");
    let o = a.run(&[
        "build",
        "--file",
        bad.to_str().unwrap(),
        "--name",
        &bad_name,
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(stdout(&o).contains("about-to-fail"), "{}", stdout(&o));
    let err = stderr(&o);
    assert!(
        err.contains("Build failed:") && err.contains("(step: 1)"),
        "{err}"
    );
    let o = a.run(&["template", "watch", &bad_name]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("(step: 1)"), "{}", stderr(&o));

    // Refused before anything is sent: an unsupported instruction, a COPY out of the
    // context.
    let unsup = ctx.join("Dockerfile.unsupported");
    std::fs::write(&unsup, "FROM base\nRUN true\nHEALTHCHECK CMD true\n").unwrap();
    let o = a.run(&[
        "build",
        "-f",
        unsup.to_str().unwrap(),
        "--name",
        "cli-never-1",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("line 3: HEALTHCHECK instructions are not supported"),
        "{}",
        stderr(&o)
    );
    let esc = ctx.join("Dockerfile.escape");
    std::fs::write(&esc, "FROM base\nCOPY ../secret /x\n").unwrap();
    let o = a.run(&[
        "build",
        "-f",
        esc.to_str().unwrap(),
        "--name",
        "cli-never-2",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("COPY source \"../secret\" leaves the build context"),
        "{}",
        stderr(&o)
    );
    let names = listed_names(&a);
    assert!(
        !names.iter().any(|(n, _)| n.starts_with("cli-never")),
        "nothing was created: {names:?}"
    );

    // rm by name; then it is gone, and a second rm says so.
    let o = a.run(&["template", "rm", &name]);
    assert!(o.status.success(), "{}", stderr(&o));
    a.ok(&["template", "rm", &bad_name]);
    let names = listed_names(&a);
    assert!(!names.iter().any(|(n, _)| n == &name), "{names:?}");
    let o = a.run(&["template", "rm", &name]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains(&format!("template {name} not found")),
        "{}",
        stderr(&o)
    );
    let o = a.run(&["template", "watch", &name]);
    assert!(
        stderr(&o).contains(&format!("template {name} not found")),
        "{}",
        stderr(&o)
    );
}
