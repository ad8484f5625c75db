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

#[cfg(target_os = "linux")]
mod tree;

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use futures_util::future::BoxFuture;
use parking_lot::Mutex;
use rustix::process::{Pid, Signal};
use tokio::process::{Child, ChildStderr, ChildStdin, ChildStdout};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::worker::PathRefused;

/// Process groups of jobs not yet proven empty (their members are never taken for orphans of
/// another job).
static LIVE_GROUPS: LazyLock<Mutex<HashSet<i32>>> = LazyLock::new(Mutex::default);

/// Escaped descendants some keeper has recorded and is dealing with (never taken for
/// unaccounted orphans by another job's proof).
static KNOWN_ESCAPEES: LazyLock<Mutex<HashSet<i32>>> = LazyLock::new(Mutex::default);

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
        let confine = |p: &Path| crate::worker::confine(root, p).map_err(ProcessError::Path);
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
        let (process, keeper) = spawn(spec, root, job_cancel, policy)?;
        let keeper = Box::pin(async move {
            keeper
                .await
                .map(|unproven| Box::new(unproven) as Box<dyn Evidence>)
        });
        Ok((process, keeper))
    }
}

/// What is known of a process group that could not be proven gone: enough to check again.
pub(crate) trait Evidence: Send + fmt::Debug + 'static {
    /// Why it is not proven gone.
    fn reason(&self) -> &str;
    /// Checks again; `None` once everything is proven gone (what it held is then forgotten).
    fn recheck(&mut self) -> Option<String>;
}

/// Spawns `spec` for a job whose temp dir is `root`; the returned keeper future must be run as
/// a tracked task of the job.
fn spawn(
    spec: ProcessSpec,
    root: &Path,
    job_cancel: &CancellationToken,
    policy: ProcessPolicy,
) -> Result<
    (
        JobProcess,
        impl Future<Output = Option<Unproven>> + Send + 'static,
    ),
    ProcessError,
> {
    let mut cmd = spec.command(root)?;
    ensure_subreaper(policy.subreaper);
    let mut child = cmd.spawn().map_err(ProcessError::Spawn)?;
    let pid = child.id().expect("a child that was just spawned has a pid");
    let pgid = pid as i32;
    LIVE_GROUPS.lock().insert(pgid);
    let (status_tx, status_rx) = watch::channel(None);
    let stop = job_cancel.child_token();
    let handle = JobProcess {
        pid,
        status: status_rx,
        stop: stop.clone(),
        stdin: child.stdin.take(),
        stdout: child.stdout.take(),
        stderr: child.stderr.take(),
    };
    let keeper = keep(child, pgid, stop, status_tx, policy);
    Ok((handle, keeper))
}

fn ensure_subreaper(wanted: bool) {
    #[cfg(target_os = "linux")]
    if wanted {
        static SET: std::sync::Once = std::sync::Once::new();
        SET.call_once(|| {
            if let Err(e) = rustix::process::set_child_subreaper(Some(rustix::process::getpid())) {
                tracing::warn!(error = %e, "could not become a child subreaper; orphaned descendants of jobs cannot be reaped");
            }
        });
    }
    #[cfg(not(target_os = "linux"))]
    let _ = wanted;
}

/// What is known of a process group that could not be proven gone: enough to check again.
#[derive(Debug)]
pub(crate) struct Unproven {
    pub(crate) reason: String,
    pgid: i32,
    escapees: Vec<Escapee>,
    subreaper: bool,
    /// The leader, when even it could not be reaped within the bound (stuck in uninterruptible
    /// sleep after `SIGKILL`, say): reaped by a later check.
    leader: Option<Child>,
}

impl Evidence for Unproven {
    fn reason(&self) -> &str {
        &self.reason
    }

