//! A template build as the E2B SDKs send it (`POST /v2/templates/{id}/builds/{build}`):
//! where it starts, its steps, how sandboxes start; checked, and keyed for the layer cache.
//!
//! Each step's cache key is the SHA-256 of the key before it, the step's type and
//! arguments and, for `COPY`, the hash of the uploaded files: a rebuild with one changed
//! step finds every layer before it in the cache and reruns from there. `force` on a step
//! (`skip_cache()` in the SDK) reruns that step and every later one; the build's own
//! `force` reruns all.

use std::collections::BTreeMap;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::catalog::{BaseRef, is_sha256_hex};

/// Most steps a build may have.
pub const MAX_STEPS: usize = 500;
/// Longest single argument (a command, a path).
pub const MAX_ARG: usize = 64 * 1024;

/// A malformed build request: the message names the step and what to change.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct StepError(pub String);

/// Registry credentials of a `fromImage` (`fromImageRegistry`).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RegistryCredentials {
    Registry {
        #[serde(default)]
        username: String,
        #[serde(default)]
        password: String,
    },
    Aws {},
    Gcp {},
}

/// The JSON of a build request (unknown keys are ignored).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct BuildRequestJson {
    #[serde(default)]
    pub from_image: Option<String>,
    #[serde(default)]
    pub from_template: Option<String>,
    #[serde(default)]
    pub from_image_registry: Option<RegistryCredentials>,
    #[serde(default)]
    pub force: bool,
    #[serde(default)]
    pub steps: Vec<StepJson>,
    #[serde(default)]
    pub start_cmd: Option<String>,
    #[serde(default)]
    pub ready_cmd: Option<String>,
}

/// One step as sent.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct StepJson {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub files_hash: Option<String>,
    #[serde(default)]
    pub force: bool,
}

/// Where a build starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BaseSpec {
    /// A template by name, name:tag or id (`base` is the built-in one).
    Template(String),
    /// An OCI image reference, with credentials when given.
    Image {
        reference: String,
        username: Option<String>,
        password: Option<String>,
    },
}

/// What a step does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A shell command (`/bin/sh -c`), as `user` (default: the current `USER`).
    Run {
        cmd: String,
        user: Option<String>,
    },
    /// Uploaded files (archive `files_hash`) copied from `src` to `dest`.
    Copy {
        src: String,
        dest: String,
        user: Option<String>,
        mode: Option<u32>,
        files_hash: String,
    },
    Env(Vec<(String, String)>),
    Workdir(String),
    User(String),
}

impl Step {
    /// Whether the step changes files (and so needs a sandbox and makes a layer).
    pub fn changes_files(&self) -> bool {
        matches!(
            self,
            Step::Run { .. } | Step::Copy { .. } | Step::Workdir(_) | Step::User(_)
        )
    }

    /// The step as a log line shows it.
    pub fn describe(&self) -> String {
        match self {
            Step::Run { cmd, user } => match user {
                Some(u) => format!("RUN {cmd} (as {u})"),
                None => format!("RUN {cmd}"),
            },
            Step::Copy { src, dest, .. } => format!("COPY {src} {dest}"),
            Step::Env(kv) => format!(
                "ENV {}",
                kv.iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
            Step::Workdir(p) => format!("WORKDIR {p}"),
            Step::User(u) => format!("USER {u}"),
        }
    }
}

/// A checked build.
#[derive(Debug, Clone)]
pub struct BuildSpec {
    pub base: BaseSpec,
    /// Steps, each with whether the cache is skipped from it on.
    pub steps: Vec<(Step, bool)>,
    /// Keys of the steps' JSON as sent, for the cache keys.
    raw: Vec<StepJson>,
    pub force: bool,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
}

/// The image name the SDKs send for "the default base": served by the built-in template.
pub const SDK_DEFAULT_IMAGE: &str = "e2bdev/base";

fn check_arg(step: usize, what: &str, s: &str) -> Result<(), StepError> {
    if s.len() > MAX_ARG {
        return Err(StepError(format!(
            "step {step}: the {what} is longer than {MAX_ARG} bytes"
        )));
    }
    if s.contains('\0') {
        return Err(StepError(format!(
            "step {step}: the {what} contains a NUL byte"
        )));
    }
    Ok(())
}

fn opt(s: Option<&String>) -> Option<String> {
    s.map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

/// A user name or `user:group` as a step may name it.
fn check_user(step: usize, u: &str) -> Result<(), StepError> {
    let ok = !u.is_empty()
        && u.len() <= 64
        && u.split(':').count() <= 2
        && u.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-:".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(StepError(format!(
            "step {step}: {u:?} is not a user name (use letters, digits, '.', '_', '-', and 'user:group')"
        )))
    }
}

