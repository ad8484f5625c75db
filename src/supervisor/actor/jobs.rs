//! A job's life around the mailbox: its worker's start (spawned in the turn that grants it),
//! its worker's end (the join handle, polled by the supervisor itself when its waker rings),
//! the [`Driver`] task for an end that must wait (tracked tasks still running, a GPU fence),
//! and the temp dir's removal when the core asks for it. None of it decides anything: every
//! report (a placement refused, a spawn failed, a proof) is an input to the core.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use futures_util::FutureExt;
use ractor::{Actor, ActorCell};
use rustc_hash::FxHashMap;
use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;

use super::config::Config;
use crate::broker::SlotToken;
use crate::error::PrepareError;
use crate::paths::TempDir;
use crate::supervisor::core::{Input, LeaseKey, Proof, Proofs, shrink_map as shrink};
use crate::supervisor::inbox::Inbox;
use crate::supervisor::messages::{PendingJob, RunOutcome, SupMsg};
use crate::supervisor::reporter::Reporter;
use crate::worker::{JobShared, WorkerActor, WorkerArgs};

/// A job granted a slot, to start: the turn spawns its worker.
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
    /// The worker's task, until its end has been seen (see [`WorkerEnd`]).
    pub(super) end: Option<WorkerEnd>,
    /// The temp dir's removal, while it runs.
    pub(super) removal: Option<Removal>,
}

/// A running worker's end, as the supervisor awaits it without a task of its own: the worker's
/// join handle, polled in the supervisor's turn with a waker that posts
/// [`SupMsg::Joined`] into the inbox. The handle resolves only once the worker's task has ended
/// and its state has been dropped, so the turn that sees it ready holds the proof.
pub(super) struct WorkerEnd {
    join: Join,
    waker: Waker,
    /// The tasks spawned through the job's context.
    tracker: TaskTracker,
}

/// Where a worker's task stands, as its join handle says.
enum Join {
    /// Its spawn has not ended yet (it is finished in a task of its own).
    Spawning,
    Running(tokio::task::JoinHandle<()>),
    /// The handle resolved: the task has ended and its state has been dropped.
    Ended,
}

/// A temp dir's removal in flight, polled in the supervisor's turn with a waker that posts
/// [`SupMsg::RemovalRang`] (the removal itself runs off every runtime thread; see
/// `hosts::FsTempDirs`): its answer is taken in the turn that sees it, with no task between.
pub(super) struct Removal {
    removal: Pin<Box<dyn Future<Output = Input> + Send>>,
    waker: Waker,
}

/// What a [`Bell`] rings for: the message it posts.
#[derive(Clone, Copy)]
enum Rings {
    /// The worker's join handle: [`SupMsg::Joined`].
    Join,
    /// The temp dir's removal: [`SupMsg::RemovalRang`].
    Removal,
}

/// The waker of something a job's end waits for, polled by the supervisor: it posts a message
/// saying which, and the turn polls it again.
struct Bell {
    inbox: Arc<Inbox>,
    key: LeaseKey,
    rings: Rings,
}

impl Bell {
    fn waker(inbox: &Arc<Inbox>, key: LeaseKey, rings: Rings) -> Waker {
        Waker::from(Arc::new(Self {
            inbox: Arc::clone(inbox),
            key,
            rings,
        }))
    }
}

impl Wake for Bell {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let key = self.key;
        // A supervisor that is gone no longer waits for it.
        let _ = self.inbox.send(match self.rings {
            Rings::Join => SupMsg::Joined { key },
            Rings::Removal => SupMsg::RemovalRang { key },
        });
    }
}

/// The running jobs, as the shell keeps them: their workers' starts and ends and their temp
/// dirs' removals. What the core must hear comes back as an input, for the shell to apply.
pub(super) struct Jobs {
    pub(super) running: FxHashMap<LeaseKey, JobRt>,
    inbox: Arc<Inbox>,
    config: Arc<Config>,
    /// The supervisor actor: every worker is linked under it.
    supervisor: ActorCell,
}

impl Jobs {
    pub(super) fn new(inbox: Arc<Inbox>, config: Arc<Config>, supervisor: ActorCell) -> Self {
        Self {
            running: FxHashMap::default(),
            inbox,
            config,
            supervisor,
        }
    }

