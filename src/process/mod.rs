//! Child processes of jobs: started as the leader of a process group of their own, stopped, reaped
//! and proven gone before the job's slot moves on.
//!
//! [`ctx.spawn_process(spec)`](crate::WorkerContext::spawn_process) starts a [`ProcessSpec`] as
//! part of the job and returns a [`JobProcess`]. A child process belongs to
//! the worker's physical lifetime exactly like a tracked task: the temp dir is removed and the slot
//! moves only after the child has been reaped and its whole process group proven empty. This needs
//! Unix process groups: on Windows the crate builds and runs jobs, but `spawn_process` refuses with
//! `PROCESS_SPAWN_FAILED` (an `io::ErrorKind::Unsupported` source), since the end of a child's
//! descendants could not be proven there. `cargo run --example process_jobs` shows process groups
//! stopped, reaped and proven empty.
//!
//! ```rust
//! # #[cfg(target_os = "linux")]
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! use std::io;
//! use std::time::Duration;
//!
//! use leasehold::{JobSpec, PathRefusedReason, ProcessSpec, Supervisor};
//!
//! let sup = Supervisor::builder()
//!     .slots(1)
//!     .process_grace(Duration::from_secs(2))        // SIGTERM, then SIGKILL 2 s later (default 5 s)
//!     .process_proof_bound(Duration::from_secs(1))  // to prove a stopped group empty (default 2 s)
//!     .start()
//!     .await?;
//!
//! let (text, dir) = sup
//!     .run(JobSpec::new("encode-0001")?, |ctx| async move {
//!         // Runs in the job's temp dir, as the leader of a process group of its own.
//!         let spec = ProcessSpec::new("sh").arg("-c").arg("echo hi > out.txt");
//!         let mut child = ctx.spawn_process(spec).map_err(io::Error::other)?;
//!         let status = child.wait().await.map_err(io::Error::other)?; // the leader's exit status
//!         assert!(status.success());
//!
//!         // Paths a job hands over are confined to its temp dir.
//!         let refused = ctx.path("../x").unwrap_err();
//!         assert_eq!(refused.code(), "JOB_PATH_REFUSED");
//!         assert_eq!(refused.reason(), PathRefusedReason::ParentComponent);
//!         // So are a process's inputs, outputs and working directory; a refused one never runs.
//!         let escape = ProcessSpec::new("cat").input("/etc/passwd");
//!         assert_eq!(ctx.spawn_process(escape).unwrap_err().code(), "JOB_PATH_REFUSED");
//!
//!         let text = std::fs::read_to_string(ctx.path("out.txt").map_err(io::Error::other)?)?;
//!         Ok::<_, io::Error>((text, ctx.temp_dir().to_path_buf()))
//!     })
//!     .await?;
//! assert_eq!(text, "hi\n");
//! assert!(!dir.exists()); // removed only once the group was proven empty
//!
//! // Nothing was quarantined, so a reclaim finds nothing to do.
//! assert!(sup.quarantined().await?.is_empty());
//! let report = sup.reclaim_quarantined().await?;
//! assert!(report.reclaimed.is_empty() && report.still_quarantined.is_empty());
//!
//! sup.shutdown().await?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! # Process groups
//!
//! Each child is started as the leader of a new process group (its pgid is its pid,
//! `JobProcess::pid`), in the job's temp dir unless `.current_dir(..)` names a directory inside it.
//! `.input(..)`, `.output(..)` and `.current_dir(..)` take paths relative to the temp dir; they are
//! checked like `ctx.path(..)` and passed on as absolute paths (standard input defaults to null,
//! standard output and error are inherited). A tracked *keeper* task owns the child, not the
//! `JobProcess` handle: dropping the handle neither kills the child nor lets the slot go. A body
//! that returns without waiting for its child is answered only once the child and every member of
//! its group have ended on their own (`.drain_timeout(..)`, if set, quarantines the slot meanwhile,
//! and releases it when they end). `wait()` gives the leader's exit status; members it left behind
//! are still the job's.
//!
//! # Stopping
//!
//! When the job is cancelled (its token, a dropped `run` future, `shutdown`) or the body calls
//! `JobProcess::kill()`, the whole group and every recorded escaped descendant (below) get
//! `SIGTERM`; whatever is left after `.process_grace(..)` (default 5 s) gets `SIGKILL`. The process
//! grace runs alongside the body's cancel grace: dropping an unresponsive body does not stop the
//! keeper. A group already proven empty (its leader exited and every member ended on its own) is
//! never signalled again, even if the job is cancelled afterwards: the kernel may have reused its
//! id.
//!
//! # The proof
//!
//! A child counts as gone only when its leader has been reaped (by tokio), members reparented to
//! this process have been reaped, `kill(-pgid, 0)` answers `ESRCH` (the group is empty), every
//! recorded escaped descendant is gone (checked by pid *and* start time) and no orphaned descendant
//! is alive. Only then does the keeper end, so only then are the temp dir removed and the slot
//! moved. The proof is bounded by `.process_proof_bound(..)` (default 2 s), counted from the moment
//! the leader is reaped after a stop (after `SIGKILL`, when it came to that) or, left alone, from
//! the moment the group has ended on its own; past it, the slot is quarantined (a process stuck in
//! uninterruptible sleep survives `SIGKILL`, an orphan may simply keep running).
//!
//! # Escaped descendants (Linux)
//!
//! A descendant can leave the group (`setsid`, `setpgid`), where `kill(-pgid, ..)` no longer
//! reaches it. When the group is stopped, the keeper reads `/proc` and records every descendant
//! outside the group, with its start time, while its parent is still alive to link it to the job.
//! Escapees get the same `SIGTERM` and `SIGKILL`, sent through a pidfd opened after checking the
//! start time (a pid the kernel has reused for another process is never signalled), and must be
//! gone before the slot moves.
//!
//! An escapee whose parent exits is orphaned, and `/proc` no longer links it to the job. Hence the
//! **child subreaper** (`PR_SET_CHILD_SUBREAPER`), on by default: when a job first spawns a
//! process, this process asks the kernel to reparent its orphaned descendants to it. The proof then
//! looks for live children of this process in a process group of their own — neither this process's
//! group, a running job's group, nor a recorded escapee — and does not declare a job clean while
//! one lives. Zombies among them are skipped, never reaped by this check: one may be a child the
//! application started itself and will wait for. The setting is process-wide: it cannot be undone
//! and holds for every supervisor in the process. So is what the check sees: while such an orphan
//! is attributed to no job, every job whose proof runs in that time waits for it, not only the one
//! it came from; the first one whose proof bound passes with the orphan still alive records it as
//! an escapee of its own and is quarantined, and later proofs no longer count it. A reclaim then
//! checks it by pid and start time like any escapee (and reaps it once it has ended). A child that
//! the application itself started in a process group of its own is taken for such an orphan too.
//!
//! `.child_subreaper(false)` stops this supervisor from setting it (it does not unset it if another
//! supervisor in the process already did) and from running the orphan check. Orphaned descendants
//! then go to init (or to the nearest other subreaper), so they are neither reaped nor seen here: a
//! job whose escaped descendant was orphaned is released while that descendant may still run. Still
//! covered with it off: the group itself (`kill(-pgid, 0)` does not depend on who the parent is)
//! and escapees whose parent is alive when the group is stopped. Out of reach with it on:
//! descendants that escaped and were orphaned before the subreaper was set, and escapes hidden
//! inside another PID namespace (orphans there go to that namespace's init). Out of reach with it
//! off, in addition: any descendant orphaned while it is off. Outside Linux there is no `/proc`:
//! only the group itself is proven empty.
//!
//! # Quarantine
//!
//! If absence cannot be proven within the bound, the keeper hands what it knows (group id, recorded
//! escapees, reason) to the job; the slot is quarantined and the caller gets
//! `LEASE_CLEANUP_UNCONFIRMED` (or `LEASE_BODY_AND_CLEANUP_FAILED` when the body failed too) as
//! soon as that is known. The temp dir is kept, since processes may still use it. Nothing re-checks
//! on its own: [`sup.quarantined()`](crate::Supervisor::quarantined) lists the quarantined slots
//! ([`QuarantinedSlot`](crate::QuarantinedSlot): token, job id, reason), and
//! [`sup.reclaim_quarantined()`](crate::Supervisor::reclaim_quarantined) checks each one again —
//! groups empty now, escapees and orphans gone now, temp dirs that can be removed now — and sends
//! those proven clean on through temp dir removal and broker release to the next waiter
//! (`ReclaimReport`: `reclaimed`, `still_quarantined`). `shutdown` reports quarantined slots
//! (`ShutdownReport::quarantined`) and does not wait for them; after it, reclaiming answers
//! `SUPERVISOR_STOPPED`.

