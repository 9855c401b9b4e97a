//! The rules of `docs/architecture.md`, checked over the source: every room of `daemon/src` uses
//! only the rooms below it (in the order the page lists them), the "must never know" rules, what
//! a module's code names (in `use` lines and in paths written out), and what each crate's
//! manifest depends on. A rule broken here fails with every offending line.

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace").to_path_buf()
}

/// Every `.rs` file under `dir` (relative to the repository), with comments removed.
fn sources(dir: &str) -> Vec<(PathBuf, String)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let root = repo().join(dir);
    let mut files = Vec::new();
    if root.is_dir() {
        walk(&root, &mut files);
    } else {
        files.push(root);
    }
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            let code: Vec<&str> = text.lines().map(|l| l.split("//").next().unwrap_or("")).collect();
            (p, code.join("\n"))
        })
        .collect()
}

/// The paths `code` names: every `a::b::c` as written, and each name of a `use a::{b, c::d}`
/// group as `a::b` and `a::c::d`.
fn paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let flat: String = code.split_whitespace().collect::<Vec<_>>().join(" ");
    for statement in flat.split(';') {
        let Some(at) = statement.find("::{") else { continue };
        let prefix_start =
            statement[..at].rfind(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).map_or(0, |i| i + 1);
        let prefix = &statement[prefix_start..at];
        let inner = statement[at + 3..].split('}').next().unwrap_or("");
        for name in inner.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            out.push(format!("{prefix}::{name}"));
        }
    }
    let token = |c: char| c.is_alphanumeric() || c == '_' || c == ':';
    out.extend(code.split(|c: char| !token(c)).filter(|t| t.contains("::")).map(String::from));
    out
}

/// Every place under `dirs` that names a path starting with one of `forbidden`.
fn offences(dirs: &[&str], forbidden: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for dir in dirs {
        for (path, code) in sources(dir) {
            for p in paths(&code) {
                let hit = forbidden.iter().find(|f| p == **f || p.starts_with(&format!("{f}::")));
                if let Some(f) = hit {
                    found.push(format!("{}: names {p} ({f})", path.strip_prefix(repo()).unwrap_or(&path).display()));
                }
            }
        }
    }
    found
}

/// The rooms of `daemon/src` from the bottom up, as `docs/architecture.md` lists them: each line
/// of its rooms block that starts with a folder name.
fn layers() -> Vec<String> {
    let doc = std::fs::read_to_string(repo().join("docs/architecture.md")).expect("docs/architecture.md");
    let start = doc.find("## The daemon's rooms, from the bottom up").expect("the rooms section");
    let block = doc[start..].split("```").nth(1).expect("the rooms block");
    let mut rooms: Vec<String> = block
        .lines()
        .filter(|l| !l.starts_with(' '))
        .filter_map(|l| l.split_whitespace().next().and_then(|w| w.strip_suffix('/')))
        .map(String::from)
        .collect();
    rooms.reverse();
    rooms
}

#[test]
fn every_room_uses_only_the_rooms_below_it() {
    let layers = layers();
    let mut on_disk: Vec<String> = std::fs::read_dir(repo().join("daemon/src"))
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    let mut documented = layers.clone();
    documented.sort();
    assert_eq!(on_disk, documented, "docs/architecture.md's rooms are not daemon/src's folders");
    let mut found = Vec::new();
    for (i, room) in layers.iter().enumerate() {
        let above: Vec<String> = layers[i + 1..].iter().map(|r| format!("crate::{r}")).collect();
        let above: Vec<&str> = above.iter().map(String::as_str).collect();
        found.extend(offences(&[&format!("daemon/src/{room}")], &above));
    }
    assert!(found.is_empty(), "a room uses one above it:\n{}", found.join("\n"));
}

#[test]
fn the_source_root_holds_only_the_crate_root_and_the_binary() {
    let mut files: Vec<String> = std::fs::read_dir(repo().join("daemon/src"))
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["lib.rs", "main.rs"]);
}

#[test]
fn the_training_loop_names_no_collective_backend() {
    // Comments included: the loop's rooms do not talk of a backend either.
    let mut found = Vec::new();
    for (path, _) in sources("daemon/src/train") {
        if std::fs::read_to_string(&path).unwrap().to_lowercase().contains("nccl") {
            found.push(path.strip_prefix(repo()).unwrap_or(&path).display().to_string());
        }
    }
    assert!(found.is_empty(), "the loop names NCCL (it sees only collective::Collective): {found:?}");
}

