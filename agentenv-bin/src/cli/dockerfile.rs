//! A Dockerfile turned into a template build request for `aenv build`: the base image,
//! the build steps (RUN, COPY/ADD, ENV/ARG, WORKDIR, USER) and the start command.

use super::model::BuildStep;

/// Errors of reading a Dockerfile.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DockerfileError {
    #[error(
        "line {line}: {instr} instructions are not supported by AENV template builds (supported: FROM, RUN, COPY, ADD, ENV, ARG, WORKDIR, USER, CMD, ENTRYPOINT)"
    )]
    Unsupported { line: usize, instr: String },
    #[error("line {line}: unknown instruction {instr}")]
    Unknown { line: usize, instr: String },
    #[error("line {line}: {reason}")]
    Bad { line: usize, reason: String },
    #[error("no usable FROM image (scratch and $-variables do not count); pass --image")]
    NoBase,
    #[error("no FROM instruction: a Dockerfile starts with FROM (e.g. FROM base)")]
    NoFrom,
}

/// What a Dockerfile asks for.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub from_image: Option<String>,
    pub steps: Vec<BuildStep>,
    pub start_cmd: Option<String>,
    pub warnings: Vec<String>,
}

/// Quotes one word for a POSIX shell.
pub fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_/.:=@%+,-".contains(&b));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Logical lines (continuations joined, comments dropped) with their first line number.
fn logical_lines(text: &str) -> Vec<(usize, String)> {
    let mut escape = '\\';
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut start = 0;
    let mut directives = true;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim_end_matches('\r');
        let t = line.trim();
        if directives {
            if let Some(d) = t.strip_prefix('#') {
                if let Some((k, v)) = d.split_once('=')
                    && k.trim().eq_ignore_ascii_case("escape")
                {
                    escape = if v.trim() == "`" { '`' } else { '\\' };
                }
                continue;
            }
            directives = false;
        }
        if t.starts_with('#') || (t.is_empty() && cur.is_empty()) {
            continue;
        }
        if cur.is_empty() {
            start = i + 1;
        }
        match t.strip_suffix(escape) {
            Some(head) => {
                cur.push_str(head);
                cur.push(' ');
            }
            None => {
                cur.push_str(t);
                out.push((start, std::mem::take(&mut cur).trim().to_string()));
            }
        }
    }
    if !cur.trim().is_empty() {
        out.push((start, cur.trim().to_string()));
    }
    out
}

/// Exec form (`["a", "b"]`) joined into one shell command; shell form as written.
fn command_form(line: usize, rest: &str) -> Result<String, DockerfileError> {
    if rest.starts_with('[') {
        let words: Vec<String> = serde_json::from_str(rest).map_err(|e| DockerfileError::Bad {
            line,
            reason: format!("bad exec form {rest:?}: {e}"),
        })?;
        return Ok(words
            .iter()
            .map(|w| shell_quote(w))
            .collect::<Vec<_>>()
            .join(" "));
    }
    Ok(rest.to_string())
}

/// Splits `K=V K2="two words"` (quotes removed, backslash escapes honoured).
fn words(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    let mut any = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, c) if c.is_whitespace() => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            (None, '"' | '\'') => {
                quote = Some(c);
                any = true;
            }
            (Some(q), c) if c == q => quote = None,
            (q, '\\') if q != Some('\'') => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
                any = true;
            }
            (_, c) => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

fn step(kind: &str, args: Vec<String>) -> BuildStep {
    BuildStep {
        kind: kind.to_string(),
        args,
        files_hash: None,
    }
}

/// `$NAME` and `${NAME}` replaced by the values of `vars` (unknown names by nothing).
fn substitute(s: &str, vars: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let (name, skip) = if let Some(b) = after.strip_prefix('{') {
            match b.find('}') {
                Some(j) => (&b[..j], j + 2),
                None => ("", 0),
            }
        } else {
            let n = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            (&after[..n], n)
        };
        if name.is_empty() {
            out.push('$');
            rest = after;
            continue;
        }
        if let Some((_, v)) = vars.iter().rev().find(|(k, _)| k == name) {
            out.push_str(v);
        }
        rest = &after[skip..];
    }
    out.push_str(rest);
    out
}

