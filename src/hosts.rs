//! What the supervisor's pipeline acts on outside itself: temp dirs, child processes, GPU
//! devices. Each is a small trait with one real implementation; the simulation test swaps in
//! scripted fakes (a file system that fails or hangs, processes that ignore `SIGTERM` or
//! escape their group, GPU work that is slow or lost) and drives the real supervisor with them.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures_util::future::BoxFuture;

use crate::process::{OsProcesses, ProcessHost};

/// Where a supervisor's jobs get their temp dirs.
pub(crate) trait TempDirHost: Send + Sync + 'static {
    /// A new directory strictly inside `root`, whatever the job id. Runs in the worker's task,
    /// never in the supervisor's mailbox.
    fn create(&self, root: &Path, job_id: &str) -> io::Result<PathBuf>;

    /// Removes the directory and everything in it; a directory already gone is removed.
    /// Never blocks the caller's thread. With `made` false the directory was never made (the
    /// job's `try_temp_dir` failed): whatever the body may have put at the path is removed,
    /// and a path that cannot hold anything (its parent is not a directory, or cannot be
    /// searched) is not an error: nothing was there.
    fn remove(&self, path: PathBuf, made: bool) -> BoxFuture<'static, io::Result<()>>;
}

/// Temp dirs on the real file system. Removals run on one thread of their own, the sweeper,
/// fed by a channel: a job's removal costs one wake of that thread, not a hop to tokio's
/// blocking pool and back, and a burst of removals is taken in one wake.
#[derive(Debug, Default)]
pub(crate) struct FsTempDirs {
    sweeper: Sweeper,
}

impl TempDirHost for FsTempDirs {
    fn create(&self, root: &Path, job_id: &str) -> io::Result<PathBuf> {
        // A fresh name with a random suffix, created exclusively: a leftover of an earlier
        // run (a quarantined dir kept as evidence) is never reused. The id may be `.` or `..`:
        // it is only ever a prefix of a single path component, so it cannot escape the root.
        let dir = tempfile::Builder::new()
            .prefix(job_id)
            .rand_bytes(6)
            .tempdir_in(root)?;
        Ok(dir.keep())
    }

    fn remove(&self, path: PathBuf, made: bool) -> BoxFuture<'static, io::Result<()>> {
        // Off every runtime thread: a file system that hangs holds the sweeper (or a thread of
        // the blocking pool), never the supervisor (nor, on a current-thread runtime,
        // everything else).
        let done = self.sweeper.remove(path, made);
        Box::pin(async move {
            done.await.unwrap_or_else(|_| {
                Err(io::Error::other(
                    "the temp dir's removal ended without an answer",
                ))
            })
        })
    }
}

