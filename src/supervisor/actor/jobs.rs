//! A job's life off the mailbox: its worker's start, and the [`Driver`] task that awaits its
//! physical end, removes its temp dir and reports once; and the removal the core asks for
//! itself (a temp dir left behind an unproven proof, or retried by a reclaim). None of it
//! decides anything: every report (a placement refused, a spawn failed, a proof) is an input
//! to the core.

#[cfg(feature = "gpu")]
use std::future::Future;
#[cfg(feature = "gpu")]
use std::task::Poll;

use super::*;

/// A job granted a slot, to start (its driver task spawns the worker).
pub(super) struct JobStart {
    pub(super) key: LeaseKey,
    pub(super) token: SlotToken,
    pub(super) more: Box<[SlotToken]>,
    pub(super) job: Box<PendingJob>,
}

/// What the shell keeps for a running job.
pub(super) struct JobRt {
    pub(super) job_id: Arc<str>,
    pub(super) shared: Arc<JobShared>,
    /// Taken when the caller has been answered (at the end, or early on quarantine).
    pub(super) reply: Option<oneshot::Sender<RunOutcome>>,
    #[cfg(feature = "gpu")]
    pub(super) placement: Option<crate::gpu::Placement>,
}

impl Shell {
    pub(super) fn start_job(&mut self, start: JobStart) {
        let JobStart {
            key,
            token,
            more,
            job,
        } = start;
        let PendingJob {
            job_id,
            shared,
            body,
            reply,
            span,
        } = *job;
        let span = span.into_span();
        span.record("slot_id", token.slot_id());
        span.record("lease_id", token.lease_id());
        #[cfg(feature = "gpu")]
        let placement = match &self.config.hosts.gpu {
            // The host's answer is a fact the core takes: no sub-slot, no start.
            Some(gpu) => match gpu.place() {
                Some(p) => Some(p),
                None => {
                    return self.not_started(key, job_id, shared, reply, PrepareError::NoGpuSlot);
                }
            },
            None => None,
        };
        let tracker = TaskTracker::new();
        let reporter = Reporter {
            inbox: Arc::clone(&self.inbox),
            key,
        };
        let args = Box::new(WorkerArgs {
            body,
            token,
            more_tokens: more,
            job_id: Arc::clone(&job_id),
            work_root: Arc::clone(&self.config.work_root),
            shared: Arc::clone(&shared),
            tracker: tracker.clone(),
            span,
            policy: self.config.process_policy,
            grace: self.config.cancel_grace,
            hosts: self.config.hosts.clone(),
            reporter: Arc::new(reporter.clone()),
            #[cfg(feature = "gpu")]
            gpu: placement,
        });
        self.kept.jobs.insert(
            key,
            JobRt {
                job_id,
                shared: Arc::clone(&shared),
                reply: Some(reply),
                #[cfg(feature = "gpu")]
                placement,
            },
        );
        let driver = Driver {
            tracker,
            shared,
            reporter,
            drain_timeout: self.config.drain_timeout,
            #[cfg(feature = "gpu")]
            gpu: self.config.hosts.gpu.clone(),
            #[cfg(feature = "gpu")]
            placement,
        };
        // One task from the mailbox: the driver spawns the worker itself (never an await in
        // the mailbox), so that the job's tasks run one after another on this worker thread
        // without waking another one.
        crate::counters::task();
        // Boxed: the future holds the worker's arguments and ractor's spawn, several KB that
        // tokio would otherwise copy three or four times on the way into its task cell.
        tokio::spawn(Box::pin(driver.run(args, self.myself.get_cell())));
        #[cfg(feature = "gpu")]
        let device = placement.map(|p| p.device);
        #[cfg(not(feature = "gpu"))]
        let device = None;
        self.core.apply(Input::Started { key, device });
    }

    /// A job that could not start: the core takes its slots back, then its caller hears why.
    #[cfg_attr(not(feature = "gpu"), allow(dead_code))]
    pub(super) fn not_started(
        &mut self,
        key: LeaseKey,
        job_id: Arc<str>,
        shared: Arc<JobShared>,
        reply: oneshot::Sender<RunOutcome>,
        why: PrepareError,
    ) {
        self.kept.jobs.insert(
            key,
            JobRt {
                job_id,
                shared,
                reply: Some(reply),
                #[cfg(feature = "gpu")]
                placement: None,
            },
        );
        self.core.apply(Input::NotStarted { key, why });
    }