    fn recheck(&mut self) -> Option<String> {
        if let Some(leader) = &mut self.leader {
            match leader.try_wait() {
                Ok(Some(_)) => self.leader = None,
                Ok(None) => {
                    return Some(format!(
                        "the leader of process group {} has not exited after SIGKILL",
                        self.pgid
                    ));
                }
                Err(e) => return Some(format!("could not wait for process {}: {e}", self.pgid)),
            }
        }
        match unproven_part(self.pgid, &self.escapees, self.subreaper) {
            Some((reason, orphan)) => {
                // An orphan seen now is attributed to this job: re-checked (and reaped) with it.
                self.escapees.extend(orphan);
                Some(reason)
            }
            None => {
                self.forget();
                None
            }
        }
    }
}

impl Unproven {
    fn forget(&self) {
        LIVE_GROUPS.lock().remove(&self.pgid);
        forget_escapees(&self.escapees);
    }
}

/// Owns one child until its whole group is proven gone. Returns what is known when that could
/// not be proven within the policy's bound (the slot must then be quarantined).
async fn keep(
    mut child: Child,
    pgid: i32,
    stop: CancellationToken,
    status_tx: watch::Sender<Status>,
    policy: ProcessPolicy,
) -> Option<Unproven> {
    let mut escapees = Vec::new();
    let mut status: Status = None;
    // Once the group is proven empty its id may be reused by the kernel: never signal it again.
    let mut emptied = false;
    // 1. Until the leader exits on its own, or the job stops it.
    tokio::select! {
        biased;
        st = child.wait() => status = Some(st.map_err(Arc::new)),
        () = stop.cancelled() => {}
    }
    if status.is_some() {
        let _ = status_tx.send(status.clone());
        // 2. The leader is gone; members it left behind are still the job's. Wait for them to
        //    end, or for the job to stop them.
        let mut backoff = Backoff::new();
        loop {
            reap_group_zombies(pgid);
            if group_empty(pgid) {
                emptied = true;
                break;
            }
            tokio::select! {
                () = stop.cancelled() => break,
                () = backoff.sleep() => {}
            }
        }
    }
    if stop.is_cancelled() && !emptied {
        escapees = snapshot_escapees(pgid);
        terminate(&mut child, &mut status, pgid, &escapees, policy).await;
        if status.is_some() && status_tx.borrow().is_none() {
            let _ = status_tx.send(status.clone());
        }
    }
    if status.is_none() {
        // The leader outlived SIGKILL by the whole proof bound (uninterruptible sleep): nothing
        // more can be proven now. The child goes with the evidence, to be reaped by a re-check.
        return Some(Unproven {
            reason: format!(
                "the leader of process group {pgid} had not exited {:?} after SIGKILL",
                policy.proof_bound
            ),
            pgid,
            escapees,
            subreaper: policy.subreaper,
            leader: Some(child),
        });
    }
    // 3. Prove it: the group is empty, and every descendant that left it is gone.
    match prove(pgid, &mut escapees, policy).await {
        None => {
            LIVE_GROUPS.lock().remove(&pgid);
            forget_escapees(&escapees);
            None
        }
        Some(reason) => Some(Unproven {
            reason,
            pgid,
            escapees,
            subreaper: policy.subreaper,
            leader: None,
        }),
    }
}

/// `SIGTERM` to the group and the escapees, then `SIGKILL` after the grace for whatever is
/// left. The wait for the leader after `SIGKILL` is bounded by the proof bound: a process in
/// uninterruptible sleep does not die on `SIGKILL` until its system call returns, which may be
/// never; `status` then stays `None`.
async fn terminate(
    child: &mut Child,
    status: &mut Status,
    pgid: i32,
    escapees: &[Escapee],
    policy: ProcessPolicy,
) {
    let grace = policy.grace;
    signal_all(pgid, escapees, Signal::TERM);
    let deadline = tokio::time::Instant::now() + grace;
    let mut backoff = Backoff::new();
    loop {
        if status.is_none() {
            tokio::select! {
                st = child.wait() => *status = Some(st.map_err(Arc::new)),
                () = backoff.sleep() => {}
                () = tokio::time::sleep_until(deadline) => {}
            }
        } else {
            reap_group_zombies(pgid);
            if group_empty(pgid) && escapees.iter().all(Escapee::gone) {
                return;
            }
            tokio::select! {
                () = backoff.sleep() => {}
                () = tokio::time::sleep_until(deadline) => {}
            }
        }
        if tokio::time::Instant::now() >= deadline {
            break;
        }
    }
    signal_all(pgid, escapees, Signal::KILL);
    if status.is_none()
        && let Ok(st) = tokio::time::timeout(policy.proof_bound, child.wait()).await
    {
        *status = Some(st.map_err(Arc::new));
    }
}