/// Removes a job's temp dir, blocking: `made` false means the dir was never made, and only
/// what the body may have put at its path is removed.
fn remove_now(path: &Path, made: bool) -> io::Result<()> {
    if !made {
        match std::fs::symlink_metadata(path) {
            // Nothing there, nor could there be (a work root that is a file, or that cannot be
            // searched): the dir was never made, and nothing is removed.
            Err(_) => return Ok(()),
            // The body put something where its dir would have been.
            Ok(meta) if !meta.is_dir() => return std::fs::remove_file(path),
            Ok(_) => {}
        }
    }
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

type Sweep = (PathBuf, bool, tokio::sync::oneshot::Sender<io::Result<()>>);

/// The thread that removes temp dirs, one after another, started on the first removal and
/// ended when its host is dropped (once the removal in hand is done). While it has been stuck
/// on one removal for [`Sweeper::STALLED`] (a file system that hangs), new removals go to
/// tokio's blocking pool instead, so that one hung directory does not hold every other job's.
/// Every removal stays bounded by the supervisor's cleanup timeout either way.
#[derive(Debug)]
struct Sweeper {
    queue: std::sync::OnceLock<std::sync::mpsc::Sender<Sweep>>,
    /// When the removal in hand began (`None`: idle).
    busy: Arc<parking_lot::Mutex<Option<std::time::Instant>>>,
    /// What removes (a removal that hangs, under test).
    remover: fn(&Path, bool) -> io::Result<()>,
}

impl Default for Sweeper {
    fn default() -> Self {
        Self {
            queue: std::sync::OnceLock::new(),
            busy: Arc::default(),
            remover: remove_now,
        }
    }
}

impl Sweeper {
    /// How long one removal may hold the sweeper before others go around it.
    const STALLED: std::time::Duration = std::time::Duration::from_millis(250);

    fn remove(&self, path: PathBuf, made: bool) -> tokio::sync::oneshot::Receiver<io::Result<()>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let stalled = self
            .busy
            .lock()
            .is_some_and(|since| since.elapsed() >= Self::STALLED);
        let sent = match (stalled, self.queue()) {
            (false, Some(queue)) => queue.send((path, made, tx)).map_err(|e| e.0),
            (_, _) => Err((path, made, tx)),
        };
        if let Err((path, made, tx)) = sent {
            let remover = self.remover;
            crate::counters::task();
            tokio::task::spawn_blocking(move || {
                let _ = tx.send(remover(&path, made));
            });
        }
        rx
    }

    /// The sweeper's queue, its thread started on first use (`None` if it cannot be).
    fn queue(&self) -> Option<&std::sync::mpsc::Sender<Sweep>> {
        if let Some(queue) = self.queue.get() {
            return Some(queue);
        }
        let (tx, rx) = std::sync::mpsc::channel::<Sweep>();
        let (busy, remover) = (Arc::clone(&self.busy), self.remover);
        crate::counters::task();
        let started = std::thread::Builder::new()
            .name("leasehold-sweeper".into())
            .spawn(move || {
                while let Ok((path, made, done)) = rx.recv() {
                    crate::counters::poll();
                    *busy.lock() = Some(std::time::Instant::now());
                    let result =
                        std::panic::catch_unwind(|| remover(&path, made)).unwrap_or_else(|_| {
                            Err(io::Error::other("the temp dir's removal panicked"))
                        });
                    *busy.lock() = None;
                    let _ = done.send(result);
                }
            });
        match started {
            Ok(_) => {
                let _ = self.queue.set(tx);
                self.queue.get()
            }
            Err(error) => {
                tracing::warn!(%error, "no sweeper thread: temp dirs are removed on the blocking pool");
                None
            }
        }
    }
}

/// The hosts of one supervisor.
#[derive(Clone)]
pub(crate) struct Hosts {
    pub(crate) temp_dirs: Arc<dyn TempDirHost>,
    pub(crate) processes: Arc<dyn ProcessHost>,
    #[cfg(feature = "gpu")]
    pub(crate) gpu: Option<Arc<dyn GpuHost>>,
}

impl Hosts {
    /// The real file system, real processes, no GPU.
    pub(crate) fn os() -> Self {
        Self {
            temp_dirs: Arc::new(FsTempDirs::default()),
            processes: Arc::new(OsProcesses),
            #[cfg(feature = "gpu")]
            gpu: None,
        }
    }
}

#[cfg(feature = "gpu")]
pub(crate) use gpu::{Fence, GpuHost, PoolHost};

#[cfg(feature = "gpu")]
mod gpu {
    use std::sync::Arc;
    use std::time::Duration;

    use futures_util::future::BoxFuture;

    use crate::gpu::{FenceFailure, GpuError, GpuPool, JobGpu, Placement};

    /// How a lease's GPU fence ended.
    pub(crate) enum Fence {
        /// Every submission made under the lease completed.
        Done,
        /// Not within the fence bound; `rest` resolves when it does end.
        Late {
            detail: String,
            rest: BoxFuture<'static, Fence>,
        },
        /// The device was lost (on that generation): the work is gone with it.
        Lost {
            device: usize,
            generation: u64,
            reason: String,
        },
    }

