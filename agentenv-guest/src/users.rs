//! Users and groups from `/etc/passwd` and `/etc/group`, parsed directly so
//! the static binary never calls into NSS.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Errors looking up users.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error("user {0:?} does not exist in /etc/passwd; create it or pass an existing user")]
    NoSuchUser(String),
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
}

/// One account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    pub shell: String,
    /// Supplementary groups (from `/etc/group`), primary group included.
    pub groups: Vec<u32>,
}

/// Where the account files live (a different root in tests).
#[derive(Debug, Clone)]
pub struct AccountFiles {
    pub passwd: PathBuf,
    pub group: PathBuf,
}

impl Default for AccountFiles {
    fn default() -> Self {
        AccountFiles {
            passwd: PathBuf::from("/etc/passwd"),
            group: PathBuf::from("/etc/group"),
        }
    }
}

fn read(path: &Path) -> Result<String, UserError> {
    std::fs::read_to_string(path).map_err(|source| UserError::Read {
        path: path.display().to_string(),
        source,
    })
}

struct PasswdLine<'a> {
    name: &'a str,
    uid: u32,
    gid: u32,
    home: &'a str,
    shell: &'a str,
}

/// The `:`-separated fields of each line of `text` that is not a comment
/// and has at least `min` fields.
fn records(text: &str, min: usize) -> impl Iterator<Item = Vec<&str>> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split(':').collect::<Vec<_>>())
        .filter(move |f| f.len() >= min)
}

fn passwd_lines(text: &str) -> impl Iterator<Item = PasswdLine<'_>> {
    records(text, 7).filter_map(|f| {
        Some(PasswdLine {
            name: f[0],
            uid: f[2].parse().ok()?,
            gid: f[3].parse().ok()?,
            home: f[5],
            shell: f[6],
        })
    })
}

/// `(name, gid, members)` of each group line.
fn group_lines(text: &str) -> impl Iterator<Item = (&str, u32, Vec<&str>)> {
    records(text, 4).filter_map(|f| {
        let members = f[3].split(',').filter(|m| !m.is_empty()).collect();
        Some((f[0], f[2].parse().ok()?, members))
    })
}

impl AccountFiles {
    /// Looks a user up by name; a numeric name that matches no account is
    /// taken as a uid.
    pub fn lookup(&self, name: &str) -> Result<User, UserError> {
        let passwd = read(&self.passwd)?;
        let line = passwd_lines(&passwd)
            .find(|p| p.name == name)
            .or_else(|| {
                let uid: u32 = name.parse().ok()?;
                passwd_lines(&passwd).find(|p| p.uid == uid)
            })
            .ok_or_else(|| UserError::NoSuchUser(name.to_string()))?;
        let mut groups = vec![line.gid];
        if let Ok(group) = read(&self.group) {
            for (_, gid, members) in group_lines(&group) {
                if members.contains(&line.name) && !groups.contains(&gid) {
                    groups.push(gid);
                }
            }
        }
        Ok(User {
            name: line.name.to_string(),
            uid: line.uid,
            gid: line.gid,
            home: PathBuf::from(if line.home.is_empty() { "/" } else { line.home }),
            shell: line.shell.to_string(),
            groups,
        })
    }

    /// The name of the account with `uid`, if any.
    pub fn name_of_uid(&self, uid: u32) -> Option<String> {
        let passwd = read(&self.passwd).ok()?;
        passwd_lines(&passwd)
            .find(|p| p.uid == uid)
            .map(|p| p.name.to_string())
    }

    /// uid → name and gid → name tables, for listing many entries.
    pub fn id_names(&self) -> IdNames {
        let mut names = IdNames::default();
        if let Ok(passwd) = read(&self.passwd) {
            for p in passwd_lines(&passwd) {
                names
                    .users
                    .entry(p.uid)
                    .or_insert_with(|| p.name.to_string());
            }
        }
        if let Ok(group) = read(&self.group) {
            for (name, gid, _) in group_lines(&group) {
                names.groups.entry(gid).or_insert_with(|| name.to_string());
            }
        }
        names
    }
}

/// uid and gid name tables; unknown ids are shown as numbers.
#[derive(Debug, Default, Clone)]
pub struct IdNames {
    users: HashMap<u32, String>,
    groups: HashMap<u32, String>,
}

impl IdNames {
    pub fn user(&self, uid: u32) -> String {
        self.users
            .get(&uid)
            .cloned()
            .unwrap_or_else(|| uid.to_string())
    }
    pub fn group(&self, gid: u32) -> String {
        self.groups
            .get(&gid)
            .cloned()
            .unwrap_or_else(|| gid.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_accounts_and_supplementary_groups() {
        let dir = tempfile::tempdir().unwrap();
        let passwd = dir.path().join("passwd");
        let group = dir.path().join("group");
        std::fs::write(
            &passwd,
            "root:x:0:0:root:/root:/bin/bash\n# comment\nbroken\nuser:x:1000:1000::/home/user:/bin/sh\n",
        )
        .unwrap();
        std::fs::write(&group, "root:x:0:\nuser:x:1000:\nwheel:x:10:root,user\n").unwrap();
        let files = AccountFiles { passwd, group };
        let u = files.lookup("user").unwrap();
        assert_eq!((u.uid, u.gid), (1000, 1000));
        assert_eq!(u.home, PathBuf::from("/home/user"));
        assert_eq!(u.groups, vec![1000, 10]);
        assert_eq!(files.lookup("0").unwrap().name, "root");
        assert!(matches!(
            files.lookup("nobody"),
            Err(UserError::NoSuchUser(_))
        ));
        let names = files.id_names();
        assert_eq!(names.user(1000), "user");
        assert_eq!(names.group(10), "wheel");
        assert_eq!(names.group(4242), "4242");
    }
}
