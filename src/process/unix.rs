//! The Unix implementation of job processes: process groups, signals, the proof that a group is
//! empty, escaped descendants (Linux: through `/proc`) and the evidence kept when that proof
//! cannot be made.

use super::*;
use parking_lot::Mutex;
use rustix::process::{Pid, Signal};
use std::collections::HashSet;
use std::sync::LazyLock;
use std::time::Duration;
use tokio::process::Child;

/// Process groups of jobs not yet proven empty (their members are never taken for orphans of
/// another job).
static LIVE_GROUPS: LazyLock<Mutex<HashSet<i32>>> = LazyLock::new(Mutex::default);

/// Escaped descendants some keeper has recorded and is dealing with (never taken for
/// unaccounted orphans by another job's proof).
static KNOWN_ESCAPEES: LazyLock<Mutex<HashSet<i32>>> = LazyLock::new(Mutex::default);

/// Spawns `spec` for a job whose temp dir is `root`; the returned keeper future must be run as
/// a tracked task of the job.
pub(super) fn spawn(
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

    fn recheck(&mut self) -> Result<(), String> {
        if let Some(leader) = &mut self.leader {
            match leader.try_wait() {
                Ok(Some(_)) => self.leader = None,
                Ok(None) => {
                    return Err(format!(
                        "the leader of process group {} has not exited after SIGKILL",
                        self.pgid
                    ));
                }
                Err(e) => return Err(format!("could not wait for process {}: {e}", self.pgid)),
            }
        }
        match unproven_part(self.pgid, &self.escapees, self.subreaper) {
            Some((reason, orphan)) => {
                // An orphan seen now is attributed to this job: re-checked (and reaped) with it.
                self.escapees.extend(orphan);
                Err(reason)
            }
            None => {
                self.forget();
                Ok(())
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

    use super::{KNOWN_ESCAPEES, LIVE_GROUPS};
    use crate::process::tree::{self, ProcEntry};

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