    /// The supervisor's GPU devices, as its pipeline uses them.
    pub(crate) trait GpuHost: Send + Sync + 'static {
        /// How many GPU sub-slots there are.
        fn capacity(&self) -> u32;
        /// Marks a free sub-slot busy (bookkeeping only: safe in the mailbox).
        fn place(&self) -> Option<Placement>;
        /// The sub-slot may serve another lease (bookkeeping only).
        fn free(&self, slot: Placement);
        /// In the worker, before the body: the device for the job, re-creating a lost one.
        fn checkout(&self, slot: Placement)
        -> BoxFuture<'static, Result<Option<JobGpu>, GpuError>>;
        /// In the job's driver, after its tasks: every submission made under the lease.
        fn fence(&self, slot: Placement, job: Option<JobGpu>) -> BoxFuture<'static, Fence>;
        /// Whether a lost device has been replaced (or given up for good).
        fn settled(&self, device: usize) -> bool;
        /// Starts replacing a lost device; `replaced` is called (off the mailbox) once it is
        /// replaced or given up, with the device's generation then.
        fn recreate(&self, device: usize);
        /// Installs the replacement hook (once, at start).
        fn on_replaced(&self, hook: Box<dyn Fn(usize, u64) + Send + Sync>);
        /// The device's generation now (1 at start, one more per re-creation).
        fn generation(&self, device: usize) -> u64;
        /// Waits at most `bound` for the devices' remaining work and destroys them, off the
        /// caller's thread; resolves with the devices it could not prove idle (index, why).
        fn close(&self, bound: Duration) -> BoxFuture<'static, Vec<(usize, String)>>;
    }

    /// The real devices.
    pub(crate) struct PoolHost(pub(crate) Arc<GpuPool>);

    impl GpuHost for PoolHost {
        fn capacity(&self) -> u32 {
            self.0.capacity()
        }

        fn place(&self) -> Option<Placement> {
            self.0.place()
        }

        fn free(&self, slot: Placement) {
            self.0.free(slot)
        }

        fn checkout(
            &self,
            slot: Placement,
        ) -> BoxFuture<'static, Result<Option<JobGpu>, GpuError>> {
            let pool = Arc::clone(&self.0);
            Box::pin(async move { pool.checkout(slot).await.map(Some) })
        }

        fn fence(&self, _slot: Placement, job: Option<JobGpu>) -> BoxFuture<'static, Fence> {
            let pool = Arc::clone(&self.0);
            Box::pin(async move {
                let Some(job) = job else {
                    return Fence::Done;
                };
                let outcome = pool.fence(&job).await;
                let generation = job.generation();
                // The job's handles are dropped here, in the driver, never in the mailbox.
                drop(job);
                match outcome {
                    Ok(()) => Fence::Done,
                    Err(FenceFailure::Timeout {
                        after,
                        still_waiting,
                    }) => Fence::Late {
                        detail: format!(
                            "gpu work submitted under the lease had not completed {after:?} after the worker ended"
                        ),
                        rest: Box::pin(async move {
                            still_waiting.await;
                            Fence::Done
                        }),
                    },
                    Err(FenceFailure::Lost { device, reason }) => Fence::Lost {
                        device,
                        generation,
                        reason,
                    },
                }
            })
        }

        fn settled(&self, device: usize) -> bool {
            self.0.settled(device)
        }

        fn recreate(&self, device: usize) {
            self.0.recreate_in_background(device)
        }

        fn on_replaced(&self, hook: Box<dyn Fn(usize, u64) + Send + Sync>) {
            let pool = Arc::downgrade(&self.0);
            self.0.set_replaced_hook(Box::new(move |device| {
                let generation = pool
                    .upgrade()
                    .and_then(|p| p.generation(device))
                    .unwrap_or(u64::MAX);
                hook(device, generation)
            }));
        }

        fn generation(&self, device: usize) -> u64 {
            self.0.generation(device).unwrap_or(0)
        }

        fn close(&self, bound: Duration) -> BoxFuture<'static, Vec<(usize, String)>> {
            let (pool, (done, closed)) = (Arc::clone(&self.0), tokio::sync::oneshot::channel());
            // A thread of its own, not the blocking pool: the close waits (up to its bound) on
            // devices, and the runtime's own shutdown must never wait on that.
            let spawned = std::thread::Builder::new()
                .name("leasehold-gpu-close".into())
                .spawn(move || {
                    let unclosed = pool
                        .close_within(bound)
                        .into_iter()
                        .map(|u| (u.device, u.reason))
                        .collect::<Vec<_>>();
                    let _ = done.send(unclosed);
                });
            if let Err(e) = spawned {
                tracing::error!(error = %e, "could not start a thread to close the gpu devices");
            }
            Box::pin(async move {
                closed.await.unwrap_or_else(|_| {
                    vec![(usize::MAX, "the close thread did not report".into())]
                })
            })
        }
    }
}