impl BuildSpec {
    /// Checks a build request.
    pub fn parse(req: BuildRequestJson) -> Result<Self, StepError> {
        let base = match (
            opt(req.from_template.as_ref()),
            opt(req.from_image.as_ref()),
        ) {
            (Some(_), Some(_)) => {
                return Err(StepError(
                    "give fromTemplate or fromImage, not both".to_string(),
                ));
            }
            (Some(t), None) => BaseSpec::Template(t),
            (None, Some(i)) if i == SDK_DEFAULT_IMAGE || i.starts_with("e2bdev/base:") => {
                BaseSpec::Template(super::BASE_TEMPLATE.to_string())
            }
            (None, Some(i)) => {
                let (username, password) = match req.from_image_registry {
                    None => (None, None),
                    Some(RegistryCredentials::Registry { username, password }) => {
                        (Some(username), Some(password))
                    }
                    Some(RegistryCredentials::Aws {}) => {
                        return Err(StepError(
                            "fromImageRegistry type \"aws\" is not supported here: give the registry's username and password (type \"registry\"), e.g. from `aws ecr get-login-password`".into(),
                        ));
                    }
                    Some(RegistryCredentials::Gcp {}) => {
                        return Err(StepError(
                            "fromImageRegistry type \"gcp\" is not supported here: give the registry's username and password (type \"registry\"), e.g. _json_key and the key file".into(),
                        ));
                    }
                };
                BaseSpec::Image {
                    reference: i,
                    username,
                    password,
                }
            }
            (None, None) => BaseSpec::Template(super::BASE_TEMPLATE.to_string()),
        };
        if req.steps.len() > MAX_STEPS {
            return Err(StepError(format!(
                "{} steps is more than the allowed {MAX_STEPS}",
                req.steps.len()
            )));
        }
        let mut steps = Vec::with_capacity(req.steps.len());
        let mut forced = req.force;
        for (i, s) in req.steps.iter().enumerate() {
            let n = i + 1;
            for a in &s.args {
                check_arg(n, "argument", a)?;
            }
            let arg = |k: usize| s.args.get(k);
            let step = match s.kind.to_ascii_uppercase().as_str() {
                "RUN" => {
                    let cmd = arg(0).cloned().unwrap_or_default();
                    if cmd.trim().is_empty() {
                        return Err(StepError(format!("step {n}: RUN needs a command")));
                    }
                    let user = opt(arg(1));
                    if let Some(u) = &user {
                        check_user(n, u)?;
                    }
                    Step::Run { cmd, user }
                }
                "COPY" => {
                    let (Some(src), Some(dest)) = (opt(arg(0)), opt(arg(1))) else {
                        return Err(StepError(format!(
                            "step {n}: COPY needs a source and a destination"
                        )));
                    };
                    let files_hash = s.files_hash.clone().unwrap_or_default();
                    if !is_sha256_hex(&files_hash) {
                        return Err(StepError(format!(
                            "step {n}: COPY needs filesHash, the SHA-256 (64 lowercase hex digits) of the uploaded files"
                        )));
                    }
                    let user = opt(arg(2));
                    if let Some(u) = &user {
                        check_user(n, u)?;
                    }
                    let mode = match opt(arg(3)) {
                        None => None,
                        Some(m) => Some(
                            u32::from_str_radix(&m, 8)
                                .ok()
                                .filter(|m| *m <= 0o7777)
                                .ok_or_else(|| {
                                    StepError(format!(
                                        "step {n}: COPY mode {m:?} is not an octal mode like 0755"
                                    ))
                                })?,
                        ),
                    };
                    Step::Copy {
                        src,
                        dest,
                        user,
                        mode,
                        files_hash,
                    }
                }
                "ENV" => {
                    if s.args.len() % 2 != 0 {
                        return Err(StepError(format!(
                            "step {n}: ENV takes name and value pairs"
                        )));
                    }
                    let mut kv = Vec::new();
                    for p in s.args.chunks(2) {
                        let k = p[0].trim();
                        let ok = !k.is_empty()
                            && !k.as_bytes()[0].is_ascii_digit()
                            && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
                        if !ok {
                            return Err(StepError(format!(
                                "step {n}: {k:?} is not an environment variable name"
                            )));
                        }
                        kv.push((k.to_string(), p[1].clone()));
                    }
                    Step::Env(kv)
                }
                "WORKDIR" => {
                    let Some(p) = opt(arg(0)) else {
                        return Err(StepError(format!("step {n}: WORKDIR needs a path")));
                    };
                    Step::Workdir(p)
                }
                "USER" => {
                    let Some(u) = opt(arg(0)) else {
                        return Err(StepError(format!("step {n}: USER needs a user name")));
                    };
                    check_user(n, &u)?;
                    Step::User(u)
                }
                other => {
                    return Err(StepError(format!(
                        "step {n}: the step type {other:?} is not supported (supported: RUN, COPY, ENV, WORKDIR, USER)"
                    )));
                }
            };
            forced |= s.force;
            steps.push((step, forced));
        }
        for (what, c) in [("startCmd", &req.start_cmd), ("readyCmd", &req.ready_cmd)] {
            if let Some(c) = c {
                check_arg(0, what, c)?;
            }
        }
        Ok(Self {
            base,
            steps,
            raw: req.steps,
            force: req.force,
            start_cmd: opt(req.start_cmd.as_ref()),
            ready_cmd: opt(req.ready_cmd.as_ref()),
        })
    }

