//! A Dockerfile turned into a template build request for `aenv build`: the base image,
//! the build steps (RUN, ENV, ARG, WORKDIR, USER) and the start command.

use super::model::BuildStep;

/// Errors of reading a Dockerfile.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DockerfileError {
    #[error("line {line}: {instr} instructions are not supported by AENV template builds yet")]
    Unsupported { line: usize, instr: String },
    #[error("line {line}: unknown instruction {instr}")]
    Unknown { line: usize, instr: String },
    #[error("line {line}: {reason}")]
    Bad { line: usize, reason: String },
    #[error("no usable FROM image (scratch and $-variables do not count); pass --image")]
    NoBase,
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
    }
}

/// Reads a Dockerfile.
pub fn parse(text: &str) -> Result<Plan, DockerfileError> {
    let mut plan = Plan::default();
    let mut cmd: Option<String> = None;
    let mut entrypoint: Option<String> = None;
    for (line, l) in logical_lines(text) {
        let (instr, rest) = match l.split_once(char::is_whitespace) {
            Some((i, r)) => (i.to_ascii_uppercase(), r.trim()),
            None => (l.to_ascii_uppercase(), ""),
        };
        match instr.as_str() {
            "FROM" => {
                let image = rest
                    .split_whitespace()
                    .find(|w| !w.starts_with("--"))
                    .unwrap_or("");
                if plan.from_image.is_none() && image != "scratch" && !image.starts_with('$') {
                    plan.from_image = Some(image.to_string());
                }
            }
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
                let mut args = Vec::new();
                if w.first().is_some_and(|x| !x.contains('=')) {
                    // Legacy form: ENV KEY the rest of the line.
                    let (k, v) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
                    args.push(k.to_string());
                    args.push(v.trim().to_string());
                } else {
                    for kv in w {
                        let (k, v) = kv.split_once('=').unwrap_or((&kv, ""));
                        args.push(k.to_string());
                        args.push(v.to_string());
                    }
                }
                plan.steps.push(step("ENV", args));
            }
            "ARG" => {
                let mut args = Vec::new();
                for kv in words(rest) {
                    let (k, v) = kv.split_once('=').unwrap_or((&kv, ""));
                    args.push(k.to_string());
                    args.push(v.to_string());
                }
                plan.steps.push(step("ARG", args));
            }
            "WORKDIR" | "USER" => plan.steps.push(step(&instr, vec![rest.to_string()])),
            "CMD" => cmd = Some(command_form(line, rest)?),
            "ENTRYPOINT" => entrypoint = Some(command_form(line, rest)?),
            "COPY" | "ADD" | "HEALTHCHECK" | "ONBUILD" => {
                return Err(DockerfileError::Unsupported { line, instr });
            }
            "EXPOSE" | "VOLUME" | "LABEL" | "MAINTAINER" => plan.warnings.push(format!(
                "warning: {instr} instruction is not supported and will be ignored"
            )),
            "SHELL" | "STOPSIGNAL" => {}
            _ => return Err(DockerfileError::Unknown { line, instr }),
        }
    }
    plan.start_cmd = entrypoint.or(cmd);
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instructions_become_build_steps_and_a_start_command() {
        let text = r#"# escape=\
# a comment
FROM --platform=linux/amd64 python:3.12-slim AS base
ARG VERSION=1.0 DEBUG
ENV A=1 B="two words"
ENV LEGACY value with spaces
RUN apt-get update && \
    apt-get install -y curl
RUN ["pip", "install", "it's"]
WORKDIR /app
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
                    "ARG",
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
    fn entrypoint_wins_and_scratch_is_no_base() {
        let p = parse("FROM scratch\nFROM $BASE\nFROM ubuntu\nCMD x\nENTRYPOINT run.sh\n").unwrap();
        assert_eq!(p.from_image.as_deref(), Some("ubuntu"));
        assert_eq!(p.start_cmd.as_deref(), Some("run.sh"));
    }

    #[test]
    fn unsupported_instructions_name_the_line() {
        assert_eq!(
            parse("FROM a\n\nCOPY . /app\n").unwrap_err().to_string(),
            "line 3: COPY instructions are not supported by AENV template builds yet"
        );
        assert!(parse("FROM a\nRUN <<EOF\necho\nEOF\n").is_err());
        assert!(parse("FROM a\nFROBNICATE\n").is_err());
        assert!(parse("FROM a\nRUN [\"unterminated\n").is_err());
    }
}
