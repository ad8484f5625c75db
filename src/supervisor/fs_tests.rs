//! The file system as an edge leasehold did not write: a scripted temp dir host (each errno a
//! real one can answer, a panic, a removal held at a gate) under the real supervisor. What it
//! shows: a refused creation is `LEASE_PREPARE_FAILED` through `try_temp_dir` and costs the
//! run nothing; a refused removal quarantines that slot alone, with the I/O error; a removal
//! that must wait shows its lease `Draining`, waiting for the temp dir alone.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::Notify;

use super::handle::Supervisor;
use super::table::{LeaseInfo, LeasePhase, WaitingFor};
use crate::error::JobError;
use crate::hosts::{Hosts, TempDirHost};
use crate::job::JobSpec;
use crate::paths::TempDir;

/// The errnos a file system answers a job's temp dir with: a root that is not a directory, that
/// cannot be written, that is full, or busy.
const REFUSALS: [(i32, &str); 4] = [
    (20, "ENOTDIR"),
    (13, "EACCES"),
    (28, "ENOSPC"),
    (16, "EBUSY"),
];

/// What the scripted file system does with the next call.
#[derive(Clone)]
enum Answer {
    Ok,
    Errno(i32),
    Panic,
    /// Waits for the gate (announcing that it waits), then answers `Ok`.
    Gate(Arc<Notify>, Arc<Notify>),
}

struct ScriptedDirs {
    create: Mutex<Answer>,
    remove: Mutex<Answer>,
    /// Each removal asked for, with whether its dir was made.
    removals: Mutex<Vec<(PathBuf, bool)>>,
}

impl ScriptedDirs {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            create: Mutex::new(Answer::Ok),
            remove: Mutex::new(Answer::Ok),
            removals: Mutex::new(Vec::new()),
        })
    }
}

impl TempDirHost for ScriptedDirs {
    fn create(&self, root: &Path, job_id: &str) -> io::Result<PathBuf> {
        match self.create.lock().clone() {
            Answer::Errno(errno) => Err(io::Error::from_raw_os_error(errno)),
            Answer::Panic => panic!("scripted panic making a temp dir"),
            Answer::Ok | Answer::Gate(..) => Ok(root.join(format!("{job_id}.scripted"))),
        }
    }

    fn remove(&self, dir: TempDir) -> BoxFuture<'static, io::Result<()>> {
        self.removals.lock().push((dir.path.into(), dir.made));
        let answer = self.remove.lock().clone();
        Box::pin(async move {
            match answer {
                Answer::Ok => Ok(()),
                Answer::Errno(errno) => Err(io::Error::from_raw_os_error(errno)),
                Answer::Panic => panic!("scripted panic removing a temp dir"),
                Answer::Gate(waiting, gate) => {
                    waiting.notify_one();
                    gate.notified().await;
                    Ok(())
                }
            }
        })
    }
}

async fn supervisor(dirs: &Arc<ScriptedDirs>, slots: u32) -> Supervisor {
    let mut hosts = Hosts::os();
    hosts.temp_dirs = Arc::clone(dirs) as Arc<dyn TempDirHost>;
    Supervisor::builder()
        .slots(slots)
        .cleanup_timeout(Duration::from_secs(1))
        .work_root(std::env::temp_dir())
        .hosts(hosts)
        .start()
        .await
        .unwrap()
}

/// A job that asks for its temp dir and returns 1 whatever it heard, with what it heard.
async fn job_with_dir(
    sup: &Supervisor,
    id: &str,
) -> (Result<u32, JobError<io::Error>>, Option<&'static str>) {
    let heard = Arc::new(Mutex::new(None));
    let result = sup
        .run(JobSpec::new(id).unwrap(), {
            let heard = Arc::clone(&heard);
            move |ctx| async move {
                *heard.lock() = ctx.try_temp_dir().err().map(|e| e.code());
                Ok(1)
            }
        })
        .await;
    let heard = *heard.lock();
    (result, heard)
}

#[tokio::test]
async fn a_temp_dir_refused_with_each_errno_is_lease_prepare_failed_and_the_run_keeps_its_result() {
    for (errno, name) in REFUSALS {
        let dirs = ScriptedDirs::new();
        *dirs.create.lock() = Answer::Errno(errno);
        let sup = supervisor(&dirs, 1).await;
        let (result, heard) = job_with_dir(&sup, "refused").await;
        assert_eq!(heard, Some("LEASE_PREPARE_FAILED"), "{name}");
        assert_eq!(result.unwrap(), 1, "{name}: the run keeps its own result");
        // The path handed out instead was never made: its removal says so.
        assert!(dirs.removals.lock().iter().all(|(_, made)| !made), "{name}");
        let stats = sup.stats();
        assert_eq!(stats.quarantined, 0, "{name}: {stats:?}");
        sup.shutdown().await.unwrap();
    }
}