// Without Unix process groups no job process is started (see `OsProcesses`): the rest of this
// module then has nothing to run.
#![cfg_attr(not(unix), allow(dead_code))]

#[cfg(target_os = "linux")]
mod tree;
#[cfg(unix)]
mod unix;

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::process::{ChildStderr, ChildStdin, ChildStdout};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::paths::PathRefused;

/// How a job's processes are stopped and proven gone.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProcessPolicy {
    /// Between `SIGTERM` and `SIGKILL`.
    pub(crate) grace: Duration,
    /// How long, after the leader is reaped (and after `SIGKILL` when it was stopped), the group
    /// may take to be proven empty before the slot is quarantined.
    pub(crate) proof_bound: Duration,
    /// Make this process a child subreaper (Linux) before the first spawn.
    pub(crate) subreaper: bool,
}

/// A child process for a job: a program, its arguments, and paths confined to the job's temp
/// dir.
///
/// # Examples
///
/// ```
/// use leasehold::ProcessSpec;
///
/// let spec = ProcessSpec::new("convert")
///     .input("scene/frame.exr")   // checked: inside the job's temp dir
///     .arg("-quality")
///     .arg("90")
///     .output("out/frame.png");
/// # let _ = spec;
/// ```
#[derive(Debug)]
pub struct ProcessSpec {
    program: OsString,
    args: Vec<SpecArg>,
    envs: Vec<(OsString, OsString)>,
    current_dir: Option<PathBuf>,
    stdin: Option<Stdio>,
    stdout: Option<Stdio>,
    stderr: Option<Stdio>,
}

