//! `aenv` behaviour that needs no cluster: help with examples on every command,
//! completion scripts, argument validation, and the messages for a missing credentials
//! file and an unreachable server.

mod cli_common;

use cli_common::{Aenv, stderr, stdout};

const COMMANDS: &[&[&str]] = &[
    &["auth"],
    &["list"],
    &["ls"],
    &["start"],
    &["connect"],
    &["cn"],
    &["exec"],
    &["pause"],
    &["resume"],
    &["timeout"],
    &["delete"],
    &["rm"],
    &["upload"],
    &["download"],
    &["template", "list"],
    &["template", "delete"],
    &["template", "watch"],
    &["snapshot", "create"],
    &["snapshot", "list"],
    &["completion"],
    &["pull"],
    &["build"],
    &["template"],
    &["snapshot"],
];

#[test]
fn every_command_has_help_with_examples_and_needs_no_credentials() {
    let a = Aenv::new();
    let top = a.ok(&["--help"]);
    assert!(top.contains("Examples:"), "{top}");
    for c in COMMANDS {
        let mut args = c.to_vec();
        args.push("--help");
        let out = a.ok(&args);
        assert!(
            out.contains("Example") && out.contains("aenv "),
            "`aenv {}` help has no example:\n{out}",
            c.join(" ")
        );
    }
    assert_eq!(
        a.ok(&["--version"]).trim(),
        format!("aenv {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn completion_scripts_call_back_into_aenv_which_completes_commands_and_flags() {
    let a = Aenv::new();
    let bash = a.ok(&["completion", "bash"]);
    assert!(
        bash.contains("COMPLETE=\"bash\"") && bash.contains("-F _clap_complete_aenv aenv"),
        "{bash}"
    );
    assert!(
        bash.contains(cli_common::aenv_bin()),
        "calls back into this binary: {bash}"
    );
    let zsh = a.ok(&["completion", "zsh"]);
    assert!(
        zsh.contains("#compdef aenv") && zsh.contains("COMPLETE=\"zsh\""),
        "{zsh}"
    );
    let fish = a.ok(&["completion", "fish"]);
    assert!(
        fish.contains("complete") && fish.contains("COMPLETE=fish"),
        "{fish}"
    );
    let o = a.run(&["completion", "tcsh"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "an unknown shell is a usage error"
    );

    // What the scripts run: `COMPLETE=bash aenv -- aenv <words>`.
    let complete = |words: &[&str]| a.complete(words);
    let subs = complete(&["d"]);
    assert!(
        subs.lines().any(|l| l == "download") && subs.lines().any(|l| l == "delete"),
        "{subs}"
    );
    let flags = complete(&["download", "--"]);
    assert!(flags.lines().any(|l| l == "--force"), "{flags}");
    // Without credentials there are no sandbox IDs to offer, and no error.
    assert!(complete(&["exec", ""]).lines().all(|l| l.starts_with('-')));
}

#[test]
fn commands_without_credentials_say_to_run_auth() {
    let a = Aenv::new();
    for args in [
        &["ls"][..],
        &["exec", "x", "true"],
        &["rm", "x"],
        &["upload", "x", "/etc/hosts", "/tmp/"],
    ] {
        let o = a.assert_not_authenticated(args);
        assert!(stdout(&o).is_empty());
    }
}

#[test]
fn an_unreachable_server_is_named_in_the_error() {
    let a = Aenv::new();
    let port = agentenv_tests::free_port();
    let url = format!("http://127.0.0.1:{port}");
    a.ok(&["auth", "--url", &url, "--api-key", "k", "--no-verify"]);
    let o = a.run(&["ls"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.starts_with(&format!(
            "Error: cannot reach the server at {url}/v2/sandboxes"
        )),
        "{e}"
    );
    assert!(e.contains("aenv auth"), "{e}");
    // Env variables work for scripted auth; a bad URL is refused before anything is saved.
    let b = Aenv::new();
    let o = b
        .cmd(&["auth", "--no-verify"])
        .env("AENV_URL", "ftp://x")
        .env("AENV_API_KEY", "k")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("invalid server URL \"ftp://x\""),
        "{}",
        stderr(&o)
    );
    assert!(!b.credentials_path().exists());
    // A Dockerfile that cannot be built is refused before any request, naming the line.
    let df = a.config.path().join("Dockerfile");
    std::fs::write(&df, "FROM ubuntu\nHEALTHCHECK CMD true\n").unwrap();
    let o = a.run(&["build", df.to_str().unwrap(), "--name", "x"]);
    assert_eq!(
        stderr(&o).trim(),
        format!(
            "Error: {}: line 2: HEALTHCHECK instructions are not supported by AENV template builds (supported: FROM, RUN, COPY, ADD, ENV, ARG, WORKDIR, USER, CMD, ENTRYPOINT)",
            df.display()
        )
    );
    // An empty sandbox ID is refused before any request.
    let o = a.run(&["exec", "", "true"]);
    assert_eq!(
        stderr(&o).trim(),
        "Error: the sandbox ID is empty; list sandboxes with `aenv ls`"
    );
    let o = b.run_with_input(&["auth", "--url", &url, "--api-key-stdin"], "\n");
    assert_eq!(stderr(&o).trim(), "Error: API key cannot be empty");
}

#[test]
fn bad_arguments_are_usage_errors_with_the_reason() {
    let a = Aenv::new();
    let o = a.run(&["start", "img", "--cold", "--disk-size-mb", "1000"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("divisible by 1024"), "{}", stderr(&o));
    let o = a.run(&["exec", "id"]);
    assert_eq!(o.status.code(), Some(2), "exec needs a command");
    let o = a.run(&["ls", "--metadata", "novalue"]);
    assert!(stderr(&o).contains("expected KEY=VALUE"), "{}", stderr(&o));
    let o = a.run(&["ls", "--state", "sleeping"]);
    assert_eq!(o.status.code(), Some(2));
}