/// `K=V` words (and bare `K` for ARG) as name/value pairs.
fn pairs(rest: &str) -> Vec<(String, String)> {
    words(rest)
        .into_iter()
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (kv, String::new()),
        })
        .collect()
}

fn flat(kv: &[(String, String)]) -> Vec<String> {
    kv.iter()
        .flat_map(|(k, v)| [k.clone(), v.clone()])
        .collect()
}

/// `COPY`/`ADD` arguments: one `COPY` step (`[src, dest, chown, chmod]`, no files hash
/// yet) per source.
fn copy_steps(line: usize, instr: &str, rest: &str) -> Result<Vec<BuildStep>, DockerfileError> {
    let bad = |reason: String| DockerfileError::Bad { line, reason };
    let mut chown = String::new();
    let mut chmod = String::new();
    let mut rest = rest.trim();
    while let Some(flag) = rest.strip_prefix("--") {
        let (f, r) = flag.split_once(char::is_whitespace).unwrap_or((flag, ""));
        rest = r.trim_start();
        let (k, v) = f.split_once('=').unwrap_or((f, ""));
        match k {
            "chown" => chown = v.to_string(),
            "chmod" => {
                let m = u32::from_str_radix(v, 8)
                    .ok()
                    .filter(|m| *m <= 0o7777)
                    .ok_or_else(|| {
                        bad(format!(
                            "{instr} --chmod={v}: give an octal mode such as 0755"
                        ))
                    })?;
                chmod = format!("{m:04o}");
            }
            "from" => {
                return Err(bad(format!(
                    "{instr} --from is not supported (multi-stage builds are not): copy files from the build context"
                )));
            }
            "link" => {}
            other => {
                return Err(bad(format!("{instr} --{other} is not supported")));
            }
        }
    }
    if rest.starts_with("<<") || rest.contains(" <<") {
        return Err(bad(format!("{instr} heredocs are not supported")));
    }
    let args: Vec<String> = if rest.starts_with('[') {
        serde_json::from_str(rest).map_err(|e| bad(format!("bad exec form {rest:?}: {e}")))?
    } else {
        words(rest)
    };
    let Some((dest, srcs)) = args.split_last().filter(|(_, s)| !s.is_empty()) else {
        return Err(bad(format!("{instr} needs a source and a destination")));
    };
    let mut out = Vec::new();
    for src in srcs {
        let url = src.contains("://") || src.starts_with("git@");
        if url {
            return Err(bad(format!(
                "{instr} of a URL ({src}) is not supported: download it with RUN curl or wget"
            )));
        }
        out.push(step(
            "COPY",
            vec![src.clone(), dest.clone(), chown.clone(), chmod.clone()],
        ));
    }
    Ok(out)
}

/// The built-in template's names as a `FROM` (sent as `fromTemplate: "base"`).
pub fn is_base(image: &str) -> bool {
    image == "base" || image == "e2bdev/base" || image.starts_with("e2bdev/base:")
}

