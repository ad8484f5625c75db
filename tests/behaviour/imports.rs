//! The import graph of each crate of the workspace, read from the source: no file imports,
//! through others, from a file that imports from it (ARCHITECTURE.md: a room below never
//! reaches up into one that uses it; a type two rooms need goes below both).
//!
//! An arrow runs from a file to the file that defines what it names: every `use` item and
//! every `crate::`/`super::` path written in the code, resolved to the deepest module file, and
//! through a face's (`lib.rs`, `mod.rs`) re-exports to the file that defines the name. A face's
//! own re-exports are not arrows of the face (it only passes names on); its other imports are.
//! Inline `mod … { }` blocks (tests) are left out.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use crate::architecture::rust_files;

/// The module path of a source file below a crate's `src/` (`a/b.rs` and `a/b/mod.rs`: `a::b`;
/// `lib.rs`: the root).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// Whether a file is a face: `lib.rs` or a folder's `mod.rs`.
fn is_face(file: &Path) -> bool {
    matches!(
        file.file_name().and_then(|n| n.to_str()),
        Some("lib.rs" | "mod.rs")
    )
}

/// The file that defines module `module` in the crate whose sources are `src`.
fn file_of(src: &Path, module: &[String]) -> Option<PathBuf> {
    if module.is_empty() {
        return Some(src.join("lib.rs"));
    }
    let base = module.iter().fold(src.to_path_buf(), |p, m| p.join(m));
    [base.with_extension("rs"), base.join("mod.rs")]
        .into_iter()
        .find(|p| p.is_file())
}

/// One name a `use` tree brings in: its path and the name it is known by.
struct UseItem {
    path: Vec<String>,
    name: String,
}

/// The items of a `use` tree (`a::{b, c::d as e, self}`: `a::b` as `b`, `a::c::d` as `e`, `a`
/// as `a`).
fn use_items(tree: &str) -> Vec<UseItem> {
    let tree = tree.trim();
    let segments = |s: &str| -> Vec<String> {
        s.split("::")
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .collect()
    };
    let Some(open) = tree.find('{') else {
        let (path, alias) = match tree.split_once(" as ") {
            Some((path, alias)) => (path, Some(alias.trim().to_owned())),
            None => (tree, None),
        };
        let mut path = segments(path);
        if path.last().is_some_and(|s| s == "self") {
            path.pop();
        }
        let name = alias.or_else(|| path.last().cloned()).unwrap_or_default();
        return vec![UseItem { path, name }];
    };
    let prefix = segments(&tree[..open]);
    let inner = &tree[open + 1..tree.rfind('}').expect("a closing brace")];
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, ch) in inner.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|part| !part.trim().is_empty())
        .flat_map(use_items)
        .map(|item| {
            let path: Vec<String> = prefix.iter().cloned().chain(item.path).collect();
            let name = if item.name.is_empty() {
                path.last().cloned().unwrap_or_default()
            } else {
                item.name
            };
            UseItem { path, name }
        })
        .collect()
}

/// What a file says, as the graph needs it: its `use` statements (with whether each is a
/// re-export) and the `crate::`/`super::` paths written elsewhere in its code.
struct Source {
    uses: Vec<(bool, String)>,
    paths: Vec<String>,
}