    #[cfg_attr(not(feature = "gpu"), allow(unused_variables))]
    pub(super) fn recreate_device(&mut self, device: usize) {
        #[cfg(feature = "gpu")]
        if let Some(gpu) = &self.config.hosts.gpu {
            if gpu.settled(device) {
                // Replaced (or given up) before the loss reached the core.
                let generation = gpu.generation(device);
                self.core
                    .apply(Input::DeviceReplaced { device, generation });
            } else {
                gpu.recreate(device);
            }
        }
    }

    pub(super) fn remove_temp_dir(&mut self, key: LeaseKey) {
        let Some(job) = self.kept.jobs.get(&key) else {
            return;
        };
        let Some((path, made)) = job.shared.temp_dir() else {
            // The worker made no temp dir (it could not): nothing to remove.
            return self.core.apply(Input::ProvenOne {
                key,
                proof: Proof::TempDir,
            });
        };
        // Started exactly when the core says, in a task of its own: never in the mailbox.
        let removal = remove_temp_dir(
            Arc::clone(&self.config.hosts.temp_dirs),
            path,
            made,
            self.config.cleanup_timeout,
            Reporter {
                inbox: Arc::clone(&self.inbox),
                key,
            },
        );
        crate::counters::task();
        tokio::spawn(removal);
    }
}

/// Removes a temp dir (off the mailbox) when the core asks, and reports; past `bound` the slot
/// is quarantined until the removal ends.
async fn remove_temp_dir(
    host: Arc<dyn crate::hosts::TempDirHost>,
    path: PathBuf,
    made: bool,
    bound: Duration,
    reporter: Reporter,
) {
    let key = reporter.key;
    let removed = removed_within(&*host, &path, made, bound, |detail| {
        reporter.input(Input::Late {
            key,
            proof: Proof::TempDir,
            detail,
        });
    })
    .await;
    reporter.input(match removed {
        Ok(()) => Input::ProvenOne {
            key,
            proof: Proof::TempDir,
        },
        Err((detail, error)) => Input::TempDirFailed { key, detail, error },
    });
}

/// Removes a job's temp dir under `bound`, when the core asks: past the bound `late` hears why
/// (the slot is then quarantined) and the removal is awaited all the same. A failure (a panic
/// of the host's among them) is logged, and returned with the detail the slot's reason gives.
async fn removed_within(
    host: &dyn crate::hosts::TempDirHost,
    path: &std::path::Path,
    made: bool,
    bound: Duration,
    late: impl FnOnce(String),
) -> Result<(), (String, std::io::Error)> {
    use crate::outside;
    // Built and awaited with its panic caught: a panic is a removal that failed.
    let result = match outside::call(|| host.remove(path.to_path_buf(), made)) {
        Ok(removal) => {
            let mut removal = std::pin::pin!(outside::caught(removal));
            match tokio::time::timeout(bound, &mut removal).await {
                Ok(result) => result,
                Err(_) => {
                    late(format!("the temp dir was not removed within {bound:?}"));
                    removal.await
                }
            }
        }
        Err(panic) => Err(panic),
    };
    let result = result.unwrap_or_else(|panic| {
        Err(std::io::Error::other(format!(
            "the temp dir's removal panicked: {panic}"
        )))
    });
    result.map_err(|error| {
        let path = path.display();
        tracing::error!(%path, %error, "a job's temp dir could not be removed");
        (format!("temp dir {path} could not be removed"), error)
    })
}