/// Reads a Dockerfile (one stage). `ARG` becomes `ENV` (build-time values stay in the
/// template, as the E2B SDK does it), `COPY`/`ADD` become `COPY` steps whose files the
/// caller packs, `CMD`/`ENTRYPOINT` the start command.
pub fn parse(text: &str) -> Result<Plan, DockerfileError> {
    let mut plan = Plan::default();
    let mut cmd: Option<String> = None;
    let mut entrypoint: Option<(String, bool)> = None;
    // ARGs before FROM: only for FROM itself.
    let mut global_args: Vec<(String, String)> = Vec::new();
    let mut from_line: Option<usize> = None;
    for (line, l) in logical_lines(text) {
        let (instr, rest) = match l.split_once(char::is_whitespace) {
            Some((i, r)) => (i.to_ascii_uppercase(), r.trim()),
            None => (l.to_ascii_uppercase(), ""),
        };
        if from_line.is_none() && !matches!(instr.as_str(), "FROM" | "ARG") {
            return Err(DockerfileError::Bad {
                line,
                reason: format!("{instr} before FROM: a Dockerfile starts with FROM"),
            });
        }
        match instr.as_str() {
            "FROM" => {
                if let Some(first) = from_line {
                    return Err(DockerfileError::Bad {
                        line,
                        reason: format!(
                            "a second FROM (the first is on line {first}): multi-stage Dockerfiles are not supported"
                        ),
                    });
                }
                from_line = Some(line);
                let image = rest
                    .split_whitespace()
                    .find(|w| !w.starts_with("--"))
                    .map(|w| substitute(w, &global_args))
                    .unwrap_or_default();
                if !image.is_empty() && image != "scratch" && !image.contains('$') {
                    plan.from_image = Some(image);
                }
            }
            "ARG" if from_line.is_none() => global_args.extend(pairs(rest)),
            "RUN" => {
                if rest.starts_with("--") {
                    return Err(DockerfileError::Bad {
                        line,
                        reason: "RUN flags (--mount, --network, --security) are not supported"
                            .into(),
                    });
                }
                if rest.contains("<<") && !rest.starts_with('[') {
                    return Err(DockerfileError::Bad {
                        line,
                        reason: "RUN heredocs are not supported; put the script in one RUN line"
                            .into(),
                    });
                }
                plan.steps
                    .push(step("RUN", vec![command_form(line, rest)?]));
            }
            "ENV" => {
                let w = words(rest);
                let kv = if w.first().is_some_and(|x| !x.contains('=')) {
                    // Legacy form: ENV KEY the rest of the line.
                    let (k, v) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
                    vec![(k.to_string(), v.trim().to_string())]
                } else {
                    pairs(rest)
                };
                plan.steps.push(step("ENV", flat(&kv)));
            }
            "ARG" => plan.steps.push(step("ENV", flat(&pairs(rest)))),
            "COPY" | "ADD" => plan.steps.extend(copy_steps(line, &instr, rest)?),
            "WORKDIR" | "USER" => plan.steps.push(step(&instr, vec![rest.to_string()])),
            "CMD" => cmd = Some(command_form(line, rest)?),
            "ENTRYPOINT" => entrypoint = Some((command_form(line, rest)?, rest.starts_with('['))),
            "HEALTHCHECK" | "ONBUILD" | "SHELL" => {
                return Err(DockerfileError::Unsupported { line, instr });
            }
            "EXPOSE" | "VOLUME" | "LABEL" | "MAINTAINER" | "STOPSIGNAL" => plan.warnings.push(
                format!("warning: {instr} instruction is not supported and will be ignored"),
            ),
            _ => return Err(DockerfileError::Unknown { line, instr }),
        }
    }
    if from_line.is_none() {
        return Err(DockerfileError::NoFrom);
    }
    // Docker's rules: CMD is the arguments of an exec-form ENTRYPOINT; a shell-form
    // ENTRYPOINT ignores CMD.
    plan.start_cmd = match (entrypoint, cmd) {
        (Some((e, true)), Some(c)) => Some(format!("{e} {c}")),
        (Some((e, _)), _) => Some(e),
        (None, c) => c,
    };
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(args: [&str; 4]) -> BuildStep {
        step("COPY", args.iter().map(|a| a.to_string()).collect())
    }

    #[test]
    fn dockerfile_instructions_become_build_steps_and_a_start_command() {
        let text = r#"# escape=\
# a comment
ARG BASE=python:3.12-slim
FROM --platform=linux/amd64 ${BASE} AS base
ARG VERSION=1.0 DEBUG
ENV A=1 B="two words"
ENV LEGACY value with spaces
RUN apt-get update && \
    apt-get install -y curl
RUN ["pip", "install", "it's"]
WORKDIR /app
COPY --chown=user:user --chmod=644 a.txt dir/ /app/
ADD ["with space", "/opt/"]
USER user
EXPOSE 8080
CMD ["python", "-m", "http.server"]
"#;
        let p = parse(text).unwrap();
        assert_eq!(p.from_image.as_deref(), Some("python:3.12-slim"));
        assert_eq!(
            p.steps,
            vec![
                step(
                    "ENV",
                    vec!["VERSION".into(), "1.0".into(), "DEBUG".into(), "".into()]
                ),
                step(
                    "ENV",
                    vec!["A".into(), "1".into(), "B".into(), "two words".into()]
                ),
                step("ENV", vec!["LEGACY".into(), "value with spaces".into()]),
                step(
                    "RUN",
                    vec!["apt-get update &&  apt-get install -y curl".into()]
                ),
                step("RUN", vec![r#"pip install 'it'\''s'"#.into()]),
                step("WORKDIR", vec!["/app".into()]),
                copy(["a.txt", "/app/", "user:user", "0644"]),
                copy(["dir/", "/app/", "user:user", "0644"]),
                copy(["with space", "/opt/", "", ""]),
                step("USER", vec!["user".into()]),
            ]
        );
        assert_eq!(p.start_cmd.as_deref(), Some("python -m http.server"));
        assert_eq!(
            p.warnings,
            vec!["warning: EXPOSE instruction is not supported and will be ignored"]
        );
    }

    #[test]
    fn dockerfile_entrypoint_and_cmd_follow_docker_rules() {
        let p = parse("FROM ubuntu\nCMD x\nENTRYPOINT run.sh\n").unwrap();
        assert_eq!(p.start_cmd.as_deref(), Some("run.sh"));
        let p = parse("FROM ubuntu\nCMD [\"-v\"]\nENTRYPOINT [\"run\"]\n").unwrap();
        assert_eq!(p.start_cmd.as_deref(), Some("run -v"));
        assert_eq!(parse("FROM scratch\n").unwrap().from_image, None);
        assert_eq!(parse("FROM $NOPE\n").unwrap().from_image, None);
        assert!(is_base("base") && is_base("e2bdev/base") && is_base("e2bdev/base:1"));
        assert!(!is_base("ubuntu"));
    }

    #[test]
    fn dockerfile_refusals_name_the_line_and_the_instruction() {
        assert_eq!(
            parse("FROM a\n\nHEALTHCHECK CMD true\n")
                .unwrap_err()
                .to_string(),
            "line 3: HEALTHCHECK instructions are not supported by AENV template builds (supported: FROM, RUN, COPY, ADD, ENV, ARG, WORKDIR, USER, CMD, ENTRYPOINT)"
        );
        assert!(
            parse("FROM a\nONBUILD RUN x\n")
                .unwrap_err()
                .to_string()
                .contains("ONBUILD")
        );
        let e = |t: &str| parse(t).unwrap_err().to_string();
        assert!(e("FROM a\nCOPY --from=b /x /y\n").contains("--from"));
        assert!(e("FROM a\nADD https://x/y.tgz /y\n").contains("URL"));
        assert!(e("FROM a\nCOPY onlyone\n").contains("a source and a destination"));
        assert!(e("FROM a\nCOPY --chmod=9z x /y\n").contains("octal"));
        assert!(e("FROM a\nFROM b\n").contains("multi-stage"));
        assert!(e("RUN x\n").contains("before FROM"));
        assert_eq!(e(""), DockerfileError::NoFrom.to_string());
        assert!(parse("FROM a\nRUN <<EOF\necho\nEOF\n").is_err());
        assert!(parse("FROM a\nFROBNICATE\n").is_err());
        assert!(parse("FROM a\nRUN [\"unterminated\n").is_err());
    }

    #[test]
    fn dockerfile_variables_in_from_come_from_args_before_it() {
        assert_eq!(
            substitute(
                "img:${V}-$W.x$",
                &[("V".into(), "1".into()), ("W".into(), "b".into())]
            ),
            "img:1-b.x$"
        );
    }
}
