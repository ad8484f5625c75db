//! Child processes of jobs: each starts as the leader of its own process group, is owned by a
//! tracked keeper task, and counts as ended only when it has been reaped and its group is
//! proven empty (`kill(-pgid, 0)` answers "no such process"), descendants that left the group
//! included.
//!
//! On cancellation (or shutdown) the group, and every descendant that left it while its parent
//! was alive, gets `SIGTERM`, then `SIGKILL` after the process grace. When absence cannot be
//! proven within the proof bound, the job's slot is quarantined, never declared clean.
//!
//! On Linux the supervisor's process becomes a child subreaper when a job first spawns a
//! process (unless `SupervisorBuilder::child_subreaper(false)`), so that descendants orphaned by
//! their parent are reparented to it and can be reaped and seen. Out of reach even then: a
//! descendant that escaped before the subreaper was set, or whose escape is hidden inside
//! another PID namespace.

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
    /// Checks again; `None` once everything is proven gone (what it held is then forgotten).
    fn recheck(&mut self) -> Option<String>;
}