#[test]
fn the_cluster_and_the_collectives_know_nothing_of_training_plugins_or_storage() {
    let training = ["crate::train", "crate::state", "crate::checkpoint", "crate::plugin"];
    let data = ["trainerd_data", "crate::input"];
    let forbidden = [&training[..], &data[..], &["trainerd_storage", "trainerd_sdk", "crate::optim"]].concat();
    let found = offences(&["daemon/src/cluster", "daemon/src/collective"], &forbidden);
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn the_collectives_know_nothing_of_membership() {
    let found = offences(&["daemon/src/collective"], &["crate::cluster"]);
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn the_state_knows_nothing_of_the_cluster_the_collectives_or_the_loop() {
    let found = offences(
        &["daemon/src/state"],
        &["crate::cluster", "crate::collective", "crate::train", "crate::checkpoint", "crate::input"],
    );
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn the_data_knows_nothing_of_the_cluster_the_loop_or_the_state() {
    let forbidden = ["crate::cluster", "crate::collective", "crate::train", "crate::state", "crate::checkpoint"];
    let found = offences(&["daemon/src/input"], &forbidden);
    assert!(found.is_empty(), "{}", found.join("\n"));
    // The data crate reads files for a plugin's declaration: it knows no daemon.
    let deps = section("data/Cargo.toml", "dependencies");
    for name in ["trainerd", "trainerd-testkit", "trainerd-supervise"] {
        assert!(!deps.iter().any(|d| d == name), "the data crate depends on {name}: {deps:?}");
    }
}

#[test]
fn the_launcher_knows_nothing_of_training_or_libtorch() {
    let found = offences(&["daemon/src/cli/local.rs"], &["crate::train", "crate::state", "crate::plugin", "tch"]);
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// The `[dependencies]` (or another section's) names in a manifest.
fn section(manifest: &str, name: &str) -> Vec<String> {
    let text = std::fs::read_to_string(repo().join(manifest)).unwrap_or_else(|e| panic!("{manifest}: {e}"));
    let mut inside = false;
    let mut names = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == format!("[{name}]");
        } else if inside && !line.is_empty() && !line.starts_with('#') {
            names.push(line.split(['=', '.']).next().unwrap_or("").trim().to_string());
        }
    }
    names
}

#[test]
fn storage_and_the_sdk_stand_alone_and_the_test_kit_is_only_ever_a_dev_dependency() {
    let storage = section("storage/Cargo.toml", "dependencies");
    for name in ["trainerd", "trainerd-sdk", "tch", "torch-sys", "trainerd-testkit"] {
        assert!(!storage.iter().any(|d| d == name), "storage depends on {name}: {storage:?}");
    }
    // What supervisors and tests share links nothing of training: neither does the test kit.
    for manifest in ["supervise/Cargo.toml", "testkit/Cargo.toml"] {
        let deps = section(manifest, "dependencies");
        for name in ["trainerd", "trainerd-sdk", "tch", "torch-sys"] {
            assert!(!deps.iter().any(|d| d == name), "{manifest} depends on {name}: {deps:?}");
        }
    }
    let sdk = section("sdk/Cargo.toml", "dependencies");
    for name in ["trainerd", "trainerd-storage", "trainerd-testkit"] {
        assert!(!sdk.iter().any(|d| d == name), "the sdk depends on {name}: {sdk:?}");
    }
    for manifest in
        ["daemon", "storage", "sdk", "data", "failpoint", "testkit", "chaos-tests"].map(|c| format!("{c}/Cargo.toml"))
    {
        for kind in ["dependencies", "build-dependencies"] {
            let deps = section(&manifest, kind);
            assert!(!deps.iter().any(|d| d == "trainerd-testkit"), "{manifest} [{kind}] holds the test kit");
            assert!(!deps.iter().any(|d| d == "trainerd-chaos-tests"), "{manifest} [{kind}] holds the chaos tests");
        }
    }
}

#[test]
fn a_forbidden_name_is_found_in_a_use_group_and_in_a_path_written_out() {
    let code = "use crate::{cluster::Network, train::{self, RunConfig}};\nfn f() { trainerd_storage::x(); }";
    let found = paths(code);
    assert!(found.iter().any(|p| p == "crate::cluster::Network"), "{found:?}");
    assert!(found.iter().any(|p| p.starts_with("crate::train")), "{found:?}");
    assert!(found.iter().any(|p| p == "trainerd_storage::x"), "{found:?}");
}

/// The page, whole.
fn page() -> String {
    std::fs::read_to_string(repo().join("docs/architecture.md")).expect("docs/architecture.md")
}

/// What the page names as a path, outside its rooms block: every span in backticks that holds a
/// `/` or ends in a file's extension, without an item after `::` (`train/commit::decide`).
fn named_paths(doc: &str) -> Vec<String> {
    let mut prose = String::new();
    for (i, part) in doc.split("```").enumerate() {
        if i % 2 == 0 {
            prose.push_str(part);
        }
    }
    let spans = prose.split('`').skip(1).step_by(2);
    let looks_like_path = |s: &&str| {
        !s.contains(' ')
            && !s.contains('*')
            && (s.contains('/') || [".rs", ".md", ".py", ".toml"].iter().any(|e| s.ends_with(e)))
    };
    spans.filter(looks_like_path).map(|s| s.split("::").next().unwrap_or(s).to_string()).collect()
}

/// Whether `path`, as the page writes it, is in the tree: from the repository's root, from
/// `daemon/src` (the rooms are written from there), or inside a crate's `src/`
/// (`storage/protocol`), a module written without its `.rs`.
fn exists(path: &str) -> bool {
    let path = path.trim_end_matches('/');
    let mut candidates = vec![repo().join(path), repo().join("daemon/src").join(path)];
    if let Some((krate, rest)) = path.split_once('/') {
        candidates.push(repo().join(krate).join("src").join(rest));
    }
    candidates.iter().any(|p| p.exists() || p.with_extension("rs").exists())
}

#[test]
fn every_path_the_page_names_exists() {
    let missing: Vec<String> = named_paths(&page()).into_iter().filter(|p| !exists(p)).collect();
    assert!(missing.is_empty(), "docs/architecture.md names paths that are not in the tree: {missing:?}");
}

#[test]
fn a_path_the_page_names_is_read_with_or_without_its_extension_and_item() {
    let doc = "`cli/args/mod.rs` and `train/commit::decide` in `storage/protocol`; ```\nx/ `no/such`\n```";
    assert_eq!(named_paths(doc), ["cli/args/mod.rs", "train/commit", "storage/protocol"]);
    assert!(exists("train/commit") && exists("storage/protocol") && exists("cluster/coordinator/rules/"));
    assert!(!exists("cli/args.rs") && !exists("cluster/membership.rs"));
}

/// Each room's paragraph of the rooms block, by the room's name.
fn room_paragraphs() -> Vec<(String, String)> {
    let doc = page();
    let start = doc.find("## The daemon's rooms, from the bottom up").expect("the rooms section");
    let block = doc[start..].split("```").nth(1).expect("the rooms block");
    let mut out: Vec<(String, String)> = Vec::new();
    for line in block.lines() {
        match line.split_whitespace().next().and_then(|w| w.strip_suffix('/')) {
            Some(room) if !line.starts_with(' ') => out.push((room.to_string(), line.to_string())),
            _ => {
                if let Some(last) = out.last_mut() {
                    last.1.push('\n');
                    last.1.push_str(line);
                }
            }
        }
    }
    out
}

#[test]
fn every_module_of_a_room_is_named_in_its_description() {
    fn modules(dir: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                out.push(name);
                modules(&path, out);
            } else if let Some(stem) = name.strip_suffix(".rs") {
                if !(stem == "mod" || stem == "tests" || stem.ends_with("_tests")) {
                    out.push(stem.to_string());
                }
            }
        }
    }
    let words = |text: &str| -> Vec<String> {
        text.split(|c: char| !(c.is_alphanumeric() || c == '_')).map(str::to_lowercase).collect()
    };
    let mut unnamed = Vec::new();
    for (room, paragraph) in room_paragraphs() {
        let said = words(&paragraph);
        let mut found = Vec::new();
        modules(&repo().join("daemon/src").join(&room), &mut found);
        unnamed.extend(found.into_iter().filter(|m| !said.contains(m)).map(|m| format!("{room}/: {m}")));
    }
    assert!(unnamed.is_empty(), "modules docs/architecture.md does not describe in their room: {unnamed:?}");
}

#[test]
fn every_crate_of_the_workspace_is_in_the_crates_table() {
    let manifest = std::fs::read_to_string(repo().join("Cargo.toml")).expect("Cargo.toml");
    let members = manifest.split("members = [").nth(1).and_then(|m| m.split(']').next()).expect("members");
    let doc = page();
    let table = doc.split("## Crates").nth(1).and_then(|t| t.split("\nRules:").next()).expect("the crates table");
    let rows: Vec<&str> =
        table.lines().filter_map(|l| l.strip_prefix("| `")).filter_map(|l| l.split('`').next()).collect();
    let missing: Vec<&str> = members
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
        .filter(|m| {
            let dir = format!("{m}/");
            !rows.iter().any(|r| {
                *r == dir
                    || (r.ends_with("/*/") || r.ends_with("/*"))
                        && m.starts_with(r.trim_end_matches("*/").trim_end_matches('*'))
            })
        })
        .collect();
    assert!(
        missing.is_empty(),
        "crates of the workspace missing from docs/architecture.md's table: {missing:?} (rows {rows:?})"
    );
}