/// Polls (with backoff) until the group is empty, the escapees are gone and no orphan of ours
/// is unaccounted for, or `bound` has passed.
async fn prove(pgid: i32, escapees: &mut Vec<Escapee>, policy: ProcessPolicy) -> Option<String> {
    let deadline = tokio::time::Instant::now() + policy.proof_bound;
    let mut backoff = Backoff::new();
    loop {
        let reason = unproven_part(pgid, escapees, policy.subreaper).map(|(reason, orphan)| {
            match orphan {
                // Attributed to this job once the bound has passed: re-checked (and reaped)
                // through its evidence from then on.
                Some(orphan) if tokio::time::Instant::now() >= deadline => escapees.push(orphan),
                Some(orphan) => {
                    KNOWN_ESCAPEES.lock().remove(&orphan.pid());
                }
                None => {}
            }
            reason
        });
        match reason {
            None => return None,
            Some(reason) if tokio::time::Instant::now() >= deadline => return Some(reason),
            Some(_) => backoff.sleep().await,
        }
    }
}

/// The first thing not yet proven gone: a member of the group (zombies of ours reaped first),
/// a recorded escapee, or (with the subreaper) an orphan no job accounts for, which is returned
/// registered as a known escapee for the caller to attribute or forget.
fn unproven_part(
    pgid: i32,
    escapees: &[Escapee],
    subreaper: bool,
) -> Option<(String, Option<Escapee>)> {
    reap_group_zombies(pgid);
    if !group_empty(pgid) {
        return Some((format!("process group {pgid} still has members"), None));
    }
    if let Some(e) = escapees.iter().find(|e| !e.gone()) {
        return Some((
            format!(
                "descendant pid {} of process group {pgid} left the group and is still alive",
                e.pid()
            ),
            None,
        ));
    }
    if subreaper && let Some(orphan) = unaccounted_orphan() {
        let reason = format!(
            "pid {}, an orphaned descendant that left its job's process group, is still alive",
            orphan.pid()
        );
        return Some((reason, Some(orphan)));
    }
    None
}

fn forget_escapees(escapees: &[Escapee]) {
    let mut known = KNOWN_ESCAPEES.lock();
    for e in escapees {
        known.remove(&e.pid());
    }
}

fn group_empty(pgid: i32) -> bool {
    let Some(pid) = Pid::from_raw(pgid) else {
        return true;
    };
    matches!(rustix::process::test_kill_process_group(pid), Err(e) if e == rustix::io::Errno::SRCH)
}

/// Reaps members of the group that are our children (reparented to us as the subreaper). Only
/// called once the leader itself has been reaped by tokio, so it never steals tokio's child.
fn reap_group_zombies(pgid: i32) {
    let Some(pid) = Pid::from_raw(pgid) else {
        return;
    };
    while let Ok(Some(_)) = rustix::process::waitpgid(pid, rustix::process::WaitOptions::NOHANG) {}
}

fn signal_all(pgid: i32, escapees: &[Escapee], sig: Signal) {
    if let Some(pid) = Pid::from_raw(pgid) {
        let _ = rustix::process::kill_process_group(pid, sig);
    }
    for e in escapees {
        e.signal(sig);
    }
}

/// Exponential backoff from 1 ms to 50 ms: there is no event for "a group became empty".
struct Backoff(Duration);

impl Backoff {
    fn new() -> Self {
        Self(Duration::from_millis(1))
    }

    async fn sleep(&mut self) {
        tokio::time::sleep(self.0).await;
        self.0 = (self.0 * 2).min(Duration::from_millis(50));
    }
}

#[cfg(target_os = "linux")]
use linux::{Escapee, snapshot_escapees, unaccounted_orphan};

