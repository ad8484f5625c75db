//! A job's temp dir, and the confinement of job-supplied relative paths to it.
//!
//! A job names files by paths relative to its temp dir; [`confine`] turns such a path into one
//! under the temp dir, or refuses it with a [`PathRefused`] (stable code `JOB_PATH_REFUSED`).
//! [`TempDir`] is the dir itself, as it travels from the job that asked for it to its removal.

use std::fmt;
use std::io;
use std::path::{Component, Path, PathBuf};

/// A job's temp dir, once the job asked for one: one value from the worker that made it (or
/// failed to) through the job's end report and the core's record to the removal.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct TempDir {
    /// The path handed out to the job.
    pub(crate) path: Box<Path>,
    /// Whether it was made. False: making it failed, and the path handed out instead names
    /// nothing unless the body put something there.
    pub(crate) made: bool,
}

/// A job-supplied path refused because it could leave (or could not be proven to stay inside)
/// the job's temp dir. Nothing was read or written through it. Stable code: `JOB_PATH_REFUSED`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathRefused {
    path: PathBuf,
    reason: PathRefusedReason,
    /// The I/O error kind behind [`PathRefusedReason::Unreadable`]; `None` for every other reason.
    io_kind: Option<io::ErrorKind>,
}

/// Why a job-supplied path was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PathRefusedReason {
    /// The path is absolute (it has a root, or a Windows-style prefix such as `C:`).
    Absolute,
    /// The path contains a `..` component somewhere, even one that would stay inside the temp
    /// dir (`a/../b`): such paths are refused outright rather than interpreted.
    ParentComponent,
    /// The path is empty, or consists only of `.` components.
    Empty,
    /// An existing component of the path is a symlink that resolves outside the temp dir, or
    /// that dangles (its target does not exist), so where it leads cannot be proven.
    SymlinkEscape,
    /// An existing component of the path could not be inspected (an I/O error other than "not
    /// found", such as a permission error, a non-directory used as a directory, or a symlink loop).
    Unreadable,
}

impl PathRefused {
    /// The stable code `"JOB_PATH_REFUSED"`.
    pub const CODE: &'static str = "JOB_PATH_REFUSED";

    fn new(path: &Path, reason: PathRefusedReason) -> Self {
        Self {
            path: path.to_path_buf(),
            reason,
            io_kind: None,
        }
    }

    fn unreadable(path: &Path, err: &io::Error) -> Self {
        Self {
            path: path.to_path_buf(),
            reason: PathRefusedReason::Unreadable,
            io_kind: Some(err.kind()),
        }
    }

    /// Always `"JOB_PATH_REFUSED"`.
    pub fn code(&self) -> &'static str {
        Self::CODE
    }

    /// The path as the job gave it (relative to its temp dir, not normalised).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Why the path was refused.
    pub fn reason(&self) -> PathRefusedReason {
        self.reason
    }
}

impl fmt::Display for PathRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = &self.path;
        match self.reason {
            PathRefusedReason::Absolute => {
                write!(f, "job path refused: {path:?} is absolute")
            }
            PathRefusedReason::ParentComponent => {
                write!(f, "job path refused: {path:?} contains a `..` component")
            }
            PathRefusedReason::Empty => {
                write!(f, "job path refused: {path:?} is empty")
            }
            PathRefusedReason::SymlinkEscape => write!(
                f,
                "job path refused: {path:?} goes through a symlink that leaves the job's temp dir or dangles"
            ),
            PathRefusedReason::Unreadable => match self.io_kind {
                Some(kind) => write!(
                    f,
                    "job path refused: {path:?} could not be inspected ({kind})"
                ),
                None => write!(f, "job path refused: {path:?} could not be inspected"),
            },
        }
    }
}

impl std::error::Error for PathRefused {}