#[derive(Debug)]
enum SpecArg {
    Plain(OsString),
    Path(PathBuf),
}

impl ProcessSpec {
    /// Runs `program` (looked up in `PATH` as `std::process::Command` does).
    pub fn new(program: impl AsRef<OsStr>) -> Self {
        Self {
            program: program.as_ref().to_owned(),
            args: Vec::new(),
            envs: Vec::new(),
            current_dir: None,
            stdin: None,
            stdout: None,
            stderr: None,
        }
    }

    /// A plain argument, passed as is.
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(SpecArg::Plain(arg.as_ref().to_owned()));
        self
    }

    /// Plain arguments, passed as they are.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args.extend(
            args.into_iter()
                .map(|a| SpecArg::Plain(a.as_ref().to_owned())),
        );
        self
    }

    /// An input path relative to the job's temp dir, passed as an absolute path. Refused at
    /// spawn (and nothing runs) when it is absolute, has a `..` component or goes through a
    /// symlink that leaves the temp dir.
    pub fn input(mut self, relative: impl AsRef<Path>) -> Self {
        self.args.push(SpecArg::Path(relative.as_ref().to_owned()));
        self
    }

    /// An output path relative to the job's temp dir; checked like [`input`](Self::input).
    pub fn output(self, relative: impl AsRef<Path>) -> Self {
        self.input(relative)
    }

    /// An environment variable for the child.
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.envs
            .push((key.as_ref().to_owned(), value.as_ref().to_owned()));
        self
    }

    /// The child's working directory, relative to the job's temp dir (default: the temp dir).
    pub fn current_dir(mut self, relative: impl AsRef<Path>) -> Self {
        self.current_dir = Some(relative.as_ref().to_owned());
        self
    }

    /// The child's standard input (default: null).
    pub fn stdin(mut self, cfg: impl Into<Stdio>) -> Self {
        self.stdin = Some(cfg.into());
        self
    }

    /// The child's standard output (default: inherited).
    pub fn stdout(mut self, cfg: impl Into<Stdio>) -> Self {
        self.stdout = Some(cfg.into());
        self
    }

    /// The child's standard error (default: inherited).
    pub fn stderr(mut self, cfg: impl Into<Stdio>) -> Self {
        self.stderr = Some(cfg.into());
        self
    }

    /// The program (the simulation test scripts its fakes by it).
    #[cfg(test)]
    pub(crate) fn program(&self) -> &OsStr {
        &self.program
    }

    /// Builds the command with every path confined to `root`; nothing is spawned.
    fn command(self, root: &Path) -> Result<tokio::process::Command, ProcessError> {
        let confine = |p: &Path| crate::paths::confine(root, p).map_err(ProcessError::Path);
        let mut cmd = tokio::process::Command::new(&self.program);
        for arg in &self.args {
            match arg {
                SpecArg::Plain(a) => cmd.arg(a),
                SpecArg::Path(p) => cmd.arg(confine(p)?),
            };
        }
        cmd.envs(self.envs);
        cmd.current_dir(match &self.current_dir {
            Some(dir) => confine(dir)?,
            None => root.to_path_buf(),
        });
        cmd.stdin(self.stdin.unwrap_or_else(Stdio::null));
        if let Some(out) = self.stdout {
            cmd.stdout(out);
        }
        if let Some(err) = self.stderr {
            cmd.stderr(err);
        }
        // A group of its own: signals reach every member, and emptiness can be proven.
        #[cfg(unix)]
        cmd.process_group(0);
        // The keeper decides when the child dies, never a destructor.
        cmd.kill_on_drop(false);
        Ok(cmd)
    }
}