#[cfg(target_os = "linux")]
mod linux {
    use rustix::process::{Pid, PidfdFlags, Signal};

    use super::tree::{self, ProcEntry};
    use super::{KNOWN_ESCAPEES, LIVE_GROUPS};

    /// A descendant that left the job's process group, recorded while its ancestry was intact.
    #[derive(Debug, Clone)]
    pub(crate) struct Escapee(ProcEntry);

    impl Escapee {
        pub(crate) fn pid(&self) -> i32 {
            self.0.pid
        }

        /// Dead: gone from `/proc`, its pid reused, or a zombie (reaped here if it is ours).
        pub(crate) fn gone(&self) -> bool {
            match tree::current(&self.0) {
                None => true,
                Some(now) if now.zombie => {
                    if let Some(pid) = Pid::from_raw(now.pid) {
                        let _ = rustix::process::waitpid(
                            Some(pid),
                            rustix::process::WaitOptions::NOHANG,
                        );
                    }
                    true
                }
                Some(_) => false,
            }
        }

        /// Signals it through a pidfd opened after checking its start time, so that a reused
        /// pid is never signalled.
        pub(crate) fn signal(&self, sig: Signal) {
            let Some(pid) = Pid::from_raw(self.0.pid) else {
                return;
            };
            let Ok(fd) = rustix::process::pidfd_open(pid, PidfdFlags::empty()) else {
                return;
            };
            if tree::current(&self.0).is_some() {
                let _ = rustix::process::pidfd_send_signal(&fd, sig);
            }
        }
    }

    /// Descendants of the group's leader (or, once it is gone, of any member) outside the group.
    pub(crate) fn snapshot_escapees(pgid: i32) -> Vec<Escapee> {
        let mut roots = vec![pgid];
        roots.extend(
            tree::children_of(rustix::process::getpid().as_raw_nonzero().get())
                .into_iter()
                .filter(|e| e.pgid == pgid)
                .map(|e| e.pid),
        );
        let mut seen = std::collections::HashSet::new();
        let escapees: Vec<_> = roots
            .into_iter()
            .flat_map(tree::descendants)
            .filter(|e| e.pgid != pgid && !e.zombie && seen.insert(e.pid))
            .map(Escapee)
            .collect();
        KNOWN_ESCAPEES
            .lock()
            .extend(escapees.iter().map(Escapee::pid));
        escapees
    }

    /// A live child of this process (reparented to it as the subreaper) in a group of its own
    /// that no job owns: a descendant that escaped its job's group and was orphaned. Zombies are
    /// skipped, never reaped here: one may be a child the application started itself and will
    /// wait for. The one returned is registered as a known escapee.
    pub(crate) fn unaccounted_orphan() -> Option<Escapee> {
        let me = rustix::process::getpid();
        let my_group = rustix::process::getpgrp().as_raw_nonzero().get();
        let live = LIVE_GROUPS.lock().clone();
        let known = KNOWN_ESCAPEES.lock().clone();
        for child in tree::children_of(me.as_raw_nonzero().get()) {
            if child.pgid == my_group || live.contains(&child.pgid) || known.contains(&child.pid) {
                continue;
            }
            if child.zombie {
                continue;
            }
            KNOWN_ESCAPEES.lock().insert(child.pid);
            return Some(Escapee(child));
        }
        None
    }
}

#[cfg(not(target_os = "linux"))]
use portable::{Escapee, snapshot_escapees, unaccounted_orphan};

#[cfg(not(target_os = "linux"))]
mod portable {
    use rustix::process::Signal;

    /// Without `/proc`, descendants that leave the group cannot be seen.
    #[derive(Debug, Clone)]
    pub(crate) struct Escapee;

    impl Escapee {
        pub(crate) fn pid(&self) -> i32 {
            0
        }
        pub(crate) fn gone(&self) -> bool {
            true
        }
        pub(crate) fn signal(&self, _sig: Signal) {}
    }

    pub(crate) fn snapshot_escapees(_pgid: i32) -> Vec<Escapee> {
        Vec::new()
    }

    pub(crate) fn unaccounted_orphan() -> Option<Escapee> {
        None
    }
}