/// Confines `relative`, a path a job handed over, to `root`, the job's temp dir, and returns
/// `root.join(relative)` with `.` components dropped.
///
/// `root` must be an absolute, canonical directory (as [`std::fs::canonicalize`] returns it);
/// the symlink checks compare canonical paths against it.
///
/// Refused, with the matching [`PathRefusedReason`]:
/// - an empty path, or one made only of `.` components ([`Empty`](PathRefusedReason::Empty));
/// - an absolute path, including one with a Windows-style prefix or root
///   ([`Absolute`](PathRefusedReason::Absolute));
/// - a path with a `..` component anywhere, even `a/../b`
///   ([`ParentComponent`](PathRefusedReason::ParentComponent));
/// - a path whose existing prefix goes through a symlink that resolves outside `root`, or through
///   a dangling symlink ([`SymlinkEscape`](PathRefusedReason::SymlinkEscape)); symlinks (and
///   chains of them) that resolve inside `root` are allowed;
/// - a path whose existing prefix cannot be inspected: any I/O error other than "not found"
///   ([`Unreadable`](PathRefusedReason::Unreadable)).
///
/// The existing prefix is walked component by component; the first component that does not exist
/// ends the walk, since the rest may be created later (by the job, under the path returned here).
///
/// # Limits
///
/// The check is made at call time, and only then. A job that swaps a component for a symlink
/// after this returns can still race it (time of check to time of use): the returned path is
/// not a capability and nothing here pins the directories it names. That is why the parent also
/// runs a job's child processes with the temp dir as their working directory, and never follows
/// a path a job hands it without calling this first.
pub(crate) fn confine(root: &Path, relative: &Path) -> Result<PathBuf, PathRefused> {
    debug_assert!(root.is_absolute(), "confine: root must be absolute");
    let refuse = |reason| PathRefused::new(relative, reason);

    let mut normalised = PathBuf::new();
    for component in relative.components() {
        match component {
            Component::Prefix(_) | Component::RootDir => {
                return Err(refuse(PathRefusedReason::Absolute));
            }
            Component::ParentDir => return Err(refuse(PathRefusedReason::ParentComponent)),
            Component::CurDir => {}
            Component::Normal(name) => normalised.push(name),
        }
    }
    if normalised.as_os_str().is_empty() {
        return Err(refuse(PathRefusedReason::Empty));
    }

    let mut current = root.to_path_buf();
    for component in normalised.components() {
        current.push(component);
        let meta = match std::fs::symlink_metadata(&current) {
            Ok(meta) => meta,
            Err(err) if err.kind() == io::ErrorKind::NotFound => break,
            Err(err) => return Err(PathRefused::unreadable(relative, &err)),
        };
        if meta.file_type().is_symlink() {
            match std::fs::canonicalize(&current) {
                Ok(target) if target.starts_with(root) => {}
                Ok(_) => return Err(refuse(PathRefusedReason::SymlinkEscape)),
                // Dangling (the target, or a link in its chain, does not exist): where it would
                // lead once created cannot be proven, so it is refused.
                Err(err) if err.kind() == io::ErrorKind::NotFound => {
                    return Err(refuse(PathRefusedReason::SymlinkEscape));
                }
                Err(err) => return Err(PathRefused::unreadable(relative, &err)),
            }
        }
    }

    Ok(root.join(normalised))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canonical_root() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = std::fs::canonicalize(dir.path()).expect("canonicalize tempdir");
        (dir, root)
    }

    fn assert_refused(root: &Path, relative: &str, reason: PathRefusedReason) {
        let err = confine(root, Path::new(relative)).expect_err(relative);
        assert_eq!(err.reason(), reason, "{relative:?}: {err}");
        assert_eq!(err.code(), "JOB_PATH_REFUSED");
        assert_eq!(err.code(), PathRefused::CODE);
        assert_eq!(err.path(), Path::new(relative));
    }

    fn assert_accepted(root: &Path, relative: &str, expected: &str) {
        let path = confine(root, Path::new(relative))
            .unwrap_or_else(|err| panic!("{relative:?} refused: {err}"));
        assert!(path.starts_with(root), "{path:?} is not under {root:?}");
        assert_eq!(path, root.join(expected));
    }

    #[test]
    fn the_error_is_send_sync_and_static() {
        fn check<T: std::error::Error + Send + Sync + 'static>() {}
        check::<PathRefused>();
    }

    #[test]
    fn a_leading_parent_component_is_refused() {
        let (_dir, root) = canonical_root();
        assert_refused(&root, "../x", PathRefusedReason::ParentComponent);
    }

    #[test]
    fn a_parent_component_that_climbs_out_is_refused() {
        let (_dir, root) = canonical_root();
        assert_refused(&root, "a/../../x", PathRefusedReason::ParentComponent);
    }

    #[test]
    fn a_parent_component_that_stays_inside_is_still_refused() {
        let (_dir, root) = canonical_root();
        assert_refused(&root, "a/../b", PathRefusedReason::ParentComponent);
    }

    #[test]
    fn an_absolute_path_is_refused() {
        let (_dir, root) = canonical_root();
        assert_refused(&root, "/etc/passwd", PathRefusedReason::Absolute);
    }

    #[test]
    fn an_empty_path_is_refused() {
        let (_dir, root) = canonical_root();
        assert_refused(&root, "", PathRefusedReason::Empty);
    }

    #[test]
    fn a_path_of_only_dots_is_refused_as_empty() {
        let (_dir, root) = canonical_root();
        assert_refused(&root, "./.", PathRefusedReason::Empty);
    }

    #[test]
    fn a_path_that_does_not_exist_yet_is_accepted() {
        let (_dir, root) = canonical_root();
        assert_accepted(&root, "out/frame.png", "out/frame.png");
    }

    #[test]
    fn dot_components_are_dropped() {
        let (_dir, root) = canonical_root();
        assert_accepted(&root, "./a/b", "a/b");
        assert_accepted(&root, "a/./b/.", "a/b");
    }

    #[test]
    fn an_existing_nested_file_is_accepted() {
        let (_dir, root) = canonical_root();
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/b/c.txt"), b"x").unwrap();
        assert_accepted(&root, "a/b/c.txt", "a/b/c.txt");
    }

    #[test]
    fn a_regular_file_used_as_a_directory_is_refused_as_unreadable() {
        let (_dir, root) = canonical_root();
        std::fs::write(root.join("file"), b"x").unwrap();
        assert_refused(&root, "file/x", PathRefusedReason::Unreadable);
    }

    #[test]
    fn the_display_is_lowercase_without_a_full_stop() {
        let (_dir, root) = canonical_root();
        for relative in ["", "/etc", "../x"] {
            let msg = confine(&root, Path::new(relative)).unwrap_err().to_string();
            assert!(msg.starts_with("job path refused"), "{msg}");
            assert!(!msg.ends_with('.'), "{msg}");
        }
    }

    #[cfg(unix)]
    mod symlinks {
        use super::*;
        use std::os::unix::fs::symlink;

        #[test]
        fn a_symlink_to_etc_is_refused() {
            let (_dir, root) = canonical_root();
            symlink("/etc", root.join("etc")).unwrap();
            assert_refused(&root, "etc/passwd", PathRefusedReason::SymlinkEscape);
            assert_refused(&root, "etc", PathRefusedReason::SymlinkEscape);
        }

        #[test]
        fn a_symlink_to_the_parent_is_refused() {
            let (_dir, root) = canonical_root();
            symlink("..", root.join("up")).unwrap();
            assert_refused(&root, "up/x", PathRefusedReason::SymlinkEscape);
        }

        #[test]
        fn a_dangling_symlink_is_refused() {
            let (_dir, root) = canonical_root();
            symlink("missing", root.join("dangling")).unwrap();
            assert_refused(&root, "dangling", PathRefusedReason::SymlinkEscape);
            assert_refused(&root, "dangling/x", PathRefusedReason::SymlinkEscape);
        }

        #[test]
        fn a_symlink_deep_in_the_path_is_checked() {
            let (_dir, root) = canonical_root();
            std::fs::create_dir_all(root.join("a/b")).unwrap();
            symlink("/etc", root.join("a/b/etc")).unwrap();
            assert_refused(&root, "./a/b/etc/passwd", PathRefusedReason::SymlinkEscape);
        }

        #[test]
        fn a_symlink_loop_is_refused_as_unreadable() {
            let (_dir, root) = canonical_root();
            symlink("loop", root.join("loop")).unwrap();
            assert_refused(&root, "loop/x", PathRefusedReason::Unreadable);
        }

        #[test]
        fn a_symlink_to_another_directory_inside_the_root_is_accepted() {
            let (_dir, root) = canonical_root();
            std::fs::create_dir(root.join("real")).unwrap();
            symlink("real", root.join("alias")).unwrap();
            assert_accepted(&root, "alias/frame.png", "alias/frame.png");
        }

        #[test]
        fn a_chain_of_symlinks_staying_inside_the_root_is_accepted() {
            let (_dir, root) = canonical_root();
            std::fs::create_dir_all(root.join("real/sub")).unwrap();
            symlink(root.join("real"), root.join("first")).unwrap();
            symlink("first/sub", root.join("second")).unwrap();
            assert_accepted(&root, "second/out.png", "second/out.png");
        }

        #[test]
        fn a_symlink_to_the_root_itself_is_accepted() {
            let (_dir, root) = canonical_root();
            symlink(".", root.join("self")).unwrap();
            assert_accepted(&root, "self/self/x", "self/self/x");
        }
    }
}