/// Why a job's process could not be started or waited for.
#[derive(Debug)]
#[non_exhaustive]
pub enum ProcessError {
    /// A path argument or the working directory is not confined to the job's temp dir; nothing
    /// ran (`JOB_PATH_REFUSED`).
    Path(PathRefused),
    /// The program could not be started (`PROCESS_SPAWN_FAILED`).
    Spawn(io::Error),
    /// The child's exit status could not be read (`PROCESS_WAIT_FAILED`).
    Wait(Arc<io::Error>),
}

impl ProcessError {
    /// `JOB_PATH_REFUSED`, `PROCESS_SPAWN_FAILED` or `PROCESS_WAIT_FAILED`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Path(p) => p.code(),
            Self::Spawn(_) => "PROCESS_SPAWN_FAILED",
            Self::Wait(_) => "PROCESS_WAIT_FAILED",
        }
    }
}

impl fmt::Display for ProcessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Path(_) => f.write_str("process refused: a path leaves the job's temp dir"),
            Self::Spawn(_) => f.write_str("could not start the process"),
            Self::Wait(_) => f.write_str("could not read the process's exit status"),
        }
    }
}

impl std::error::Error for ProcessError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Path(e) => Some(e),
            Self::Spawn(e) => Some(e),
            Self::Wait(e) => Some(&**e),
        }
    }
}

type Status = Option<Result<ExitStatus, Arc<io::Error>>>;

/// A running child process of a job. Its keeper task, not this handle, owns the child: dropping
/// the handle neither kills nor forgets it, and the job's slot waits for the whole group.
#[derive(Debug)]
pub struct JobProcess {
    pid: u32,
    status: watch::Receiver<Status>,
    stop: CancellationToken,
    /// The child's standard input, when piped.
    pub stdin: Option<ChildStdin>,
    /// The child's standard output, when piped.
    pub stdout: Option<ChildStdout>,
    /// The child's standard error, when piped.
    pub stderr: Option<ChildStderr>,
}