    pub(super) fn shrink(&mut self) {
        shrink(&mut self.running);
    }

    /// Starts a job granted its slots: `Input::Started`, or `Input::NotStarted` when no GPU
    /// sub-slot is free for it.
    pub(super) fn start(&mut self, start: JobStart) -> Input {
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
            ..
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
                    // The body never runs: it is the user's value, dropped off the turn like
                    // every closure that never ran (invariant 9).
                    crate::outside::dispose_off_turn(body);
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
            reporter: Arc::new(reporter),
            #[cfg(feature = "gpu")]
            gpu: placement,
        });
        let waker = Bell::waker(&self.inbox, key, Rings::Join);
        self.running.insert(
            key,
            JobRt {
                job_id,
                shared,
                reply: Some(reply),
                #[cfg(feature = "gpu")]
                placement,
                end: Some(WorkerEnd {
                    join: Join::Spawning,
                    waker,
                    tracker,
                }),
                removal: None,
            },
        );
        // The worker's spawn runs its `pre_start`, which only moves its arguments: it ends on
        // its first poll, here, and the worker's task is the one task the job costs. Boxed: it
        // holds the worker's arguments and ractor's spawn, several KB. Should it not end at
        // once, it is finished in a task of its own, which reports (never an await in the
        // mailbox).
        crate::counters::task();
        let mut spawn = Box::pin(Actor::spawn_linked(
            None,
            WorkerActor,
            args,
            self.supervisor.clone(),
        ));
        match (&mut spawn).now_or_never() {
            Some(spawned) => {
                let result = spawned.map(|(_, join)| join).map_err(|e| e.to_string());
                self.worker_spawned(key, result);
            }
            None => {
                let inbox = Arc::clone(&self.inbox);
                crate::counters::task();
                tokio::spawn(async move {
                    let result = spawn.await.map(|(_, join)| join).map_err(|e| e.to_string());
                    let _ = inbox.send(SupMsg::WorkerSpawned { key, result });
                });
            }
        }
        #[cfg(feature = "gpu")]
        let device = placement.map(|p| p.device);
        #[cfg(not(feature = "gpu"))]
        let device = None;
        Input::Started { key, device }
    }

    /// The worker's spawn ended: its join handle is kept and polled once (which registers the
    /// waker that rings when it ends). Whatever follows (the end seen, or a spawn that failed)
    /// goes through the inbox, so that the core takes it after the job's start.
    pub(super) fn worker_spawned(
        &mut self,
        key: LeaseKey,
        result: Result<tokio::task::JoinHandle<()>, String>,
    ) {
        let join = match result {
            Ok(join) => join,
            Err(err) => {
                // The worker's pre_start only moves its arguments, so the body never ran: a
                // fact the core takes (it gives the slots back, and the caller hears why).
                tracing::error!(error = %err, "could not spawn the worker actor");
                let why = PrepareError::WorkerSpawn(err);
                let _ = self
                    .inbox
                    .send(SupMsg::Input(Input::NotStarted { key, why }));
                return;
            }
        };
        let Some(end) = self.running.get_mut(&key).and_then(|j| j.end.as_mut()) else {
            return;
        };
        end.join = Join::Running(join);
        if end.poll_join() {
            // Already over (another thread ran it): seen in the next drain.
            let _ = self.inbox.send(SupMsg::Joined { key });
        }
    }

    /// A worker's join handle rang: when its task has ended, the worker's physical end is
    /// proven here. With nothing left to wait for (no tracked task still running, no GPU
    /// work to fence), the job's end is one input to the core in this turn; otherwise the rest
    /// is awaited by a [`Driver`] task, which reports.
    pub(super) fn worker_joined(&mut self, key: LeaseKey) -> Option<Input> {
        let job = self.running.get_mut(&key)?;
        if !job.end.as_mut()?.poll_join() {
            // Not spawned yet, or a wake that was not the end.
            return None;
        }
        let WorkerEnd { tracker, .. } = job.end.take()?;
        tracker.close();
        #[cfg(feature = "gpu")]
        let gpu = self.config.hosts.gpu.clone().zip(job.placement);
        #[cfg(not(feature = "gpu"))]
        let gpu: Option<()> = None;
        // Closed to new work only with no task left; a start that got in meanwhile (a context
        // kept past the job) is waited for by the driver, like any task still running.
        if tracker.is_empty() && gpu.is_none() && job.shared.close_if_idle(&tracker) {
            return Some(Input::Ended {
                key,
                proofs: Proofs::JOINED.with(Proofs::TASKS),
                dir: job.shared.temp_dir(),
            });
        }
        let driver = Driver {
            tracker,
            shared: Arc::clone(&job.shared),
            reporter: Reporter {
                inbox: Arc::clone(&self.inbox),
                key,
            },
            drain_timeout: self.config.drain_timeout,
            #[cfg(feature = "gpu")]
            gpu,
        };
        crate::counters::task();
        tokio::spawn(crate::counters::polled(driver.finish()));
        None
    }

    /// A job that could not start: the core takes its slots back, then its caller hears why.
    #[cfg_attr(not(feature = "gpu"), allow(dead_code))]
    fn not_started(
        &mut self,
        key: LeaseKey,
        job_id: Arc<str>,
        shared: Arc<JobShared>,
        reply: oneshot::Sender<RunOutcome>,
        why: PrepareError,
    ) -> Input {
        self.running.insert(
            key,
            JobRt {
                job_id,
                shared,
                reply: Some(reply),
                #[cfg(feature = "gpu")]
                placement: None,
                end: None,
                removal: None,
            },
        );
        Input::NotStarted { key, why }
    }

    /// Starts removing a job's temp dir; its answer, when the first poll has it.
    pub(super) fn remove_temp_dir(&mut self, key: LeaseKey, dir: TempDir) -> Option<Input> {
        let job = self.running.get_mut(&key)?;
        // Started exactly when the core says. The host's removal runs off every runtime
        // thread; what the turn polls is only its answer and the bound's timer.
        job.removal = Some(Removal {
            removal: Box::pin(remove_temp_dir(
                Arc::clone(&self.config.hosts.temp_dirs),
                dir,
                self.config.cleanup_timeout,
                Reporter {
                    inbox: Arc::clone(&self.inbox),
                    key,
                },
            )),
            waker: Bell::waker(&self.inbox, key, Rings::Removal),
        });
        self.poll_removal(key)
    }

    /// Polls a temp dir's removal (its bell rang, or it has just started); its answer, once
    /// there, is the core's input.
    pub(super) fn poll_removal(&mut self, key: LeaseKey) -> Option<Input> {
        let job = self.running.get_mut(&key)?;
        let removal = job.removal.as_mut()?;
        let mut cx = Context::from_waker(&removal.waker);
        let fut = tokio::task::unconstrained(removal.removal.as_mut());
        let Poll::Ready(input) = std::pin::pin!(fut).poll(&mut cx) else {
            return None;
        };
        job.removal = None;
        Some(input)
    }
}