#[cfg(test)]
mod sweeper_tests {
    use std::sync::Condvar;
    use std::time::{Duration, Instant};

    use super::*;

    #[tokio::test]
    async fn the_sweeper_removes_a_dir_and_what_it_holds_and_a_dir_never_made_is_no_error() {
        let root = tempfile::tempdir().unwrap();
        let dirs = FsTempDirs::default();
        let dir = dirs.create(root.path(), "job").unwrap();
        std::fs::create_dir(dir.join("sub")).unwrap();
        std::fs::write(dir.join("sub/file"), b"x").unwrap();
        dirs.remove(dir.clone(), true).await.unwrap();
        assert!(!dir.exists());
        // Already gone, and never made: both are removed.
        dirs.remove(dir.clone(), true).await.unwrap();
        dirs.remove(root.path().join("never-made"), false)
            .await
            .unwrap();
        // A file the body put where its unmade dir would have been is removed too.
        let stray = root.path().join("unmade");
        std::fs::write(&stray, b"x").unwrap();
        dirs.remove(stray.clone(), false).await.unwrap();
        assert!(!stray.exists());
    }

    /// (the stuck removal may end, it has begun), and its signal.
    static GATE: (std::sync::Mutex<(bool, bool)>, Condvar) =
        (std::sync::Mutex::new((false, false)), Condvar::new());

    /// Waits until `ready` holds of the gate's state, after `change` (under its lock).
    fn at_gate(change: impl FnOnce(&mut (bool, bool)), ready: impl Fn(&(bool, bool)) -> bool) {
        let mut state = GATE.0.lock().unwrap();
        change(&mut state);
        GATE.1.notify_all();
        while !ready(&state) {
            state = GATE.1.wait(state).unwrap();
        }
    }

    /// A removal that hangs (for a path named `stuck`) until the gate opens.
    fn hanging(path: &Path, made: bool) -> io::Result<()> {
        if path.ends_with("stuck") {
            at_gate(|s| s.1 = true, |s| s.0);
        }
        remove_now(path, made)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sweeper_stuck_on_one_removal_sends_the_next_ones_to_the_blocking_pool() {
        let root = tempfile::tempdir().unwrap();
        let dirs = FsTempDirs {
            sweeper: Sweeper {
                remover: hanging,
                ..Sweeper::default()
            },
        };
        let stuck = root.path().join("stuck");
        std::fs::create_dir(&stuck).unwrap();
        let first = dirs.remove(stuck.clone(), true);
        at_gate(|_| {}, |s| s.1);
        // Held as if for longer than the stall bound (no sleep: the clock is moved back).
        let since = dirs.sweeper.busy.lock().expect("the sweeper is busy");
        *dirs.sweeper.busy.lock() = Some(since - Duration::from_secs(1));
        let next = dirs.create(root.path(), "next").unwrap();
        dirs.remove(next.clone(), true).await.unwrap();
        assert!(!next.exists(), "removed while the sweeper is still stuck");
        assert!(stuck.exists(), "the stuck removal has not ended");
        at_gate(|s| s.0 = true, |_| true);
        first.await.unwrap();
        assert!(!stuck.exists());
        assert!(dirs.sweeper.busy.lock().is_none_or(|t| t <= Instant::now()));
    }
}