impl JobProcess {
    /// The child's pid, which is also its process group id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Waits for the group leader's exit status. Members it left behind are still part of the
    /// job: the slot waits for them (and the job's cancellation stops them).
    ///
    /// # Errors
    ///
    /// [`ProcessError::Wait`] when the status could not be read.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future changes nothing; call it again.
    pub async fn wait(&mut self) -> Result<ExitStatus, ProcessError> {
        let status =
            self.status.wait_for(Option::is_some).await.map_err(|_| {
                ProcessError::Wait(Arc::new(io::Error::other("process keeper ended")))
            })?;
        match status.as_ref().expect("waited for Some") {
            Ok(s) => Ok(*s),
            Err(e) => Err(ProcessError::Wait(Arc::clone(e))),
        }
    }

    /// Stops the whole group (and descendants that left it): `SIGTERM`, then `SIGKILL` after
    /// the process grace. Returns at once; [`wait`](Self::wait) tells when the leader is gone.
    pub fn kill(&self) {
        self.stop.cancel();
    }

    /// A handle for a scripted process (the simulation test): its keeper reports the exit
    /// through the returned sender, and `stop` is what its `kill` and the job's cancellation
    /// reach.
    #[cfg(test)]
    pub(crate) fn scripted(pid: u32, stop: CancellationToken) -> (Self, watch::Sender<Status>) {
        let (tx, rx) = watch::channel(None);
        let process = Self {
            pid,
            status: rx,
            stop,
            stdin: None,
            stdout: None,
            stderr: None,
        };
        (process, tx)
    }
}

/// What a keeper ends with: `None` once the group is proven gone, otherwise what is known of
/// it, to be checked again.
pub(crate) type Keeper = BoxFuture<'static, Option<Box<dyn Evidence>>>;

/// Where a job's child processes come from: the operating system, or (in the simulation test)
/// a scripted fake. A host starts the child and returns its keeper, which the job runs as a
/// tracked task; the keeper ends only once the child's whole group is proven gone, or with the
/// evidence that it could not be.
pub(crate) trait ProcessHost: Send + Sync + 'static {
    fn spawn(
        &self,
        spec: ProcessSpec,
        root: &Path,
        job_cancel: &CancellationToken,
        policy: ProcessPolicy,
    ) -> Result<(JobProcess, Keeper), ProcessError>;
}

/// Real child processes, each the leader of its own process group.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OsProcesses;

impl ProcessHost for OsProcesses {
    fn spawn(
        &self,
        spec: ProcessSpec,
        root: &Path,
        job_cancel: &CancellationToken,
        policy: ProcessPolicy,
    ) -> Result<(JobProcess, Keeper), ProcessError> {
        #[cfg(unix)]
        {
            let (process, keeper) = unix::spawn(spec, root, job_cancel, policy)?;
            let keeper = Box::pin(async move {
                keeper
                    .await
                    .map(|unproven| Box::new(unproven) as Box<dyn Evidence>)
            });
            Ok((process, keeper))
        }
        // Without process groups the end of a job's processes cannot be proven (DESIGN.md
        // invariant 4), so none is started.
        #[cfg(not(unix))]
        {
            let _ = (spec, root, job_cancel, policy);
            Err(ProcessError::Spawn(io::Error::new(
                io::ErrorKind::Unsupported,
                "job processes need Unix process groups, which this platform does not have",
            )))
        }
    }
}

/// What is known of a process group that could not be proven gone: enough to check again.
pub(crate) trait Evidence: Send + fmt::Debug + 'static {
    /// Why it is not proven gone.
    fn reason(&self) -> &str;
    /// Checks again: `Ok` once everything is proven gone (what it held is then forgotten), else
    /// what still stands in the way.
    fn recheck(&mut self) -> Result<(), String>;
}