/// Reads a file: comments and inline `mod … { }` blocks dropped.
fn read_source(file: &Path) -> Source {
    let text = fs::read_to_string(file).unwrap();
    let (mut uses, mut paths) = (Vec::new(), Vec::new());
    let mut pending: Option<(bool, String)> = None;
    // Brace depth inside an inline module being skipped.
    let mut skipping: Option<i32> = None;
    for line in text.lines() {
        let code = line.find("//").map_or(line, |at| &line[..at]);
        let trimmed = code.trim();
        if let Some(depth) = skipping.as_mut() {
            *depth += code.matches('{').count() as i32 - code.matches('}').count() as i32;
            if *depth <= 0 {
                skipping = None;
            }
            continue;
        }
        let bare = trimmed
            .strip_prefix("pub(crate) ")
            .or_else(|| trimmed.strip_prefix("pub(super) "))
            .or_else(|| trimmed.strip_prefix("pub "))
            .unwrap_or(trimmed);
        if bare.starts_with("mod ") && trimmed.ends_with('{') {
            skipping = Some(1);
            continue;
        }
        if let Some((reexport, mut statement)) = pending.take() {
            statement.push_str(trimmed);
            match statement.find(';') {
                Some(end) => uses.push((reexport, statement[..end].to_owned())),
                None => pending = Some((reexport, statement)),
            }
            continue;
        }
        if let Some(rest) = bare.strip_prefix("use ") {
            let reexport = bare.len() != trimmed.len();
            match rest.find(';') {
                Some(end) => uses.push((reexport, rest[..end].to_owned())),
                None => pending = Some((reexport, rest.to_owned())),
            }
            continue;
        }
        for start in ["crate::", "super::"] {
            let mut from = 0;
            while let Some(at) = code[from..].find(start) {
                let at = from + at;
                let before = code[..at].chars().next_back();
                from = at + start.len();
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                    continue;
                }
                let len = code[at..]
                    .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                    .unwrap_or(code.len() - at);
                paths.push(code[at..at + len].trim_end_matches(':').to_owned());
                from = at + len;
            }
        }
    }
    Source { uses, paths }
}

/// One crate's files, their sources and what each face re-exports.
struct Crate {
    src: PathBuf,
    files: Vec<(PathBuf, Source)>,
    /// For each face: the names it re-exports, and the paths they come from.
    exports: HashMap<PathBuf, Vec<(String, Vec<String>)>>,
}

impl Crate {
    fn read(src: &Path) -> Crate {
        let mut paths = Vec::new();
        rust_files(src, &mut paths);
        paths.sort();
        let files: Vec<(PathBuf, Source)> = paths
            .into_iter()
            .map(|f| {
                let source = read_source(&f);
                (f, source)
            })
            .collect();
        let mut exports = HashMap::new();
        for (file, source) in &files {
            if !is_face(file) {
                continue;
            }
            let module = module_of(src, file);
            let names = source
                .uses
                .iter()
                .filter(|(reexport, _)| *reexport)
                .flat_map(|(_, tree)| use_items(tree))
                .filter_map(|item| Some((item.name.clone(), absolute(src, &module, &item.path)?)))
                .collect();
            exports.insert(file.clone(), names);
        }
        Crate {
            src: src.to_path_buf(),
            files,
            exports,
        }
    }

    /// The file that defines what `path` (absolute, from the crate root) names: the deepest
    /// module file on it, and through a face's re-export of the next name, that name's file.
    fn resolve(&self, path: &[String], depth: usize) -> Option<PathBuf> {
        let (mut found, mut used) = (None, 0);
        for n in 1..=path.len() {
            match file_of(&self.src, &path[..n]) {
                Some(file) => (found, used) = (Some(file), n),
                None => break,
            }
        }
        let found = found.or_else(|| file_of(&self.src, &[]))?;
        if is_face(&found)
            && depth < 8
            && let Some(name) = path.get(used)
            && let Some((_, from)) = self
                .exports
                .get(&found)
                .and_then(|names| names.iter().find(|(n, _)| n == name))
        {
            let mut from = from.clone();
            from.extend(path[used + 1..].iter().cloned());
            return self.resolve(&from, depth + 1).or(Some(found));
        }
        Some(found)
    }

    /// Every file's arrows.
    fn graph(&self) -> Vec<(PathBuf, Vec<PathBuf>)> {
        self.files
            .iter()
            .map(|(file, source)| {
                let module = module_of(&self.src, file);
                let face = is_face(file);
                let from_uses = source
                    .uses
                    .iter()
                    .filter(|(reexport, _)| !(face && *reexport))
                    .flat_map(|(_, tree)| use_items(tree))
                    .map(|item| item.path);
                let from_code = source.paths.iter().map(|p| {
                    p.split("::")
                        .map(str::to_owned)
                        .filter(|s| !s.is_empty())
                        .collect()
                });
                let mut targets: Vec<PathBuf> = Vec::new();
                for path in from_uses.chain(from_code) {
                    let Some(absolute) = absolute(&self.src, &module, &path) else {
                        continue;
                    };
                    if let Some(target) = self.resolve(&absolute, 0)
                        && target != *file
                        && !targets.contains(&target)
                    {
                        targets.push(target);
                    }
                }
                (file.clone(), targets)
            })
            .collect()
    }
}

