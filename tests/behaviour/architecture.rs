//! The architecture's absences, checked on the source (DESIGN.md section 2): the supervisor
//! actor's shell decides nothing — it never reads the core's state to choose what to do — and
//! the core is pure (no tokio, no ractor, no clock, no I/O).

use std::fs;
use std::path::{Path, PathBuf};

/// Every `.rs` file below `dir`.
pub(crate) fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The source lines of a file, without comments (line comments and doc comments).
fn code_lines(path: &Path) -> Vec<(usize, String)> {
    fs::read_to_string(path)
        .unwrap()
        .lines()
        .enumerate()
        .map(|(i, line)| {
            let code = match line.find("//") {
                Some(at) => &line[..at],
                None => line,
            };
            (i + 1, code.to_owned())
        })
        .filter(|(_, code)| !code.trim().is_empty())
        .collect()
}

/// What the shell may do with the core: apply an input, let it settle, take its effects, and
/// read the views the lease table and `Stats` show (never to branch on), or the decision it
/// hands back when the runtime goes away.
const SHELL_MAY_CALL: [&str; 8] = [
    "apply(",
    "settle(",
    "pop_effect(",
    "take_touched(",
    "view(",
    "figures(",
    "shrink_idle(",
    "abandon(",
];

#[test]
fn the_supervisor_shell_never_branches_on_the_cores_state() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/supervisor");
    let mut files = vec![root.join("actor.rs")];
    rust_files(&root.join("actor"), &mut files);
    let mut found = Vec::new();
    for file in &files {
        for (n, code) in code_lines(file) {
            let mut rest = code.as_str();
            while let Some(at) = rest.find("core.") {
                let call = &rest[at + "core.".len()..];
                let allowed = SHELL_MAY_CALL.iter().any(|m| call.starts_with(m));
                // A view read inside a condition is a decision taken outside the core.
                let branches = ["if ", "match ", "while ", "&& ", "|| ", "filter("]
                    .iter()
                    .any(|b| code.contains(b))
                    && !["apply(", "abandon(", "pop_effect("]
                        .iter()
                        .any(|m| call.starts_with(m));
                if !allowed || branches {
                    found.push(format!("{}:{n}: {}", file.display(), code.trim()));
                }
                rest = call;
            }
        }
    }
    assert!(
        found.is_empty(),
        "the shell reads the core's state to decide (move the decision into the core):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_core_is_pure() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/supervisor/core");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    // The tests beside the core may read a clock (for fresh seeds); the core itself may not.
    files.retain(|f| !f.components().any(|c| c.as_os_str() == "tests"));
    assert!(files.len() >= 7, "{files:?}");
    let forbidden = [
        "tokio",
        "ractor",
        "Instant",
        "SystemTime",
        "std::fs",
        "std::net",
        "std::thread",
        "futures",
        "async ",
        ".await",
    ];
    let mut found = Vec::new();
    for file in &files {
        for (n, code) in code_lines(file) {
            for word in forbidden {
                if code.contains(word) {
                    found.push(format!("{}:{n}: {word}: {}", file.display(), code.trim()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "the core must stay pure:\n{}",
        found.join("\n")
    );
}

/// The `codes` module's docs promise a table row for every one of its constants, and every code
/// a row names is either one of them or one the docs say is not.
#[test]
fn every_stable_code_has_its_row_in_the_codes_table() {
    let source =
        fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/error.rs")).unwrap();
    let (docs, module) = source
        .split_once("pub mod codes {")
        .expect("src/error.rs holds `pub mod codes`");
    let module = module.split("\n}").next().unwrap();
    let constants: Vec<&str> = module
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub const "))
        .map(|l| l.split('"').nth(1).expect("a string constant"))
        .collect();
    assert!(constants.len() >= 20, "{constants:?}");
    // The doc block right above the module: its table rows start with a code.
    let doc_block: Vec<&str> = docs
        .lines()
        .rev()
        .take_while(|l| l.trim_start().starts_with("///") || l.trim().is_empty())
        .collect();
    let rows: Vec<&str> = doc_block
        .iter()
        .filter_map(|l| l.trim_start().strip_prefix("/// | `"))
        .filter_map(|l| l.split('`').next())
        .collect();
    for code in &constants {
        assert!(rows.contains(code), "{code} has no row in the codes table");
    }
    let outside: Vec<&&str> = rows.iter().filter(|r| !constants.contains(r)).collect();
    let prose = doc_block.join("\n");
    for code in outside {
        assert!(
            prose.contains(&format!("`{code}`")) && prose.contains("not constants of this module"),
            "{code} has a row but is no constant of `codes`, and the docs do not say so"
        );
    }
}

/// The lines of the shell's rooms (`src/supervisor/actor/`) that `bad` picks, with where.
fn lines_of_the_shells_rooms(bad: impl Fn(&str) -> bool) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src/supervisor/actor"),
        &mut files,
    );
    assert!(files.len() >= 4, "{files:?}");
    files
        .iter()
        .flat_map(|file| {
            code_lines(file)
                .into_iter()
                .filter(|(_, code)| bad(code.trim()))
                .map(move |(n, code)| format!("{}:{n}: {}", file.display(), code.trim()))
        })
        .collect()
}

/// Each room of the supervisor's shell says what it depends on: no glob import of the shell's
/// own scope (ARCHITECTURE.md: rooms that own their state, with explicit imports).
#[test]
fn every_room_of_the_shell_names_what_it_imports() {
    let found = lines_of_the_shells_rooms(|code| code.starts_with("use super::*"));
    assert!(
        found.is_empty(),
        "a room imports its parent's whole scope (name what it uses):\n{}",
        found.join("\n")
    );
}

/// Each room of the supervisor's shell owns its state and its methods: none opens an `impl` of
/// the shell or imports from `actor.rs` above it (the shell applies what a room hands back), so
/// `actor.rs` is only the message-to-input and effect dispatch (ARCHITECTURE.md).
#[test]
fn no_room_of_the_shell_reaches_back_into_the_shell() {
    let rooms = ["config", "jobs", "brokerage", "ending", "rooms"];
    let found = lines_of_the_shells_rooms(|code| {
        code.starts_with("impl Shell")
            || code.contains("super::Shell")
            || code.contains("super::{") && code.contains("Shell")
            || code.starts_with("use super::")
                && !code.starts_with("use super::super")
                && !rooms
                    .iter()
                    .any(|room| code.starts_with(&format!("use super::{room}")))
    });
    assert!(
        found.is_empty(),
        "a room reaches back into the shell (own the state, hand back an input):\n{}",
        found.join("\n")
    );
}

/// The body of the first `fn name(` in a file, braces matched (comments dropped).
fn body_of(file: &str, name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    let code: Vec<String> = code_lines(&path).into_iter().map(|(_, c)| c).collect();
    let code = code.join("\n");
    let start = code
        .find(&format!("fn {name}("))
        .unwrap_or_else(|| panic!("no fn {name} in {file}"));
    let open = start + code[start..].find('{').expect("a body");
    let mut depth = 0;
    for (i, c) in code[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return code[open..=open + i].to_owned();
                }
            }
            _ => {}
        }
    }
    panic!("fn {name} in {file} does not close");
}

/// The one function that grants and the worker's start carry no test switch: faults are put in
/// by a host (the spawn) or by cargo-mutants (the admission checks), never by a `cfg(test)`
/// branch in the path every lease takes.
#[test]
fn the_grant_and_the_workers_start_have_no_test_switch() {
    for (file, name) in [
        ("src/supervisor/core/grant.rs", "admit_round"),
        ("src/supervisor/core/grant.rs", "take_from_pool"),
        ("src/worker/actor.rs", "pre_start"),
    ] {
        let body = body_of(file, name);
        assert!(body.len() > 100, "{file}: {name} is not where it was");
        assert!(
            !body.contains("cfg(test)") && !body.contains("FOR_TEST"),
            "{file}: {name} has a test switch:\n{body}"
        );
    }
}
