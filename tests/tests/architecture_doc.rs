//! docs/architecture.md stays in step with the tree: every crate of its table
//! is a workspace member, and every room its room list names exists in that
//! crate's sources (a module file or folder of that name, or the path given).

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn doc() -> String {
    std::fs::read_to_string(root().join("docs/architecture.md")).unwrap()
}

/// Whether a file `name.rs` or a folder `name` exists anywhere below `dir`.
fn has_room(dir: &Path, name: &str) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    for e in entries.flatten() {
        let p = e.path();
        let file = e.file_name().to_string_lossy().to_string();
        if file == name || file == format!("{name}.rs") {
            return true;
        }
        if p.is_dir() && has_room(&p, name) {
            return true;
        }
    }
    false
}

/// The backticked words of a line.
fn ticked(line: &str) -> Vec<&str> {
    line.split('`').skip(1).step_by(2).collect()
}

#[test]
fn every_crate_in_the_table_is_a_workspace_member() {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let text = doc();
    let mut crates = 0;
    for line in text.lines().filter(|l| l.starts_with("| `")) {
        let name = ticked(line)[0];
        crates += 1;
        assert!(
            manifest.contains(&format!("\"{name}\"")),
            "docs/architecture.md lists {name}, which is not a workspace member"
        );
    }
    assert!(crates >= 10, "the crate table was not found");
}

#[test]
fn every_room_named_exists_in_its_crate() {
    let text = doc();
    let mut checked = 0;
    let mut item = String::new();
    let mut items = Vec::new();
    let mut in_rooms = false;
    for line in text.lines() {
        if line.starts_with("## ") {
            in_rooms = line.contains("rooms");
            continue;
        }
        if !in_rooms {
            continue;
        }
        if line.starts_with("- **") {
            if !item.is_empty() {
                items.push(std::mem::take(&mut item));
            }
            item = line.to_string();
        } else if line.starts_with("  ") {
            item.push(' ');
            item.push_str(line.trim());
        }
    }
    if !item.is_empty() {
        items.push(item);
    }
    for item in items {
        let short = item
            .trim_start_matches("- **")
            .split("**")
            .next()
            .unwrap()
            .to_string();
        let src = root().join(format!("agentenv-{short}")).join("src");
        assert!(src.is_dir(), "no crate agentenv-{short}");
        for room in ticked(&item) {
            if room.contains([':', ' ', '(', '.']) && !room.ends_with(".rs") {
                continue;
            }
            if room.starts_with('/') || room.starts_with('-') {
                continue;
            }
            let found = if room.contains('/') {
                let p = src.join(room.trim_end_matches('/'));
                p.exists() || has_room(&src, room.trim_end_matches('/'))
            } else {
                has_room(&src, room)
            };
            assert!(
                found,
                "docs/architecture.md names room `{room}` of agentenv-{short}, which is not in {}",
                src.display()
            );
            checked += 1;
        }
    }
    assert!(checked > 40, "only {checked} rooms were checked");
}