/// `path` as written in module `module`, from the crate root; `None` for another crate's.
fn absolute(src: &Path, module: &[String], path: &[String]) -> Option<Vec<String>> {
    let first = path.first()?;
    let (mut base, rest) = match first.as_str() {
        "crate" => (Vec::new(), &path[1..]),
        "self" => (module.to_vec(), &path[1..]),
        "super" => {
            let ups = path.iter().take_while(|s| *s == "super").count();
            let mut up = module.to_vec();
            for _ in 0..ups {
                up.pop();
            }
            (up, &path[ups..])
        }
        // A child module named from its parent, or another crate.
        _ => {
            let mut child = module.to_vec();
            child.push(first.clone());
            file_of(src, &child)?;
            (module.to_vec(), path)
        }
    };
    base.extend(rest.iter().cloned());
    Some(base)
}

/// A circle in the graph, as the files it passes through, if there is one.
fn a_circle(graph: &[(PathBuf, Vec<PathBuf>)]) -> Option<Vec<PathBuf>> {
    fn visit(
        at: &PathBuf,
        graph: &[(PathBuf, Vec<PathBuf>)],
        done: &mut Vec<PathBuf>,
        path: &mut Vec<PathBuf>,
    ) -> Option<Vec<PathBuf>> {
        if let Some(start) = path.iter().position(|p| p == at) {
            let mut circle = path[start..].to_vec();
            circle.push(at.clone());
            return Some(circle);
        }
        if done.contains(at) {
            return None;
        }
        path.push(at.clone());
        let next = graph.iter().find(|(f, _)| f == at).map(|(_, t)| t.clone());
        for to in next.unwrap_or_default() {
            if let Some(circle) = visit(&to, graph, done, path) {
                return Some(circle);
            }
        }
        path.pop();
        done.push(at.clone());
        None
    }
    let mut done = Vec::new();
    graph
        .iter()
        .find_map(|(file, _)| visit(file, graph, &mut done, &mut Vec::new()))
}

#[test]
fn no_file_imports_in_a_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rel = |p: &Path| p.strip_prefix(root).unwrap().display().to_string();
    // Arrows the reading must find (one through a face's re-export), so that a reader that
    // finds too few fails here rather than passing a tree it did not read.
    let known = [
        (
            "src",
            "src/supervisor/handle.rs",
            "src/supervisor/job_handle.rs",
        ),
        ("src", "src/supervisor/desk.rs", "src/supervisor/state.rs"),
        ("src", "src/conformance.rs", "src/supervisor/handle.rs"),
        ("etcd/src", "etcd/src/acquire.rs", "etcd/src/records.rs"),
        ("etcd/src", "etcd/src/inner.rs", "etcd/src/records.rs"),
        (
            "console/src",
            "console/src/sampler.rs",
            "console/src/timeline.rs",
        ),
    ];
    for src in ["src", "etcd/src", "console/src"] {
        let graph = Crate::read(&root.join(src)).graph();
        for (_, from, to) in known.iter().filter(|(s, ..)| *s == src) {
            assert!(
                graph
                    .iter()
                    .any(|(f, t)| rel(f) == *from && t.iter().any(|t| rel(t) == *to)),
                "the import graph of {src} misses {from} -> {to}"
            );
        }
        if let Some(circle) = a_circle(&graph) {
            let names: Vec<String> = circle.iter().map(|p| rel(p)).collect();
            panic!("an import circle in {src}: {}", names.join(" -> "));
        }
    }
}
