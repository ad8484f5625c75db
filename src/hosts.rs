//! What the supervisor's pipeline acts on outside itself: temp dirs, child processes, GPU
//! devices, a worker's spawn. Each is a small trait with one real implementation; the
//! simulation test swaps in scripted fakes (a file system that fails or hangs, processes that
//! ignore `SIGTERM` or escape their group, GPU work that is slow or lost, a spawn that fails or
//! takes more than one poll) and drives the real supervisor with them.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures_util::future::BoxFuture;

use crate::paths::TempDir;
use crate::process::{OsProcesses, ProcessHost};

/// Where a supervisor's jobs get their temp dirs.
pub(crate) trait TempDirHost: Send + Sync + 'static {
    /// A new directory strictly inside `root`, whatever the job id. Runs in the worker's task,
    /// never in the supervisor's mailbox.
    fn create(&self, root: &Path, job_id: &str) -> io::Result<PathBuf>;

    /// Removes the directory and everything in it; a directory already gone is removed.
    /// Never blocks the caller's thread. A dir that was never made (the job's `try_temp_dir`
    /// failed): whatever the body may have put at the path is removed, and a path that cannot
    /// hold anything (its parent is not a directory, or cannot be searched) is not an error:
    /// nothing was there.
    fn remove(&self, dir: TempDir) -> BoxFuture<'static, io::Result<()>>;
}

/// Temp dirs on the real file system.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FsTempDirs;

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

    fn remove(&self, dir: TempDir) -> BoxFuture<'static, io::Result<()>> {
        let TempDir { path, made } = dir;
        // On the blocking pool: a file system that hangs holds one of its threads, never the
        // supervisor (nor, on a current-thread runtime, everything else).
        crate::counters::task();
        let task = tokio::task::spawn_blocking(move || {
            crate::counters::poll();
            if !made {
                match std::fs::symlink_metadata(&path) {
                    // Nothing there, nor could there be (a work root that is a file, or that
                    // cannot be searched): the dir was never made, and nothing is removed.
                    Err(_) => return Ok(()),
                    // The body put something where its dir would have been.
                    Ok(meta) if !meta.is_dir() => return std::fs::remove_file(&path),
                    Ok(_) => {}
                }
            }
            match std::fs::remove_dir_all(&path) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                other => other,
            }
        });
        Box::pin(async move { task.await.unwrap_or_else(|e| Err(io::Error::other(e))) })
    }
}

/// Where a worker's spawn can be scripted. The real spawn only moves the job's arguments into
/// the worker and has nothing to ask ([`Hosts::spawns`] is `None`); a fake makes it fail, or
/// take more than the supervisor's one poll.
pub(crate) trait SpawnHost: Send + Sync + 'static {
    /// Awaited in the worker's `pre_start`, before the job's arguments are taken: an error
    /// refuses the spawn.
    fn starting(&self, job_id: &str) -> BoxFuture<'static, Result<(), String>>;
}

/// The hosts of one supervisor.
#[derive(Clone)]
pub(crate) struct Hosts {
    pub(crate) temp_dirs: Arc<dyn TempDirHost>,
    pub(crate) processes: Arc<dyn ProcessHost>,
    /// `None`: the real spawn, with nothing to ask.
    pub(crate) spawns: Option<Arc<dyn SpawnHost>>,
    #[cfg(feature = "gpu")]
    pub(crate) gpu: Option<Arc<dyn GpuHost>>,
}

impl Hosts {
    /// The real file system, real processes, no GPU.
    pub(crate) fn os() -> Self {
        Self {
            temp_dirs: Arc::new(FsTempDirs),
            processes: Arc::new(OsProcesses),
            spawns: None,
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

    use crate::gpu::{FenceFailure, GpuError, GpuPool, JobGpu, LostDevice, Placement};

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

    impl Fence {
        /// The device `lost` under the lease, on its `generation`.
        fn lost(lost: LostDevice, generation: u64) -> Self {
            let LostDevice { device, reason } = lost;
            Self::Lost {
                device,
                generation,
                reason,
            }
        }
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
        /// Whether the engine handed the device over (`GpuOptions::adopt`): leasehold never
        /// re-creates it, only the engine's replacement brings it back after a loss.
        fn adopted(&self, _device: usize) -> bool {
            false
        }
        /// Waits at most `bound` for the devices' remaining work and destroys them, off the
        /// caller's thread; resolves with the devices it could not prove idle (index, why), or
        /// with why the close as a whole did not report.
        fn close(
            &self,
            bound: Duration,
        ) -> BoxFuture<'static, Result<Vec<(usize, String)>, String>>;
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
                        // A late end is a proof only if the work completed.
                        rest: Box::pin(async move {
                            match still_waiting.await {
                                Ok(()) => Fence::Done,
                                Err(lost) => Fence::lost(lost, generation),
                            }
                        }),
                    },
                    Err(FenceFailure::Lost(lost)) => Fence::lost(lost, generation),
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

        fn adopted(&self, device: usize) -> bool {
            self.0.adopted(device)
        }

        fn close(
            &self,
            bound: Duration,
        ) -> BoxFuture<'static, Result<Vec<(usize, String)>, String>> {
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
                closed
                    .await
                    .map_err(|_| "the close thread did not report".to_owned())
            })
        }
    }
}