#[tokio::test]
async fn a_temp_dir_removal_refused_with_each_errno_quarantines_that_slot_alone_with_the_error() {
    for (errno, name) in REFUSALS {
        let dirs = ScriptedDirs::new();
        *dirs.remove.lock() = Answer::Errno(errno);
        let sup = supervisor(&dirs, 2).await;
        let (result, heard) = job_with_dir(&sup, "unremovable").await;
        assert_eq!(heard, None, "{name}");
        let err = result.unwrap_err();
        assert_eq!(err.code(), "LEASE_CLEANUP_UNCONFIRMED", "{name}");
        let source = std::error::Error::source(err.cleanup_error().unwrap())
            .and_then(|s| s.downcast_ref::<io::Error>())
            .unwrap_or_else(|| panic!("{name}: the I/O error is kept"));
        assert_eq!(source.raw_os_error(), Some(errno), "{name}");
        assert_eq!(sup.stats().quarantined, 1, "{name}");
        // The other slot keeps serving.
        *dirs.remove.lock() = Answer::Ok;
        let (result, _) = job_with_dir(&sup, "next").await;
        assert_eq!(result.unwrap(), 1, "{name}");
        let report = sup.reclaim_quarantined().await.unwrap();
        assert_eq!(report.reclaimed.len(), 1, "{name}: {report:?}");
        sup.shutdown().await.unwrap();
    }
}

#[tokio::test]
async fn a_temp_dir_host_that_panics_quarantines_that_slot_alone_and_the_supervisor_keeps_serving()
{
    let dirs = ScriptedDirs::new();
    *dirs.remove.lock() = Answer::Panic;
    let sup = supervisor(&dirs, 2).await;
    let (result, _) = job_with_dir(&sup, "panicking-fs").await;
    assert_eq!(result.unwrap_err().code(), "LEASE_CLEANUP_UNCONFIRMED");
    assert_eq!(sup.stats().quarantined, 1);
    *dirs.remove.lock() = Answer::Ok;
    let (result, _) = job_with_dir(&sup, "next").await;
    assert_eq!(result.unwrap(), 1);
    // A panic while making the dir is the body's panic: the body ran it.
    *dirs.create.lock() = Answer::Panic;
    let (result, _) = job_with_dir(&sup, "panicking-create").await;
    assert_eq!(result.unwrap_err().code(), "LEASE_BODY_PANICKED");
    *dirs.create.lock() = Answer::Ok;
    let report = sup.reclaim_quarantined().await.unwrap();
    assert_eq!(report.reclaimed.len(), 1, "{report:?}");
    assert_eq!(sup.stats().quarantined, 0);
    sup.shutdown().await.unwrap();
}

/// The lease's row, once the supervisor has handled everything sent before this call.
async fn row(sup: &Supervisor) -> LeaseInfo {
    // A round trip through the mailbox: every report sent before it has been handled.
    sup.waiters().await.unwrap();
    let mut rows = sup.leases();
    assert_eq!(rows.len(), 1, "{rows:?}");
    rows.remove(0)
}

#[tokio::test]
async fn draining_shows_from_the_bodys_end_while_its_temp_dir_is_removed() {
    let dirs = ScriptedDirs::new();
    let (waiting, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    *dirs.remove.lock() = Answer::Gate(Arc::clone(&waiting), Arc::clone(&gate));
    let sup = supervisor(&dirs, 1).await;
    let job = tokio::spawn({
        let sup = sup.clone();
        async move { job_with_dir(&sup, "slow-removal").await.0 }
    });
    waiting.notified().await;
    let lease = row(&sup).await;
    assert_eq!(lease.phase, LeasePhase::Draining, "{lease:?}");
    assert_eq!(lease.waiting_for, [WaitingFor::TempDir], "{lease:?}");
    let stats = sup.stats();
    assert_eq!((stats.active, stats.draining), (1, 1), "{stats:?}");
    gate.notify_one();
    assert_eq!(job.await.unwrap().unwrap(), 1);
    let stats = sup.stats();
    assert_eq!((stats.active, stats.draining), (0, 0), "{stats:?}");
    sup.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_waiting_for_list_shrinks_as_each_proof_is_made() {
    let dirs = ScriptedDirs::new();
    let (waiting, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    *dirs.remove.lock() = Answer::Gate(Arc::clone(&waiting), Arc::clone(&gate));
    let sup = supervisor(&dirs, 1).await;
    let (task_started, task_gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let job = tokio::spawn({
        let (sup, task_started, task_gate) = (
            sup.clone(),
            Arc::clone(&task_started),
            Arc::clone(&task_gate),
        );
        async move {
            sup.run(JobSpec::new("proofs").unwrap(), move |ctx| async move {
                ctx.try_temp_dir().unwrap();
                // A tracked task outlives the body.
                ctx.spawn(async move {
                    task_started.notify_one();
                    task_gate.notified().await;
                });
                Ok::<_, io::Error>(1)
            })
            .await
        }
    });
    task_started.notified().await;
    // The body may not have returned yet: wait for the worker's end to be reported.
    let mut lease = row(&sup).await;
    while lease.waiting_for.contains(&WaitingFor::Worker) {
        tokio::task::yield_now().await;
        lease = row(&sup).await;
    }
    assert_eq!(lease.phase, LeasePhase::Draining, "{lease:?}");
    assert_eq!(
        lease.waiting_for,
        [WaitingFor::Tasks, WaitingFor::TempDir],
        "{lease:?}"
    );
    task_gate.notify_one();
    waiting.notified().await;
    let lease = row(&sup).await;
    assert_eq!(lease.phase, LeasePhase::Draining, "{lease:?}");
    assert_eq!(lease.waiting_for, [WaitingFor::TempDir], "{lease:?}");
    gate.notify_one();
    assert_eq!(job.await.unwrap().unwrap(), 1);
    sup.shutdown().await.unwrap();
}