/// Has a lost GPU device re-created, unless it was replaced (or given up) before the loss reached
/// the core: then the replacement, for the shell to apply.
#[cfg(feature = "gpu")]
pub(super) fn recreate_device(config: &Config, device: usize) -> Option<Input> {
    let gpu = config.hosts.gpu.as_ref()?;
    if gpu.settled(device) {
        let generation = gpu.generation(device);
        return Some(Input::DeviceReplaced { device, generation });
    }
    gpu.recreate(device);
    None
}

/// Without the `gpu` feature there are no devices to lose.
#[cfg(not(feature = "gpu"))]
pub(super) fn recreate_device(_config: &Config, _device: usize) -> Option<Input> {
    None
}

/// Removes a temp dir when the core asks, and answers with the core's input; past `bound` the
/// slot is quarantined (a `Late` through the inbox) until the removal ends.
async fn remove_temp_dir(
    host: Arc<dyn crate::hosts::TempDirHost>,
    dir: TempDir,
    bound: Duration,
    reporter: Reporter,
) -> Input {
    let key = reporter.key;
    let removed = removed_within(&*host, dir, bound, |detail| {
        reporter.input(Input::Late {
            key,
            proof: Proof::TempDir,
            detail,
        });
    })
    .await;
    match removed {
        Ok(()) => Input::ProvenOne {
            key,
            proof: Proof::TempDir,
        },
        Err((detail, error)) => Input::TempDirFailed { key, detail, error },
    }
}