    /// The cache key of the base (before any step).
    pub fn base_key(base: &BaseRef) -> String {
        let mut h = Sha256::new();
        h.update(b"agentenv template base v1\0");
        h.update(serde_json::to_vec(base).expect("a base serializes"));
        hex::encode(h.finalize())
    }

    /// The cache keys after each step, given the base's key.
    pub fn step_keys(&self, base_key: &str) -> Vec<String> {
        let mut prev = base_key.to_string();
        self.raw
            .iter()
            .map(|s| {
                let mut h = Sha256::new();
                h.update(prev.as_bytes());
                h.update(b"\0");
                h.update(s.kind.to_ascii_uppercase().as_bytes());
                for a in &s.args {
                    h.update((a.len() as u64).to_be_bytes());
                    h.update(a.as_bytes());
                }
                h.update(b"\0");
                h.update(s.files_hash.as_deref().unwrap_or("").as_bytes());
                prev = hex::encode(h.finalize());
                prev.clone()
            })
            .collect()
    }
}

/// A template reference as a create or `fromTemplate` gives it: `name`, `name:tag` or
/// an id (`team/name` is accepted and the team part ignored: one cluster, one team).
pub fn split_reference(r: &str) -> (&str, Option<&str>) {
    let r = r.rsplit_once('/').map(|(_, n)| n).unwrap_or(r);
    match r.split_once(':') {
        Some((n, t)) if !t.is_empty() => (n, Some(t)),
        Some((n, _)) => (n, None),
        None => (r, None),
    }
}