/// A job's own task: awaits its physical end outside the supervisor's mailbox and reports. It
/// proves the worker's actor task ended (its join handle resolves only once the actor is fully
/// gone, state dropped), then every task and blocking closure spawned through its context
/// (process keepers included), then (with a GPU) every submission made under the lease, and
/// says whether the job asked for a temp dir. The common case is one message,
/// [`Input::Ended`]; a step that must wait (tasks still running after the body, a fence) is
/// announced first with the proofs made so far (`Proven`), and a bound that passes with a
/// `Late`. It decides nothing: what follows from the proofs (the temp dir's removal among it) is
/// the core's.
struct Driver {
    tracker: TaskTracker,
    shared: Arc<JobShared>,
    reporter: Reporter,
    drain_timeout: Option<Duration>,
    #[cfg(feature = "gpu")]
    gpu: Option<Arc<dyn crate::hosts::GpuHost>>,
    #[cfg(feature = "gpu")]
    placement: Option<crate::gpu::Placement>,
}

#[cfg(feature = "gpu")]
/// Awaits one of a driver's cleanup steps. When it cannot end at once, the proofs made so far
/// are reported first, so that while it runs the lease shows `Draining` and waits only for
/// what is left (a step that ends at once costs no message).
async fn step<F: Future>(reporter: &Reporter, proofs: &mut Proofs, step: F) -> F::Output {
    let mut step = std::pin::pin!(step);
    let first = std::future::poll_fn(|cx| Poll::Ready(step.as_mut().poll(cx))).await;
    match first {
        Poll::Ready(out) => out,
        Poll::Pending => {
            reporter.proven_so_far(proofs);
            step.await
        }
    }
}

impl Driver {
    async fn run(self, args: Box<WorkerArgs>, supervisor: ractor::ActorCell) {
        let key = self.reporter.key;
        crate::counters::task();
        let join = match Actor::spawn_linked(None, WorkerActor, args, supervisor).await {
            Ok((_worker, join)) => join,
            Err(err) => {
                // The worker's pre_start only moves its arguments, so the body never ran: a
                // fact the core takes (it gives the slots back, and the caller hears why).
                tracing::error!(error = %err, "could not spawn the worker actor");
                let why = PrepareError::WorkerSpawn(err.to_string());
                self.reporter.input(Input::NotStarted { key, why });
                return;
            }
        };
        let _ = join.await;
        let tracker = self.tracker;
        tracker.close();
        let mut proofs = Proofs::JOINED;
        if !tracker.is_empty() {
            // Tell the supervisor the body has ended; the tasks are waited for.
            self.reporter.proven_so_far(&mut proofs);
            if let Some(after) = self.drain_timeout
                && tokio::time::timeout(after, tracker.wait()).await.is_err()
            {
                self.reporter.input(Input::Late {
                    key,
                    proof: Proof::TasksJoined,
                    detail: format!(
                        "tasks spawned through the worker context were still running {after:?} after the worker ended"
                    ),
                });
            }
            tracker.wait().await;
        }
        self.shared.close();
        proofs = proofs.with(Proofs::TASKS);
        #[cfg(feature = "gpu")]
        if let (Some(gpu), Some(placement)) = (&self.gpu, self.placement) {
            use crate::hosts::Fence;
            let job = self.shared.take_gpu();
            let mut fence = step(&self.reporter, &mut proofs, gpu.fence(placement, job)).await;
            if let Fence::Late { detail, rest } = fence {
                self.reporter.proven_so_far(&mut proofs);
                self.reporter.input(Input::Late {
                    key,
                    proof: Proof::GpuFence,
                    detail,
                });
                fence = rest.await;
            }
            match fence {
                Fence::Done | Fence::Late { .. } => proofs = proofs.with(Proofs::GPU),
                Fence::Lost {
                    device,
                    generation,
                    reason,
                } => {
                    self.reporter.proven_so_far(&mut proofs);
                    self.reporter.input(Input::DeviceLost {
                        key,
                        device,
                        generation,
                        reason,
                    });
                }
            }
        }
        // The job is closed (above): nothing more is made after this read. Whether and when
        // the dir is removed is the core's decision (once the worker's physical end is
        // proven: a process group unproven or GPU work lost holds it back).
        let dir = match self.shared.temp_dir() {
            // The job never asked for one: nothing to remove, no blocking-pool hop.
            None => DirEnd::NeverMade,
            Some(_) => DirEnd::Asked,
        };
        self.reporter.input(Input::Ended { key, proofs, dir });
    }
}