/// Removes a job's temp dir under `bound`, when the core asks: past the bound `late` hears why
/// (the slot is then quarantined) and the removal is awaited all the same. A failure (a panic
/// of the host's among them) is logged, and returned with the detail the slot's reason gives.
async fn removed_within(
    host: &dyn crate::hosts::TempDirHost,
    dir: TempDir,
    bound: Duration,
    late: impl FnOnce(String),
) -> Result<(), (String, std::io::Error)> {
    use crate::outside;
    // Built and awaited with its panic caught: a panic is a removal that failed.
    let path = dir.path.clone();
    let result = match outside::call(|| host.remove(dir)) {
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

impl WorkerEnd {
    /// Polls the worker's join handle (outside tokio's cooperative budget: a turn that sees
    /// many ends must not be told "not yet" for a handle that is ready); true once it resolved.
    fn poll_join(&mut self) -> bool {
        let join = match &mut self.join {
            Join::Spawning => return false,
            Join::Ended => return true,
            Join::Running(join) => join,
        };
        let mut cx = Context::from_waker(&self.waker);
        let ready = std::pin::pin!(tokio::task::unconstrained(join))
            .poll(&mut cx)
            .is_ready();
        if ready {
            self.join = Join::Ended;
        }
        ready
    }
}

/// What is left of a job's end once its worker's task has ended, when it cannot be seen at
/// once (tracked tasks still running after the body, GPU work to fence): awaited in a task of
/// its own, off the mailbox, which reports. It proves every task and blocking closure spawned
/// through the job's context (process keepers included) has returned, then (with a GPU) every
/// submission made under the lease, and says whether the job asked for a temp dir. A step that
/// must wait is announced first with the proofs made so far (`Proven`), and a bound that
/// passes with a `Late`. It decides nothing: what follows from the proofs (the temp dir's
/// removal among it) is the core's.
struct Driver {
    tracker: TaskTracker,
    shared: Arc<JobShared>,
    reporter: Reporter,
    drain_timeout: Option<Duration>,
    #[cfg(feature = "gpu")]
    gpu: Option<(Arc<dyn crate::hosts::GpuHost>, crate::gpu::Placement)>,
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
    /// Runs from the worker's end (already proven: `JOINED`) to the job's end report.
    async fn finish(self) {
        let key = self.reporter.key;
        let tracker = self.tracker;
        let mut proofs = Proofs::JOINED;
        let (mut announced, mut late) = (false, false);
        // Until the job is closed to new work with no task left: a start that got in just
        // before the close (a context kept past the job) is waited for like the others, under
        // the same bound.
        loop {
            if !tracker.is_empty() {
                if !announced {
                    // Tell the supervisor the body has ended; the tasks are waited for.
                    self.reporter.proven_so_far(&mut proofs);
                    announced = true;
                }
                if !late
                    && let Some(after) = self.drain_timeout
                    && tokio::time::timeout(after, tracker.wait()).await.is_err()
                {
                    late = true;
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
            if self.shared.close_if_idle(&tracker) {
                break;
            }
        }
        proofs = proofs.with(Proofs::TASKS);
        #[cfg(feature = "gpu")]
        if let Some((gpu, placement)) = &self.gpu {
            use crate::hosts::Fence;
            let job = self.shared.take_gpu();
            let mut fence = step(&self.reporter, &mut proofs, gpu.fence(*placement, job)).await;
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
                    // Which input says who brings the device back: leasehold re-creates its
                    // own devices, only the engine replaces one it handed over.
                    self.reporter.input(if gpu.adopted(device) {
                        Input::EngineDeviceLost {
                            key,
                            device,
                            generation,
                            reason,
                        }
                    } else {
                        Input::DeviceLost {
                            key,
                            device,
                            generation,
                            reason,
                        }
                    });
                }
            }
        }
        // The job is closed (above): nothing more is made after this read. Whether and when
        // the dir is removed is the core's decision (once the worker's physical end is
        // proven: a process group unproven or GPU work lost holds it back).
        let dir = self.shared.temp_dir();
        self.reporter.input(Input::Ended { key, proofs, dir });
    }
}