/// The environment after `steps` over `env`.
pub fn apply_env(env: &mut BTreeMap<String, String>, kv: &[(String, String)]) {
    for (k, v) in kv {
        env.insert(k.clone(), v.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: serde_json::Value) -> Result<BuildSpec, StepError> {
        BuildSpec::parse(serde_json::from_value(v).unwrap())
    }

    const H: &str = "2a3d99b5aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab422";

    #[test]
    fn the_sdk_request_shapes_parse() {
        let spec = parse(serde_json::json!({
            "fromTemplate": "base", "force": false,
            "steps": [
                {"type": "COPY", "args": ["app", "/home/user/app", "user", "0755"], "filesHash": H, "force": false, "forceUpload": true},
                {"type": "RUN", "args": ["echo 1 && echo 2", "root"], "force": false},
                {"type": "ENV", "args": ["K1", "v1"], "force": false},
                {"type": "RUN", "args": ["echo after skip"], "force": true},
                {"type": "WORKDIR", "args": ["/app"], "force": false}
            ],
            "startCmd": "python -m http.server 8000",
            "readyCmd": "[ -n \"$(ss -Htuln sport = :8000)\" ]"
        }))
        .unwrap();
        assert_eq!(spec.base, BaseSpec::Template("base".into()));
        assert_eq!(spec.steps.len(), 5);
        assert!(
            matches!(&spec.steps[0].0, Step::Copy { mode: Some(0o755), user: Some(u), .. } if u == "user")
        );
        // force on step 4 skips the cache from there on.
        let forced: Vec<bool> = spec.steps.iter().map(|s| s.1).collect();
        assert_eq!(forced, [false, false, false, true, true]);
        assert_eq!(
            spec.start_cmd.as_deref(),
            Some("python -m http.server 8000")
        );
    }

    #[test]
    fn the_default_image_is_the_builtin_template_and_images_keep_credentials() {
        let spec = parse(serde_json::json!({"fromImage": "e2bdev/base", "steps": []})).unwrap();
        assert_eq!(spec.base, BaseSpec::Template("base".into()));
        let spec = parse(serde_json::json!({
            "fromImage": "127.0.0.1:5000/py:3", "steps": [],
            "fromImageRegistry": {"type": "registry", "username": "u", "password": "p"}
        }))
        .unwrap();
        assert_eq!(
            spec.base,
            BaseSpec::Image {
                reference: "127.0.0.1:5000/py:3".into(),
                username: Some("u".into()),
                password: Some("p".into())
            }
        );
        let err = parse(serde_json::json!({
            "fromImage": "x", "fromImageRegistry": {"type": "aws", "awsRegion": "r"}
        }))
        .unwrap_err();
        assert!(err.0.contains("aws"), "{err}");
    }

    #[test]
    fn bad_steps_are_named() {
        for (v, want) in [
            (
                serde_json::json!({"steps": [{"type": "ADD", "args": ["a"]}]}),
                "step 1: the step type \"ADD\"",
            ),
            (
                serde_json::json!({"steps": [{"type": "COPY", "args": ["a", "/b"]}]}),
                "filesHash",
            ),
            (
                serde_json::json!({"steps": [{"type": "ENV", "args": ["A"]}]}),
                "pairs",
            ),
            (
                serde_json::json!({"steps": [{"type": "ENV", "args": ["1A", "x"]}]}),
                "not an environment",
            ),
            (
                serde_json::json!({"steps": [{"type": "RUN", "args": [""]}]}),
                "needs a command",
            ),
            (
                serde_json::json!({"steps": [{"type": "RUN", "args": ["true", "a b"]}]}),
                "not a user",
            ),
            (
                serde_json::json!({"steps": [{"type": "COPY", "args": ["a", "/b", "", "999"], "filesHash": H}]}),
                "octal",
            ),
        ] {
            let err = parse(v).unwrap_err();
            assert!(err.0.contains(want), "{err} lacks {want}");
        }
    }

    #[test]
    fn a_changed_step_changes_its_key_and_every_later_one_only() {
        let mk = |cmd: &str| {
            parse(serde_json::json!({"steps": [
                {"type": "RUN", "args": ["echo a"]},
                {"type": "RUN", "args": [cmd]},
                {"type": "RUN", "args": ["echo c"]}
            ]}))
            .unwrap()
        };
        let base = BuildSpec::base_key(&BaseRef::Builtin {
            name: "base".into(),
        });
        let a = mk("echo b").step_keys(&base);
        let b = mk("echo B").step_keys(&base);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        assert_ne!(a[2], b[2]);
        let other = BuildSpec::base_key(&BaseRef::Builtin {
            name: "other".into(),
        });
        assert_ne!(mk("echo b").step_keys(&other)[0], a[0]);
    }

    #[test]
    fn references_split_into_name_and_tag() {
        assert_eq!(split_reference("web"), ("web", None));
        assert_eq!(split_reference("web:v1"), ("web", Some("v1")));
        assert_eq!(split_reference("team/web:v1"), ("web", Some("v1")));
    }
}
